"""oneDNN-packed float32 linears compute what nn.Linear does, and replace every one of them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from carpool.platform.cpu_linear import (MAX_ROWS, ROW_BUCKETS, PackedLinear, can_pack, pack_linears,
                                       padded_rows)

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


def test_row_counts_reach_onednn_as_a_few_buckets_only():
    for rows in range(1, MAX_ROWS + 1):
        padded = padded_rows(rows)
        assert padded in ROW_BUCKETS and rows <= padded
        assert padded < 2 * rows if rows <= 8 else padded - rows < (8 if rows <= 128 else 16)
    assert len(ROW_BUCKETS) == 43


def test_pack_linears_replaces_every_float32_linear_only():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)))
    assert can_pack(model)
    assert pack_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
    assert not can_pack(nn.Linear(8, 8).to(torch.float16))


def _runner_linears(checkpoint, **kwargs):
    from carpool.runner.model_runner import ModelRunner

    runner = ModelRunner(checkpoint, dtype="float32", device="cpu", num_kv_blocks=8,
                         max_model_len=64, max_num_batched_tokens=64, max_num_seqs=2, **kwargs)
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
    assert config.cpu_packed_linears is False and config.cpu_malloc_tuning is False
    default = EngineConfig.from_cli_args(parser.parse_args([]))
    assert default.cpu_packed_linears is True and default.cpu_malloc_tuning is True
