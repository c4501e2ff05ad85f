"""benchmarks.quant.make_vs_vllm_quant_checkpoints writes AWQ's GEMM packing as GPTQModel
does, and carpool reads back the integers it quantized."""

from pathlib import Path

import torch
from safetensors import safe_open

from benchmarks.quant.make_vs_vllm_quant_checkpoints import pack_awq, quantize_awq
from carpool.models.quant.hf_config import HfScheme
from carpool.models.quant.hf_formats import to_quantized
from carpool.models.quant.weight import unpack_int4

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "hf_quant" / "awq-gemm-g128"
AWQ = HfScheme("awq", "awq", 4, 128, symmetric=False)


def test_packing_equals_gptqmodels_words():
    """Every linear's integers as carpool reads them, packed again, give GPTQModel's own
    qweight bit for bit (its AWQ GEMM writer is the reference for the nibble order)."""
    with safe_open(str(FIXTURE / "model.safetensors"), framework="pt") as f:
        prefixes = sorted({k.rpartition(".")[0] for k in f.keys() if k.endswith(".qweight")})
        assert prefixes
        for prefix in prefixes:
            t = {s: f.get_tensor(f"{prefix}.{s}") for s in ("qweight", "qzeros", "scales")}
            q = unpack_int4(to_quantized(AWQ, t).qweight)  # [N, K], 0..15
            assert torch.equal(pack_awq(q.T), t["qweight"]), prefix


def test_round_to_nearest_round_trips_through_carpools_reader():
    torch.manual_seed(0)
    w = torch.randn(64, 256) * 0.05
    tensors = quantize_awq(w, 128)
    assert tensors["qweight"].dtype == torch.int32 and tensors["qweight"].shape == (256, 8)
    assert tensors["qzeros"].shape == (2, 8) and tensors["scales"].shape == (2, 64)
    back = to_quantized(AWQ, tensors).dequantize()
    step = tensors["scales"].float().T.repeat_interleave(128, dim=1)  # [N, K]
    assert ((back - w).abs() <= step / 2 + 1e-6).all()
