"""The elementwise kernels (csrc/elementwise/fused_ops.cpp) called directly against their
PyTorch references, on every build this CPU runs (the AVX2 build's loops included): rotary_
in place, rms_norm's pair of outputs, silu_and_mul, write_kv_, and their checks. (The fused
modules that call them in the model, with special values and every 16-bit gate:
tests/platform/test_cpu_kernels_in_model.py.)"""

from __future__ import annotations

import pytest
import torch

from carpool.kernels.reference import (
    rms_norm_reference,
    rotary_reference,
    silu_and_mul_reference,
    write_kv_reference,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def projection(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
               gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D] and k [T, Hkv, D]: views into one qkv row per token, as in the model."""
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)


@dtypes
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 4, 1, 16), (37, 9, 3, 64),
                                                            (5, 6, 2, 40), (3, 2, 2, 256)])
def test_rotary_matches_reference_bitwise(kernels, dtype, tokens, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(tokens * head_dim)
    q, k = projection(tokens, heads, kv_heads, head_dim, dtype, gen)
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 50
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(dtype)
    expected_q, expected_k = q.clone(), k.clone()
    rotary_reference(expected_q, expected_k, cos, sin)
    assert kernels.rotary_(q, k, cos, sin) is None  # in place, through the views
    assert torch.equal(bits(q), bits(expected_q)) and torch.equal(bits(k), bits(expected_k))


def test_rotary_checks_its_arguments(kernels):
    q, k, cos = torch.zeros(3, 4, 16), torch.zeros(3, 2, 16), torch.zeros(3, 16)
    with pytest.raises(RuntimeError, match=r"\[T, heads, head_dim\]"):
        kernels.rotary_(q[0], k, cos, cos)
    with pytest.raises(RuntimeError, match="head_dim must be contiguous"):
        kernels.rotary_(q.transpose(1, 2), k, cos, cos)
    with pytest.raises(RuntimeError):
        kernels.rotary_(q, k, cos[:2], cos[:2])  # a cos row per token
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        kernels.rotary_(q.double(), k.double(), cos.double(), cos.double())


def assert_norm_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """float32: the reference's bits; bfloat16/float16: within a last bit (F.rms_norm sums
    its squares in another order)."""
    if got.dtype == torch.float32:
        assert torch.equal(bits(got), bits(expected))
    else:
        ulp = torch.finfo(got.dtype).eps
        assert ((got.float() - expected.float()).abs() <= ulp * expected.float().abs()).all()


@dtypes
@pytest.mark.parametrize("rows,dim", [(1, 576), (40, 256), (5, 37), (3, 8)])
def test_rms_norm_matches_reference(kernels, dtype, rows, dim):
    """Rows with a residual give (norm(x + residual), x + residual); without, (norm(x), None)."""
    gen = torch.Generator().manual_seed(rows * dim)
    weight = (torch.rand(dim, generator=gen) + 0.5).to(dtype)
    x = (torch.randn(rows, dim + 3, generator=gen) * 5).to(dtype)[:, :dim]  # strided rows
    residual = torch.randn(rows, dim, generator=gen).to(dtype)
    out, summed = kernels.rms_norm(x, residual, weight, 1e-6)
    expected_out, expected_sum = rms_norm_reference(x, residual, weight, 1e-6)
    assert torch.equal(bits(summed), bits(expected_sum))  # the add, to the bit
    assert_norm_close(out, expected_out)
    out, none = kernels.rms_norm(x, None, weight, 1e-6)
    assert none is None
    assert_norm_close(out, rms_norm_reference(x, None, weight, 1e-6)[0])


@dtypes
def test_rms_norm_of_heads_matches_reference(kernels, dtype):
    """Qwen3's per-head q and k norms: [T, H, D] views of the projection, each head a row."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.rand(64, generator=gen) + 0.5).to(dtype)
    for x in projection(9, 6, 2, 64, dtype, gen):
        out, _ = kernels.rms_norm(x, None, weight, 1e-6)
        assert out.shape == x.shape and out.is_contiguous()
        assert_norm_close(out, rms_norm_reference(x, None, weight, 1e-6)[0])


@dtypes
@pytest.mark.parametrize("rows,inner", [(1, 8), (33, 100), (4, 1536)])
def test_silu_and_mul_matches_reference_bitwise(kernels, dtype, rows, inner):
    gen = torch.Generator().manual_seed(rows * inner)
    gate_up = (torch.randn(rows, 2 * inner + 5, generator=gen) * 30).to(dtype)[:, :2 * inner]
    gate_up[0, :3] = torch.tensor([float("inf"), float("-inf"), -0.0])  # silu(-inf) x up: NaN
    got, expected = kernels.silu_and_mul(gate_up), silu_and_mul_reference(gate_up)
    assert got.shape == (rows, inner)
    nan = expected.isnan()
    assert torch.equal(got.isnan(), nan) and torch.equal(bits(got)[~nan], bits(expected)[~nan])


def test_silu_and_mul_checks_its_arguments(kernels):
    with pytest.raises(RuntimeError, match="even width"):
        kernels.silu_and_mul(torch.zeros(2, 7))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        kernels.silu_and_mul(torch.zeros(8, 2).t())
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        kernels.silu_and_mul(torch.zeros(2, 8, dtype=torch.float64))


@dtypes
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (1, 16), (5, 40)])
def test_write_kv_matches_reference(kernels, dtype, block_size, head_dim):
    gen = torch.Generator().manual_seed(block_size * head_dim)
    cache = torch.randn(2, 3, 10, block_size, head_dim, generator=gen).to(dtype)
    kv = torch.randn(7, 2 * 3 * head_dim, generator=gen).to(dtype)
    k, v = (t.view(7, 3, head_dim) for t in kv.split(3 * head_dim, dim=-1))  # strided views
    slots = torch.randperm(10 * block_size, generator=gen)[:7]
    expected, got = cache.clone(), cache.clone()
    write_kv_reference(expected, slots, k, v)
    kernels.write_kv_(got, slots, k, v)
    assert torch.equal(bits(got), bits(expected))


def test_write_kv_checks_its_arguments(kernels):
    cache, k = torch.zeros(2, 3, 4, 16, 8), torch.zeros(2, 3, 8)
    slots = torch.tensor([0, 5])
    with pytest.raises(RuntimeError, match="int64"):
        kernels.write_kv_(cache, slots.int(), k, k)
    with pytest.raises(RuntimeError, match="of the cache's dtype"):
        kernels.write_kv_(cache, slots, k.bfloat16(), k.bfloat16())
    with pytest.raises(RuntimeError, match="contiguous CPU"):
        kernels.write_kv_(cache.transpose(3, 4), slots, k, k)
    with pytest.raises(RuntimeError, match="slot -1 of token 1 is outside the cache"):
        kernels.write_kv_(cache, torch.tensor([0, -1]), k, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(("rows", "k"), [(1, 576), (3, 37), (70, 896), (5, 1)])
def test_int8_per_token_matches_reference_bitwise(kernels, dtype, rows, k):
    """Every row rounded to int8 steps of its own scale, the eager oracle's bits, rows of
    zeros (scale: the dtype's eps), values that land on .5 steps, and a NaN row included."""
    from carpool.kernels.reference import int8_per_token_reference

    gen = torch.Generator().manual_seed(rows * 1000 + k)
    x = (torch.randn(rows, k, generator=gen) * torch.logspace(-3, 3, rows)[:, None]).to(dtype)
    if rows > 2:
        x[1] = 0
        x[2, : k // 2] = torch.arange(k // 2, dtype=torch.float32).to(dtype) * 0.5
        x[2, -1] = 127.5  # scale exactly 1: every .5 rounds half to even
    if rows > 4:
        x[4, k // 3] = float("nan")
    strided = torch.cat([x, x], dim=1)[:, :k]  # rows not contiguous with each other
    for given in (x, strided):
        ours, reference = kernels.int8_per_token(given), int8_per_token_reference(given)
        assert ours.dtype == dtype and ours.shape == (rows, k)
        assert torch.equal(bits(ours), bits(reference))


def test_int8_per_token_checks_its_arguments(kernels):
    with pytest.raises(RuntimeError, match="int8_per_token: x must be float32 or bfloat16"):
        kernels.int8_per_token(torch.ones(2, 4, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="rows, k"):
        kernels.int8_per_token(torch.ones(2, 4).t())
