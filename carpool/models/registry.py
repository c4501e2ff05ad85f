"""The architectures carpool can run, by the name `config.json` gives them.

All are the same Llama-family network; they differ only in a few switches
(biases on q/k/v, an RMSNorm on each head of q and k) and, for the mixtures of experts
(`moe`: how their config.json spells the router, `moe_config.py`), in the MLP of their
sparse layers (`moe.py`). Adding an architecture of that family is one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchitectureSpec:
    # Bias switches: True/False fixed by the architecture, None read from config.json
    # (`attention_bias` for q/k/v/o, `mlp_bias` for the MLP; absent means False).
    qkv_bias: bool | None
    o_proj_bias: bool | None
    mlp_bias: bool | None
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE
    moe: str | None = None  # "qwen" or "mixtral": experts in the sparse layers; None: dense

    def biases(self, raw: dict) -> tuple[bool, bool, bool]:
        """(qkv, o_proj, mlp) biases for a checkpoint whose config.json is `raw`."""
        def pick(fixed: bool | None, key: str) -> bool:
            return bool(raw.get(key, False)) if fixed is None else fixed
        return (pick(self.qkv_bias, "attention_bias"), pick(self.o_proj_bias, "attention_bias"),
                pick(self.mlp_bias, "mlp_bias"))


ARCHITECTURES: dict[str, ArchitectureSpec] = {
    "LlamaForCausalLM": ArchitectureSpec(None, None, None, qk_norm=False),
    "MistralForCausalLM": ArchitectureSpec(False, False, False, qk_norm=False),
    "Qwen2ForCausalLM": ArchitectureSpec(True, False, False, qk_norm=False),
    "Qwen3ForCausalLM": ArchitectureSpec(None, None, False, qk_norm=True),
    "MixtralForCausalLM": ArchitectureSpec(False, False, False, qk_norm=False, moe="mixtral"),
    "Qwen2MoeForCausalLM": ArchitectureSpec(True, False, False, qk_norm=False, moe="qwen"),
    "Qwen3MoeForCausalLM": ArchitectureSpec(None, None, False, qk_norm=True, moe="qwen"),
}


def get_architecture_spec(architecture: str) -> ArchitectureSpec:
    """The spec for `architecture`; ValueError naming it and the supported ones otherwise."""
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r}; "
                         f"supported: {', '.join(ARCHITECTURES)}") from None
