"""A mixture of experts served from a GGUF file gives Hugging Face's greedy tokens.

The files are written as llama.cpp's converter writes them (`testing.gguf_writer`: experts
stacked per layer, `blk.N.ffn_{gate,up,down}_exps` [n_expert, rows, cols], the router in F32;
its tensors and expert metadata were checked byte for byte against `convert_hf_to_gguf.py`'s
files of the same checkpoints, docs/lab/56). transformers' own GGUF reader cannot be the
reference here (it loads a qwen3moe file with the default expert size, and a Mixtral file as a
dense Llama), so the reference is transformers on the checkpoint the file was made from,
written in the file's float type so both hold the same values, run in float32.
"""

from __future__ import annotations

import json
import shutil

import pytest

from carpool import LLM, SamplingParams
from carpool.testing.gguf_writer import write_gguf
from tests.engine.conftest import SEPARATED
from tests.engine.test_hf_equivalence import workload

# Every layer sparse: llama.cpp's qwen2moe / qwen3moe graphs have no dense layers among them.
ARCHS = {"qwen3_moe": dict(mlp_only_layers=[]), "mixtral": {},
         "qwen2_moe": dict(decoder_sparse_step=1)}
TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
UNSUPPORTED = "MXFP4"
BACKENDS = {"cpu": {}, "cpu-pytorch": dict(cpu_kernels=False)}
SETTINGS = {"default": dict(num_kv_blocks=256),
            "chunked_preemption": dict(num_kv_blocks=96, block_size=4,
                                       max_num_batched_tokens=32)}


@pytest.fixture(scope="module")
def moe_gguf(make_checkpoint, tmp_path_factory):
    """moe_gguf(arch, qtype) -> (checkpoint folder in the type's dtype, its GGUF file)."""
    cache = {}

    def make(arch: str, qtype: str):
        if (arch, qtype) not in cache:
            checkpoint = make_checkpoint(arch, dtype=TYPES.get(qtype, "float32"), **SEPARATED,
                                         **ARCHS[arch])
            out = tmp_path_factory.mktemp(f"moe_gguf_{arch}") / f"{arch}-{qtype}.gguf"
            cache[arch, qtype] = checkpoint, write_gguf(checkpoint, out, qtype)
        return cache[arch, qtype]
    return make


@pytest.fixture(scope="module")
def hf_greedy_of():
    """hf_greedy_of(checkpoint, prompt_ids, n) -> transformers' greedy tokens in float32."""
    import torch
    from transformers import AutoModelForCausalLM

    models = {}

    def generate(checkpoint, prompt_ids, max_new_tokens):
        if checkpoint not in models:
            models[checkpoint] = AutoModelForCausalLM.from_pretrained(
                str(checkpoint), dtype=torch.float32).eval()
        ids = torch.tensor([prompt_ids])
        with torch.no_grad():
            out = models[checkpoint].generate(ids, attention_mask=torch.ones_like(ids),
                                              do_sample=False, max_new_tokens=max_new_tokens)
        return out[0, len(prompt_ids):].tolist()
    return generate


CASES = ([(arch, qtype, "cpu", "default") for arch in ARCHS for qtype in TYPES]
         + [(arch, "BF16", "cpu-pytorch", "default") for arch in ARCHS]
         + [(arch, "F16", "cpu", "chunked_preemption") for arch in ARCHS])


@pytest.mark.parametrize(("arch", "qtype", "backend", "setting"), CASES)
def test_moe_gguf_greedy_matches_transformers(arch, qtype, backend, setting, moe_gguf,
                                              hf_greedy_of):
    checkpoint, file = moe_gguf(arch, qtype)
    prompts = workload()
    references = [hf_greedy_of(checkpoint, ids, n) for ids, n in prompts]
    with LLM(str(file), dtype="float32", **BACKENDS[backend], **SETTINGS[setting]) as llm:
        model = llm.engine.runner.model
        assert model.config.moe is not None and model.quantization.startswith("gguf")
        assert model.config.architecture == {"qwen3_moe": "Qwen3MoeForCausalLM",
                                             "mixtral": "MixtralForCausalLM",
                                             "qwen2_moe": "Qwen2MoeForCausalLM"}[arch]
        assert llm.engine.runner.platform.route.moe is not None
        outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in prompts],
                            [SamplingParams(max_tokens=n, temperature=0) for _, n in prompts],
                            use_tqdm=False)
        for (ids, _), ref, out in zip(prompts, references, outs):
            assert list(out.outputs[0].token_ids) == ref, (
                f"{arch} {qtype} {backend} {setting}: prompt of {len(ids)} tokens")
        stats = llm.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
        assert (stats.num_preemptions > 0) == (setting == "chunked_preemption")


def test_moe_gguf_config_matches_checkpoint(moe_gguf):
    """The expert counts and sizes read from the metadata are the checkpoint's config.json's
    (norm_topk_prob as llama.cpp runs each architecture: renormalised for qwen3moe and
    Mixtral, not for qwen2moe, as the checkpoints say too)."""
    from carpool.models.config import load_model_config

    for arch in ARCHS:
        checkpoint, file = moe_gguf(arch, "F32")
        assert load_model_config(file).moe == load_model_config(checkpoint).moe, arch


def test_quantized_experts_greedy_matches_transformers_on_the_same_values(moe_gguf, tmp_path):
    """Q8_0 and Q4_0 experts (every matrix but the router quantized, as the converter writes
    them) stay quantized, one quantized linear per expert (with the kernels all of a layer's
    in one `quant_moe_experts` call, which the layer stack makes itself), and give the greedy
    tokens of transformers on the checkpoint whose matrices are replaced by the `gguf`
    package's own dequantization of the same blocks."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    from carpool.models.quant.experts import QuantExperts
    from carpool.platform.cpu_moe import KernelQuantExperts

    prompts = workload()[:4]
    for arch, qtype in (("qwen3_moe", "Q8_0"), ("mixtral", "Q4_0")):
        checkpoint, _ = moe_gguf(arch, "F32")
        file = write_gguf(checkpoint, tmp_path / f"{arch}-{qtype}.gguf", qtype)
        kind = gguf.GGMLQuantizationType[qtype]
        hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
        with torch.no_grad():
            for name, param in hf.named_parameters():
                if param.ndim >= 2 and not name.endswith((".gate.weight",
                                                          "shared_expert_gate.weight")):
                    blocks = gguf.quants.quantize(param.numpy(), kind)
                    param.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, kind)))
        references = []
        for ids, n in prompts:
            x = torch.tensor([ids])
            with torch.no_grad():
                out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                  max_new_tokens=n)
            references.append(out[0, len(ids):].tolist())
        for backend in BACKENDS:
            with LLM(str(file), dtype="float32", num_kv_blocks=256, **BACKENDS[backend]) as llm:
                experts = [m for m in llm.engine.runner.model.modules()
                           if isinstance(m, QuantExperts)]
                assert experts and all(e.kinds() == [qtype] for e in experts)
                fused = [m for m in llm.engine.runner.model.modules()
                         if isinstance(m, KernelQuantExperts)]
                assert len(fused) == (len(experts) if backend == "cpu" else 0)
                # the C++ layer stack runs these layers too, their experts by the same call
                route = llm.engine.runner.platform.route
                stack = llm.engine.runner.model.layer_stack
                assert (stack is not None) == (backend == "cpu" and route.layer_stack)
                outs = llm.generate(
                    [{"prompt_token_ids": ids} for ids, _ in prompts],
                    [SamplingParams(max_tokens=n, temperature=0) for _, n in prompts],
                    use_tqdm=False)
                for (ids, _), ref, out in zip(prompts, references, outs):
                    assert list(out.outputs[0].token_ids) == ref, (
                        f"{arch} {qtype} {backend}: prompt of {len(ids)} tokens")


def test_unsupported_type_is_refused_naming_the_tensor(moe_gguf, tmp_path):
    """A file in a type carpool has no conversion for (MXFP4, which the `gguf` package
    writes): the error names the first such tensor and the type."""
    checkpoint, _ = moe_gguf("qwen3_moe", "F32")
    file = write_gguf(checkpoint, tmp_path / "tq.gguf", UNSUPPORTED)
    with pytest.raises(ValueError, match=rf"tensor 'blk\.0\.[a-z_]+\.weight' in .*{UNSUPPORTED}"):
        LLM(str(file), dtype="float32", num_kv_blocks=64)


def test_quantized_hf_moe_checkpoint_is_refused(moe_gguf, tmp_path):
    """An AWQ (or GPTQ, compressed-tensors) mixture of experts is refused naming the scheme."""
    checkpoint, _ = moe_gguf("qwen3_moe", "F32")
    folder = tmp_path / "awq-moe"
    shutil.copytree(checkpoint, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32,
                                     "zero_point": True, "version": "gemm"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="awq checkpoints of a mixture-of-experts model"):
        LLM(str(folder), dtype="float32", num_kv_blocks=64)
