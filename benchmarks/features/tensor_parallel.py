"""Step time at tensor_parallel_size 1 (one rank, 2 threads) vs 2 (two ranks, 1 thread each),
and the share of a TP=2 step rank 0 spends in collectives.

The model is SmolLM2-135M's shape (hidden 576, 30 layers, intermediate 1536, vocab
49152, tied embeddings) with 8 query heads of 72 and 2 KV heads instead of 9 of 64 and
3, since 9 heads do not split over two ranks; random weights (no hub here). Each
variant runs in its own process: N requests (prompts of 16-512 tokens, 32 output
tokens, greedy, ignore_eos) added at once, the prefill phase timed until every request
has its first token, then the median decode step, all wall clock (rank 1's work is
not in rank 0's CPU time). Rank 0's time inside `all_reduce` / `all_gather` /
`broadcast_ints` (waiting for rank 1 included) is summed per phase. The variants
alternate, ROUNDS times; compare within a round.

    OMP_WAIT_POLICY=PASSIVE python3 -m benchmarks.features.tensor_parallel /tmp/vs-vllm --rounds 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHAPE = dict(vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=8,
             num_key_value_heads=2, head_dim=72, intermediate_size=1536,
             tie_word_embeddings=True)


def checkpoint(root: Path, dtype: str) -> Path:
    """The TP-splittable 135M checkpoint under `root` (built once, reusing its tokenizer)."""
    from carpool.testing.checkpoints import build_checkpoint

    path = root / f"135m-tp-{dtype}"
    if not (path / "model.safetensors").exists():
        build_checkpoint(path, "llama", dtype=dtype, tokenizer_dir=root / "tokenizer-49152",
                         max_position_embeddings=2048, **SHAPE)
    return path


def run_variant(model: str, dtype: str, tp: int, threads: int, requests: int) -> dict:
    import torch

    from carpool import LLM, SamplingParams
    from carpool.distributed import TensorParallelGroup

    torch.set_num_threads(threads)
    comm = {"s": 0.0}
    for name in ("all_reduce", "all_gather", "broadcast_ints"):
        original = getattr(TensorParallelGroup, name)

        def timed(self, *args, _original=original, **kwargs):
            begin = time.perf_counter()
            try:
                return _original(self, *args, **kwargs)
            finally:
                if self.is_parallel:
                    comm["s"] += time.perf_counter() - begin
        setattr(TensorParallelGroup, name, timed)
    with LLM(model, dtype=dtype, device="cpu", tensor_parallel_size=tp, max_num_seqs=256,
             max_num_batched_tokens=2048, kv_cache_memory=1 << 30) as llm:
        engine = llm.engine
        rng = random.Random(0)
        params = SamplingParams(max_tokens=32, min_tokens=32, ignore_eos=True, temperature=0.0)
        for i in range(requests):
            prompt = [rng.randrange(1, 49152) for _ in range(rng.randint(16, 512))]
            engine.add_request(f"r{i}", prompt, params)
        started: set[str] = set()
        comm["s"], begin = 0.0, time.perf_counter()
        while len(started) < requests:
            started.update(out.request_id for out in engine.step() if out.new_token_ids)
        prefill, prefill_comm = time.perf_counter() - begin, comm["s"]
        steps, comm["s"] = [], 0.0
        while engine.has_unfinished_requests():
            begin = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - begin)
        return dict(tp=tp, threads=threads, prefill_s=prefill,
                    prefill_comm_share=prefill_comm / prefill,
                    decode_p50_ms=1000 * statistics.median(steps),
                    decode_comm_share=comm["s"] / sum(steps))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", help="folder of make_vs_vllm_checkpoints.py (tokenizer-49152)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # "tp,threads": run one, print JSON
    args = parser.parse_args()
    model = checkpoint(Path(args.root), args.dtype)
    if args.variant:
        tp, threads = map(int, args.variant.split(","))
        print(json.dumps(run_variant(str(model), args.dtype, tp, threads, args.requests)))
        return 0
    for round_index in range(args.rounds):
        order = ((1, 2), (2, 1)) if round_index % 2 == 0 else ((2, 1), (1, 2))
        for tp, threads in order:
            out = subprocess.run([sys.executable, "-m", "benchmarks.features.tensor_parallel",
                                  str(Path(args.root).resolve()), "--dtype", args.dtype,
                                  "--requests", str(args.requests), "--variant",
                                  f"{tp},{threads}"], cwd=ROOT, capture_output=True, text=True,
                                 check=True)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"round {round_index + 1} TP={tp} x {threads} thread(s): "
                  f"prefill {result['prefill_s']:.2f} s "
                  f"(collectives {100 * result['prefill_comm_share']:.0f}%), decode step p50 "
                  f"{result['decode_p50_ms']:.1f} ms "
                  f"(collectives {100 * result['decode_comm_share']:.0f}%)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
