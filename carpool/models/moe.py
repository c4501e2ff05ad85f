"""Mixture-of-experts decoders (Qwen3-MoE, Qwen2-MoE, Mixtral): the Llama-family network whose
sparse layers replace the MLP by a router over experts (`MoeConfig` says which layers).

A sparse layer's MLP is a `SparseMoeBlock`: the router (a linear to one logit per expert,
a float32 softmax, the top k, renormalised where the config says so) picks each row's
experts and their weights; `Experts` holds every expert's gate/up and down stacked
(`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I], the layout transformers 5 keeps them in),
filled from the checkpoint's per-expert tensors; Qwen2-MoE's shared expert runs on every row
behind a sigmoid gate. `Experts.forward` is the PyTorch path, Hugging Face's loop over the
experts hit; on the CPU with the kernels the platform swaps it for the fused pass and `route`
for the kernels' router (`platform/cpu_moe.py`, `kernels/csrc/moe/`); these are their
references. There the C++ layer stack runs the sparse layers too (`cpu_layer_stack.py`).

Under tensor parallelism every rank holds a slice of each expert's intermediate rows (as the
dense MLP is split, `sharding.py`): the router runs whole on each rank (its input is the same
after the attention's all-reduce), every rank runs every routed row through its slices, and
one all-reduce sums the experts and the shared expert together.

With `count_router_load` set the blocks add up how many rows each expert received
(`router_load`), a debug counter: one bincount per sparse layer per step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from carpool.distributed import SINGLE, TensorParallelGroup
from carpool.models.config import ModelConfig
from carpool.models.llama import (
    LlamaForCausalLM,
    SiluAndMul,
    StackedLinear,
    Target,
    row_parallel_linear,
)
from carpool.models.sharding import Shard, ShardLayout

# What each checkpoint calls a sparse layer's block and an expert's gate, up and down.
CHECKPOINT_NAMES = {"qwen": ("mlp", ("gate_proj", "up_proj", "down_proj")),
                    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool,
          dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k], expert ids [T, k] int64), Hugging Face's
    order: float32 softmax, top k, renormalised if `norm_topk_prob`, cast to `dtype` (None:
    kept float32, as Mixtral's)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if dtype is None else weights.to(dtype)), ids


def experts_forward(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum over each row's experts e of weight * down_e(silu(gate_e(x)) * up_e(x)): rows x
    [T, H], gate_up [E, 2I, H], down [E, H, I], ids and weights [T, k] -> [T, H] in x's dtype.
    Hugging Face's loop: the experts hit in ascending order, each adding into the sum."""
    return experts_loop(x, ids, weights, lambda e, h: F.linear(h, gate_up[e]),
                        lambda e, h: F.linear(h, down[e]))


def experts_loop(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 gate_up: Callable[[int, torch.Tensor], torch.Tensor],
                 down: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`experts_forward` with each expert's two multiplies given as `gate_up(e, rows)` and
    `down(e, rows)` (quantized experts: `quant.experts`)."""
    out = torch.zeros_like(x)
    for expert in torch.unique(ids).tolist():
        rows, slots = torch.nonzero(ids == expert, as_tuple=True)
        gate, up = gate_up(expert, x[rows]).chunk(2, dim=-1)
        y = down(expert, F.silu(gate) * up) * weights[rows, slots, None]
        out.index_add_(0, rows, y.to(out.dtype))
    return out


class Experts(nn.Module):
    """Every expert's gate/up and down of this rank, stacked; `forward` is the PyTorch path."""

    def __init__(self, num_experts: int, hidden_size: int, inner_per_rank: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inner_per_rank,
                                                     hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, inner_per_rank))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return experts_forward(x, self.gate_up_proj, self.down_proj, ids, weights)


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a SwiGLU MLP of this rank's rows, its output a partial sum
    (the block's one all-reduce adds the ranks)."""

    def __init__(self, layout: ShardLayout, hidden: int, inner: int) -> None:
        super().__init__()
        rows = layout.shared_expert_intermediate_size
        shard = layout.column(rows, inner)
        self.gate_up_proj = StackedLinear(hidden, (("gate_proj", shard), ("up_proj", shard)),
                                          bias=False)
        self.down_proj = row_parallel_linear(layout, rows, hidden, bias=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


def _gate_sigmoid(gate: torch.Tensor) -> torch.Tensor:
    """sigmoid of a [n, 1] gate, each row the same whatever n. ATen's loop runs whole vectors
    through its vectorized sigmoid and the remainder through the scalar one, which differ in
    the last bit on a few inputs, so a row's value would depend on its place in the step; each
    row widened to 64 lanes (whole vectors on every ISA and dtype) always takes the vector one."""
    return torch.sigmoid(gate.expand(-1, _GATE_LANES).contiguous())[:, :1]


_GATE_LANES = 64


class SparseMoeBlock(nn.Module):
    """A sparse layer's MLP: router, experts, the shared expert where the config has one."""

    def __init__(self, config: ModelConfig, layout: ShardLayout, tp: TensorParallelGroup,
                 style: str) -> None:
        super().__init__()
        moe = config.moe
        hidden = config.hidden_size
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.weights_in_model_dtype = moe.weights_in_model_dtype
        self.gate = nn.Linear(hidden, moe.num_experts, bias=False)
        self.experts = Experts(moe.num_experts, hidden, layout.expert_intermediate_size)
        self.expert_shard = layout.column(layout.expert_intermediate_size,
                                          moe.expert_intermediate_size)
        self.shared_expert = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(layout, hidden, moe.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        self.style = style
        self.tp = tp
        # logits -> (weights, ids) as `route` computes them; the CPU platform swaps in the
        # kernels' one-call router (`platform/cpu_moe.py`)
        self.router = route
        self.router_load: torch.Tensor | None = None  # [E] rows per expert, when counted

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        if lora is not None:  # the decoder layer passes a step's adapters to every MLP
            raise ValueError("LoRA adapters are not supported on a mixture of experts' sparse "
                             "layers; serve this model without --enable-lora")
        weights, ids = self.router(self.gate(x), self.top_k, self.norm_topk_prob,
                                   x.dtype if self.weights_in_model_dtype else None)
        if self.router_load is not None:
            self.router_load += torch.bincount(ids.flatten(), minlength=self.router_load.numel())
        out = self.experts(x, ids, weights)
        if self.shared_expert is not None:
            out = out + _gate_sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)

    def rename_targets(self, module_name: str, targets: dict[str, Target]) -> None:
        """Map the checkpoint's per-expert tensors (and a Mixtral block's other name) onto
        this block's stacked parameters, in `targets` (`llama.checkpoint_targets`)."""
        block, (gate, up, down) = CHECKPOINT_NAMES[self.style]
        prefix = module_name.rpartition(".")[0] + "." + block
        targets.pop(f"{module_name}.gate.weight", None)
        if isinstance(self.gate, nn.Linear):  # else a quantized router, loaded whole
            targets[f"{prefix}.gate.weight"] = Target(self.gate.weight)
        if not isinstance(self.experts, Experts):
            return  # quantized experts (`quant.experts`), loaded whole, are no parameters
        for name in ("experts.gate_up_proj", "experts.down_proj"):
            targets.pop(f"{module_name}.{name}")
        shard = self.expert_shard
        rows = shard.size
        down_shard = Shard(1, shard.start, shard.size, shard.full)
        gate_up, down_w = self.experts.gate_up_proj.detach(), self.experts.down_proj.detach()
        for e in range(gate_up.shape[0]):
            expert = f"{prefix}.experts.{e}"
            targets[f"{expert}.{gate}.weight"] = Target(gate_up[e], slice(0, rows), shard)
            targets[f"{expert}.{up}.weight"] = Target(gate_up[e], slice(rows, 2 * rows), shard)
            targets[f"{expert}.{down}.weight"] = Target(down_w[e], shard=down_shard)


class MoeForCausalLM(LlamaForCausalLM):
    """The Llama-family decoder with a `SparseMoeBlock` as the MLP of every sparse layer."""

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup = SINGLE,
                 style: str = "qwen") -> None:
        super().__init__(config, tp)
        for index, layer in enumerate(self.model.layers):
            if config.moe.is_sparse(index):
                layer.mlp = SparseMoeBlock(config, self.layout, tp, style)

    def sparse_blocks(self) -> list[SparseMoeBlock]:
        return [m for m in self.modules() if isinstance(m, SparseMoeBlock)]

    def count_router_load(self) -> None:
        """Start counting rows per expert in every sparse layer (from zero)."""
        for block in self.sparse_blocks():
            block.router_load = torch.zeros(block.gate.out_features, dtype=torch.int64,
                                            device=block.gate.weight.device)

    def router_load(self) -> tuple[tuple[int, ...], ...] | None:
        """Rows each expert received so far, per sparse layer (None: not counted)."""
        blocks = self.sparse_blocks()
        if not blocks or blocks[0].router_load is None:
            return None
        return tuple(tuple(block.router_load.tolist()) for block in blocks)
