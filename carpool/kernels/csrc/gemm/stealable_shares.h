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

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
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

// Units of up to `max_blocks` blocks, as even as they can be, at least two a thread (a k or v
// projection of 8 blocks is still split four ways) and a whole number of them a thread where
// the call allows it: 56 blocks in units of 8 would be shares of 3 and 4 units, which no
// stealing evens out, so they go as 8 units of 7.
inline int64_t unit_blocks_for(int64_t blocks, int64_t max_blocks) {
  const int64_t threads = std::max(1, at::get_num_threads());
  int64_t units = std::max((blocks + max_blocks - 1) / max_blocks, 2 * threads);
  units = (units + threads - 1) / threads * threads;
  return std::clamp<int64_t>((blocks + units - 1) / units, 1, max_blocks);
}

// One unit of a product's output: column blocks [blk, blk + nb) of rows [r0, r0 + rows).
// next_nb: the blocks of the unit its thread runs next from its own share, which start at
// blk + nb (0 where it has none or does not know): what a tile may prefetch.
struct ColumnUnit {
  int64_t blk, nb, r0, rows, next_nb;
};

// The GEMMs' split: column blocks [0, blocks) in units of up to `max_blocks` (unit_blocks_for),
// rows [0, m) in blocks of up to `row_block`, each thread owning a contiguous share of units
// (row block by row block, so that a row block's activations stay in cache while the weight
// streams past), stealable. Columns only: a row's sums never depend on its batch or on who
// ran its unit. `make_worker()` runs once on each thread (where a thread's buffers are made)
// and returns the callable that takes that thread's ColumnUnits.
template <typename MakeWorker>
void for_each_column_unit(int64_t blocks, int64_t max_blocks, int64_t m, int64_t row_block,
                          const MakeWorker& make_worker) {
  if (blocks <= 0 || m <= 0) return;
  const int64_t unit_blocks = unit_blocks_for(blocks, max_blocks);
  const int64_t units = (blocks + unit_blocks - 1) / unit_blocks;
  const int64_t row_blocks = (m + row_block - 1) / row_block;
  const int64_t threads = std::min<int64_t>(std::max(1, at::get_num_threads()), units);
  // Share s: row block by row block, its units [first_unit(s), first_unit(s + 1)).
  const auto first_unit = [&](int64_t s) { return units * s / threads; };
  StealableShares shares(threads, [&](int64_t s) { return row_blocks * first_unit(s); });
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    auto work = make_worker();
    for (int64_t own = begin; own < end; ++own) {
      for (auto claim = shares.next(own); claim.unit >= 0; claim = shares.next(own)) {
        const int64_t u0 = first_unit(claim.share), share_units = first_unit(claim.share + 1) - u0;
        const int64_t index = claim.unit - row_blocks * u0;
        const int64_t unit = u0 + index % share_units, rb = index / share_units;
        const int64_t blk = unit * unit_blocks, r0 = rb * row_block;
        const bool owns_next = claim.share == own && index % share_units + 1 < share_units;
        const int64_t next_blk = blk + unit_blocks;
        work(ColumnUnit{blk, std::min(unit_blocks, blocks - blk), r0, std::min(row_block, m - r0),
                        owns_next ? std::min(unit_blocks, blocks - next_blk) : 0});
      }
    }
  });
}

// Rows [0, rows) in tiles of at most `max_rows`, as even as they can be (7 rows as 4 + 3
// rather than 6 + 1): fn(first, count) for each tile.
template <typename Fn>
void for_each_row_tile(int64_t rows, int64_t max_rows, const Fn& fn) {
  const int64_t tiles = (rows + max_rows - 1) / max_rows;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t first = rows * t / tiles;
    fn(first, rows * (t + 1) / tiles - first);
  }
}

}  // namespace
