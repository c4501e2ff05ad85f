"""Scheduler settings, under vLLM's names, validated when built.

Frozen: nothing changes a config after construction. A bad value raises
`ValueError` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

PREEMPTION_POLICIES = ("newest", "least_work")
SCHEDULER_KINDS = ("continuous", "static")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # running requests at most
    max_num_batched_tokens: int = 2048  # tokens per step at most (the step's budget)
    max_model_len: int = 2048  # prompt + outputs at most
    enable_chunked_prefill: bool = True
    # At most this many requests part-way through their prompt at once...
    max_num_partial_prefills: int = 1
    # ...and of those, at most this many with prompts longer than the threshold.
    max_long_partial_prefills: int = 1
    # A prompt longer than this is "long", and each prefill chunk is capped at it.
    # 0: unset; as in vLLM it then becomes 4% of max_model_len when max_num_partial_prefills > 1.
    long_prefill_token_threshold: int = 0
    block_size: int = 16  # tokens per KV block
    preemption_policy: str = "newest"  # victim: most recently admitted, or least work done
    scheduler: str = "continuous"  # or "static", the baseline
    # A waiting request skipped this many times because it did not fit is not skipped again:
    # admission stops behind it until it fits (aging, so it is never starved).
    max_skips: int = 16
    # Reuse the KV of computed full blocks whose token prefix a new request repeats
    # (continuous scheduler; the static baseline never shares).
    enable_prefix_caching: bool = True
    # At most this many distinct LoRA adapters in one step (None: adapters off, no limit).
    max_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len",
                     "max_num_partial_prefills", "max_long_partial_prefills", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.long_prefill_token_threshold,
                          int) or self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be an integer >= 0, "
                             f"got {self.long_prefill_token_threshold!r}")
        if self.max_long_partial_prefills > self.max_num_partial_prefills:
            raise ValueError(
                f"max_long_partial_prefills ({self.max_long_partial_prefills}) must be <= "
                f"max_num_partial_prefills ({self.max_num_partial_prefills})")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) when chunked prefill is off, "
                "or the longest prompts could never be scheduled")
        if self.preemption_policy not in PREEMPTION_POLICIES:
            raise ValueError(f"preemption_policy must be one of {PREEMPTION_POLICIES}, "
                             f"got {self.preemption_policy!r}")
        if self.scheduler not in SCHEDULER_KINDS:
            raise ValueError(f"scheduler must be one of {SCHEDULER_KINDS}, got {self.scheduler!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError("enable_prefix_caching must be a bool, "
                             f"got {self.enable_prefix_caching!r}")
        if self.max_loras is not None and (isinstance(self.max_loras, bool) or not isinstance(
                self.max_loras, int) or self.max_loras < 1):
            raise ValueError(f"max_loras must be a positive integer, got {self.max_loras!r}")
        if not isinstance(self.max_skips, int) or self.max_skips < 0:
            raise ValueError(f"max_skips must be an integer >= 0, got {self.max_skips!r}")

    @staticmethod
    def default_max_num_batched_tokens(max_model_len: int, enable_chunked_prefill: bool) -> int:
        """The step budget when none is given: 2048, raised to max_model_len without chunked
        prefill so the longest prompt fits one step (as vLLM)."""
        budget = SchedulerConfig.max_num_batched_tokens
        return budget if enable_chunked_prefill else max(budget, max_model_len)

    @property
    def effective_long_prefill_threshold(self) -> int | None:
        """The threshold in tokens, or None when there is none (no chunk cap, no prompt is long)."""
        if self.long_prefill_token_threshold:
            return self.long_prefill_token_threshold
        if self.max_num_partial_prefills > 1:
            return max(1, int(self.max_model_len * 0.04))
        return None


# Who builds the engine: the offline `LLM` (and `carpool generate` / `bench offline`) or
# `carpool serve`. As in vLLM (its usage context), some defaults differ between the two.
USAGE_CONTEXTS = ("offline", "server")
SERVER_CPU_MAX_NUM_SEQS = 128  # vLLM's for its API server on CPU
OFFLINE_CPU_MAX_NUM_BATCHED_TOKENS = 4096  # vLLM's for its offline LLM on CPU


def default_max_num_seqs(usage: str, device: str) -> int:
    """The most requests running at once when none is given, on `device` (a resolved name,
    "cpu" or "cuda[:N]"): vLLM's CPU defaults, 128 for a server and 256 offline (a server's
    burst then decodes in shorter steps, for a lower time per output token; see
    docs/lab/22-the-server-at-vllm-s-cpu-defaults.md); 256 on CUDA. ValueError names `usage`
    if it is not one of USAGE_CONTEXTS."""
    if usage not in USAGE_CONTEXTS:
        raise ValueError(f"usage must be one of {USAGE_CONTEXTS}, got {usage!r}")
    if usage == "server" and str(device).startswith("cpu"):
        return SERVER_CPU_MAX_NUM_SEQS
    return SchedulerConfig.max_num_seqs


def default_max_num_batched_tokens(usage: str, device: str, max_model_len: int,
                                   enable_chunked_prefill: bool) -> int:
    """The step token budget when none is given, on `device` (a resolved name): vLLM's, 4096
    for the offline LLM on CPU (each prefill step's linears then run on more rows, where
    oneDNN is at its fastest), else the scheduler's 2048; without chunked prefill at least
    max_model_len, so the longest prompt fits one step. ValueError names `usage` if it is
    not one of USAGE_CONTEXTS."""
    if usage not in USAGE_CONTEXTS:
        raise ValueError(f"usage must be one of {USAGE_CONTEXTS}, got {usage!r}")
    budget = SchedulerConfig.default_max_num_batched_tokens(max_model_len, enable_chunked_prefill)
    if usage == "offline" and str(device).startswith("cpu"):
        return max(budget, OFFLINE_CPU_MAX_NUM_BATCHED_TOKENS)
    return budget
