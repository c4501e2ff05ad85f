// The AMX tile unit (Intel Sapphire Rapids and later), shared by the kernels that use it:
// the process's permission to use it, and the one tile configuration they all run with.
// Compiled only where carpool/kernels/loader.py adds -DCARPOOL_AMX (the CPU lists amx_bf16 and
// amx_tile); the functions carry the ISA as a target attribute. amx_usable() (bound as
// has_amx) answers in every build. Internal linkage: each file
// that includes it gets its own copy.

#pragma once

#if defined(CARPOOL_AMX)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#define CARPOOL_AMX_TARGET \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace {

// Linux hands out the tile registers' state only on request (ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); without it the first tile instruction faults. Once per process.
inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Every tile 16 rows of 64 bytes: A 16 x 32 bfloat16, B 16 pair rows x 16 columns, C 16 x
// 16 float32. A constant in memory: GCC's _tile_loadconfig tells the compiler it reads only
// 8 bytes of its argument, so a local's other fields may not be stored yet when it runs.
alignas(64) const TileConfig kTileConfig = {
    1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

// A thread's configuration is its own, and other code (oneDNN) sets its own between calls:
// each worker sets it before its tiles and releases them after.
CARPOOL_AMX_TARGET inline void configure_tiles() { _tile_loadconfig(&kTileConfig); }

CARPOOL_AMX_TARGET inline void release_tiles() { _tile_release(); }

}  // namespace
#endif

namespace {
// Whether this build and process can run the tile unit (false in builds without AMX).
inline bool amx_usable() {
#if defined(CARPOOL_AMX)
  return amx_permitted();
#else
  return false;
#endif
}
}  // namespace
