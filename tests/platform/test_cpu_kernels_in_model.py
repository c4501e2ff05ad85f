"""The CPU platform's compiled kernels: fused RoPE gives `apply_rope`'s bits, the platform
swaps it into the model only when the kernels are on, and the switch is a flag."""

from __future__ import annotations

import pytest
import torch

from carpool.attention import cpu_kernels
from carpool.models.rope import Rotary
from carpool.platform import CpuPlatform
from carpool.platform.cpu_rotary import FusedRotary


@pytest.fixture(scope="module")
def kernels():
    module = cpu_kernels.load()
    assert module is not None, "the C++ kernels did not build"
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


def test_platform_swaps_rotary_only_with_kernels(llama_checkpoint):
    from carpool.models.config import load_model_config
    from carpool.models.loader import load_model

    def rotaries(platform):
        model = load_model(llama_checkpoint, load_model_config(llama_checkpoint),
                           torch.float32, torch.device("cpu"))
        platform.prepare_model(model)
        return {type(m) for m in model.modules() if isinstance(m, (Rotary, FusedRotary))}

    assert rotaries(CpuPlatform(kernels=True)) == {FusedRotary}
    assert rotaries(CpuPlatform(kernels=False)) == {Rotary}
    assert "C++ kernels off" in CpuPlatform(kernels=False).describe()


def test_kernels_are_a_flag_and_a_config_field():
    import argparse

    from carpool.config import EngineConfig
    from carpool.server.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert EngineConfig.from_cli_args(parser.parse_args(["--no-cpu-kernels"])).cpu_kernels is False
    assert EngineConfig.from_cli_args(parser.parse_args([])).cpu_kernels is True
