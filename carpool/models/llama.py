"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flat packed batch.

There is no batch dimension: the T tokens of every scheduled request are packed
end to end. Attention arrives through the forward arguments: the chosen
`AttentionBackend` and its metadata for this step, which say which request each
token belongs to and where its keys and values live in the paged cache; the
model never builds either. Parameter names mirror Hugging
Face's, except that projections applied to the same input are stacked into one
matrix (`StackedLinear`: q/k/v, gate/up), one matmul instead of three or two;
`checkpoint_targets` maps each checkpoint tensor to its rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from carpool.attention import AttentionBackend
from carpool.models.config import ModelConfig
from carpool.models.rope import Rotary, RotaryEmbedding


class StackedLinear(nn.Linear):
    """Several checkpoint projections of the same input, stacked by output rows.

    `parts` names them in row order with their output sizes, e.g. (("q_proj", 576),
    ("k_proj", 192), ("v_proj", 192)), which `checkpoint_targets` reads to load it.
    """

    def __init__(self, in_features: int, parts: tuple[tuple[str, int], ...], bias: bool) -> None:
        super().__init__(in_features, sum(size for _, size in parts), bias=bias)
        self.parts = parts


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32.

    float32 follows Hugging Face's ops exactly. Reduced precision takes PyTorch's fused
    `F.rms_norm` (4x faster on CPU for 4096 bfloat16 rows), which also multiplies by the
    weight in float32 before the one cast back, where Hugging Face casts first: results
    differ in the last bfloat16 bit.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = StackedLinear(
            config.hidden_size, (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)),
            bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.rotary = Rotary()
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, attention: AttentionBackend, meta) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, k, cos, sin)
        out = attention.forward(q, k, v, kv_cache, meta, self.scale)  # (T, H, D)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_up_proj = StackedLinear(hidden, (("gate_proj", inner), ("up_proj", inner)),
                                          bias=config.mlp_bias)
        self.down_proj = nn.Linear(inner, hidden, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, attention: AttentionBackend, meta) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, attention, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.rope, config.head_dim)


class LlamaForCausalLM(nn.Module):
    """Hidden states for packed tokens; logits only for the rows asked for."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attention: AttentionBackend, meta) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden_size] (before the norm).

        `meta` is `attention.build_metadata(...)` of this step; each layer writes its new
        keys and values into its own cache in `kv_caches` and attends through `attention`.
        """
        x = self.model.embed_tokens(input_ids)  # (T, hidden)
        cos, sin = self.model.rotary_emb.cos_sin(positions, x.dtype)  # (T, head_dim) each
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x = layer(x, cos, sin, kv_cache, attention, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] (rows to sample) -> logits [N, vocab_size] in float32."""
        return self.lm_head(self.model.norm(hidden)).float()


def checkpoint_targets(model: nn.Module) -> dict[str, tuple[torch.Tensor, slice]]:
    """Every tensor name a Hugging Face checkpoint of `model` holds -> (parameter, its rows).

    A plain parameter is filled whole (`slice(None)`); a `StackedLinear`'s weight and
    bias are filled part by part, e.g. `...self_attn.k_proj.weight` -> rows
    [q_size, q_size + kv_size) of `...self_attn.qkv_proj.weight`. Tied parameters
    appear under each of their names.
    """
    targets = {name: (param, slice(None))
               for name, param in model.named_parameters(remove_duplicate=False)}
    for module_name, module in model.named_modules():
        if not isinstance(module, StackedLinear):
            continue
        prefix = module_name.rpartition(".")[0]
        for kind in ("weight", "bias"):
            param = targets.pop(f"{module_name}.{kind}", (None, None))[0]
            if param is None:
                continue
            offset = 0
            for part, size in module.parts:
                targets[f"{prefix}.{part}.{kind}"] = (param, slice(offset, offset + size))
                offset += size
    return targets
