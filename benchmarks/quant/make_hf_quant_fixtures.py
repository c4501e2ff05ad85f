"""Write tests/fixtures/hf_quant: tiny GPTQ and AWQ checkpoints made by GPTQModel (the
packages that write such checkpoints), with what transformers makes of each.

GPTQModel needs torch >= 2.14.1 by its metadata, so it is not a dev dependency of carpool
(torch 2.13.0); it runs here installed with `pip install --no-deps gptqmodel optimum pypcre
logbar tokenicer device-smi defuser threadpoolctl` and GPTQMODEL_CPU_WORKERS=2. Each fixture
folder holds the tool's own output (config.json with its quantization_config,
model.safetensors, tokenizer) and reference.json: transformers' greedy tokens for fixed prompts
(`record_reference` says which two ways) and, in reference.safetensors, the float32 weights
GPTQModel's own dequantization gives for two linears of layer 0.

    GPTQMODEL_CPU_WORKERS=2 python3 -m benchmarks.quant.make_hf_quant_fixtures
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "hf_quant"
SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)
PROMPT_LENGTHS = (1, 5, 17, 40)
NEW_TOKENS = 16
REFERENCE_LINEARS = ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj")
# name -> GPTQModel QuantizeConfig arguments
FIXTURES = {
    "gptq-int4-g32-desc-act": dict(bits=4, group_size=32, desc_act=True, sym=True),
    "gptq-int8-g64-asym": dict(bits=8, group_size=64, desc_act=False, sym=False),
    "gptq-int4-g128-asym": dict(bits=4, group_size=128, desc_act=False, sym=False),
    "awq-gemm-g128": dict(bits=4, group_size=128, sym=False, method="awq"),
    "awq-gemm-g64-sym": dict(bits=4, group_size=64, sym=True, method="awq"),
}


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(512) for _ in range(n)] for n in PROMPT_LENGTHS]


def quantize(float_dir: Path, out: Path, spec: dict) -> None:
    from gptqmodel import GPTQModel, QuantizeConfig
    from gptqmodel.quantization.config import FORMAT, METHOD

    spec = dict(spec)
    if spec.pop("method", "gptq") == "awq":
        spec.update(quant_method=METHOD.AWQ, format=FORMAT.GEMM)
    rng = random.Random(0)
    calibration = [{"input_ids": [rng.randrange(512) for _ in range(64)],
                    "attention_mask": [1] * 64} for _ in range(8)]
    model = GPTQModel.load(str(float_dir), QuantizeConfig(**spec), device="cpu")
    model.quantize(calibration, batch_size=1)
    model.save(str(out))
    (out / "quant_log.csv").unlink(missing_ok=True)


def record_reference(out: Path) -> None:
    """transformers' greedy tokens for `out`, two ways, and GPTQModel's dequantized weights.

    "greedy_kernel": transformers with GPTQModel's CPU kernels as they load (they dequantize
    to float16). "greedy": transformers with every quantized linear replaced by the float32
    matrix GPTQModel's own `dequantize_weight` gives with its scales in float32 (exact: a
    16-bit scale times a small integer), the model the checkpoint's integers define; carpool
    computes with that matrix in float32, so this is the reference its tests hold it to."""
    import gptqmodel
    import transformers
    from safetensors.torch import save_file
    from torch import nn
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    kernel_class = type(model.get_submodule(REFERENCE_LINEARS[0])).__name__
    kernel = greedy(model)
    weights = {}
    for name, module in list(model.named_modules()):
        if not (hasattr(module, "qweight") and hasattr(module, "dequantize_weight")):
            continue
        module.scales = module.scales.float()
        matrix = module.dequantize_weight().T.float().contiguous()  # [K, N] -> [N, K]
        linear = nn.Linear(matrix.shape[1], matrix.shape[0], bias=module.bias is not None)
        linear.weight.data = matrix
        if module.bias is not None:
            linear.bias.data = module.bias.float()
        model.set_submodule(name, linear)
        if name in REFERENCE_LINEARS:
            weights[name] = matrix
    save_file(weights, str(out / "reference.safetensors"))
    cases = [{"prompt_token_ids": ids, "greedy": new, "greedy_kernel": k}
             for ids, new, k in zip(prompts(), greedy(model), kernel)]
    meta = {"writer": f"gptqmodel {gptqmodel.__version__}",
            "reference": f"transformers {transformers.__version__}, float32, greedy; "
                         f"quantized linears as GPTQModel {gptqmodel.__version__} dequantizes "
                         f"them in float32 (greedy), or through its {kernel_class} "
                         f"(greedy_kernel)",
            "cases": cases}
    (out / "reference.json").write_text(json.dumps(meta, indent=1) + "\n")


def greedy(model) -> list[list[int]]:
    result = []
    for ids in prompts():
        x = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=NEW_TOKENS)
        result.append(out[0, len(ids):].tolist())
    return result


def main() -> None:
    from carpool.testing.checkpoints import build_checkpoint, train_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        os.chdir(tmp)  # GPTQModel writes its logs/ into the working directory
        tokenizer = train_tokenizer(tmp / "tokenizer") and tmp / "tokenizer"
        float_dir = build_checkpoint(tmp / "float", "llama", tokenizer_dir=tokenizer, **SHAPE)
        for name, spec in FIXTURES.items():
            out = OUT / name
            shutil.rmtree(out, ignore_errors=True)
            quantize(float_dir, out, spec)
            record_reference(out)
            print(name, sum(f.stat().st_size for f in out.iterdir()), "bytes")


if __name__ == "__main__":
    main()
