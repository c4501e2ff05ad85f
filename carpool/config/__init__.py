"""Everything needed to build an engine: model, device, KV cache size, scheduler.

One frozen dataclass shared by `LLM(...)`, `carpool serve`, `carpool generate`
and `carpool bench offline`, so a setting has one name everywhere (vLLM's).
All of them build it through `EngineConfig.from_args`, which reads the model's
config first and checks every value against the model's real limits; a bad
value raises `ValueError` naming the argument and the numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
from dataclasses import dataclass, field
from typing import NoReturn

from carpool.config.named_files import (
    GENERATION_CONFIG_AUTO,
    check_generation_config,
    check_quantization_of,
    load_model_config_of,
    model_or_default,
    read_chat_template,
)
from carpool.core.config import (  # noqa: F401 - the usage defaults, re-exported
    OFFLINE_CPU_MAX_NUM_BATCHED_TOKENS,
    SERVER_CPU_MAX_NUM_SEQS,
    USAGE_CONTEXTS,
    SchedulerConfig,
    default_max_num_batched_tokens,
    default_max_num_seqs,
)
from carpool.core.spec_config import SpeculativeConfig
from carpool.cpu_options import CpuOptions
from carpool.lora_request import LoraConfig
from carpool.sampling_params import GrammarLimits

DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's other names
# --quantization (vLLM's names; models.quant.hf_config reads them): auto (or None) is the
# checkpoint's own.
QUANTIZATION_METHODS = ("auto", "awq", "gptq", "compressed-tensors", "gguf")
DEFAULT_MAX_LOGPROBS = 20  # vLLM's; -1 lifts the cap to the vocabulary
# Estimated bytes the compiled-grammar cache may hold (carpool.structured.compiler).
DEFAULT_GRAMMAR_CACHE_MEMORY = 128 * 2**20
# auto: cpu on CPU, sdpa elsewhere (carpool.attention holds the backends under these names).
ATTENTION_BACKENDS = ("auto", "cpu", "sdpa")

# torch.distributed rendezvous URLs carpool passes on (tcp:// must carry ?rank=&world_size=).
INIT_METHOD_SCHEMES = ("env://", "tcp://")

# With no max_model_len given, the model's own limit is capped here, so a 128k-context
# model does not size its budgets for contexts nobody sends to a small server.
DEFAULT_MAX_MODEL_LEN_CAP = 8192



@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF folder or hub id; None: the built-in default model
    dtype: str = "auto"  # the checkpoint's; float32 ones in bfloat16 on native-bf16 hardware
    quantization: str | None = None  # one of QUANTIZATION_METHODS; None: auto
    device: str = "auto"  # auto: cuda if available, else cpu
    seed: int = 0
    served_model_name: str | None = None
    # KV cache size, first that is set wins: explicit blocks, bytes, GPU fraction, CPU default.
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # None until resolved against the model (`from_args`, `for_model`); then equal to
    # scheduler.max_model_len.
    max_model_len: int | None = None
    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS (see carpool.attention)
    # The CPU platform's switches (`LLM(cpu_kernels=...)`, `--no-cpu-kernels`, ...); ignored on
    # CUDA. See carpool.cpu_options.
    cpu: CpuOptions = field(default_factory=CpuOptions)
    # Every token's logits bitwise the same whatever else shares its steps (linears over fixed
    # row tiles, every query through the C++ kernel in one key order); CPU only, costs speed.
    batch_invariant: bool = False
    # Debug: a mixture of experts counts the rows each expert receives (`EngineStats.router_load`).
    moe_router_stats: bool = False
    tokenizer: str | None = None  # folder or hub id; None: the model's
    chat_template: str | None = None  # the Jinja text itself; None: the tokenizer's
    # GENERATION_CONFIG_AUTO, GENERATION_CONFIG_NONE, or a folder with generation_config.json
    generation_config: str = GENERATION_CONFIG_AUTO
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # per token, sampled or prompt; -1: no cap
    grammar_cache_memory: int = DEFAULT_GRAMMAR_CACHE_MEMORY  # compiled grammars, estimated
    # How big a request's grammar may be, and how long the server's check of it may take.
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits)
    # Tensor parallelism: ranks each holding 1/N of every layer (see carpool.distributed).
    tensor_parallel_size: int = 1
    # None: carpool starts ranks 1..N-1 on this machine. "env://": the ranks meet through
    # torch.distributed's env:// rendezvous (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE,
    # read by torch), each started by its own command (multi-node); rank 0 runs the engine.
    distributed_init_method: str | None = None
    # Data parallelism: this engine is replica `data_parallel_rank` of `data_parallel_size`
    # behind one server (set by the server's data-parallel client, `carpool serve -dp N`); a
    # replica takes 1/N of the CPU threads, or its own CUDA card(s).
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    # Who builds the engine, one of USAGE_CONTEXTS: on CPU the server's default max_num_seqs
    # is lower (`default_max_num_seqs`) and the offline step budget higher
    # (`default_max_num_batched_tokens`), which needs the device, known only in the engine.
    usage: str = "offline"
    # max_num_seqs and max_num_batched_tokens as the user gave them; None: not given, so
    # `for_device` may replace the scheduler's (the CUDA defaults until then) with the
    # defaults for usage and device.
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    # Speculative decoding (vLLM's speculative_config); None: off. Continuous scheduler only.
    speculative_config: SpeculativeConfig | None = None
    lora: LoraConfig | None = None  # LoRA adapters (`--enable-lora`); None: off

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization not in (None, *QUANTIZATION_METHODS):
            raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS}, "
                             f"got {self.quantization!r}")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int)
                                               or self.num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks must be a positive integer, "
                             f"got {self.num_kv_blocks!r}")
        if self.kv_cache_memory is not None and (not isinstance(self.kv_cache_memory, int)
                                                 or self.kv_cache_memory < 1):
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, "
                             f"got {self.kv_cache_memory!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization!r}")
        if (isinstance(self.tensor_parallel_size, bool)
                or not isinstance(self.tensor_parallel_size, int)
                or self.tensor_parallel_size < 1):
            raise ValueError(f"tensor_parallel_size must be a positive integer, "
                             f"got {self.tensor_parallel_size!r}")
        if (isinstance(self.data_parallel_size, bool)
                or not isinstance(self.data_parallel_size, int)
                or self.data_parallel_size < 1):
            raise ValueError(f"data_parallel_size must be a positive integer, "
                             f"got {self.data_parallel_size!r}")
        if not (isinstance(self.data_parallel_rank, int)
                and 0 <= self.data_parallel_rank < self.data_parallel_size):
            raise ValueError(f"data_parallel_rank must be in [0, data_parallel_size "
                             f"{self.data_parallel_size}), got {self.data_parallel_rank!r}")
        if self.distributed_init_method is not None and not (
                isinstance(self.distributed_init_method, str)
                and self.distributed_init_method.startswith(INIT_METHOD_SCHEMES)):
            raise ValueError(f"distributed_init_method must start with one of "
                             f"{INIT_METHOD_SCHEMES}, got {self.distributed_init_method!r}")
        if self.usage not in USAGE_CONTEXTS:
            raise ValueError(f"usage must be one of {USAGE_CONTEXTS}, got {self.usage!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")
        if not isinstance(self.cpu, CpuOptions):
            raise ValueError(f"cpu must be a CpuOptions, got {self.cpu!r}")
        if self.batch_invariant:
            check_batch_invariant_supported(self)
        if self.lora is not None:
            LoraConfig.check_engine(self.lora, self.tensor_parallel_size, self.batch_invariant,
                                    self.scheduler.scheduler)
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or \
                self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= -1, got {self.max_logprobs!r}")
        if isinstance(self.grammar_cache_memory, bool) or not isinstance(
                self.grammar_cache_memory, int) or self.grammar_cache_memory < 0:
            raise ValueError(f"grammar_cache_memory must be a number of bytes >= 0, "
                             f"got {self.grammar_cache_memory!r}")
        if not isinstance(self.grammar_limits, GrammarLimits):
            raise ValueError(f"grammar_limits must be a GrammarLimits, got {self.grammar_limits!r}")
        if self.speculative_config is not None:
            SpeculativeConfig.check_engine(self.speculative_config, self.tensor_parallel_size,
                                           self.lora is not None, self.scheduler.scheduler)

    @property
    def is_resolved(self) -> bool:
        return self.max_model_len == self.scheduler.max_model_len

    @classmethod
    def from_args(cls, model: str | None = None, *, dtype: str = "auto", device: str = "auto",
                  seed: int = 0, served_model_name: str | None = None,
                  num_kv_blocks: int | None = None, kv_cache_memory: int | None = None,
                  gpu_memory_utilization: float = 0.9, max_model_len: int | None = None,
                  max_num_seqs: int | None = None,
                  max_num_batched_tokens: int | None = None,
                  enable_chunked_prefill: bool = True, max_num_partial_prefills: int = 1,
                  max_long_partial_prefills: int = 1, long_prefill_token_threshold: int = 0,
                  block_size: int = 16, scheduler: str = "continuous",
                  preemption_policy: str = "newest", enable_prefix_caching: bool = True,
                  tensor_parallel_size: int = 1, distributed_init_method: str | None = None,
                  trust_remote_code: bool = False, attention_backend: str = "auto",
                  batch_invariant: bool = False, moe_router_stats: bool = False,
                  tokenizer: str | None = None,
                  chat_template: str | None = None,
                  generation_config: str = GENERATION_CONFIG_AUTO,
                  max_logprobs: int = DEFAULT_MAX_LOGPROBS,
                  grammar_cache_memory: int = DEFAULT_GRAMMAR_CACHE_MEMORY,
                  max_grammar_bytes: int = GrammarLimits.max_bytes,
                  max_grammar_rules: int = GrammarLimits.max_rules,
                  max_grammar_depth: int = GrammarLimits.max_depth,
                  max_grammar_alternatives: int = GrammarLimits.max_alternatives,
                  grammar_check_timeout: float = GrammarLimits.check_timeout,
                  enforce_eager: bool = False, usage: str = "offline",
                  quantization: str | None = None,
                  speculative_config: dict | str | None = None, enable_lora: bool = False,
                  max_loras: int = 1, max_lora_rank: int = 16,
                  max_cpu_loras: int | None = None, **cpu_args) -> EngineConfig:
        """The config these arguments describe, for the model they name (read first).

        max_model_len: None takes the model's max_position_embeddings, capped at
        DEFAULT_MAX_MODEL_LEN_CAP. max_num_seqs: None takes `default_max_num_seqs` for
        `usage` (one of USAGE_CONTEXTS) and the device (for device "auto" the engine sets it,
        `for_device`, once it knows the device). max_num_batched_tokens: None takes
        `default_max_num_batched_tokens` for `usage` and the device, likewise.
        chat_template: a file, or the template itself. max_grammar_* and
        grammar_check_timeout: the fields of `GrammarLimits`. cpu_args: the CPU switches by their
        public names (cpu_kernels=False, ...), read by `CpuOptions.from_args`. enforce_eager
        is accepted for vLLM's sake and changes nothing: carpool has no CUDA graphs or
        compilation to turn off. speculative_config: vLLM's mapping or JSON text
        (`SpeculativeConfig.from_dict`). moe_router_stats: rows per expert per sparse layer
        (`EngineStats.router_load`). enable_lora, max_loras, max_lora_rank, max_cpu_loras:
        LoRA adapters as vLLM's flags (`LoraConfig`)."""
        if trust_remote_code:
            raise ValueError("trust_remote_code is not supported: carpool runs only its own "
                             "model code (Llama, Mistral, Qwen2, Qwen3, their mixtures of "
                             "experts) and loads weights from safetensors, never code or "
                             "pickles from a checkpoint")
        cpu = CpuOptions.from_args(**cpu_args)
        speculative = SpeculativeConfig.from_dict(speculative_config)
        lora = LoraConfig(max_loras, max_lora_rank, max_cpu_loras) if enable_lora else None
        grammar_limits = GrammarLimits(
            max_bytes=max_grammar_bytes, max_rules=max_grammar_rules, max_depth=max_grammar_depth,
            max_alternatives=max_grammar_alternatives, check_timeout=grammar_check_timeout)
        model_config = load_model_config_of(model)
        check_quantization_of(model, quantization)
        max_position_embeddings = model_config.max_position_embeddings
        from carpool.models.sharding import check_divisible
        check_divisible(model_config, tensor_parallel_size)
        check_generation_config(generation_config)
        max_model_len = resolve_max_model_len(max_model_len, max_position_embeddings)
        if speculative is not None and speculative.method == "draft_model":
            from carpool.models.draft_check import check_draft_model, estimated_pass_cost
            from carpool.models.paths import resolve_model_path
            target_path = resolve_model_path(model_or_default(model))
            check_draft_model(speculative.model, model_config, target_path, max_model_len)
            if speculative.draft_pass_cost is None:
                speculative = dataclasses.replace(speculative, draft_pass_cost=round(
                    estimated_pass_cost(speculative.model, target_path), 4))
        requested_max_num_seqs = max_num_seqs
        requested_max_num_batched_tokens = max_num_batched_tokens
        device_until_known = "cuda" if device == "auto" else device
        if max_num_seqs is None:
            max_num_seqs = default_max_num_seqs(usage, device_until_known)
        if max_num_batched_tokens is None:
            max_num_batched_tokens = default_max_num_batched_tokens(
                usage, device_until_known, max_model_len, enable_chunked_prefill)
        scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, enable_chunked_prefill=enable_chunked_prefill,
            max_num_partial_prefills=max_num_partial_prefills,
            max_long_partial_prefills=max_long_partial_prefills,
            long_prefill_token_threshold=long_prefill_token_threshold, block_size=block_size,
            preemption_policy=preemption_policy, scheduler=scheduler,
            enable_prefix_caching=enable_prefix_caching,
            max_loras=None if lora is None else lora.max_loras)
        return cls(model=model, dtype=dtype, quantization=quantization, device=device, seed=seed,
                   served_model_name=served_model_name, num_kv_blocks=num_kv_blocks,
                   kv_cache_memory=kv_cache_memory,
                   gpu_memory_utilization=gpu_memory_utilization,
                   scheduler=scheduler_config, max_model_len=max_model_len,
                   attention_backend=attention_backend, cpu=cpu,
                   batch_invariant=batch_invariant, moe_router_stats=moe_router_stats,
                   tokenizer=tokenizer,
                   chat_template=read_chat_template(chat_template),
                   generation_config=generation_config, max_logprobs=max_logprobs,
                   grammar_cache_memory=grammar_cache_memory, grammar_limits=grammar_limits,
                   tensor_parallel_size=tensor_parallel_size,
                   distributed_init_method=distributed_init_method, usage=usage,
                   max_num_seqs=requested_max_num_seqs,
                   max_num_batched_tokens=requested_max_num_batched_tokens,
                   speculative_config=speculative, lora=lora)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, usage: str = "offline") -> EngineConfig:
        """`from_args` over the flags of `carpool.arg_utils`, for `usage` (one of
        USAGE_CONTEXTS); errors name the flags."""
        names = [name for name, parameter in inspect.signature(cls.from_args).parameters.items()
                 if parameter.kind is not inspect.Parameter.VAR_KEYWORD]
        names += CpuOptions.argument_names()
        try:
            return cls.from_args(**{name: getattr(args, name) for name in names
                                    if hasattr(args, name)}, usage=usage)
        except ValueError as exc:
            raise ValueError(as_flags(str(exc), names)) from exc

    def for_model(self, max_position_embeddings: int) -> EngineConfig:
        """This config with max_model_len resolved for a model (the scheduler's too), checked
        again; for configs built field by field rather than through `from_args`."""
        if self.is_resolved and self.max_model_len <= max_position_embeddings:
            return self
        max_model_len = resolve_max_model_len(self.max_model_len, max_position_embeddings)
        scheduler = dataclasses.replace(self.scheduler, max_model_len=max_model_len)
        return dataclasses.replace(self, scheduler=scheduler, max_model_len=max_model_len)


    def for_device(self, device_type: str) -> EngineConfig:
        """This config with the defaults that depend on the device set for `device_type`
        ("cpu" or "cuda", the device "auto" resolved to): max_num_seqs and
        max_num_batched_tokens, each when not given."""
        changes = {}
        if self.max_num_seqs is None:
            changes["max_num_seqs"] = default_max_num_seqs(self.usage, device_type)
        sched = self.scheduler
        placeholder = default_max_num_batched_tokens(self.usage, "cuda", sched.max_model_len,
                                                     sched.enable_chunked_prefill)
        # A scheduler built field by field keeps a budget other than the placeholder.
        if self.max_num_batched_tokens is None and sched.max_num_batched_tokens == placeholder:
            changes["max_num_batched_tokens"] = default_max_num_batched_tokens(
                self.usage, device_type, sched.max_model_len, sched.enable_chunked_prefill)
        if all(getattr(self.scheduler, name) == value for name, value in changes.items()):
            return self
        return dataclasses.replace(self, scheduler=dataclasses.replace(self.scheduler, **changes))


def check_batch_invariant_supported(config: EngineConfig) -> None:
    """ValueError naming batch_invariant where the mode cannot hold its promise: it is built
    from the CPU's fixed-order kernels (the C++ paged attention, oneDNN linears over fixed row
    tiles) and one rank (an all-reduce over three or more ranks sums in an order that depends
    on the tensor's size). On CUDA the sdpa backend's paths differ per step shape, so the mode
    refuses rather than run silently non-invariant."""
    def refuse(reason: str) -> NoReturn:
        raise ValueError(f"batch_invariant is CPU-only for now and needs {reason}")
    if config.device.startswith("cuda"):
        refuse(f"device cpu (got device {config.device!r})")
    if config.attention_backend == "sdpa":
        refuse("attention_backend cpu or auto (got 'sdpa')")
    if not config.cpu.kernels:
        refuse("the C++ kernels (cpu_kernels on)")
    if config.tensor_parallel_size != 1:
        refuse(f"tensor_parallel_size 1 (got {config.tensor_parallel_size})")


def resolve_max_model_len(requested: int | None, max_position_embeddings: int) -> int:
    """`requested`, or the model's limit capped at DEFAULT_MAX_MODEL_LEN_CAP."""
    if requested is None:
        return min(max_position_embeddings, DEFAULT_MAX_MODEL_LEN_CAP)
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise ValueError(f"max_model_len must be a positive integer, got {requested!r}")
    if requested > max_position_embeddings:
        raise ValueError(f"max_model_len ({requested}) is larger than the model's "
                         f"max_position_embeddings ({max_position_embeddings})")
    return requested


def as_flags(message: str, names) -> str:
    """`message` with each argument name in `names` written as its flag (--max-model-len)."""
    def flag(match: re.Match) -> str:
        return "--" + match.group(0).replace("_", "-")
    pattern = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True) if "_" in n)
    return re.sub(rf"\b(?:{pattern})\b", flag, message)
