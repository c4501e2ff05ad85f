"""The fused experts pass (csrc/moe/moe_experts.cpp) against the model's loop over the experts
(`reference.moe_experts_reference`), on every build this CPU runs: every routing shape (an
expert with no rows, all rows on one expert, more experts than rows, one row), widths that are
not whole vectors or blocks, float32 and bfloat16; and each row's result independent of the
other rows of the call (what the batch-invariant mode needs). The router (`moe_route`,
csrc/moe/moe_route.cpp) against the model's (`reference.moe_route_reference`)."""

from __future__ import annotations

import pytest
import torch

from carpool.kernels.reference import moe_experts_reference, moe_route_reference

# (T, H, I, E, k, routing): "random", "one" (every row on experts 0..k-1), "skip" (expert 1
# never chosen)
CASES = [(1, 64, 32, 8, 2, "random"), (3, 64, 32, 16, 4, "random"),  # more experts than rows
         (37, 96, 48, 8, 2, "random"), (64, 64, 32, 8, 8, "random"),  # top-8 of 8
         (20, 64, 32, 8, 1, "one"),  # every row on expert 0
         (29, 72, 20, 6, 2, "skip"),  # an expert with no rows; H, I not whole vectors
         (5, 33, 9, 4, 3, "random")]  # odd widths
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1e-2}


def routing(tokens: int, experts: int, k: int, kind: str,
            gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "one":
        ids = torch.arange(k).repeat(tokens, 1)
    else:
        choices = [e for e in range(experts) if kind != "skip" or e != 1]
        ids = torch.stack([torch.tensor(choices)[torch.randperm(len(choices), generator=gen)[:k]]
                           for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), dim=-1)
    return ids, weights


def problem(case, dtype):
    tokens, hidden, inner, experts, k, kind = case
    gen = torch.Generator().manual_seed(tokens * hidden + inner)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    gate_up = (torch.randn(experts, 2 * inner, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    down = (torch.randn(experts, hidden, inner, generator=gen) / inner ** 0.5).to(dtype)
    ids, weights = routing(tokens, experts, k, kind, gen)
    return x, gate_up, down, ids, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_moe_experts_matches_reference(kernels, case, dtype):
    x, gate_up, down, ids, weights = problem(case, dtype)
    if case[-1] == "skip":
        assert 1 not in ids.tolist()[0] and (ids != 1).all()
    packed = kernels.pack_moe_experts(gate_up, down)
    out = kernels.moe_experts(x, *packed, ids, weights)
    # the reference in float32 on the same (rounded) inputs: the kernel sums in float32
    expected = moe_experts_reference(x.float(), gate_up.float(), down.float(), ids,
                                     weights.float())
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), expected, rtol=TOLERANCE[dtype],
                               atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_moe_experts_rows_independent_of_the_batch(kernels, dtype):
    x, gate_up, down, ids, weights = problem((37, 96, 48, 8, 2, "random"), dtype)
    packed = kernels.pack_moe_experts(gate_up, down)
    together = kernels.moe_experts(x, *packed, ids, weights)
    for row in (0, 5, 36):
        alone = kernels.moe_experts(x[row:row + 1], *packed, ids[row:row + 1],
                                    weights[row:row + 1])
        assert torch.equal(alone[0], together[row])
    assert torch.equal(kernels.moe_experts(x[3:20], *packed, ids[3:20], weights[3:20]),
                       together[3:20])


def test_moe_experts_checks_its_inputs(kernels):
    x, gate_up, down, ids, weights = problem((3, 64, 32, 4, 2, "random"), torch.float32)
    packed = kernels.pack_moe_experts(gate_up, down)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.moe_experts(x, *packed, ids + 4, weights)
    with pytest.raises(RuntimeError, match="int64"):
        kernels.moe_experts(x, *packed, ids.int(), weights)
    with pytest.raises(RuntimeError, match="packed"):  # a width the weights do not take
        kernels.moe_experts(x[:, :32], *packed, ids, weights)
    with pytest.raises(RuntimeError, match="packed"):  # I = 20 unpadded: not whole blocks
        kernels.moe_experts(x, gate_up[:, :40], down[..., :20].contiguous(), ids, weights)
    assert kernels.moe_experts(x[:0], *packed, ids[:0], weights[:0]).shape == (0, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("tokens,experts,k", [(1, 16, 4), (37, 8, 2), (5, 8, 8), (3, 60, 1),
                                              (0, 8, 2)])
@pytest.mark.parametrize("renormalize", [False, True], ids=["softmax", "renormalized"])
def test_moe_route_matches_reference(kernels, tokens, experts, k, renormalize, dtype):
    gen = torch.Generator().manual_seed(tokens * experts + k)
    logits = (torch.randn(tokens, experts, generator=gen) * 3).to(dtype)
    weights, ids = kernels.moe_route(logits, k, renormalize)
    expected_weights, expected_ids = moe_route_reference(logits, k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert weights.shape == ids.shape == (tokens, k)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)
    if renormalize and tokens:
        torch.testing.assert_close(weights.sum(-1), torch.ones(tokens))


def test_moe_route_rows_independent_and_checked(kernels):
    logits = torch.randn(9, 16, generator=torch.Generator().manual_seed(1))
    together = kernels.moe_route(logits, 4, True)
    for row in range(9):
        alone = kernels.moe_route(logits[row:row + 1], 4, True)
        assert all(torch.equal(a[0], t[row]) for a, t in zip(alone, together))
    # equal logits: the lower expert first
    assert kernels.moe_route(torch.zeros(1, 6), 3, False)[1].tolist() == [[0, 1, 2]]
    with pytest.raises(RuntimeError, match="top_k"):
        kernels.moe_route(logits, 17, True)
    with pytest.raises(RuntimeError, match="top_k"):
        kernels.moe_route(logits, 0, True)
