"""The PyTorch reference of the compiled kernels: what each bound op of `csrc/bindings.cpp`
computes, written for reading, not speed. Each kernel test (`tests/kernels/`) compares its op
with the function named after it here (`paged_attention` with `paged_attention_reference`;
an in-place op's trailing underscore dropped: `rotary_` with `rotary_reference`).

Where the model already holds the computation (RoPE, RMSNorm, SiLU x up, the KV write, the
greedy argmax), the reference calls it, so the kernel is held to what the PyTorch path runs.

Ops without a function here:
- `LayerStack.forward`: the model's own decoder loop is its reference (`DecoderLayer.forward`
  over `LlamaModel.layers` in `carpool/models/llama.py`); `tests/runner/test_layer_stack.py`
  compares the two step by step.
- `pack_bf16_weight` / `pack_f32_weight` / `pack_quant_weight` / `pack_moe_experts`: layouts
  only; the GEMMs' references take the weight unpacked.
- `quant_linear`, `dequantize_rows`: `quant_linear_ref` and `dequantize_ref` (named as
  carpool's quantized-weight format names them; carpool/quant/ calls them too).
- `bind_threads`, `parallel_width`, `shares_claims`, `max_head_dim`, `has_*`,
  `prefill_head_dim_ok`: facts about the build, the CPU and its threads, no numbers to
  compare; their tests check them directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from carpool.attention.base import write_kv
from carpool.models.llama import RMSNorm, SiluAndMul
from carpool.models.moe import experts_forward, route
from carpool.models.quant.weight import int8_per_token, int8_steps
from carpool.models.rope import apply_rope

# --- attention/ -------------------------------------------------------------------------


def paged_attention_reference(out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor,
                              block_tables: torch.Tensor, query_starts: torch.Tensor,
                              query_lens: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                              sliding_window: int) -> None:
    """What the kernel computes, one request at a time: writes the covered rows of out.

    Request i's queries q[query_starts[i] : + query_lens[i]] sit at the last query_lens[i]
    of positions 0 .. seq_lens[i] - 1 and attend the keys at positions <= their own (and
    less than sliding_window behind, if it is > 0), in a float32 softmax of scale * q.k.
    """
    _, num_kv_heads, _, block_size, head_dim = kv_cache.shape
    group_size = q.shape[1] // num_kv_heads
    for i in range(block_tables.shape[0]):
        start, q_len, seq_len = int(query_starts[i]), int(query_lens[i]), int(seq_lens[i])
        if q_len == 0:
            continue
        blocks = block_tables[i, :-(-seq_len // block_size)].long()
        # (2, Hkv, num_blocks, block_size, D) -> (2, Hkv, seq_len, D)
        kv = kv_cache[:, :, blocks].flatten(2, 3)[:, :, :seq_len].float()
        keys = kv[0].repeat_interleave(group_size, dim=0)  # (H, seq_len, D)
        values = kv[1].repeat_interleave(group_size, dim=0)
        queries = q[start:start + q_len].float().transpose(0, 1)  # (H, q_len, D)
        scores = scale * (queries @ keys.transpose(1, 2))  # (H, q_len, seq_len)
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window > 0:
            allowed &= q_pos - k_pos < sliding_window
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        out[start:start + q_len] = (probs @ values).transpose(0, 1).to(out.dtype)


def prefill_attention_bf16_reference(out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor,
                                     block_tables: torch.Tensor, query_starts: torch.Tensor,
                                     query_lens: torch.Tensor, seq_lens: torch.Tensor,
                                     scale: float) -> None:
    """paged_attention without a sliding window (the kernel takes bfloat16 prompt chunks;
    `amx` picks how it multiplies, not what)."""
    paged_attention_reference(out, q, kv_cache, block_tables, query_starts, query_lens,
                              seq_lens, scale, sliding_window=0)


def attend_reference(q: torch.Tensor, kv_cache: torch.Tensor, paged_rows: list[torch.Tensor],
                     prefill_rows: list[torch.Tensor], scale: float,
                     sliding_window: int) -> torch.Tensor:
    """A step's attention into a new [T, H, D]: the two kernels' references over their rows
    (each list empty or [block_tables, query_starts, query_lens, seq_lens]; together they
    cover every row of q). `prefill_amx` and `batch_invariant` pick how, not what."""
    out = torch.empty_like(q)
    if paged_rows:
        paged_attention_reference(out, q, kv_cache, *paged_rows, scale, sliding_window)
    if prefill_rows:
        prefill_attention_bf16_reference(out, q, kv_cache, *prefill_rows, scale)
    return out


# --- gemm/ ------------------------------------------------------------------------------


def small_gemm_bf16_reference(x: torch.Tensor, weight: torch.Tensor,
                              bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight.T + bias -> [M, N] in x's dtype, for the unpacked weight [N, K]:
    products and sums in float32, one rounding at the end (the kernel adds the bias in
    float32 too). `amx` picks how the kernel multiplies, not what."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


def small_gemm_f32_reference(x: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor | None = None) -> torch.Tensor:
    """small_gemm_bf16_reference's sum in float32 throughout (nn.Linear's)."""
    return small_gemm_bf16_reference(x, weight, bias)


def dequantize_ref(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                   bits: int, group_size: int) -> torch.Tensor:
    """carpool's canonical quantized weight (carpool/quant/, `csrc/gemm/quant_weight.h`) as
    float32 [N, K]: W[n, k] = scales[n, k // g] * q[n, k] + mins[n, k // g] (mins None: 0).

    bits 8: q = qweight, int8 [N, K]. bits 4: qweight uint8 [N, K // 2] in units of 32 k
    (k0 = 32 u): byte 16 u + j holds q[n, k0 + j] in its low nibble and q[n, k0 + 16 + j] in
    its high one (ggml's Q4_0 order). `pack_quant_weight` takes the same arguments."""
    if bits == 8:
        q = qweight.float()
    elif bits == 4:
        units = qweight.reshape(qweight.shape[0], -1, 16)
        q = torch.cat([units & 15, units >> 4], dim=-1).reshape(qweight.shape[0], -1).float()
    else:
        raise ValueError(f"dequantize_ref: bits must be 8 or 4, got {bits}")
    w = scales.repeat_interleave(group_size, dim=1) * q
    return w if mins is None else w + mins.repeat_interleave(group_size, dim=1)


def quant_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     mins: torch.Tensor | None, bits: int, group_size: int,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W.T + bias -> [M, N] in x's dtype, W = dequantize_ref(...): float32 sums,
    one rounding at the end. `quant_linear` computes this from the packed weight (its sums
    group by group, so within float32 rounding of this, not its bits)."""
    out = x.float() @ dequantize_ref(qweight, scales, mins, bits, group_size).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def lora_add_reference(out: torch.Tensor, x: torch.Tensor, starts, ends, a, b,
                       parts) -> torch.Tensor:
    """`lora_add_`: out[starts[g]:ends[g], col0:col0 + cols] += (x·a[g])[:, r0:r1]·b[p] for
    each part p = parts[4p:4p + 4] = (g, col0, r0, r1), in float32, then cast; returns out."""
    result = out.float()
    for p, bp in enumerate(b):
        g, col0, r0, r1 = parts[4 * p:4 * p + 4]
        rows = slice(starts[g], ends[g])
        shrunk = x[rows].float() @ a[g].float()
        result[rows, col0:col0 + bp.shape[1]] += shrunk[:, r0:r1] @ bp.float()
    out.copy_(result.to(out.dtype))
    return out


# --- elementwise/ -----------------------------------------------------------------------


def rotary_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> None:
    """q [T, H, D] and k [T, Hkv, D] rotated in place by cos/sin [T, D]: the model's
    `apply_rope` (the kernel gives its bits in every dtype)."""
    q.copy_(apply_rope(q, cos, sin))
    k.copy_(apply_rope(k, cos, sin))


def rms_norm_reference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(norm(x + residual), x + residual), or (norm(x), None) without a residual: the model's
    `RMSNorm` over the last dim of rows [T, dim] or heads [T, H, dim] (heads take no
    residual). float32 is Hugging Face's eager ops, which the kernel gives to the bit;
    bfloat16/float16 is `F.rms_norm`, which it gives up to a last bit of some rows."""
    norm = RMSNorm(weight.shape[0], eps)
    norm.weight = nn.Parameter(weight, requires_grad=False)
    if residual is None:
        return norm(x), None
    return norm(x, residual)


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] [T, 2I] -> [T, I]: the model's `SiluAndMul`
    (the kernel gives its bits, NaNs aside: which NaN a NaN x NaN keeps is the compiler's)."""
    return SiluAndMul()(gate_up)


def w8a8_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 as vLLM defines it, for `w8a8_linear` (and `quant_linear` on a `pack_w8a8_weight`
    weight): x [M, K] rounded per token to q_x and scale_x (`int8_steps`: compressed-tensors'
    steps, scale_x in x's dtype), qweight int8 [N, K] with one float32 scale per column, and
    y = float32(sum_k q_x q_w) * scale_x * scale_w (+ bias), each product and the sum rounded
    to float32 in that order, then y in x's dtype. The int sums are exact in float64."""
    q, scale = int8_steps(x)
    sums = (q.double() @ qweight.double().T).float()
    y = sums * scale.float() * scales.reshape(1, -1).float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def int8_per_token_reference(x: torch.Tensor) -> torch.Tensor:
    """W8A8's dynamic per-token activation rounding, as the model's reference path runs it."""
    return int8_per_token(x)


def write_kv_reference(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor) -> None:
    """k, v [T, Hkv, D] stored at their slots of kv_cache [2, Hkv, blocks, block_size, D]
    (slot = block * block_size + offset), in place: the attention backends' `write_kv`
    without kernels (two `index_copy_`)."""
    write_kv(kv_cache, slot_mapping, k, v)


# --- moe/ -------------------------------------------------------------------------------


def moe_experts_reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                          ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The model's loop over the experts (`models.moe.experts_forward`) on the unpacked
    weights: gate_up [E, 2I, H], down [E, H, I]."""
    return experts_forward(x, gate_up, down, ids, weights)


def moe_route_reference(logits: torch.Tensor, top_k: int,
                        renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's router after its linear (`models.moe.route`, weights kept float32):
    softmax in float32, the top k, renormalised if `renormalize`."""
    return route(logits, top_k, renormalize, None)


# --- sampling/ --------------------------------------------------------------------------


def argmax_rows_reference(logits: torch.Tensor) -> torch.Tensor:
    """Each row's largest value's index, as the runner's `greedy_ids` takes it without the
    kernels (`max(-1).indices`: the first of equal maxima, a row's first NaN above everything).
    Written out rather than imported: the kernels sit below the runner."""
    return logits.max(dim=-1).indices
