"""Time one decode step of carpool's engine at N running requests (any device, any backend).

Adds N requests with prompts of `--prompt-len` random tokens, steps until every
one has its first token (the prefill), then times `--steps` decode-only steps
(each `LLMEngine.step()` returns Python ints, so a CUDA step is synchronised).
Prints the median and p90 step time and the decode throughput.

    python benchmarks/decode_step.py /tmp/vs-vllm/135m-bfloat16 --dtype bfloat16 --requests 64 256
    python benchmarks/decode_step.py MODEL --device cuda --attention-backend sdpa --requests 64 256
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def time_decode_steps(llm, num_requests: int, prompt_len: int, num_steps: int,
                      seed: int = 0) -> dict:
    from carpool.sampling_params import SamplingParams

    engine = llm.engine
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=num_steps + 2, min_tokens=num_steps + 2, ignore_eos=True,
                            temperature=0.0)
    ids = [f"d{num_requests}-{i}" for i in range(num_requests)]
    for request_id in ids:
        engine.add_request(request_id, [rng.randrange(1, vocab) for _ in range(prompt_len)],
                           params)
    started = set()
    while len(started) < num_requests:  # prefill (and a first decode for early prompts)
        started.update(out.request_id for out in engine.step() if out.new_token_ids)
    times = []
    for _ in range(num_steps):
        begin = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - begin)
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    median = statistics.median(times)
    return {"requests": num_requests, "step_p50_ms": 1000 * median,
            "step_p90_ms": 1000 * statistics.quantiles(times, n=10)[-1],
            "decode_tok_s": num_requests / median}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None, help="checkpoint (default: built-in)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--requests", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args(argv)

    import torch

    from carpool.llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype, device=args.device,
              attention_backend=args.attention_backend, max_num_seqs=max(args.requests),
              max_model_len=args.prompt_len + args.steps + 8, max_num_batched_tokens=4096)
    runner = llm.engine.runner
    print(f"model {args.model or 'built-in'}, {runner.dtype}, device {runner.device}, "
          f"attention {runner.attention.name}, prompt {args.prompt_len} tokens")
    time_decode_steps(llm, min(args.requests), args.prompt_len, 3)  # warm-up
    results = []
    for num_requests in args.requests:
        result = time_decode_steps(llm, num_requests, args.prompt_len, args.steps)
        results.append(result)
        print(f"{num_requests:5d} running: decode step p50 {result['step_p50_ms']:.2f} ms, "
              f"p90 {result['step_p90_ms']:.2f} ms, {result['decode_tok_s']:.0f} tok/s")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
