"""A mixture-of-experts checkpoint's router and expert sizes, read from its `config.json`.

The checkpoints name the same things differently: Qwen3-MoE and Qwen2-MoE say `num_experts`
(transformers 5 writes `num_local_experts`), `moe_intermediate_size`, `norm_topk_prob`, and
choose dense layers among the sparse ones by `mlp_only_layers` and `decoder_sparse_step`;
Mixtral says `num_local_experts`, its experts use `intermediate_size`, it always renormalises
the top-k weights, and every layer is sparse. Qwen2-MoE adds a shared expert behind a sigmoid
gate. `MoeConfig` is the one spelling the model reads.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int  # experts per token (`num_experts_per_tok`)
    expert_intermediate_size: int  # each expert's gate/up rows
    norm_topk_prob: bool  # the top-k softmax weights renormalised to sum to 1
    sparse_layers: tuple[bool, ...]  # per decoder layer: experts (True) or the dense MLP
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert; 0: none
    # Qwen routers cast the top-k weights to the model's dtype; Mixtral's stay float32.
    weights_in_model_dtype: bool = True

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "expert_intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"config field {name} must be a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) exceeds the number of "
                             f"experts ({self.num_experts})")

    def is_sparse(self, layer: int) -> bool:
        return self.sparse_layers[layer]


def parse_moe_config(raw: dict, style: str, num_layers: int) -> MoeConfig:
    """`raw` config.json of a `style` ("qwen" or "mixtral") checkpoint -> MoeConfig; ValueError
    naming a missing field."""
    num_experts = raw.get("num_experts") or raw.get("num_local_experts")
    if not num_experts:
        raise ValueError("config.json of a mixture-of-experts model names no num_experts")
    top_k = raw.get("num_experts_per_tok")
    if top_k is None:
        raise ValueError("config.json is missing required field 'num_experts_per_tok'")
    if style == "mixtral":
        return MoeConfig(num_experts=num_experts, top_k=top_k,
                         expert_intermediate_size=raw["intermediate_size"], norm_topk_prob=True,
                         sparse_layers=(True,) * num_layers, weights_in_model_dtype=False)
    dense = set(raw.get("mlp_only_layers") or ())
    step = int(raw.get("decoder_sparse_step") or 1)
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    if "moe_intermediate_size" not in raw:
        raise ValueError("config.json is missing required field 'moe_intermediate_size'")
    return MoeConfig(num_experts=num_experts, top_k=top_k,
                     expert_intermediate_size=raw["moe_intermediate_size"],
                     norm_topk_prob=bool(raw.get("norm_topk_prob", False)), sparse_layers=sparse,
                     shared_expert_intermediate_size=int(
                         raw.get("shared_expert_intermediate_size") or 0))
