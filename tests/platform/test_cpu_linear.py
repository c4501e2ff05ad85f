"""oneDNN-packed float32 linears compute what nn.Linear does, and replace every one of them;
bfloat16 and float32 few-row calls through the compiled small GEMMs do too, with each row's
result independent of its batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from carpool import kernels as cpu_kernels
from carpool.platform.cpu_linear import (
    MAX_ROWS,
    ROW_BUCKETS,
    PackedLinear,
    can_pack,
    pack_linears,
    padded_rows,
    this_cpu_route,
)
from carpool.platform.cpu_route import (
    SMALL_GEMM_AMX_TILE_MAX_ROWS,
    SMALL_GEMM_MAX_ROWS,
    CpuClass,
    CpuFacts,
    SmallGemmRoute,
)
from tests.kernels.builds import build_id, kernel_builds

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 300, 512, 1100])
def test_packed_linear_matches_linear(bias, rows, dtype):
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias).to(dtype)
    x = torch.randn(rows, 96, dtype=dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(linear)(x), linear(x), atol=tolerance,
                                   rtol=tolerance)
        assert PackedLinear(linear)(x.view(1, rows, 96)).shape == (1, rows, 160)


def this_cpu_cut(dtype: torch.dtype) -> int:
    return SMALL_GEMM_MAX_ROWS[CpuFacts.probe().cpu_class][dtype]


def bf16_route(kernels, max_rows: int, amx_tile_max_rows: int = 0):
    """This CPU's bfloat16 linear route with the small GEMM cut at max_rows rows (and on AMX
    tiles up to amx_tile_max_rows for layers whose K is in 32s; 0: never)."""
    return dataclasses.replace(this_cpu_route(torch.bfloat16, kernels), small_gemm=SmallGemmRoute(
        "small_gemm_bf16", max_rows, amx_tile_max_rows))


@pytest.fixture(scope="module", params=kernel_builds(), ids=build_id)
def bf16_kernels(request):
    """The builds with a bfloat16 small GEMM here: AVX512-BF16 CPUs, and AVX2 builds (float32
    FMAs from the bfloat16 weight)."""
    kernels = cpu_kernels.load(capability=request.param)
    if kernels is None or not kernels.has_small_gemm_bf16():
        pytest.skip("no compiled kernels or no bfloat16 small GEMM in this build on this CPU")
    return kernels


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("in_features,out_features", [(96, 160), (576, 577), (2, 17)])
def test_small_bf16_gemm_matches_linear_and_ignores_its_batch(bf16_kernels, bias, in_features,
                                                              out_features):
    torch.manual_seed(in_features)
    linear = nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    # The AVX512-BF16 GEMM at its cut whatever this CPU's (with AMX oneDNN or the tiles
    # take all but 1-2 rows).
    cut = SMALL_GEMM_MAX_ROWS[CpuClass.AVX512_BF16][torch.bfloat16]
    packed = PackedLinear(linear, bf16_kernels, bf16_route(bf16_kernels, cut))
    x = torch.randn(cut, in_features, dtype=torch.bfloat16)
    with torch.inference_mode():
        reference = nn.functional.linear(x.float(), linear.weight.float(),
                                         None if linear.bias is None else linear.bias.float())
        out = packed(x)  # the small GEMM's largest call
        torch.testing.assert_close(out.float(), reference, atol=2e-2, rtol=1e-2)
        for rows in (1, 5, 13, 40):  # every row, whatever its batch, gives the same bits
            assert torch.equal(packed(x[-rows:]), out[-rows:])
        assert packed(x[:3].view(3, 1, in_features)).shape == (3, 1, out_features)
        assert packed(x.t().contiguous().t()[:4]).shape == (4, out_features)  # strided rows


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("in_features,out_features", [(96, 160), (576, 577), (32, 16)])
def test_small_bf16_gemm_on_amx_tiles(bf16_kernels, bias, in_features, out_features):
    """On AMX tiles: every call up to 1024 rows (row tiles and column blocks in pairs, a last
    odd one alone, a last partial row tile read from a zero-padded copy of its rows, first or
    second of its pair; more than 256 rows in blocks of 96, the last block's tiles odd or
    even), each row's bits independent of its batch."""
    if not bf16_kernels.has_amx():
        pytest.skip("no AMX on this CPU")
    torch.manual_seed(in_features)
    linear = nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(linear, bf16_kernels)
    assert packed._small_max_rows == SMALL_GEMM_AMX_TILE_MAX_ROWS == 2 * MAX_ROWS
    x = torch.randn(2 * MAX_ROWS, in_features, dtype=torch.bfloat16)
    with torch.inference_mode():
        reference = nn.functional.linear(x.float(), linear.weight.float(),
                                         None if linear.bias is None else linear.bias.float())
        out = packed(x)
        torch.testing.assert_close(out.float(), reference, atol=2e-2, rtol=1e-2)
        for rows in (1, 3, 17, 40, 200, 257, 300, 1000, 1023):
            assert torch.equal(packed(x[-rows:]), out[-rows:])
        assert packed(x.t().contiguous().t()[:20]).shape == (20, out_features)  # strided rows
        wide = torch.randn(40, in_features + 32, dtype=torch.bfloat16)[:, 16:16 + in_features]
        assert torch.equal(packed(wide), packed(wide.contiguous()))  # rows further apart than K
        threads = torch.get_num_threads()
        try:  # the same bits on other thread counts (3 on 2 cores: likely to steal)
            for count in (1, 3):
                torch.set_num_threads(count)
                for rows in (5, 200, 1000):
                    assert torch.equal(packed(x[-rows:]), out[-rows:])
        finally:
            torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        bf16_kernels.small_gemm_bf16(torch.randn(2, 6, dtype=torch.bfloat16),
                                     bf16_kernels.pack_bf16_weight(torch.randn(8, 6).bfloat16()),
                                     8, amx=True)
    assert PackedLinear(nn.Linear(48, 16).to(torch.bfloat16), bf16_kernels)._small_max_rows \
        == this_cpu_cut(torch.bfloat16)  # K not in 32s: the AVX512-BF16 GEMM


@pytest.mark.parametrize("out_features", [4096, 4099])
def test_small_bf16_gemm_on_amx_tiles_streams_a_large_output_to_the_same_bits(bf16_kernels,
                                                                            out_features):
    """An output of more than 4 MiB (an LM head's logits) is written by non-temporal stores:
    whole 64-byte lines only (4099 columns: rows off the line and a ragged last pair take
    the ordinary stores), the same bits as the smaller calls' ordinary stores."""
    if not bf16_kernels.has_amx():
        pytest.skip("no AMX on this CPU")
    torch.manual_seed(out_features)
    linear = nn.Linear(64, out_features, bias=True).to(torch.bfloat16)
    packed = PackedLinear(linear, bf16_kernels)
    x = torch.randn(2 * MAX_ROWS, 64, dtype=torch.bfloat16)
    assert x.shape[0] * out_features * 2 > 4 * 2**20
    with torch.inference_mode():
        out = packed(x)
        reference = nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
        torch.testing.assert_close(out.float(), reference, atol=2e-2, rtol=1e-2)
        for rows in (1, 40, 300):  # outputs of under 4 MiB: ordinary stores
            assert torch.equal(packed(x[-rows:]), out[-rows:])


def test_stealable_shares_run_their_own_front_then_steal_from_the_back():
    """The AMX GEMM's split of its work units: each thread takes its own share front to back,
    then the back of the next share that has any left; every unit is claimed exactly once."""
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("no compiled kernels")
    claims = kernels.shares_claims([0, 4, 7], [1, 1, 1, 1, 1, 0, 1, 0, 1])
    assert claims == [(4, 1), (5, 1), (6, 1), (3, 0), (2, 0), (0, 0), (1, 0), (-1, 0), (-1, 0)]
    assert kernels.shares_claims([0, 0, 3], [0, 0, 0, 0]) == [(2, 1), (1, 1), (0, 1), (-1, 0)]
    generator = torch.Generator().manual_seed(0)
    for _ in range(500):
        shares = int(torch.randint(1, 5, (1,), generator=generator))
        sizes = torch.randint(0, 6, (shares,), generator=generator).tolist()
        bounds = [0] + torch.tensor(sizes).cumsum(0).tolist()
        owners = torch.randint(0, shares, (bounds[-1] + 3,), generator=generator).tolist()
        claims = kernels.shares_claims(bounds, owners)
        units = [unit for unit, _ in claims if unit >= 0]
        assert sorted(units) == list(range(bounds[-1]))  # each once, then none left
        assert all(unit == -1 for unit, _ in claims[len(units):])
        for (unit, share), owner in zip(claims, owners):
            if unit >= 0:
                assert bounds[share] <= unit < bounds[share + 1]
                # a thread steals only once its own share is empty
                assert share == owner or all(u < bounds[owner] or u >= bounds[owner + 1]
                                             for u in units[units.index(unit):])
    with pytest.raises(RuntimeError, match="no share 2"):
        kernels.shares_claims([0, 1, 2], [2])


@pytest.fixture(scope="module", params=kernel_builds(), ids=build_id)
def f32_kernels(request):
    kernels = cpu_kernels.load(capability=request.param)
    if kernels is None or not kernels.has_f32_gemm():
        pytest.skip("no compiled kernels or no float32 small GEMM in this build")
    return kernels


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("in_features,out_features", [(96, 160), (576, 577), (3, 17)])
def test_small_f32_gemm_matches_linear_and_ignores_its_batch(f32_kernels, bias, in_features,
                                                             out_features):
    torch.manual_seed(in_features)
    linear = nn.Linear(in_features, out_features, bias=bias)
    packed = PackedLinear(linear, f32_kernels)
    x = torch.randn(40, in_features)

    def small(rows: torch.Tensor) -> torch.Tensor:
        return f32_kernels.small_gemm_f32(rows, packed.small.packed, out_features, linear.bias)

    with torch.inference_mode():
        out = small(x)  # several row tiles of the kernel itself
        torch.testing.assert_close(out, linear(x), atol=1e-5, rtol=1e-5)
        for rows in (1, 5, 13, 40):  # every row, whatever its batch, gives the same bits
            assert torch.equal(small(x[-rows:]), out[-rows:])
        # PackedLinear sends calls of up to this CPU's cut to it, more to oneDNN
        cut = this_cpu_cut(torch.float32)
        x = torch.randn(cut + 1, in_features)
        out = small(x)
        assert packed._small_max_rows == cut
        assert torch.equal(packed(x[:cut]), out[:cut])
        assert packed(x[:3].view(3, 1, in_features)).shape == (3, 1, out_features)
        assert packed(x.t().contiguous().t()[:2]).shape == (2, out_features)  # strided rows
        more = x[:cut + 1]
        torch.testing.assert_close(packed(more), linear(more), atol=1e-5, rtol=1e-5)


def test_small_f32_gemm_checks_its_arguments(f32_kernels):
    packed = f32_kernels.pack_f32_weight(torch.randn(8, 6))
    with pytest.raises(RuntimeError, match="float32 CPU"):
        f32_kernels.pack_f32_weight(torch.randn(8, 6, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="does not match"):
        f32_kernels.small_gemm_f32(torch.randn(2, 4), packed, 8)
    with pytest.raises(RuntimeError, match="float32 CPU"):
        f32_kernels.small_gemm_f32(torch.randn(2, 6, dtype=torch.bfloat16), packed, 8)
    with pytest.raises(RuntimeError, match="bias"):
        f32_kernels.small_gemm_f32(torch.randn(2, 6), packed, 8, torch.zeros(7))


@pytest.mark.parametrize("vendor, family, flags, zen4", [
    ("AuthenticAMD", "25", "fpu avx2 avx512f avx512_bf16", True),  # Zen 4
    ("AuthenticAMD", "25", "fpu avx2", False),  # Zen 3: same family, no AVX-512
    ("AuthenticAMD", "26", "fpu avx2 avx512f avx512_bf16", False),  # Zen 5
    ("GenuineIntel", "6", "fpu avx2 avx512f amx_tile", False),
])
def test_zen4_is_told_from_cpuinfo(monkeypatch, vendor, family, flags, zen4):
    fields = {"vendor_id": vendor, "cpu family": family, "flags": flags}
    monkeypatch.setattr(cpu_kernels.cpu_info, "cpuinfo", lambda: fields)
    assert cpu_kernels.is_zen4() is zen4


def test_bf16_calls_above_the_cut_go_to_onednn(bf16_kernels, monkeypatch):
    torch.manual_seed(0)
    linear = nn.Linear(96, 160).to(torch.bfloat16)
    cut = SMALL_GEMM_MAX_ROWS[CpuClass.AMX][torch.bfloat16]
    packed = PackedLinear(linear, bf16_kernels,
                          bf16_route(bf16_kernels, cut, cut if bf16_kernels.has_amx() else 0))
    x = torch.randn(cut + 1, 96, dtype=torch.bfloat16)
    small_calls, onednn_calls = [], []
    small, onednn = packed._small_gemm, packed.packed_matmul
    monkeypatch.setattr(packed, "_small_gemm", lambda rows, *a: small_calls.append(
        rows.shape[0]) or small(rows, *a))
    monkeypatch.setattr(packed, "packed_matmul", lambda rows: onednn_calls.append(
        rows.shape[0]) or onednn(rows))
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), atol=2e-2, rtol=2e-2)
        packed(x[:cut])
    assert small_calls == [cut]
    assert onednn_calls == [padded_rows(cut + 1)]


def test_small_bf16_gemm_checks_its_arguments(bf16_kernels):
    weight = torch.randn(8, 6, dtype=torch.bfloat16)
    packed = bf16_kernels.pack_bf16_weight(weight)
    with pytest.raises(RuntimeError, match="K even"):
        bf16_kernels.pack_bf16_weight(torch.randn(8, 5, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="does not match"):
        bf16_kernels.small_gemm_bf16(torch.randn(2, 4, dtype=torch.bfloat16), packed, 8)
    with pytest.raises(RuntimeError, match="bfloat16 CPU"):
        bf16_kernels.small_gemm_bf16(torch.randn(2, 6), packed, 8)


def test_row_counts_reach_onednn_as_a_few_buckets_only():
    for rows in range(1, MAX_ROWS + 1):
        padded = padded_rows(rows)
        assert padded in ROW_BUCKETS and rows <= padded
        assert padded < 2 * rows if rows <= 8 else padded - rows < (8 if rows <= 128 else 16)
    assert len(ROW_BUCKETS) == 43


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_full_step_is_one_onednn_call_and_other_large_counts_are_pieces(dtype, monkeypatch):
    """Up to 2 * MAX_ROWS rows, pieces; above, below the full step, one call padded to whole
    MAX_ROWS (a fixed set of shapes) for bfloat16 on AMX, else pieces; above the full step,
    pieces again."""
    torch.manual_seed(0)
    linear = nn.Linear(96, 160).to(dtype)
    packed = PackedLinear(linear, route=this_cpu_route(dtype, full_rows=2048))
    padded = dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported()
    assert packed._one_padded_call == padded
    calls = []
    matmul = packed.packed_matmul
    monkeypatch.setattr(packed, "packed_matmul",
                        lambda rows: calls.append(len(rows)) or matmul(rows))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    with torch.inference_mode():
        for rows, expected_calls in (
                (2048, [2048]), (1024, [512, 512]),
                (1025, [1536] if padded else [512, 512, 1]),
                (1535, [1536] if padded else [512, 512, 512]),
                (2047, [2048] if padded else [512, 512, 512, 512]),
                (2100, [512, 512, 512, 512, 56])):
            calls.clear()
            x = torch.randn(rows, 96, dtype=dtype)
            torch.testing.assert_close(packed(x), linear(x), atol=tolerance, rtol=tolerance)
            assert calls == expected_calls, rows
    route = this_cpu_route(dtype, full_rows=MAX_ROWS)
    assert PackedLinear(linear, route=route)._full_rows == 0  # no shape of its own


def test_runner_gives_its_step_budget_to_the_linears_but_not_in_batch_invariant_mode(
        llama_checkpoint):
    from carpool.platform import platform_for

    assert platform_for(torch.device("cpu"), max_num_batched_tokens=2048).full_step_rows == 2048
    linears = _runner_linears(llama_checkpoint, max_num_batched_tokens=1024)
    assert {m._full_rows for m in linears} == {1024}
    from carpool.config import EngineConfig
    from carpool.platform.cpu_invariant_linear import RowTiledLinear
    from carpool.runner.model_runner import ModelRunner

    config = EngineConfig.from_args(str(llama_checkpoint), dtype="float32", device="cpu",
                                    num_kv_blocks=8, max_model_len=64,
                                    max_num_batched_tokens=1024, max_num_seqs=2,
                                    batch_invariant=True)
    runner = ModelRunner(config, llama_checkpoint)
    packed = [m.matmul.__self__ if isinstance(m, RowTiledLinear) else m
              for m in runner.model.modules() if isinstance(m, (RowTiledLinear, PackedLinear))]
    assert packed and {m._full_rows for m in packed} == {0}  # fixed tiles, or the small GEMM


def test_pack_linears_replaces_every_float32_linear_only():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)))
    assert can_pack(model)
    assert pack_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
    assert not can_pack(nn.Linear(8, 8).to(torch.float16))


def _runner_linears(checkpoint, **kwargs):
    from carpool.config import EngineConfig
    from carpool.runner.model_runner import ModelRunner

    kwargs.setdefault("max_num_batched_tokens", 64)
    config = EngineConfig.from_args(str(checkpoint), dtype="float32", device="cpu",
                                    num_kv_blocks=8, max_model_len=64, max_num_seqs=2, **kwargs)
    runner = ModelRunner(config, checkpoint)
    return [m for m in runner.model.modules() if isinstance(m, (nn.Linear, PackedLinear))]


def test_cpu_float32_runner_packs_linears_unless_told_not_to(llama_checkpoint):
    linears = _runner_linears(llama_checkpoint, cpu_packed_linears=False)
    assert linears and not any(isinstance(m, PackedLinear) for m in linears)
    linears = _runner_linears(llama_checkpoint)
    assert linears and all(isinstance(m, PackedLinear) for m in linears)


def test_packing_is_a_flag_and_a_config_field():
    import argparse

    from carpool.config import EngineConfig
    from carpool.server.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = EngineConfig.from_cli_args(parser.parse_args(["--no-cpu-packed-linears",
                                                           "--no-cpu-malloc-tuning"]))
    assert config.cpu.packed_linears is False and config.cpu.malloc_tuning is False
    default = EngineConfig.from_cli_args(parser.parse_args([]))
    assert default.cpu.packed_linears is True and default.cpu.malloc_tuning is True


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 300, 1100])
def test_bfloat16_weights_go_through_float32_where_onednn_has_no_bfloat16(bias, rows):
    """On an AVX2 CPU oneDNN's matmul has no bfloat16 (and torch's own bfloat16 GEMM is far
    slower than packed float32 there, docs/lab/37-an-avx2-only-machine.md): the weight is packed as float32, each call's rows are
    converted in and its result rounded to bfloat16 once, as a bfloat16 matmul does."""
    route = dataclasses.replace(this_cpu_route(torch.bfloat16, full_rows=1100),
                                onednn_dtype=torch.float32)
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(linear, route=route)
    assert packed._packed.dtype == torch.float32
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        out = packed(x.view(1, rows, 96))
        expected = nn.functional.linear(x.float(), linear.weight.float(),
                                        None if linear.bias is None else linear.bias.float())
    assert out.dtype == torch.bfloat16 and out.shape == (1, rows, 160)
    # float32 sums rounded once: within half a bfloat16 ulp of the float32 result
    torch.testing.assert_close(out[0].float(), expected, atol=1e-5, rtol=2 ** -8)
