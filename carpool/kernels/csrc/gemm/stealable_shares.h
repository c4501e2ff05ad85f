// Work units split into one contiguous share per thread, each thread running its own share
// front to back and, once that is empty, taking units from the back of the others'.
//
// A static split (at::parallel_for's) makes a call wait for its slowest thread. On the
// shared Xeon VMs this project benchmarks on, one vCPU's AMX tile unit ran several times
// slower than the other's for seconds at a time (docs/lab/44-the-amx-small-gemm-s-threads-steal.md), and a laptop's efficiency cores are slower than its performance cores all
// the time. With the shares stealable, a fast thread finishes a slow one's work instead of
// waiting for it; where the threads run at one speed each runs its own share, as before, in
// the same order (the same locality), for one uncontended compare-and-swap a unit.
//
// Which thread runs a unit changes nothing in its result: callers give units that are
// independent of each other.

#pragma once

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdint>
#include <memory>

namespace {

class StealableShares {
 public:
  // Units [0, units) cut into `shares` contiguous shares by `bound(s)`, the first unit of
  // share s (bound(0) == 0, bound(shares) == units, nondecreasing).
  template <typename Bound>
  StealableShares(int64_t shares, const Bound& bound)
      : shares_(shares), ranges_(new Range[shares]) {
    TORCH_CHECK(bound(shares) < (int64_t{1} << 31), "StealableShares: too many units");
    for (int64_t s = 0; s < shares; ++s)
      ranges_[s].bounds.store(pack(bound(s), bound(s + 1)), std::memory_order_relaxed);
  }

  struct Claim {
    int64_t unit = -1;  // -1: no work is left anywhere
    int64_t share = 0;  // whose share it came from
  };

  // The next unit for the thread that owns share `own`: the front of its own share, else the
  // back of the first other share that still has some.
  Claim next(int64_t own) {
    for (int64_t i = 0; i < shares_; ++i) {
      const int64_t s = (own + i) % shares_;
      const int64_t unit = take(ranges_[s], i == 0);
      if (unit >= 0) return Claim{unit, s};
    }
    return Claim{};
  }

 private:
  // [front, back) of one share, in one word so that its owner and a thief agree on it; a
  // cache line each, so that owners claiming from their own shares do not contend.
  struct alignas(64) Range {
    std::atomic<uint64_t> bounds{0};
  };

  static uint64_t pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) << 32 | static_cast<uint64_t>(back);
  }

  // The first (front) or last unit of a share, taken; -1 where it has none left.
  static int64_t take(Range& range, bool front_end) {
    uint64_t word = range.bounds.load(std::memory_order_relaxed);
    while (true) {
      const int64_t front = static_cast<int64_t>(word >> 32), back = word & 0xffffffffu;
      if (front >= back) return -1;
      const uint64_t rest = front_end ? pack(front + 1, back) : pack(front, back - 1);
      if (range.bounds.compare_exchange_weak(word, rest, std::memory_order_acq_rel))
        return front_end ? front : back - 1;
    }
  }

  int64_t shares_;
  std::unique_ptr<Range[]> ranges_;
};

}  // namespace
