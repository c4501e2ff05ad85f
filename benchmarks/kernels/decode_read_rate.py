"""How fast the decode kernel reads the KV cache, against a loop that only reads it.

Both walk the same block tables (by default the 135M model's attention shape in bfloat16: 3
kv heads of 9 query heads, head_dim 64, blocks of 16; `--shape 2 2 --dtype float32` is
`vs_vllm.py`'s tiny float32 model): each decode's blocks come in runs of `--run` consecutive
ids, the runs shuffled (the engine's tables on `vs_vllm.py`'s workload average runs of ~4
blocks). Three cases: a few decodes hot in L2, 200 decodes over one layer's cache (L3), and
200 decodes over 12 layers' caches (memory). The read-only loop is the rate this access
pattern allows these cores; the kernel's rate below it is time spent not reading. The
caches sit on transparent huge pages as the engine's do (`--no-huge-pages`: 4 KiB pages).

`--headers DIR` builds the kernel from another checkout's csrc folder
(`carpool/kernels/csrc`, or an older checkout's flat `carpool/attention/csrc`);
`--against DIR` times that build and this one's alternated, sample by sample, and gives the
median ratio of their times (this / that) and whether their outputs are bitwise equal. Both
are compiled here with `torch.utils.cpp_extension`. On a CPU
with AVX512-BF16 this times `decode_one_pass.h`; on one without AVX-512 (AVX2 builds) it times
`decode_one_pass_avx2.h`; the read-only loop loads a vector of the build's width. Per key
row (one kv head's key and value rows) at `--clock-ghz`, the kernel's cycles in cache and
from memory, against the read-only loop's, say how far its reads overlap its arithmetic.

    python3 -m benchmarks.kernels.decode_read_rate --threads 2 --run 4
    python3 -m benchmarks.kernels.decode_read_rate --threads 1 --shape 2 2 --dtype float32
    python3 -m benchmarks.kernels.decode_read_rate --threads 1 --samples 15 \
        --against /tmp/base/carpool/kernels/csrc
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

from carpool.kernels.loader import CAPABILITY_FLAGS as _CAPABILITY_FLAGS
from carpool.kernels.reference import paged_attention_reference
from carpool.platform.cpu_huge_pages import zeros_on_huge_pages

HEADS, GROUP, HEAD_DIM, BLOCK = 3, 3, 64, 16
SCALE = HEAD_DIM ** -0.5

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <atomic>
#include <ATen/cpu/vec/vec.h>
#if defined(CPU_CAPABILITY_AVX512)
#include "decode_one_pass.h"
#define CARPOOL_ATTEND_DECODE attend_decode_one_pass
#else
#include "decode_one_pass_avx2.h"
#define CARPOOL_ATTEND_DECODE attend_single_query
#endif
using namespace carpool_cpu;

// One work item per (request, kv head), claimed as the engine's paged_attention claims them.
template <typename F>
void for_items(int64_t items, F&& f) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), items), 1, [&](int64_t, int64_t) {
    DecodeScratch buf;
    for (int64_t i = next.fetch_add(1); i < items;) {
      const int64_t j = next.fetch_add(1);
      f(i, j, buf);
      i = j;
    }
  });
}

// cache [2, H, blocks, block, D]; tables [S, width]; lens [S]; q and out [S, H * G, D].
void decode(torch::Tensor q, torch::Tensor cache, torch::Tensor tables, torch::Tensor lens,
            torch::Tensor out, int64_t group, double scale) {
  const int64_t H = cache.size(1), NB = cache.size(2), BS = cache.size(3), D = cache.size(4);
  const auto* c = reinterpret_cast<const CARPOOL_ELEM*>(cache.const_data_ptr());
  const auto* qp = reinterpret_cast<const CARPOOL_ELEM*>(q.const_data_ptr());
  auto* op = reinterpret_cast<CARPOOL_ELEM*>(out.data_ptr());
  const int32_t* t = tables.const_data_ptr<int32_t>();
  const int32_t* l = lens.const_data_ptr<int32_t>();
  const int64_t width = tables.size(1), items = lens.size(0) * H;
  auto args = [&](int64_t i) {
    const int64_t s = i / H, h = i % H, row = (s * H + h) * group * D;
    return DecodeArgs<CARPOOL_ELEM>{qp + row, D, c + h * NB * BS * D, c + (H + h) * NB * BS * D,
                                t + s * width, NB, BS, D, group, 0, l[s],
                                static_cast<float>(scale), op + row, D, s};
  };
  for_items(items, [&](int64_t i, int64_t j, DecodeScratch& buf) {
    const DecodeArgs<CARPOOL_ELEM> next = j < items ? args(j) : DecodeArgs<CARPOOL_ELEM>{};
    CARPOOL_ATTEND_DECODE(args(i), j < items ? &next : nullptr, buf);
  });
}

// The same items' keys and values, only read (summed, so the loads stay).
double read_only(torch::Tensor cache, torch::Tensor tables, torch::Tensor lens) {
  const int64_t H = cache.size(1), NB = cache.size(2), BS = cache.size(3), D = cache.size(4);
  const auto* c = reinterpret_cast<const CARPOOL_ELEM*>(cache.const_data_ptr());
  const int32_t* t = tables.const_data_ptr<int32_t>();
  const int32_t* l = lens.const_data_ptr<int32_t>();
  const int64_t width = tables.size(1), items = lens.size(0) * H;
  std::atomic<int64_t> sink{0};
  for_items(items, [&](int64_t i, int64_t, DecodeScratch&) {
    const int64_t s = i / H, h = i % H;
    using Vec = at::vec::Vectorized<float>;  // the build's width: 256 or 512 bits a load
    constexpr int64_t kStep = sizeof(float) / sizeof(CARPOOL_ELEM) * Vec::size();  // a load
    Vec acc(0.f);
    for (int64_t b = 0; b * BS < l[s]; ++b) {
      const int64_t n = std::min<int64_t>(BS, l[s] - b * BS) * D;
      const CARPOOL_ELEM* k = c + (h * NB + t[s * width + b]) * BS * D;
      const CARPOOL_ELEM* v = c + ((H + h) * NB + t[s * width + b]) * BS * D;
      for (int64_t x = 0; x < n; x += kStep) {
        acc = acc + Vec::loadu(k + x) + Vec::loadu(v + x);
      }
    }
    float lanes[Vec::size()];
    acc.store(lanes);
    sink += static_cast<int64_t>(lanes[0] != 0.f);
  });
  return static_cast<double>(sink.load());
}
"""


def build(headers: Path, avx512: bool, dtype: torch.dtype = torch.bfloat16):
    """The two functions for caches of `dtype`, compiled against `headers`' decode loop (named
    by its text, the dtype and the build): the AVX512-BF16 one, else the AVX2 one."""
    names = ("decode_one_pass.h" if avx512 else "decode_one_pass_avx2.h", "decode_common.h",
             "block_ops.h")
    folder = headers / "attention" if (headers / "attention").is_dir() else headers
    text = "".join((folder / name).read_text() for name in names)
    elem = "float" if dtype == torch.float32 else "uint16_t"
    name = ("decode_read_rate_" + ("" if avx512 else "avx2_") + ("f32_" if elem == "float" else "")
            + hashlib.sha1(text.encode()).hexdigest()[:12])
    flags = ["-O3", "-fopenmp", f"-DCARPOOL_ELEM={elem}",
             *_CAPABILITY_FLAGS["AVX512" if avx512 else "AVX2"]]
    if avx512:
        flags += ["-mavx512bf16", "-DCARPOOL_AVX512_BF16"]
    return load_inline(name, cpp_sources=_SOURCE, functions=["decode", "read_only"],
                       extra_include_paths=[str(headers), str(folder)], extra_cflags=flags,
                       extra_ldflags=["-fopenmp"])


def make_case(num_decodes: int, context: int | None, num_layers: int, run: int,
              huge_pages: bool, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
              heads: int = HEADS, group: int = GROUP):
    """q, the layers' caches, block tables, lengths, out, and the KV bytes one layer reads."""
    gen = torch.Generator().manual_seed(seed)
    if context:
        lens = torch.full((num_decodes,), context, dtype=torch.int32)
    else:
        lens = torch.randint(16, 513, (num_decodes,), generator=gen, dtype=torch.int32)
    blocks_each = (lens + BLOCK - 1) // BLOCK
    num_runs = -(-int(blocks_each.sum()) // run)
    ids = (torch.randperm(num_runs, generator=gen)[:, None] * run + torch.arange(run)).flatten()
    tables = torch.zeros(num_decodes, int(blocks_each.max()), dtype=torch.int32)
    taken = 0
    for s, n in enumerate(blocks_each.tolist()):
        tables[s, :n] = ids[taken:taken + n].to(torch.int32)
        taken += n
    shape = (2, heads, num_runs * run, BLOCK, HEAD_DIM)
    caches = []
    for _ in range(num_layers):  # on huge pages, as the engine's cache (cpu_kv_huge_pages)
        cache = zeros_on_huge_pages(shape, dtype) if huge_pages else torch.empty(
            shape, dtype=dtype)
        caches.append(cache.copy_(torch.randn(shape, generator=gen)))
    q = torch.randn(num_decodes, heads * group, HEAD_DIM, generator=gen).to(dtype)
    kv_bytes = int(lens.sum()) * heads * HEAD_DIM * 2 * dtype.itemsize
    return q, caches, tables, lens, torch.empty_like(q), kv_bytes


def reference(q, cache, tables, lens) -> torch.Tensor:
    """The project's float32 reference of the same decodes (the check)."""
    out = torch.empty(q.shape, dtype=torch.float32)
    ones = torch.ones(len(lens), dtype=torch.int64)
    paged_attention_reference(out, q, cache, tables, torch.cumsum(ones, 0) - 1, ones, lens,
                              SCALE, 0)
    return out


def seconds_per_layer(fn, caches, repeats: int, samples: int) -> float:
    """Median over samples of the time per layer of `repeats` passes over every cache."""
    times = []
    for _ in range(samples):
        begin = time.perf_counter()
        for _ in range(repeats):
            for cache in caches:
                fn(cache)
        times.append((time.perf_counter() - begin) / repeats / len(caches))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--run", type=int, default=4, help="consecutive block ids per run")
    parser.add_argument("--headers", type=Path,
                        default=Path(__file__).resolve().parents[2] / "carpool" / "kernels"
                        / "csrc", help="the csrc folder whose decode_one_pass.h is timed")
    parser.add_argument("--against", type=Path, default=None,
                        help="another csrc folder: time both decode loops, alternated")
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--huge-pages", action=argparse.BooleanOptionalAction, default=True,
                        help="the caches on transparent huge pages, as the engine's")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--shape", type=int, nargs=2, default=[HEADS, GROUP],
                        metavar=("KV_HEADS", "GROUP"), help="kv heads, query rows a kv head")
    parser.add_argument("--clock-ghz", type=float, default=2.0,
                        help="the clock the cycles a key row are counted at")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    avx512 = bool(torch.cpu._is_avx512_bf16_supported())
    if not avx512 and not torch.cpu._is_avx2_supported():
        raise SystemExit("the decode loops timed here need AVX512-BF16 or AVX2")
    torch.set_num_threads(args.threads)
    module = build(args.headers, avx512, dtype)
    heads, group = args.shape

    def case(num, context, layers):
        return make_case(num, context, layers, args.run, args.huge_pages, dtype=dtype,
                         heads=heads, group=group)

    q, caches, tables, lens, out, _ = case(6, 100, 1)
    module.decode(q, caches[0], tables, lens, out, group, SCALE)
    error = (out.float() - reference(q, caches[0], tables, lens)).abs().max().item()
    print(f"{args.headers} ({'AVX512' if avx512 else 'AVX2'}): {args.dtype}, {heads} kv heads "
          f"of {group} rows, {args.threads} threads, runs of {args.run} blocks, huge pages "
          f"{'on' if args.huge_pages else 'off'}; "
          f"max abs diff to float32 {error:.1e}")
    cases = [("8 decodes at 128 (L2)", 8, 128, 1, 2000),
             ("200 decodes, 1 layer (L3)", 200, None, 1, 30),
             ("200 decodes, 12 layers (memory)", 200, None, 12, 6)]
    if args.against is not None:
        other = build(args.against, avx512, dtype)
        print(f"against {args.against}: kernel time per layer, {args.samples} alternated samples")
        print(f"{'case':34} {'that ms':>9} {'this ms':>9} {'this/that':>9} {'bitwise':>8}")
        for label, num, context, layers, repeats in cases:
            compare_case(other, module, label, case(num, context, layers),
                         max(1, repeats // 10), args.samples)
        return
    print(f"{'case':34} {'kernel ms':>9} {'GB/s':>6} {'cycles':>6} {'read-only ms':>12} "
          f"{'GB/s':>6} {'cycles':>6}")
    for label, num, context, layers, repeats in cases:
        time_case(module, label, case(num, context, layers), repeats, args.samples,
                  args.clock_ghz * 1e9 * args.threads)


def time_case(module, label: str, case: tuple, repeats: int, samples: int,
              cycles_a_second: float) -> None:
    """One table row: the kernel's and the read-only loop's time per layer, GB/s, and cycles
    a key row (all threads' cycles at the given clock)."""
    q, caches, tables, lens, out, kv_bytes = case
    group = q.shape[1] // caches[0].shape[1]
    key_rows = int(lens.sum()) * caches[0].shape[1]
    kernel = seconds_per_layer(lambda c: module.decode(q, c, tables, lens, out, group, SCALE),
                               caches, repeats, samples)
    read = seconds_per_layer(lambda c: module.read_only(c, tables, lens), caches, repeats,
                             samples)
    print(f"{label:34} {kernel * 1e3:9.3f} {kv_bytes / kernel / 1e9:6.1f} "
          f"{kernel * cycles_a_second / key_rows:6.0f} {read * 1e3:12.3f} "
          f"{kv_bytes / read / 1e9:6.1f} {read * cycles_a_second / key_rows:6.0f}")

def compare_case(that, this, label: str, case: tuple, repeats: int, samples: int) -> None:
    """One row of `--against`: both builds' kernel time per layer, sample by sample in turn."""
    q, caches, tables, lens, out, _ = case
    group = q.shape[1] // caches[0].shape[1]
    outs, times = [], ([], [])
    for module in (that, this):
        module.decode(q, caches[0], tables, lens, out, group, SCALE)
        outs.append(out.clone())
    for _ in range(samples):
        for module, spent in zip((that, this), times):
            spent.append(seconds_per_layer(
                lambda c, m=module: m.decode(q, c, tables, lens, out, group, SCALE),
                caches, repeats, 1))
    ratio = statistics.median(b / a for a, b in zip(*times))
    print(f"{label:34} {statistics.median(times[0]) * 1e3:9.3f} "
          f"{statistics.median(times[1]) * 1e3:9.3f} {ratio:9.3f} "
          f"{str(torch.equal(outs[0], outs[1])):>8}")


if __name__ == "__main__":
    main()
