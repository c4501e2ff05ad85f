"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flat packed batch.

There is no batch dimension: the T tokens of every scheduled request are packed
end to end. Attention arrives through the forward arguments: the chosen
`AttentionBackend` and its metadata for this step, which say which request each
token belongs to and where its keys and values live in the paged cache; the
model never builds either. Parameter names mirror Hugging
Face's, except that projections applied to the same input are stacked into one
matrix (`StackedLinear`: q/k/v, gate/up), one matmul instead of three or two;
`checkpoint_targets` maps each checkpoint tensor to its rows.

Under tensor parallelism each rank builds its shard of the network (sizes from
`sharding.ShardLayout`) and sums partial results over its `TensorParallelGroup`
after o_proj, down_proj and the embedding; with the one-rank group every
collective is the identity.

Who runs the decoder loop: on the CPU with the C++ kernels, the C++ layer stack
(`carpool/kernels/csrc/layers/`, installed as `layer_stack` by `CpuPlatform` where its route
says so) runs every layer of the steps the kernels attention backend attends, and this file
is its reference: the stack makes the same kernel calls in the same order and matches these
modules to the bit (tests/runner/test_layer_stack.py). On CUDA, on the CPU without the
kernels, under tensor parallelism or batch invariance, the loop in
`LlamaForCausalLM.forward` below runs the modules itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from carpool.attention import AttentionBackend
from carpool.distributed import SINGLE, TensorParallelGroup
from carpool.models.config import ModelConfig
from carpool.models.rope import Rotary, RotaryEmbedding
from carpool.models.sharding import Shard, ShardLayout


class StackedLinear(nn.Linear):
    """Several checkpoint projections of the same input, stacked by output rows.

    `parts` names them in row order with the rows of each checkpoint tensor this rank
    holds, e.g. (("q_proj", Shard(0, 0, 576, 576)), ("k_proj", ...), ("v_proj", ...)),
    which `checkpoint_targets` reads to load it.
    """

    def __init__(self, in_features: int, parts: tuple[tuple[str, Shard], ...],
                 bias: bool) -> None:
        super().__init__(in_features, sum(shard.size for _, shard in parts), bias=bias)
        self.parts = parts


def row_parallel_linear(layout: ShardLayout, in_features_per_rank: int, out_features: int,
                        bias: bool) -> nn.Linear:
    """A linear layer holding this rank's input columns; its output is a partial sum.

    The bias lives on rank 0 only, so the all-reduce adds it once. (A plain `nn.Linear`,
    marked for the loader, so a platform may still swap it for a faster one.)
    """
    linear = nn.Linear(in_features_per_rank, out_features, bias=bias and layout.rank == 0)
    linear.weight_shard = layout.row(in_features_per_rank, in_features_per_rank
                                     * layout.world_size)
    linear.bias_skipped = bias and layout.rank != 0
    return linear


class VocabParallelEmbedding(nn.Module):
    """Rank r holds embedding rows [r*Vr, (r+1)*Vr); ids outside them give zero rows, and
    the all-reduce assembles each id's row from the one rank holding it."""

    def __init__(self, layout: ShardLayout, vocab_size: int, hidden_size: int,
                 tp: TensorParallelGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(layout.vocab_per_rank, hidden_size))
        self.weight_shard = layout.column(layout.vocab_per_rank, vocab_size)
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.is_parallel:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.weight_shard.start
        outside = (local < 0) | (local >= self.weight_shard.size)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside[:, None], 0.0)
        return self.tp.all_reduce(x)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32; given a residual, the residual add first.

    `norm(x)` normalises x; `norm(x, residual)` returns `(norm(x + residual), x + residual)`,
    the pre-norm decoder's add-then-normalise as one call, so a platform can swap in a kernel
    that does both in one pass (see `carpool.platform`).

    float32 follows Hugging Face's ops exactly. Reduced precision takes PyTorch's fused
    `F.rms_norm` (4x faster on CPU for 4096 bfloat16 rows), which also multiplies by the
    weight in float32 before the one cast back, where Hugging Face casts first: results
    differ in the last bfloat16 bit.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = residual + x  # Hugging Face's order (the sum is the same either way)
            return self.normalize(x), x
        return self.normalize(x)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class SiluAndMul(nn.Module):
    """silu(gate) * up for x = [gate | up] (..., 2I) -> (..., I). A module so that a platform
    can swap in a one-pass kernel with the same results."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class Attention(nn.Module):
    """This rank's query heads and the KV heads they read (`ShardLayout`)."""

    def __init__(self, config: ModelConfig, layout: ShardLayout, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = layout.num_heads, layout.num_kv_heads
        self.head_dim = d = config.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        self.qkv_sizes = [q_size, kv_size, kv_size]
        kv_shard = Shard(0, layout.kv_head_start * d, kv_size, config.num_kv_heads * d)
        self.qkv_proj = StackedLinear(
            config.hidden_size, (("q_proj", layout.column(q_size, config.num_heads * d)),
                                 ("k_proj", kv_shard), ("v_proj", kv_shard)),
            bias=config.qkv_bias)
        self.o_proj = row_parallel_linear(layout, q_size, config.hidden_size, config.o_proj_bias)
        self.tp = tp
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.rotary = Rotary()
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, attention: AttentionBackend, meta,
                lora=None) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if lora is not None:
            lora.add(qkv, x, self.layer_index, "qkv")
        q, k, v = qkv.split(self.qkv_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, k, cos, sin)
        out = attention.forward(q, k, v, kv_cache, meta, self.scale)  # (T, H, D)
        out = out.reshape(num_tokens, self.num_heads * self.head_dim)
        projected = self.o_proj(out)
        if lora is not None:
            lora.add(projected, out, self.layer_index, "o")
        return self.tp.all_reduce(projected)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, layout: ShardLayout, tp: TensorParallelGroup) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, layout.intermediate_size
        shard = layout.column(inner, config.intermediate_size)
        self.gate_up_proj = StackedLinear(hidden, (("gate_proj", shard), ("up_proj", shard)),
                                          bias=config.mlp_bias)
        self.down_proj = row_parallel_linear(layout, inner, hidden, config.mlp_bias)
        self.act = SiluAndMul()
        self.tp = tp

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        if lora is None:
            return self.tp.all_reduce(self.down_proj(self.act(self.gate_up_proj(x))))
        gate_up = self.gate_up_proj(x)
        lora.add(gate_up, x, self.layer_index, "gate_up")
        inner = self.act(gate_up)
        out = self.down_proj(inner)
        lora.add(out, inner, self.layer_index, "down")
        return self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layout: ShardLayout, tp: TensorParallelGroup,
                 index: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(config, layout, tp)
        self.mlp = MLP(config, layout, tp)
        # which layer's adapter weights `lora.add` takes
        self.self_attn.layer_index = self.mlp.layer_index = index
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: torch.Tensor, attention: AttentionBackend,
                meta, lora=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (this layer's MLP output, the residual stream before it); their
        sum is the layer's output. The first layer gets residual None (x is the stream).
        `lora`: the step's adapter rows (`carpool.lora.step_lora.StepLora`), or None."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, attention, meta, lora)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h, lora), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, layout: ShardLayout, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(layout, config.vocab_size, config.hidden_size,
                                                   tp)
        self.layers = nn.ModuleList(DecoderLayer(config, layout, tp, i)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.rope, config.head_dim)


class LlamaForCausalLM(nn.Module):
    """Hidden states for packed tokens; logits only for the rows asked for.

    `tp` is the tensor-parallel group this rank belongs to; every rank runs every call.
    """

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.layout = layout = ShardLayout.of(config, tp.rank, tp.world_size)
        self.model = LlamaModel(config, layout, tp)
        self.lm_head = nn.Linear(config.hidden_size, layout.vocab_per_rank, bias=False)
        self.lm_head.weight_shard = self.model.embed_tokens.weight_shard
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # A platform may hand the steps it `takes` to its own runner of the decoder layers,
        # which returns what the loop in `forward` would (CpuPlatform: cpu_layer_stack).
        self.layer_stack = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attention: AttentionBackend, meta,
                lora=None) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden_size] (before the norm).

        `meta` is `attention.build_metadata(...)` of this step; each layer writes its new
        keys and values into its own cache in `kv_caches` and attends through `attention`.
        `lora` (None: no row has an adapter) adds each adapter's term to its rows after
        every base linear: `lora.add(out, x, layer, "qkv" | "o" | "gate_up" | "down")`.
        """
        x = self.model.embed_tokens(input_ids)  # (T, hidden)
        cos, sin = self.model.rotary_emb.cos_sin(positions, x.dtype)  # (T, head_dim) each
        stack = self.layer_stack
        if stack is not None and stack.takes(meta, lora):
            return stack(x, cos, sin, kv_caches, meta) if lora is None else \
                stack(x, cos, sin, kv_caches, meta, lora)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, cos, sin, kv_cache, attention, meta, lora)
        return x if residual is None else residual + x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] (rows to sample) -> logits [N, vocab_size] in the model's
        dtype (the sampler widens them to float32 where it needs more than their argmax).

        Each rank computes its vocabulary shard's columns; the gather assembles them.
        """
        logits = self.tp.all_gather(self.lm_head(self.model.norm(hidden)))  # (N, V padded)
        if logits.shape[-1] != self.config.vocab_size:
            logits = logits[:, :self.config.vocab_size]
        return logits


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: `rows` of `param` (None: this rank does not hold
    it), filled from the `shard` of the checkpoint tensor (None: all of it)."""

    param: torch.Tensor | None
    rows: slice = field(default_factory=lambda: slice(None))
    shard: Shard | None = None


def checkpoint_targets(model: nn.Module) -> dict[str, Target]:
    """Every tensor name a Hugging Face checkpoint of `model` holds -> its `Target`.

    A plain parameter is filled whole, or from its module's `weight_shard`; a
    `StackedLinear`'s weight and bias are filled part by part, e.g.
    `...self_attn.k_proj.weight` -> rows [q_size, q_size + kv_size) of
    `...self_attn.qkv_proj.weight`, from the k_proj rows of this rank's KV heads. A
    row-parallel bias held by rank 0 only is a target without a parameter elsewhere.
    Tied parameters appear under each of their names.
    """
    targets = {name: Target(param)
               for name, param in model.named_parameters(remove_duplicate=False)}
    for module_name, module in model.named_modules():
        shard = getattr(module, "weight_shard", None)
        if shard is not None:
            targets[f"{module_name}.weight"] = Target(module.weight, shard=shard)
        if getattr(module, "bias_skipped", False):
            targets[f"{module_name}.bias"] = Target(None)
        if not isinstance(module, StackedLinear):
            continue
        prefix = module_name.rpartition(".")[0]
        for kind in ("weight", "bias"):
            param = targets.pop(f"{module_name}.{kind}", Target(None)).param
            if param is None:
                continue
            offset = 0
            for part, part_shard in module.parts:
                targets[f"{prefix}.{part}.{kind}"] = Target(
                    param, slice(offset, offset + part_shard.size), part_shard)
                offset += part_shard.size
    for module_name, module in model.named_modules():  # modules named apart (models/moe.py)
        rename = getattr(module, "rename_targets", None)
        if rename is not None:
            rename(module_name, targets)
    return targets
