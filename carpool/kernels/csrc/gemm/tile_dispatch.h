// The tile shape of a register-tiled loop picked at run time: small_gemm.cpp's and
// lora_gemm.cpp's tiles are templates on their rows and blocks (the sums' array sized at
// compile time, so it stays in registers). Internal linkage, as bf16_dot.h.

#pragma once

#include <cstdint>

namespace {

// Calls f.template operator()<R, B>() with R == rows (1 <= rows <= MaxR) and B == nb
// (1 <= nb <= MaxB): the tile function instantiated for this tile's height and width.
template <int MaxR, int MaxB, typename F>
void dispatch_tile(int64_t rows, int64_t nb, const F& f) {
  if constexpr (MaxB > 1) {
    if (nb < MaxB) return dispatch_tile<MaxR, MaxB - 1>(rows, nb, f);
  }
  if constexpr (MaxR > 1) {
    if (rows < MaxR) return dispatch_tile<MaxR - 1, MaxB>(rows, nb, f);
  }
  f.template operator()<MaxR, MaxB>();
}

}  // namespace
