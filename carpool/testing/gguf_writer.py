"""Write a Hugging Face checkpoint folder as a GGUF file with the `gguf` package, for tests.

The files follow what llama.cpp's converter writes for these architectures (its metadata keys,
tensor names from `gguf`'s own name map, the q/k row order of `llama` models, a byte-level BPE
tokenizer with its merges and chat template), in the types the `gguf` package can quantize
itself (F32, F16, BF16, Q8_0, Q5_0, Q4_0). A mixture of experts is written as the converter
writes it: each layer's experts stacked into one tensor per part (`blk.N.ffn_gate_exps` ...,
[n_expert, rows, cols]), the router `ffn_gate_inp` always F32, and the expert counts and sizes
in the metadata. Files made by llama.cpp's own converter and quantizer, K-quants
included, are committed under tests/fixtures/gguf with the script that made them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
        "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
        "MixtralForCausalLM": "llama", "Qwen2MoeForCausalLM": "qwen2moe",
        "Qwen3MoeForCausalLM": "qwen3moe"}
# One expert's matrix in a checkpoint (Qwen's and Mixtral's spellings) -> its stacked part.
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_EXPERT_PARTS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                 "down_proj": "down", "w2": "down"}


def write_gguf(model_dir: str | Path, out_file: str | Path, qtype: str = "Q8_0") -> Path:
    """`model_dir` (config.json, model.safetensors, tokenizer.json) -> GGUF file `out_file`
    with every matrix in `qtype` (one whose row length the block does not divide: F16) and
    every vector in F32."""
    import gguf
    from safetensors.torch import load_file

    model_dir, out_file = Path(model_dir), Path(out_file)
    config = json.loads((model_dir / "config.json").read_text())
    arch = ARCH[config["architectures"][0]]
    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // heads
    writer = gguf.GGUFWriter(str(out_file), arch)
    writer.add_name(model_dir.name)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    _add_tokenizer(writer, model_dir, config)
    num_experts = config.get("num_experts") or config.get("num_local_experts")
    if num_experts:
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if "moe_intermediate_size" in config:
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(
                config["shared_expert_intermediate_size"])

    names = gguf.get_tensor_name_map(arch_enum, config["num_hidden_layers"])
    qt = gguf.GGMLQuantizationType[qtype]
    tensors = load_file(str(model_dir / "model.safetensors"))
    experts: dict[str, dict[int, np.ndarray]] = {}
    for hf_name, value in tensors.items():
        if hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        data = value.float().numpy()
        expert = _EXPERT.match(hf_name)
        if expert is not None:
            layer, index, part = expert.groups()
            experts.setdefault(f"blk.{layer}.ffn_{_EXPERT_PARTS[part]}_exps.weight",
                               {})[int(index)] = data
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            data = _permute(data, heads if ".q_proj." in hf_name else kv_heads)
        router = name.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight"))
        _add(writer, name, data, gguf.GGMLQuantizationType.F32 if router else qt)
    for name, stack in experts.items():
        _add(writer, name, np.stack([stack[e] for e in range(num_experts)]), qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_file


def _add(writer, name: str, data: np.ndarray, qt) -> None:
    """A tensor in type `qt`; a vector in F32, and a matrix whose row length the block does
    not divide in F16, as the converter does."""
    import gguf

    block = gguf.GGML_QUANT_SIZES[qt][0]
    kinds = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
             gguf.GGMLQuantizationType.BF16)
    if data.ndim == 1 or qt == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType.F32)
    elif qt == gguf.GGMLQuantizationType.F16 or (qt not in kinds and data.shape[-1] % block):
        writer.add_tensor(name, data.astype(np.float16), raw_dtype=gguf.GGMLQuantizationType.F16)
    else:
        writer.add_tensor(name, gguf.quants.quantize(data, qt), raw_dtype=qt)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order: the rotary halves of each head interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def _add_tokenizer(writer, model_dir: Path, config: dict) -> None:
    """The byte-level BPE tokenizer as llama.cpp's "gpt2" tokenizer model."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {t["id"]: t["content"] for t in tok.get("added_tokens", [])}
    for idx, content in special.items():
        vocab[content] = idx
    size = config["vocab_size"]
    by_id = {i: t for t, i in vocab.items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(size)]
    types = [3 if i in special else (5 if i not in by_id else 1) for i in range(size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, add in (("bos_token_id", writer.add_bos_token_id),
                     ("eos_token_id", writer.add_eos_token_id)):
        value = config.get(key)
        if isinstance(value, list):
            value = value[0]
        if value is not None:
            add(int(value))
    template = model_dir / "chat_template.jinja"
    tok_config = model_dir / "tokenizer_config.json"
    text = template.read_text() if template.is_file() else json.loads(
        tok_config.read_text()).get("chat_template") if tok_config.is_file() else None
    if text:
        writer.add_chat_template(text)
