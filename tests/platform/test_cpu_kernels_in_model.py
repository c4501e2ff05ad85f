"""The CPU platform's compiled kernels: fused RoPE and SiLU x up give the eager ops' bits,
the fused residual add + RMSNorm gives the eager ops' bits in float32 and, in reduced
precision, the eager add's bits and F.rms_norm's up to a last bit; the KV write equals
`index_copy_`'s, the platform swaps them into the model only when the kernels are on, and
the switch is a flag."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from carpool import kernels as cpu_kernels
from carpool.attention.base import write_kv
from carpool.models.llama import RMSNorm, SiluAndMul
from carpool.models.rope import Rotary
from carpool.platform import CpuPlatform
from carpool.platform.cpu_fused import FusedRMSNorm, FusedRotary, FusedSiluAndMul


@pytest.fixture(scope="module")
def kernels():
    module = cpu_kernels.load()
    if module is None:
        pytest.skip("the C++ kernels did not build (tests/kernels reports why)")
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 1, 16), (6, 2, 40)])
def test_fused_rotary_equals_apply_rope_bitwise(kernels, dtype, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    num_tokens = 37
    # q and k are views into one projection output, as in the model (strided token rows).
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(num_tokens, heads, head_dim), k.view(num_tokens, kv_heads, head_dim)
    angles = torch.rand(num_tokens, head_dim // 2, generator=gen) * 50
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(dtype)
    expected_q, expected_k = Rotary()(q, k, cos, sin)
    got_q, got_k = FusedRotary(kernels)(q, k, cos, sin)
    assert torch.equal(got_q, expected_q) and torch.equal(got_k, expected_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inner", [1536, 100, 37, 8])
def test_fused_silu_and_mul_equals_eager_bitwise(kernels, dtype, inner):
    gen = torch.Generator().manual_seed(inner)
    gate_up = (torch.randn(33, 2 * inner, generator=gen) * 30).to(dtype)
    gate_up[0, :3] = torch.tensor([float("inf"), float("-inf"), -0.0])
    expected = SiluAndMul()(gate_up)
    got = FusedSiluAndMul(kernels)(gate_up)
    assert got.shape == (33, inner)
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)  # silu(-inf) is nan


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


# Which NaN a product of two NaNs keeps is the compiler's choice (x86 keeps the first operand's;
# operands get swapped): checked against the AVX512 torch build only.
avx512_only = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512",
                                 reason="NaN x NaN checked on AVX512 builds")


@pytest.mark.parametrize("nan_up", [False, pytest.param(True, marks=avx512_only)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_silu_and_mul_every_16bit_gate_bitwise(kernels, dtype, nan_up):
    # Every gate bit pattern (bfloat16 takes silu from a table), in the vector loop and the
    # scalar tail (1590 = 24 x 64 + 54: eager's bfloat16 loop steps 64 on AVX512), against
    # eager to the bit, NaN signs included; with nan_up, a NaN up beside a NaN silu (gate -inf
    # or NaN) too.
    rows, inner = 42, 1590
    gate = ((torch.arange(rows * inner) * 7919) % 65536 - 32768).to(torch.int16).view(dtype)
    up = torch.randn(rows * inner, generator=torch.Generator().manual_seed(1)).to(dtype)
    if nan_up:
        up[::5] = float("nan")
        bits(up)[::10] ^= -32768  # NaNs of both signs
    gate_up = torch.cat([gate.view(rows, inner), up.view(rows, inner)], dim=1)
    assert torch.equal(bits(FusedSiluAndMul(kernels)(gate_up)), bits(SiluAndMul()(gate_up)))


@avx512_only
def test_fused_silu_and_mul_gives_eagers_nan_of_two_in_float32(kernels):
    # NaN silu x NaN up: torch's float32 product keeps up's NaN (its float16 one silu's).
    gate = torch.tensor([float("nan"), float("-inf"), -float("nan"), 1.0] * 20)
    up = torch.tensor([-float("nan"), float("nan"), float("nan"), -float("nan")] * 20)
    gate_up = torch.cat([gate, up])[None].repeat(3, 1)
    assert torch.equal(bits(FusedSiluAndMul(kernels)(gate_up)), bits(SiluAndMul()(gate_up)))


def norm_pair(kernels, dim: int, eps: float, dtype: torch.dtype,
              gen: torch.Generator) -> tuple[RMSNorm, FusedRMSNorm]:
    """An eager RMSNorm with a random weight in `dtype`, and the fused one sharing it."""
    eager = RMSNorm(dim, eps)
    with torch.no_grad():
        eager.weight.copy_(torch.rand(dim, generator=gen) + 0.5)
    eager = eager.to(dtype)
    return eager, FusedRMSNorm(eager, kernels)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,dim", [(1, 576), (40, 576), (700, 64), (5, 37)])
def test_fused_rms_norm_adds_bitwise_and_normalises_like_rms_norm(kernels, dtype, rows, dim):
    gen = torch.Generator().manual_seed(rows * dim)
    eager, fused = norm_pair(kernels, dim, 1e-5, dtype, gen)
    # x is a view with a row stride, as a projection's output slice would be.
    x = torch.randn(rows, dim + 3, generator=gen).to(dtype)[:, :dim]
    residual = torch.randn(rows, dim, generator=gen).to(dtype)
    out, summed = fused(x, residual)
    expected_out, expected_sum = eager(x, residual)
    assert torch.equal(summed, expected_sum)  # the eager add, to the bit
    reference = F.rms_norm(expected_sum.float(), (dim,), eager.weight.float(), 1e-5)
    ulp = torch.finfo(dtype).eps
    assert ((out.float() - reference) / reference.abs().clamp_min(1e-3)).abs().max() <= ulp
    assert (out != expected_out).float().mean() < 0.01  # differs in a last bit, rarely
    alone = fused(x)
    assert ((alone.float() - eager(x).float()).abs() <= ulp * eager(x).float().abs()).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_rms_norm_adds_special_values_as_eager(kernels, dtype):
    # Every pair of special values, 100 columns: six 16-lane vectors and a scalar tail; the
    # second row reversed, so pairs meet the other part of the loop too. A NaN sum is NaN,
    # but which NaN (sign, payload) is not eager's everywhere; see FusedRMSNorm.
    specials = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 1e-40,
                             3e38, -3e38, 0.0, -0.0, 1.0])
    x_row, residual_row = specials.repeat_interleave(10), specials.repeat(10)
    x = torch.stack([x_row, x_row.flip(0)]).to(dtype)
    residual = torch.stack([residual_row, residual_row.flip(0)]).to(dtype)
    eager = RMSNorm(100, 1e-5).to(dtype)
    _, summed = FusedRMSNorm(eager, kernels)(x, residual)
    expected = eager(x, residual)[1]
    nan = expected.isnan()
    assert nan.sum() > 20 and torch.equal(summed.isnan(), nan)
    assert torch.equal(bits(summed)[~nan], bits(expected)[~nan])


@pytest.mark.parametrize("rows,dim", [(1, 576), (40, 256), (700, 64), (5, 37), (3, 8)])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_rms_norm_float32_is_eager_bitwise(kernels, rows, dim, threads):
    gen = torch.Generator().manual_seed(rows * dim)
    eager, fused = norm_pair(kernels, dim, 1e-6, torch.float32, gen)
    x = (torch.randn(rows, dim + 5, generator=gen) * 7)[:, :dim]  # rows with a stride
    residual = torch.randn(rows, dim, generator=gen) * 3
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, summed = fused(x, residual)
        expected_out, expected_sum = eager(x, residual)
        alone, expected_alone = fused(x), eager(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(bits(summed), bits(expected_sum))
    assert torch.equal(bits(out), bits(expected_out))
    assert torch.equal(bits(alone), bits(expected_alone))


def test_fused_rms_norm_float32_special_values_as_eager(kernels):
    # Every pair of special values in the add, 100 columns (vectors and a scalar tail), and
    # rows whose squares overflow or vanish: the eager ops' bits. A NaN is a NaN where eager's
    # is, but which NaN a NaN + NaN sum carries (sign, payload) is not eager's everywhere: the
    # compiler may swap an add's operands in the scalar tail (see FusedRMSNorm).
    specials = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 1e-40,
                             3e38, -3e38, 0.0, -0.0, 1.0])
    x_row, residual_row = specials.repeat_interleave(10), specials.repeat(10)
    x = torch.stack([x_row, x_row.flip(0), torch.full((100,), 2e20), torch.full((100,), 1e-30)])
    residual = torch.stack([residual_row, residual_row.flip(0), torch.zeros(100),
                            torch.zeros(100)])
    eager = RMSNorm(100, 1e-5)
    for got, expected in zip(FusedRMSNorm(eager, kernels)(x, residual), eager(x, residual)):
        nan = expected.isnan()
        assert nan.sum() > 20 and torch.equal(got.isnan(), nan)
        assert torch.equal(bits(got)[~nan], bits(expected)[~nan])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(37, 9, 3, 64), (1, 4, 2, 128),
                                                            (700, 2, 1, 16), (5, 3, 1, 40)])
def test_fused_rms_norm_of_heads_as_eager(kernels, dtype, tokens, heads, kv_heads, head_dim):
    # Qwen3's q and k norms: each head of the projection's strided [T, H, D] views a row.
    gen = torch.Generator().manual_seed(tokens * head_dim)
    eager, fused = norm_pair(kernels, head_dim, 1e-6, dtype, gen)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 5).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    for x in (q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)):
        got, expected = fused(x), eager(x)
        assert got.shape == expected.shape and got.is_contiguous()
        if dtype == torch.float32:
            assert torch.equal(bits(got), bits(expected))
        else:  # F.rms_norm's results up to a last bit, as for rows
            ulp = torch.finfo(dtype).eps
            assert ((got.float() - expected.float()).abs()
                    <= ulp * expected.float().abs()).all()


def test_fused_rms_norm_rejects_other_dtypes_and_layouts(kernels):
    weight = torch.ones(16)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        kernels.rms_norm(torch.zeros(3, 16, dtype=torch.float64), None, weight.double(), 1e-6)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        kernels.rms_norm(torch.zeros(16, 3).t(), None, weight, 1e-6)
    with pytest.raises(RuntimeError, match="residual must match x"):
        kernels.rms_norm(torch.zeros(3, 16), torch.zeros(2, 16), weight, 1e-6)
    with pytest.raises(RuntimeError, match="a residual needs x"):
        kernels.rms_norm(torch.zeros(3, 2, 16), torch.zeros(3, 2, 16), weight, 1e-6)
    with pytest.raises(RuntimeError, match="contiguous heads"):
        kernels.rms_norm(torch.zeros(3, 16, 2).transpose(1, 2), None, weight, 1e-6)
    with pytest.raises(RuntimeError, match="weight must be"):
        kernels.rms_norm(torch.zeros(3, 2, 16), None, torch.ones(8), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_kv_write_equals_index_copy(kernels, dtype):
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 3, 10, 16, 64, generator=gen).to(dtype)
    kv = torch.randn(7, 2 * 3 * 64, generator=gen).to(dtype)
    k, v = (t.view(7, 3, 64) for t in kv.split(3 * 64, dim=-1))  # strided views
    slots = torch.randperm(160, generator=gen)[:7]
    expected, got = cache.clone(), cache.clone()
    write_kv(expected, slots, k, v)
    write_kv(got, slots, k, v, kernels)
    assert torch.equal(got, expected)
    with pytest.raises(RuntimeError, match="slot 160 of token 0 is outside the cache"):
        kernels.write_kv_(got, torch.tensor([160, 0]), k[:2], v[:2])


def test_platform_swaps_fused_modules_only_with_kernels(llama_checkpoint):
    from carpool.models.config import load_model_config
    from carpool.models.loader import load_model

    def rotaries(platform):
        model = load_model(llama_checkpoint, load_model_config(llama_checkpoint),
                           torch.float32, torch.device("cpu"))
        platform.prepare_model(model)
        return {type(m) for m in model.modules()
                if isinstance(m, (Rotary, FusedRotary, RMSNorm, SiluAndMul))}

    assert rotaries(CpuPlatform(kernels=True)) == {FusedRotary, FusedRMSNorm, FusedSiluAndMul}
    assert rotaries(CpuPlatform(kernels=False)) == {Rotary, RMSNorm, SiluAndMul}
    assert "C++ kernels off" in CpuPlatform(kernels=False).describe()


def test_kernels_are_a_flag_and_a_config_field():
    import argparse

    from carpool.config import EngineConfig
    from carpool.server.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert EngineConfig.from_cli_args(parser.parse_args(["--no-cpu-kernels"])).cpu.kernels is False
    assert EngineConfig.from_cli_args(parser.parse_args([])).cpu.kernels is True
