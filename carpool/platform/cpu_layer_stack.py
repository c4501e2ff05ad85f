"""A model's decoder layers in one C++ call (`csrc/layers/layer_stack.cpp`).

Prepared for the CPU (packed linears, the fused norm, RoPE and SiLU x up, the kernels
attention backend), a layer still calls its kernels one by one from Python: about 16 module
and tensor calls a layer, a large share of a small model's decode step
(docs/lab/47-the-decoder-layers-in-one-c-call.md). `LayerStack` makes the same kernel calls
in the same order on the same tensors in C++, attention through the same `attend` entry as
the backend, with the GIL released, so its hidden states are the modules' to the bit; a
linear's calls of more rows than its small GEMM takes go back to the module's own forward
(oneDNN's, at prompt sizes).

A mixture of experts' sparse layer (`models.moe.SparseMoeBlock` with its fused experts and
kernel router, `cpu_moe.py`) is a `MoeStep` there: the router's small GEMM, `moe_route`,
`moe_experts`, the calls the block makes; one with quantized experts (`quant.experts`) the
same with `quant_moe_experts` (`KernelQuantExperts`), or, where the kernel does not take them
(a part not packed for it), a `MoeStep` that calls the block's own forward back for the whole MLP,
the rest of its layer staying in C++. The Python layers keep the steps the stack cannot
run as the modules do: a shared expert (Qwen2-MoE) builds no stack, and while the router's
load is counted (`--moe-router-stats`, a bincount in the block) the modules run.

Whether it runs is the route's (`cpu_route.CpuRoute.layer_stack`): `CpuPlatform` builds it
where the route says so, and it then takes every step the kernels backend attends.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from carpool.attention.cpu_kernel import KernelMetadata
from carpool.models.moe import SparseMoeBlock
from carpool.models.quant.experts import QuantExperts
from carpool.models.quant.linear import QuantLinear
from carpool.platform.cpu_linear import PackedLinear
from carpool.platform.cpu_moe import FusedExperts, KernelQuantExperts, KernelRouter
from carpool.platform.cpu_route import CpuRoute


class KernelLayerStack:
    """`LlamaForCausalLM.layer_stack` on the CPU: runs the decoder layers of the steps it
    `takes`."""

    def __init__(self, stack, route: CpuRoute, sparse: list[SparseMoeBlock]) -> None:
        self._stack = stack
        self._sparse = sparse
        self._sliding_window = route.sliding_window or 0
        self._prefill_amx = route.attention.prefill_amx
        self._batch_invariant = route.attention.batch_invariant

    @classmethod
    def of(cls, model: nn.Module, kernels: ModuleType, route: CpuRoute) -> KernelLayerStack | None:
        """The stack of `model`'s layers as the route prepared them (every linear packed with
        a small GEMM, the fused norm, RoPE and SiLU x up), or None where the model itself rules
        it out: tensor parallelism (collectives between the modules), a linear its small GEMM
        does not take (odd in_features in bfloat16), norms of differing eps, a sparse layer
        the kernels do not run whole (a shared expert, float experts or router not fused)."""
        if getattr(model, "tp", None) is None or model.tp.is_parallel:
            return None
        layers = list(model.model.layers)
        weights, norms, sparse = [], [], []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            layer_norms = [layer.input_layernorm, layer.post_attention_layernorm]
            if attn.qk_norm:
                layer_norms += [attn.q_norm, attn.k_norm]
            is_sparse = isinstance(mlp, SparseMoeBlock)
            fused = is_sparse and isinstance(mlp.experts, (FusedExperts, KernelQuantExperts)) \
                and isinstance(mlp.router, KernelRouter)
            if is_sparse and (mlp.shared_expert is not None or not (
                    fused or isinstance(mlp.experts, QuantExperts))):
                return None
            layer_linears = [attn.qkv_proj, attn.o_proj] + (
                [mlp.gate] if is_sparse else [mlp.gate_up_proj, mlp.down_proj])
            if any(getattr(lin, "small", None) is None and not isinstance(lin, QuantLinear)
                   for lin in layer_linears):
                return None
            norms += layer_norms
            small = [_stack_linear(kernels, lin) for lin in layer_linears]
            args = (layer_norms[0].weight.detach(), layer_norms[1].weight.detach(),
                    attn.q_norm.weight.detach() if attn.qk_norm else None,
                    attn.k_norm.weight.detach() if attn.qk_norm else None)
            if is_sparse:
                sparse.append(mlp)
                routing = (mlp.top_k, mlp.norm_topk_prob, mlp.weights_in_model_dtype)
                if not fused:  # quantized experts the kernel does not take: called back
                    step = kernels.MoeStep.module(mlp.forward)
                elif isinstance(mlp.experts, KernelQuantExperts):
                    step = kernels.MoeStep.quantized(small[2], mlp.experts.packed, *routing)
                else:
                    step = kernels.MoeStep(small[2], mlp.experts.gate_up, mlp.experts.down,
                                           *routing)
                weights.append(kernels.DecoderWeights.sparse(*args, *small[:2], step))
            else:
                weights.append(kernels.DecoderWeights(*args, *small))
        if len({n.eps for n in norms}) != 1:
            return None
        attn = layers[0].self_attn
        shape = kernels.StackShape(attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                   norms[0].eps, attn.scale)
        return cls(kernels.LayerStack(weights, shape), route, sparse)

    def takes(self, meta, lora=None) -> bool:
        """Whether this step's layers run here: those the kernels backend attends (the route
        builds the stack only beside it; a backend made apart from the platform, as some tests
        make one, keeps the modules), and with LoRA adapters only where their term is the
        kernels' `lora_add_`, which the stack calls after each linear as the modules do
        (`CpuRoute.lora_steps`). A mixture of experts' steps go to the modules where some row
        has an adapter (its blocks refuse them by name) or the router's load is counted."""
        if self._sparse and (lora is not None or self._sparse[0].router_load is not None):
            return False
        return isinstance(meta, KernelMetadata) and (lora is None or lora.kernel is not None)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_caches: list[torch.Tensor], meta: KernelMetadata,
                 lora=None) -> torch.Tensor:
        """The hidden states after the last layer (before the final norm), as the modules'
        loop returns them; `lora`: the step's `StepLora`, or None."""
        paged_rows, prefill_rows = meta.attend_args()
        terms = [] if lora is None else lora.stack_terms(len(kv_caches))
        return self._stack.forward(x, cos.contiguous(), sin.contiguous(), kv_caches,
                                   meta.slot_mapping, paged_rows, prefill_rows,
                                   self._sliding_window, self._prefill_amx,
                                   self._batch_invariant, terms)


def _stack_linear(kernels: ModuleType, linear: PackedLinear | QuantLinear):
    if isinstance(linear, QuantLinear):
        parts = linear.stack_parts
        if parts is None:
            # every call back to its own forward (max_rows 0)
            return kernels.StackLinear(torch.empty(0), linear.out_features, None, False, False,
                                       0, linear.forward)
        bias = None if linear.bias is None else linear.bias.detach()
        return kernels.StackLinear.quantized(parts.packed, linear.out_features, bias,
                                             parts.max_rows, parts.rounded_from, linear.forward,
                                             parts.int8_input)
    small = linear.small
    bias = None if small.bias is None else small.bias.detach()
    return kernels.StackLinear(small.packed, small.out_features, bias, small.float32, small.amx,
                               small.max_rows, linear.forward)
