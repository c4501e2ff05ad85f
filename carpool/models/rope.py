"""Rotary position embeddings: inverse frequencies for each scaling type, and applying them.

RoPE rotates each pair of dimensions (i, i + head_dim/2) of q and k by an angle
`position * inv_freq[i]`, so q·k depends only on the distance between tokens.
Scaling types change `inv_freq` (and, for YaRN, scale cos/sin by an attention
factor) so a model can read past its pretraining length. The arithmetic follows
the published definitions in the same float32 order as Hugging Face, so logits match.
"""

from __future__ import annotations

import math

import torch

from carpool.models.config import RopeConfig


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32, attention_factor) for `rope`'s scaling type."""
    base = _base_inv_freq(rope.rope_theta, head_dim)
    if rope.rope_type == "default":
        return base, 1.0
    if rope.rope_type == "linear":
        return base / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(base, rope), 1.0
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, head_dim)
    raise ValueError(f"unsupported RoPE type {rope.rope_type!r}")


def _base_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return 1.0 / (theta ** exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between."""
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor
                                                           - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between; scale attention."""
    base, factor, dim = rope.rope_theta, rope.factor, head_dim
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(
                factor, rope.mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings
                               / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class RotaryEmbedding(torch.nn.Module):
    """Computes cos/sin for a flat vector of positions and rotates q and k with them."""

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        self.rope, self.head_dim = rope, head_dim
        inv_freq, self.attention_factor = rope_inv_freq(rope, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def reset(self) -> None:
        """Recompute inv_freq (float32) in place, e.g. after `Module.to_empty`."""
        inv_freq, _ = rope_inv_freq(self.rope, self.head_dim)
        self.inv_freq = inv_freq.to(self.inv_freq.device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor,
                                                                            torch.Tensor]:
        """positions [T] int -> cos, sin [T, head_dim] in `dtype`."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # (T, head_dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, head_dim)
        cos = emb.cos() * self.attention_factor
        sin = emb.sin() * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, num_heads, head_dim] rotated by cos/sin [T, head_dim]."""
    cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, head_dim)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # rotate_half
    return x * cos + rotated * sin


class Rotary(torch.nn.Module):
    """Rotates q and k by this step's cos/sin. A module (not a call) so that a platform can
    swap in a fused kernel that gives the same results (see `carpool.platform`)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)
