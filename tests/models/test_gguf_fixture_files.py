"""The committed GGUF fixtures are the files llama.cpp's tools wrote, and hold what they claim.

tests/fixtures/gguf/ holds files made by llama.cpp's converter and quantizer
(`python3 -m benchmarks.quant.make_gguf_fixtures`, see the README there); these
tests read them with the gguf package only, so they hold without llama.cpp.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gguf"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
BY_NAME = {r["file"]: r for r in MANIFEST}
BUILTIN_Q4_K_M = "carpool-default-Q4_K_M.gguf"


def _reader(name: str):
    return gguf.GGUFReader(str(FIXTURES / name))


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_file_is_the_one_the_manifest_records(name):
    data = (FIXTURES / name).read_bytes()
    assert len(data) == BY_NAME[name]["bytes"]
    assert hashlib.sha256(data).hexdigest() == BY_NAME[name]["sha256"]


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_q4_k_m_files_hold_k_quants(name):
    types = {t.name: t.tensor_type.name for t in _reader(name).tensors}
    assert types == BY_NAME[name]["types"]
    assert "Q4_K" in types.values() and "Q6_K" in types.values()
    assert all(v == "F32" for k, v in types.items() if k.endswith("norm.weight"))


def test_every_architecture_has_a_fixture():
    sources = {r["hf_dir"] for r in MANIFEST}
    assert {"tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"} <= sources
    archs = {r["metadata"]["general.architecture"] for r in MANIFEST}
    assert archs == {"llama", "qwen2", "qwen3"}  # llama.cpp writes Mistral as llama


def test_builtin_vocabulary_is_the_builtin_tokenizers():
    from tokenizers import Tokenizer

    from carpool.default_model_path import DEFAULT_MODEL_DIR

    reader = _reader(BUILTIN_Q4_K_M)
    tokens = reader.get_field("tokenizer.ggml.tokens").contents()
    vocab = Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json")).get_vocab()
    assert tokens == [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert reader.get_field("tokenizer.ggml.pre").contents() == "gpt-2"


def _unpermute_rotary_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k row order for the llama architecture.

    Its converter stores, per head, the rotary pairs interleaved (row 2i, 2i+1 = HF rows
    i, i + head_dim/2); this puts the halves back.
    """
    rows, cols = w.shape
    head_dim = rows // n_head
    return w.reshape(n_head, head_dim // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def test_builtin_q4_k_m_dequantizes_to_the_builtin_weights():
    from safetensors.numpy import load_file

    from carpool.default_model_path import DEFAULT_MODEL_DIR

    hf = load_file(str(DEFAULT_MODEL_DIR / "model.safetensors"))
    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}
    per_layer = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                 "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                 "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
                 "ffn_norm": "post_attention_layernorm"}
    tensors = _reader(BUILTIN_Q4_K_M).tensors
    assert len(tensors) == len(hf)  # tied embeddings: no output.weight on either side
    for t in tensors:
        base, _ = t.name.rsplit(".", 1)
        if base.startswith("blk."):
            _, layer, part = base.split(".")
            hf_name = f"model.layers.{layer}.{per_layer[part]}.weight"
        else:
            hf_name = f"{names[base]}.weight"
        got = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        want = hf[hf_name].reshape(got.shape)
        if base.endswith("attn_q"):
            got = _unpermute_rotary_rows(got, config["num_attention_heads"])
        elif base.endswith("attn_k"):
            got = _unpermute_rotary_rows(got, config["num_key_value_heads"])
        rel = np.linalg.norm(got - want) / np.linalg.norm(want)
        limit = {"F32": 0.0, "F16": 1e-3}.get(t.tensor_type.name, 0.1)
        assert rel <= limit, f"{t.name} ({t.tensor_type.name}): relative error {rel:.4f}"
