"""What LoRA adapters cost (issue 62): output tokens/s of the same requests spread over N
adapters vs on the base model, and of base-only requests with `enable_lora` on vs off; and
the memory a loaded adapter takes against its file. One process, the variants alternated
over rounds (rotating which goes first), equal thread settings; ratios are the point.

The workload is `vs_vllm`'s (prompts 16-512 tokens, outputs half 16-32 and half 128-256,
exact, greedy). The adapters are written by `peft` (random non-zero A and B, every
q/k/v/o/gate/up/down module, in the checkpoint's dtype) into `--adapters-dir`.

    python3 -m benchmarks.features.lora_adapters /work/vs-vllm/135m-bfloat16 --threads 2
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

from benchmarks.compare.vs_vllm import build_requests
from carpool import LLM, LoRARequest, SamplingParams


def make_adapters(model: Path, folder: Path, count: int, rank: int) -> list[Path]:
    from carpool.models.config import load_model_config
    from carpool.testing.peft_adapters import ALL_MODULES, build_adapter

    dtype = str(load_model_config(model).dtype).removeprefix("torch.")
    made = []
    for i in range(count):
        out = folder / f"r{rank}-{i}"
        if not (out / "adapter_model.safetensors").is_file():
            build_adapter(model, out, seed=100 + i, rank=rank, alpha=2 * rank,
                          target_modules=ALL_MODULES, dtype=dtype)
        made.append(out)
    return made


def run(llm: LLM, requests, loras) -> float:
    """Output tokens/s of one generate over every request."""
    params = [SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0)
              for _, n in requests]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": ids} for ids, _ in requests], params,
                           use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--adapters-dir", type=Path, default=Path("/tmp/carpool-lora-bench"))
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--variants", default="base,base-lora-on,adapters")
    parser.add_argument("--max-prompt-len", type=int, default=0,
                        help="cut each prompt to this many tokens (0: vs_vllm's 16-512)")
    parser.add_argument("--max-output-len", type=int, default=0,
                        help="cap each output at this many tokens (0: vs_vllm's)")
    args = parser.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    folders = make_adapters(args.model, args.adapters_dir, args.num_adapters, args.rank)
    loras = [LoRARequest(f"a{i}", i + 1, str(f)) for i, f in enumerate(folders)]
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    requests = build_requests(args.num_requests, vocab, seed=0)
    if args.max_prompt_len or args.max_output_len:  # a shorter run of the same shape
        requests = [(ids[:args.max_prompt_len or None], min(n, args.max_output_len or n))
                    for ids, n in requests]
    common = dict(dtype="auto", max_num_seqs=256, max_num_batched_tokens=4096,
                  enable_prefix_caching=False, kv_cache_memory=int(args.kv_cache_gib * 2**30),
                  seed=0)
    lora_args = dict(enable_lora=True, max_loras=args.num_adapters,
                     max_cpu_loras=args.num_adapters, max_lora_rank=args.rank)
    variants = {  # name -> (LLM arguments, per-request adapters)
        "base": ({}, None),
        "base-lora-on": (lora_args, None),
        "adapters": (lora_args, [loras[i % len(loras)] for i in range(len(requests))]),
    }
    names = args.variants.split(",")
    results: dict[str, list[float]] = {name: [] for name in names}
    memory = None
    for round_index in range(args.rounds):
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        for name in order:
            engine_args, per_request = variants[name]
            llm = LLM(str(args.model), **common, **engine_args)
            results[name].append(run(llm, requests, per_request))
            if per_request is not None:
                stats = llm.stats()
                files = sum((f / "adapter_model.safetensors").stat().st_size for f in folders)
                memory = (stats.lora_loaded_bytes, files, len(folders))
            print(f"round {round_index} {name}: {results[name][-1]:.1f} out tok/s", flush=True)
            llm.close()
            del llm
            gc.collect()  # one variant's KV cache at a time (the OOM killer ended a run without)
    medians = {name: statistics.median(values) for name, values in results.items()}
    print(json.dumps({"out_tok_s": results, "median": medians}, indent=1))
    if "base" in medians:
        for name in names:
            print(f"{name} / base: {medians[name] / medians['base']:.3f}x")
    if memory is not None:
        loaded, files, count = memory
        print(f"memory: {loaded / count / 2**20:.2f} MiB per loaded adapter, its file "
              f"{files / count / 2**20:.2f} MiB ({loaded / files:.3f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
