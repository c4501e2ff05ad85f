// Software prefetches, for kernels whose reads run ahead of what the hardware prefetcher
// fetches on its own.
//
// Forced inline: GCC (12, -O3) finds a function that does nothing but prefetch free of side
// effects and drops the calls it does not inline (the decode kernel's first-block prefetch
// had never run, objdump showing none of its prefetches in the loops that called it).

#pragma once

#include <cstdint>

namespace {  // internal linkage: each build's copy is its own

// `bytes` from p into L1, a line at a time (prefetcht0).
__attribute__((always_inline)) inline void prefetch_block_l1(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 3);
}

// The GEMMs' weight streams. A tile reads its B blocks of packed weight front to back side by
// side: B streams, `stride` bytes apart. Where each byte takes much arithmetic (4- and 5-bit
// weights unpacked in registers), the hardware prefetcher falls behind on Zen 5: a one-row
// pass read them from memory at half the rate it reached on the same bytes in L3. So as a
// tile starts a span of its blocks (a group), it prefetches the same span kStreamAhead bytes
// further on in each of them.
constexpr int64_t kStreamAhead = 1024;

template <int B>
__attribute__((always_inline)) inline void prefetch_streams(const uint8_t* at, int64_t stride,
                                                            int64_t bytes) {
  for (int b = 0; b < B; ++b) prefetch_block_l1(at + b * stride + kStreamAhead, bytes);
}

}  // namespace
