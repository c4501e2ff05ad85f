// Vectors whose storage starts on a 64-byte cache line, for the kernels' scratch buffers.
//
// A 512-bit load or store, or an AMX tile row of 64 bytes, that straddles two cache lines
// costs two accesses. malloc aligns only to 16 bytes (glibc puts a large block 16 bytes past
// a page boundary), so a scratch buffer read and written a line at a time straddled lines on
// every access; the prefill kernel's packed keys and values and its per-item buffers sit on
// 64-byte lines (docs/lab/46-decode-blocks-in-runs-of-consecutive-ids.md).

#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace {  // internal linkage, as in block_ops.h

template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(std::size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
  }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const LineAligned<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAligned<U>&) const { return false; }
};

template <typename T>
using LineVector = std::vector<T, LineAligned<T>>;

}  // namespace
