"""The cpu backend sends the bfloat16 prefill kernel every bfloat16 request of 2+ tokens and
nothing else, on AMX tiles where it can (the kernel itself: tests/kernels/)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from carpool.attention import AttentionShape, create_backend
from carpool.attention.base import StepLayout
from carpool.kernels import load
from carpool.kernels.reference import paged_attention_reference

UNTOUCHED = 7.0
AS_INT = dict(dtype=torch.int32)


@pytest.fixture(scope="module")
def kernels():
    module = load()
    if module is None or not module.has_bf16_gemm():
        pytest.skip("no compiled kernels or no AVX512-BF16 on this CPU")
    return module


def test_cpu_backend_takes_the_amx_path_where_it_can(kernels):
    cpu = torch.device("cpu")
    wide = create_backend("cpu", AttentionShape(9, 3, 64, dtype=torch.bfloat16), cpu,
                          kernels=kernels)
    narrow = create_backend("cpu", AttentionShape(4, 2, 16, dtype=torch.bfloat16), cpu,
                            kernels=kernels)
    assert wide.route.prefill_amx is kernels.has_amx()
    assert narrow.route.prefill_amx is False


@pytest.mark.parametrize("dtype,window,takes_it", [(torch.bfloat16, None, True),
                                                   (torch.float32, None, False),
                                                   (torch.bfloat16, 8, False)])
def test_cpu_backend_sends_bfloat16_chunks_to_the_prefill_kernel(kernels, dtype, window,
                                                                 takes_it):
    backend = create_backend("cpu", AttentionShape(4, 2, 16, window, dtype=dtype),
                             torch.device("cpu"), kernels=kernels)
    assert backend.route.prefill_kernel is takes_it
    # a fresh prompt of 40 tokens, a decode at position 20, a 5-token chunk after 30 cached
    layout = StepLayout(query_starts=np.array([0, 40, 41]), query_lens=np.array([40, 1, 5]),
                        num_computed=np.array([0, 20, 30]),
                        block_table=np.array([[1, 2, 3], [4, 5, 0], [6, 7, 8]], dtype=np.int32),
                        slot_mapping=np.concatenate([np.arange(16, 56), [84], np.arange(126, 131)]),
                        num_cache_blocks=9, block_size=16)
    meta = backend.build_metadata(layout)
    if takes_it:
        assert meta.prefill_rows.query_lens.tolist() == [40, 5]
        assert meta.paged_rows.query_lens.tolist() == [1]
    else:
        assert meta.prefill_rows is None
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(46, h, 16, generator=gen).to(dtype) for h in (4, 2, 2))
    cache = torch.randn(2, 2, 9, 16, 16, generator=gen).to(dtype)
    out = backend.forward(q, k, v, cache, meta, 0.25)
    expected = torch.full_like(q, UNTOUCHED)
    paged_attention_reference(
        expected, q, cache, torch.tensor([[1, 2, 3], [4, 5, 0], [6, 7, 8]], **AS_INT),
        torch.tensor([0, 40, 41], **AS_INT), torch.tensor([40, 1, 5], **AS_INT),
        torch.tensor([40, 21, 35], **AS_INT), 0.25, window or 0)
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=2e-2)
