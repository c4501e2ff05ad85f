"""The quantized experts in one call (csrc/moe/quant_experts.cpp, `cpu_moe.KernelQuantExperts`)
against the per-expert loop over quantized linears it replaces (`models.quant.experts.
QuantExperts` with its linears packed by the platform, `cpu_quant.QuantLinearPacker`): the
same bits, on every build this CPU runs, for every routing shape (an expert with no rows, all
rows on one expert, more experts than rows, one row), int8 / int4 / five-bit experts, gate and
up of different types (two parts), calls above the kernel's cut, float32 and bfloat16; each
row's result independent of the other rows of the call; and, within float32 rounding, the
model's loop over the same experts dequantized (`reference.dequantize_ref`)."""

from __future__ import annotations

import pytest
import torch

from carpool.kernels.reference import dequantize_ref, moe_experts_reference
from carpool.models.quant.experts import QuantExperts
from carpool.models.quant.linear import QuantLinear
from carpool.models.quant.weight import QuantizedWeight
from carpool.platform.cpu_moe import KernelQuantExperts
from carpool.platform.cpu_quant import QuantLinearPacker, packed_bits
from carpool.platform.cpu_route import ALL_ROWS, QuantRoute
from tests.kernels.test_moe import routing

# (T, H, I, E, k, routing) as test_moe's, H and I whole groups of 32
CASES = [(1, 64, 32, 8, 2, "random"), (3, 64, 32, 16, 4, "random"),  # more experts than rows
         (37, 96, 64, 8, 2, "random"), (64, 64, 32, 8, 8, "random"),  # top-8 of 8
         (20, 64, 32, 8, 1, "one"),  # every row on expert 0
         (29, 64, 96, 6, 2, "skip")]  # an expert with no rows
# gate, up, down: (bits, group, mins); Q8_0, Q4_0, Q4_K-like (mins), Q5_0 (int8 q in -16..15,
# packed in five bits), Q6_K-like (int8 q in -32..31, packed as bits 6), and gate / up of
# different types (two parts)
FORMATS = {"q8_0": [(8, 32, False)] * 3, "q4_0": [(4, 32, False)] * 3,
           "q4_k": [(4, 32, True)] * 3, "q5_0": [(5, 32, False)] * 3,
           "q6_k": [(6, 16, False)] * 3,
           "mixed": [(8, 32, False), (4, 32, True), (5, 32, False)]}
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def quantized(n: int, k: int, fmt, gen: torch.Generator) -> QuantizedWeight:
    bits, group, mins = fmt
    if bits == 4:
        qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    else:
        qweight = torch.randint(-span_of(bits), span_of(bits), (n, k), dtype=torch.int8,
                                generator=gen)
    # float16-exact scales, as GGUF's are (the packer keeps them in float16 headers)
    scales = (torch.rand(n, k // group, generator=gen) / (span_of(bits) * k ** 0.5)).half()
    offsets = torch.randn(n, k // group, generator=gen) / (16 * k ** 0.5) if mins else None
    return QuantizedWeight(qweight, scales.float(), offsets, 4 if bits == 4 else 8, group,
                           f"int{bits}")


def dense(w: QuantizedWeight) -> torch.Tensor:
    return dequantize_ref(w.qweight, w.scales, w.mins, w.bits, w.group_size)


def span_of(bits: int) -> int:
    return {4: 8, 5: 16, 6: 32, 8: 128}[bits]


def problem(case, fmt_name: str, dtype: torch.dtype, weights_dtype: torch.dtype | None = None):
    tokens, hidden, inner, experts, k, kind = case
    gen = torch.Generator().manual_seed(tokens * hidden + inner + experts)
    gate_f, up_f, down_f = FORMATS[fmt_name]
    parts = [(quantized(inner, hidden, gate_f, gen), quantized(inner, hidden, up_f, gen),
              quantized(hidden, inner, down_f, gen)) for _ in range(experts)]
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    ids, weights = routing(tokens, experts, k, kind, gen)
    return x, parts, ids, weights.to(weights_dtype or torch.float32)


def prepared(kernels, parts, dtype: torch.dtype, route: QuantRoute):
    """(the module loop over packed quantized linears, the one-call experts) on the same
    packed parts."""
    packer = QuantLinearPacker(kernels, route, dtype)
    gate_ups = [QuantLinear([gate, up], None) for gate, up, _ in parts]
    downs = [QuantLinear([down], None) for _, _, down in parts]
    for linear in (*gate_ups, *downs):
        packer(linear)
    module = QuantExperts(gate_ups, downs)
    fused = KernelQuantExperts.of(module, kernels, route)
    assert fused is not None
    return module, fused


ROUTE = QuantRoute(ALL_ROWS, ALL_ROWS, tiles=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_quant_moe_experts_is_the_per_expert_loop(kernels, case, fmt, dtype):
    x, parts, ids, weights = problem(case, fmt, dtype)
    if case[-1] == "skip":
        assert (ids != 1).all()
    module, fused = prepared(kernels, parts, dtype, ROUTE)
    out = fused(x, ids, weights)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out, module(x, ids, weights))
    # and the model's loop on the dequantized experts, in float32 on the same inputs
    gate_up = torch.stack([torch.cat([dense(g), dense(u)]) for g, u, _ in parts])
    down = torch.stack([dense(d) for _, _, d in parts])
    expected = moe_experts_reference(x.float(), gate_up, down, ids, weights)
    torch.testing.assert_close(out.float(), expected, rtol=TOLERANCE[dtype],
                               atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_weights_in_the_model_dtype_and_calls_above_the_cut(kernels, dtype):
    """bfloat16 routing weights (`weights_in_model_dtype`), and a cut of 4 rows: experts with
    more rows take the dequantized weight into a linear, as the module's parts do; with
    rounded_from the kernel's rounded path from 2 rows."""
    x, parts, ids, weights = problem((37, 96, 64, 8, 2, "random"), "mixed", dtype, dtype)
    for route in (QuantRoute(4, 4, tiles=False), QuantRoute(64, 64, tiles=False, rounded_from=2)):
        module, fused = prepared(kernels, parts, dtype, route)
        assert torch.equal(fused(x, ids, weights), module(x, ids, weights))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_six_bit_parts_take_the_int8_cut(kernels, dtype):
    """Q6_K's bits-6 parts are a byte a weight: their cut is int8's, as the module's parts
    take it (`QuantRoute.max_rows`), not int4's."""
    x, parts, ids, weights = problem((37, 96, 64, 8, 2, "random"), "q6_k", dtype)
    assert {packed_bits(w) for expert in parts for w in expert} == {6}
    module, fused = prepared(kernels, parts, dtype, QuantRoute(64, 2, tiles=False))
    assert torch.equal(fused(x, ids, weights), module(x, ids, weights))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_rows_independent_of_the_batch_and_the_threads(kernels, dtype):
    x, parts, ids, weights = problem((37, 96, 64, 8, 2, "random"), "q8_0", dtype)
    _, fused = prepared(kernels, parts, dtype, ROUTE)
    together = fused(x, ids, weights)
    for row in (0, 5, 36):
        alone = fused(x[row:row + 1], ids[row:row + 1], weights[row:row + 1])
        assert torch.equal(alone[0], together[row])
    assert torch.equal(fused(x[3:7], ids[3:7], weights[3:7]), together[3:7])
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            assert torch.equal(fused(x, ids, weights), together)
            assert torch.equal(fused(x[:2], ids[:2], weights[:2]), together[:2])
    finally:
        torch.set_num_threads(threads)


def test_no_rows_and_bad_arguments(kernels):
    x, parts, ids, weights = problem((3, 64, 32, 4, 2, "random"), "q8_0", torch.float32)
    _, fused = prepared(kernels, parts, torch.float32, ROUTE)
    assert fused(x[:0], ids[:0], weights[:0]).shape == (0, 64)
    with pytest.raises(RuntimeError, match="out of range"):
        fused(x, ids + 4, weights)
    with pytest.raises(RuntimeError, match="columns"):
        fused(x[:, :32], ids, weights)
    packed = [lin.stack_parts.packed for lin in fused.reference.gate_up]
    downs = [lin.stack_parts.packed for lin in fused.reference.down]
    def cuts(experts, extra=0):
        return [[8] * (len(parts) + extra) for parts in experts]

    with pytest.raises(RuntimeError, match="gate/up experts for"):
        kernels.QuantExperts(packed, downs[:-1], cuts(packed), cuts(downs[:-1]))
    with pytest.raises(RuntimeError, match="one cut a part"):
        kernels.QuantExperts(packed, downs, cuts(packed, extra=1), cuts(downs))
    with pytest.raises(RuntimeError, match="down part is not a grouped quantized weight"):
        kernels.QuantExperts(downs, packed, cuts(downs), cuts(packed))
