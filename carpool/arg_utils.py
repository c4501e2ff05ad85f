"""The engine and scheduler flags, shared by `carpool serve`, `generate` and `bench offline`.

A neutral module: front ends import it, it imports only configs, so no front end
imports another. Each flag's dest is the `EngineConfig.from_args` argument of the
same name (vLLM's); the --cpu-* flags' dests are the public names of `CpuOptions`' fields
(--cpu-kernels fills cpu_kernels, the field `kernels`), with its defaults.
"""

from __future__ import annotations

import argparse
import logging
import re

from carpool.config import (
    ATTENTION_BACKENDS,
    DEFAULT_GRAMMAR_CACHE_MEMORY,
    DEFAULT_MAX_LOGPROBS,
    DTYPE_ALIASES,
    DTYPES,
    OFFLINE_CPU_MAX_NUM_BATCHED_TOKENS,
    QUANTIZATION_METHODS,
    SERVER_CPU_MAX_NUM_SEQS,
    GrammarLimits,
)
from carpool.core.config import PREEMPTION_POLICIES, SCHEDULER_KINDS, SchedulerConfig
from carpool.cpu_options import CpuOptions
from carpool.lora_request import LoraConfig

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'4GiB', '512MiB', '2e9', '1000000' -> bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (try 4GiB or 512MiB)")
    try:
        value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r}") from None
    return int(value)


LOG_LEVELS = ("debug", "info", "warning", "error")


def add_log_level_argument(group, default: str) -> None:
    group.add_argument("--log-level", default=default, choices=LOG_LEVELS,
                       help=f"Logging level (default {default}).")


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def human_readable_int(text: str) -> int:
    """vLLM's integer flags: '32k' = 32,000 and '25.6k' = 25,600 (k m g t: powers of 1000),
    '32K' = 32,768 (K M G T: powers of 1024, whole numbers only), or a plain integer."""
    text = text.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text)
    try:
        if match is None:
            return int(text)
        number, suffix = match.groups()
        if suffix.islower():
            return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
        return int(number) * 1024 ** ("KMGT".index(suffix) + 1)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not an integer: {text!r} (try 4096, 32k = 32000 or 32K = 32768; "
            "decimals only with the lowercase, powers-of-1000 suffixes)") from None


def human_readable_int_or_auto(text: str) -> int | None:
    """`human_readable_int`, or None (the default) for 'auto' or -1, as vLLM's --max-model-len."""
    if text.strip().lower() in ("auto", "-1"):
        return None
    return human_readable_int(text)


class _ModelAction(argparse.Action):
    """The positional MODEL and `--model` (vLLM takes both) fill one `model`; two different
    models are an error."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if values is None:  # the positional, absent: keep what --model set, if anything
            return
        given = getattr(namespace, self.dest, None)
        if given is not None and given != values:
            parser.error(f"two models given: {values!r} and --model {given!r}")
        setattr(namespace, self.dest, values)


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, action=_ModelAction,
                        metavar="MODEL",
                        help="Hugging Face model folder or hub id (default: the built-in model, "
                             "carpool-default).")
    parser.add_argument("--model", dest="model", default=None, metavar="MODEL", action=_ModelAction,
                        help="The model, as a flag (vLLM's form; same as the positional MODEL).")


def add_engine_arguments(group) -> None:
    cpu = CpuOptions()
    group.add_argument("--dtype", default="auto", choices=DTYPES + tuple(DTYPE_ALIASES),
                       help="Weights and activations dtype (auto: the checkpoint's, but a float32 "
                            "checkpoint in bfloat16 where the hardware has it, as vLLM; half = "
                            "float16, float = float32).")
    group.add_argument("--quantization", "-q", default=None,
                       choices=QUANTIZATION_METHODS,
                       help="The checkpoint's quantization (default auto: what its config.json's "
                            "quantization_config says, or a .gguf file's types); a value the "
                            "checkpoint does not match is an error.")
    group.add_argument("--tokenizer", default=None,
                       help="Tokenizer folder or hub id (default: the model's).")
    group.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                       help="Jinja chat template, a file or the template itself (default: the "
                            "tokenizer's).")
    group.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                       help="Where unset sampling fields take their defaults: auto (the model's "
                            "generation_config.json), vllm (none: SamplingParams' defaults), or "
                            "a folder holding a generation_config.json.")
    group.add_argument("--max-logprobs", type=int, default=DEFAULT_MAX_LOGPROBS,
                       help="Most logprobs a request may ask per token, sampled or prompt "
                            f"(default {DEFAULT_MAX_LOGPROBS}; -1: the vocabulary).")
    group.add_argument("--grammar-cache-memory", type=parse_bytes,
                       default=DEFAULT_GRAMMAR_CACHE_MEMORY, metavar="BYTES",
                       help="Most memory the compiled structured-output grammars kept for reuse "
                            "may hold, estimated from their size, e.g. 64MiB (default "
                            f"{DEFAULT_GRAMMAR_CACHE_MEMORY // 2**20}MiB; 0: keep none).")
    _add_lora_arguments(group)
    limits = GrammarLimits()
    for flag, default, what in (
            ("--max-grammar-bytes", limits.max_bytes, "UTF-8 bytes of a request's JSON schema, "
             "regex, grammar or choice list"),
            ("--max-grammar-rules", limits.max_rules, "rules of a Lark/GBNF grammar, $refs of a "
             "JSON schema"),
            ("--max-grammar-depth", limits.max_depth, "levels of nesting of a grammar, regex or "
             "JSON schema"),
            ("--max-grammar-alternatives", limits.max_alternatives, "alternatives of a grammar "
             "or regex (|), choices, enum/anyOf/oneOf/allOf items of a JSON schema")):
        group.add_argument(flag, type=parse_bytes if flag.endswith("bytes") else int,
                           default=default, metavar="N",
                           help=f"Most {what} (default {default}); more is a 400 naming the "
                                "field, before the grammar library sees it.")
    group.add_argument("--grammar-check-timeout", type=float, default=limits.check_timeout,
                       metavar="SECONDS",
                       help="Longest the server's check of one grammar may take, in its checker "
                            f"process (default {limits.check_timeout:g}); longer is a 400.")
    group.add_argument("--enforce-eager", action="store_true",
                       help="Accepted for vLLM launch lines; carpool always runs eagerly (no "
                            "CUDA graphs or compilation to disable).")
    group.add_argument("--device", default="auto",
                       help="Device: auto (cuda if available, else cpu), cpu, cuda, cuda:N.")
    group.add_argument("--seed", type=int, default=0, help="Seed of the sampler's generators.")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="Fraction of GPU memory the model and KV cache may use (CUDA only).")
    group.add_argument("--kv-cache-memory", type=parse_bytes, default=None, metavar="BYTES",
                       help="KV cache size in bytes, e.g. 2GiB (overrides the GPU fraction; "
                            "CPU default: 10%% of free RAM, at most 4GiB).")
    group.add_argument("--kv-cache-memory-bytes", dest="kv_cache_memory",
                       type=human_readable_int, default=argparse.SUPPRESS, metavar="BYTES",
                       help="vLLM's name for --kv-cache-memory, with vLLM's suffixes "
                            "(4G = 4 x 2**30, 4g = 4 x 10**9).")
    group.add_argument("--num-kv-blocks", "--num-gpu-blocks-override", dest="num_kv_blocks",
                       type=int, default=None,
                       help="Exact number of KV cache blocks (tests, tuning).")
    group.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                       help="Attention kernels: auto (cpu on CPU, sdpa on CUDA), cpu (CPU fast "
                            "paths), sdpa (portable PyTorch SDPA over gathered blocks).")
    group.add_argument("--cpu-packed-linears", action=argparse.BooleanOptionalAction,
                       default=cpu.packed_linears,
                       help="CPU: run linear layers through oneDNN on weights packed once at "
                            "load (float32 and bfloat16).")
    group.add_argument("--cpu-malloc-tuning", action=argparse.BooleanOptionalAction,
                       default=cpu.malloc_tuning,
                       help="CPU: keep freed memory in the malloc heap (no page faults on each "
                            "step's large temporaries; the process keeps its peak heap).")
    group.add_argument("--cpu-kv-huge-pages", action=argparse.BooleanOptionalAction,
                       default=cpu.kv_huge_pages,
                       help="CPU: ask Linux for transparent huge pages under the KV cache "
                            "(madvise), so decode attention's reads of blocks all over the "
                            "cache do not each miss the TLB.")
    group.add_argument("--cpu-kernels", action=argparse.BooleanOptionalAction,
                       default=cpu.kernels,
                       help="CPU: the C++ kernels (paged attention reading the KV cache in "
                            "place, fused RoPE, the decoder layers run in one call), built on "
                            "first use; off, or without a compiler: the PyTorch paths.")
    group.add_argument("--cpu-omp-threads-bind", default=cpu.omp_threads_bind,
                       metavar="auto|nobind|CPUS",
                       help="CPU: pin torch's threads one to a CPU, as vLLM's "
                            "VLLM_CPU_OMP_THREADS_BIND: auto (the CPUs this process may use, "
                            "in the engine processes carpool starts; the offline LLM pins "
                            "nothing), nobind, or CPU lists such as 0-3 or 0-1|2-3 (one per "
                            "data-parallel replica or tensor-parallel rank).")
    group.add_argument("--cpu-omp-spin-count", type=int, default=cpu.omp_spin_count,
                       metavar="N",
                       help="CPU: how many times an idle OpenMP thread of the engine processes "
                            "carpool starts spins before it sleeps (libgomp's GOMP_SPINCOUNT, "
                            "about 100 a microsecond; 0 sleeps at once). Default: the "
                            "environment's OMP_WAIT_POLICY / GOMP_SPINCOUNT if set, else "
                            "10000.")
    group.add_argument("--batch-invariant", action="store_true",
                       help="Every token's logits bitwise identical whatever else runs in its "
                            "steps (batch size, chunking, preemption, prefix-cache hits); CPU "
                            "only, costs throughput (see docs/serving.md).")
    group.add_argument("--moe-router-stats", action="store_true",
                       help="Debug: a mixture-of-experts model counts the rows each expert "
                            "receives per layer (LLM.stats().router_load, GET /stats).")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="Ranks to shard every layer over (torch.distributed: NCCL on CUDA, "
                            "gloo on CPU); carpool starts ranks 1..N-1 on this machine.")
    group.add_argument("--distributed-init-method", default=None,
                       help="env:// to meet ranks started elsewhere (MASTER_ADDR, MASTER_PORT, "
                            "RANK, WORLD_SIZE; one command per node, `carpool tp-worker` for "
                            "ranks other than 0); default: start them here.")
    group.add_argument("--speculative-config", default=None, metavar="JSON",
                       help="Speculative decoding as vLLM's JSON object, e.g. "
                            "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                            "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5}' or "
                            "'{\"method\": \"draft_model\", \"model\": PATH, "
                            "\"num_speculative_tokens\": 3}' (default off; see "
                            "docs/serving.md).")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="Not supported: carpool never runs code shipped with a checkpoint.")


def add_scheduler_arguments(group) -> None:
    defaults = SchedulerConfig()
    group.add_argument("--max-num-seqs", type=int, default=None,
                       help=f"Most requests running at once (default {SERVER_CPU_MAX_NUM_SEQS} "
                            f"for a server on CPU, else {defaults.max_num_seqs}; vLLM's).")
    group.add_argument("--max-num-batched-tokens", type=human_readable_int, default=None,
                       help="Most tokens per step, the step's budget (default "
                            f"{OFFLINE_CPU_MAX_NUM_BATCHED_TOKENS} offline on CPU, else "
                            f"{defaults.max_num_batched_tokens}, vLLM's; or max-model-len if "
                            "larger without chunked prefill).")
    group.add_argument("--max-model-len", type=human_readable_int_or_auto, default=None,
                       help="Longest prompt + output, e.g. 4096, 32k (32000) or 32K (32768) "
                            "(default, or auto or -1: the model's, capped at 8192).")
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                       default=defaults.enable_chunked_prefill,
                       help="Split long prompts into chunks that share steps with decodes.")
    group.add_argument("--max-num-partial-prefills", type=int,
                       default=defaults.max_num_partial_prefills,
                       help="Most requests part-way through their prompt at once.")
    group.add_argument("--max-long-partial-prefills", type=int,
                       default=defaults.max_long_partial_prefills,
                       help="Of those, most with prompts longer than the threshold.")
    group.add_argument("--long-prefill-token-threshold", type=int,
                       default=defaults.long_prefill_token_threshold,
                       help="A prompt longer than this is 'long'; chunks are capped at it (0: "
                            "auto).")
    group.add_argument("--block-size", type=int, default=defaults.block_size,
                       help=f"Tokens per KV cache block (default {defaults.block_size}).")
    group.add_argument("--scheduler", default=defaults.scheduler, choices=SCHEDULER_KINDS,
                       help="continuous batching, or the static baseline.")
    group.add_argument("--preemption-policy", default=defaults.preemption_policy,
                       choices=PREEMPTION_POLICIES,
                       help="Which running request gives up its blocks when the cache is full.")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=defaults.enable_prefix_caching,
                       help="Reuse the KV cache of prompt prefixes earlier requests computed "
                            "(default on).")



def _add_lora_arguments(group) -> None:
    """vLLM's LoRA flags (the adapters a server serves by name: `carpool serve --lora-modules`)."""
    lora = LoraConfig()
    group.add_argument("--enable-lora", action="store_true",
                       help="Serve LoRA adapters of the model (requests name one as their "
                            "model; offline: LLM(enable_lora=True) and a lora_request).")
    group.add_argument("--max-loras", type=int, default=lora.max_loras,
                       help="Distinct LoRA adapters in one step at most; requests on others "
                            f"wait (default {lora.max_loras}).")
    group.add_argument("--max-lora-rank", type=int, default=lora.max_lora_rank,
                       help="The largest rank an adapter may have (default "
                            f"{lora.max_lora_rank}).")
    group.add_argument("--max-cpu-loras", type=int, default=None,
                       help="LoRA adapters kept loaded, the least recently used dropped "
                            "beyond it (default: --max-loras).")
