"""Which attention paths a CPU step takes: decided once by `decide_attention`, held by a frozen
`AttentionRoute`, which picks the backend (`create_backend`) and the rows' kernels. The CPU
platform's route (`carpool.platform.cpu_route.CpuRoute`) holds one beside its other decisions;
a backend made without the platform (tests, benchmarks) decides it here by the same function.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class DecodePath(enum.Enum):
    PAGED_ATTENTION = "paged_attention"
    PYTORCH = "PyTorch (matmul + embedding_bag)"
    SDPA = "SDPA"


class PromptPath(enum.Enum):
    PREFILL_AMX = "prefill_attention_bf16 on AMX"
    PREFILL_BF16 = "prefill_attention_bf16"
    PAGED_ATTENTION = "paged_attention"
    PYTORCH = "PyTorch (query-block matmuls, SDPA for chunks)"
    SDPA = "SDPA"


@dataclass(frozen=True)
class AttentionRoute:
    """Which backend attends and by which kernels (`carpool.attention.create_backend`)."""

    backend: str  # "cpu-kernel", "cpu-torch" or "sdpa" (a key of the attention registry)
    decodes: DecodePath
    prompts: PromptPath
    batch_invariant: bool  # the kernels score every row the same way

    @property
    def prefill_kernel(self) -> bool:
        """Prompt chunks go to prefill_attention_bf16 (decodes stay with paged_attention)."""
        return self.prompts in (PromptPath.PREFILL_AMX, PromptPath.PREFILL_BF16)

    @property
    def prefill_amx(self) -> bool:
        return self.prompts is PromptPath.PREFILL_AMX

    def describe(self) -> str:
        text = f"decodes {self.decodes.value}, prompts {self.prompts.value}"
        return text + (" (batch-invariant)" if self.batch_invariant else "")


def decide_attention(dtype: torch.dtype | None, head_dim: int, sliding_window: int | None, *,
                     max_head_dim: int | None, prefill_bf16: bool = False, amx: bool = False,
                     batch_invariant: bool = False,
                     attention_backend: str = "cpu") -> AttentionRoute:
    """The kernels backend where the kernels take head_dim, else the PyTorch one (SDPA where
    asked for). Prompt chunks of bfloat16 take prefill_attention_bf16 where the CPU has
    AVX512-BF16 (no sliding window), on AMX tiles where it has them and head_dim is in 32s;
    every other row takes paged_attention, which also beats the PyTorch query-block matmuls
    on fresh prompts (docs/lab/17-the-paged-attention-kernel-second-pass.md).

    The kernels' facts: max_head_dim (the most paged_attention takes; None: no kernels),
    prefill_bf16 (prefill_attention_bf16 runs here and takes head_dim), amx (AMX tiles)."""
    if batch_invariant and (attention_backend != "cpu" or max_head_dim is None):
        raise ValueError(f"batch_invariant needs the cpu attention backend with the C++ "
                         f"kernels (got {attention_backend!r}, kernels "
                         f"{'on' if max_head_dim is not None else 'off'})")
    if attention_backend == "sdpa":
        return AttentionRoute("sdpa", DecodePath.SDPA, PromptPath.SDPA, False)
    if max_head_dim is None or head_dim > max_head_dim:
        if batch_invariant:
            raise ValueError(f"batch_invariant needs the C++ attention kernel, which takes "
                             f"head_dim up to {max_head_dim} in this build "
                             f"(the model's is {head_dim})")
        return AttentionRoute("cpu-torch", DecodePath.PYTORCH, PromptPath.PYTORCH, False)
    prompts = PromptPath.PAGED_ATTENTION
    if (not batch_invariant and dtype == torch.bfloat16 and sliding_window is None
            and prefill_bf16):
        prompts = PromptPath.PREFILL_AMX if head_dim % 32 == 0 and amx else PromptPath.PREFILL_BF16
    return AttentionRoute("cpu-kernel", DecodePath.PAGED_ATTENTION, prompts, batch_invariant)
