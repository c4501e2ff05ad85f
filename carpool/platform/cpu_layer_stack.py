"""A model's decoder layers in one C++ call (`csrc/layer_stack.cpp`).

Prepared for the CPU (packed linears, the fused norm, RoPE and SiLU x up, the CPU
attention backend's kernels), a layer still calls its kernels one by one from Python:
about 16 module and tensor calls a layer, 3-4 ms of a 135M model's decode step (21.8 of
a 20-request step, 65.7 of a 100-request one: BENCHMARKS §47). `LayerStack` makes the
same kernel calls in the same order on the same tensors in C++, with the GIL released, so
its hidden states are the modules' to the bit; a linear's calls of more rows than its
small GEMM takes go back to the module's own forward (oneDNN's, at prompt sizes). The
model hands it every step `takes` accepts: those whose attention is the CPU backend's
kernels alone.

`KernelLayerStack.of` builds one only for a model whose every layer the CPU platform
prepared that way (not under tensor parallelism or batch invariance, which change what the
modules do).
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from carpool.attention.cpu import CpuBackend, CpuMetadata, KernelRows
from carpool.platform.cpu_fused import FusedRMSNorm, FusedRotary, FusedSiluAndMul
from carpool.platform.cpu_linear import PackedLinear


class KernelLayerStack:
    """`LlamaForCausalLM.layer_stack` on the CPU: `takes` a step, then runs its layers."""

    def __init__(self, stack) -> None:
        self._stack = stack

    @classmethod
    def of(cls, model: nn.Module, kernels: ModuleType) -> KernelLayerStack | None:
        """The stack of `model`'s layers, or None where one of them is not all kernels."""
        if getattr(model, "tp", None) is None or model.tp.is_parallel:
            return None
        layers = list(model.model.layers)
        weights, norms = [], []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            layer_norms = [layer.input_layernorm, layer.post_attention_layernorm]
            if attn.qk_norm:
                layer_norms += [attn.q_norm, attn.k_norm]
            layer_linears = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
            if not (all(type(n) is FusedRMSNorm for n in layer_norms)
                    and type(attn.rotary) is FusedRotary and type(mlp.act) is FusedSiluAndMul
                    and all(type(lin) is PackedLinear and lin.small is not None
                            for lin in layer_linears)):
                return None
            norms += layer_norms
            small = [_stack_linear(kernels, lin) for lin in layer_linears]
            weights.append(kernels.DecoderWeights(
                layer_norms[0].weight.detach(), layer_norms[1].weight.detach(),
                attn.q_norm.weight.detach() if attn.qk_norm else None,
                attn.k_norm.weight.detach() if attn.qk_norm else None, *small))
        if len({n.eps for n in norms}) != 1:
            return None
        attn = layers[0].self_attn
        shape = kernels.StackShape(attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                   norms[0].eps, attn.scale)
        return cls(kernels.LayerStack(weights, shape))

    def takes(self, attention, meta) -> bool:
        """Whether this step's layers run here: attention by the CPU backend's kernels alone
        (its PyTorch paths and batch-invariant mode stay with the modules)."""
        return (type(attention) is CpuBackend
                and attention.kernels is not None and not attention.batch_invariant
                and type(meta) is CpuMetadata
                and (meta.kernel_rows is not None or meta.prefill_rows is not None))

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_caches: list[torch.Tensor], attention: CpuBackend,
                 meta: CpuMetadata) -> torch.Tensor:
        """The hidden states after the last layer (before the final norm), as the modules'
        loop returns them."""
        return self._stack.forward(x, cos.contiguous(), sin.contiguous(), kv_caches,
                                   meta.slot_mapping, _rows(meta.kernel_rows),
                                   _rows(meta.prefill_rows),
                                   attention.shape.sliding_window or 0, attention.prefill_amx)


def _stack_linear(kernels: ModuleType, linear: PackedLinear):
    small = linear.small
    bias = None if small.bias is None else small.bias.detach()
    return kernels.StackLinear(small.packed, small.out_features, bias, small.float32, small.amx,
                               small.max_rows, linear.forward)


def _rows(rows: KernelRows | None) -> list[torch.Tensor]:
    if rows is None:
        return []
    return [rows.block_tables, rows.query_starts, rows.query_lens, rows.seq_lens]
