"""A GGUF file as carpool reads it: the network's hyper-parameters from its metadata, and its
tensors under Hugging Face's names, quantized blocks converted (`gguf_blocks`), never
dequantized.

The `gguf` package (llama.cpp's own reader) memory-maps the file and parses it; its name map
gives the Hugging Face name of each tensor. llama.cpp's converter reorders the rows of the
query and key projections of `llama` models (for its interleaved RoPE); `tensor` puts them
back in Hugging Face's order, as transformers does when it loads a GGUF file. Rows are
independent in every block type, so that is a row gather on the integers.
"""

from __future__ import annotations

import mmap
import re
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, Keys, get_tensor_name_map
from gguf.constants import MODEL_ARCH_NAMES

from carpool.models.config import ModelConfig, RopeConfig
from carpool.models.moe_config import MoeConfig
from carpool.models.quant.gguf_blocks import FLOAT_TYPES

# GGUF's general.architecture -> the architecture carpool runs it as. Mistral's converter
# writes "llama", and so does Mixtral's: a "llama" file with experts is Mixtral.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM",
                 "qwen3moe": "Qwen3MoeForCausalLM"}
_MOE_ARCHITECTURES = {"llama": "MixtralForCausalLM"}
# llama.cpp renormalises the top-k router weights of these (`build_moe_ffn`'s norm_w), and
# the file has no key for it: the file runs as llama.cpp runs it.
_NORM_TOPK = {"llama": True, "qwen3moe": True, "qwen2moe": False}
# One expert's matrix by its Hugging Face name (Qwen's and Mixtral's spellings); the converter
# stacks a layer's experts into one tensor [n_expert, rows, cols] per part.
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_EXPERT_PARTS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                 "down_proj": "down", "w2": "down"}
_PERMUTED_ARCHS = ("llama",)  # q/k rows reordered by the converter
_ROPE_TYPES = {"none": "default", "linear": "linear", "yarn": "yarn"}


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


class GgufFile:
    """One GGUF file: `arch`, `model_config()`, `tensor(hf_name)`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.reader = GGUFReader(self.path, "r")
        except Exception as exc:  # not a GGUF file, truncated, unknown version
            raise ValueError(f"{self.path} is not a readable GGUF file: {exc}") from exc
        self.arch = self.field(Keys.General.ARCHITECTURE)
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"GGUF architecture {self.arch!r} in {self.path.name} is not "
                             f"supported (supported: {', '.join(ARCHITECTURES)})")
        self.tensors = {t.name: t for t in self.reader.tensors}
        # The reader parses every metadata array into one object per element: the
        # vocabulary's tokens, merges and scores take ~150 MiB for a 49k vocabulary. The
        # tokenizer is read from the file by its own loader, so only scalars are kept here.
        for key in [key for key, f in self.reader.fields.items()
                    if f.types and f.types[0] == GGUFValueType.ARRAY]:
            del self.reader.fields[key]
        arch_enum = next(a for a, name in MODEL_ARCH_NAMES.items() if name == self.arch)
        self._names = get_tensor_name_map(arch_enum, self.field(Keys.LLM.BLOCK_COUNT))

    def field(self, key: str, default=KeyError):
        """A metadata value by key ("{arch}" filled in); `default` when absent (else KeyError
        naming the key)."""
        key = key.format(arch=getattr(self, "arch", ""))
        field = self.reader.get_field(key)
        if field is None:
            if default is KeyError:
                raise ValueError(f"GGUF file {self.path.name} lacks metadata {key!r}")
            return default
        return field.contents()

    def gguf_name(self, hf_name: str) -> str | None:
        """The file's name for a Hugging Face tensor name (None: the map has none); one
        expert's matrix is named by its layer's stacked tensor."""
        expert = _EXPERT.match(hf_name)
        if expert is not None:
            layer, _, part = expert.groups()
            return f"blk.{layer}.ffn_{_EXPERT_PARTS[part]}_exps.weight"
        return self._names.get_name(hf_name, try_suffixes=(".weight", ".bias"))

    def has(self, hf_name: str) -> bool:
        name = self.gguf_name(hf_name)
        return name is not None and name in self.tensors

    def _info(self, hf_name: str):
        name = self.gguf_name(hf_name)
        if name is None or name not in self.tensors:
            raise ValueError(f"GGUF file {self.path.name} lacks tensor {name or hf_name!r} "
                             f"({hf_name})")
        return self.tensors[name]

    def tensor(self, hf_name: str) -> tuple[np.ndarray, GGMLQuantizationType]:
        """(data, type) of a tensor by its Hugging Face name: rows first (a matrix is [N,
        bytes per row] for block types, [N, K] for float ones), in Hugging Face's row order."""
        t = self._info(hf_name)
        data, qtype = t.data, GGMLQuantizationType(t.tensor_type)
        expert = _EXPERT.match(hf_name)
        if expert is not None:  # one expert of the stacked tensor (a view: nothing read yet)
            index = int(expert.group(2))
            if data.ndim != 3 or index >= data.shape[0]:
                raise ValueError(f"tensor {t.name!r} in {self.path.name} has shape "
                                 f"{tuple(data.shape)}, which holds no expert {index}")
            data = data[index]
        elif hf_name.endswith("shared_expert_gate.weight") and data.ndim == 1:
            data = data[None]  # llama.cpp stores Qwen2-MoE's one-logit gate as a vector
        if self.arch in _PERMUTED_ARCHS and hf_name.endswith(("q_proj.weight", "k_proj.weight",
                                                              "q_proj.bias", "k_proj.bias")):
            heads = self.field("{arch}.attention.head_count")
            if "k_proj" in hf_name:
                heads = self.field("{arch}.attention.head_count_kv", heads)
            data = data[_unpermute_rows(data.shape[0], heads)]
        return data, qtype

    def release_pages(self) -> None:
        """Drop the file's pages read so far from this process's resident memory. They stay in
        the page cache and fault back in if read again; without this, every page a load read
        counts in the process's RSS beside the weights made from it until the file closes."""
        mapping = getattr(self.reader.data, "_mmap", None)
        if mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
            mapping.madvise(mmap.MADV_DONTNEED)

    def type_name(self, hf_name: str) -> str:
        return GGMLQuantizationType(self._info(hf_name).tensor_type).name

    def is_quantized(self, hf_name: str) -> bool:
        return GGMLQuantizationType(self._info(hf_name).tensor_type) not in FLOAT_TYPES

    def model_config(self) -> ModelConfig:
        """The network's hyper-parameters from the metadata and the tensors present."""
        if "rope_freqs.weight" in self.tensors:
            raise ValueError(f"GGUF file {self.path.name} carries rope_freqs.weight (llama3 "
                             f"RoPE scaling baked into factors), which is not supported")
        get = self.field
        hidden = get("{arch}.embedding_length")
        heads = get("{arch}.attention.head_count")
        vocab = self.tensors["token_embd.weight"].data.shape[0]
        eos = [get(f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot", "eom")]
        embed_type = GGMLQuantizationType(self.tensors["token_embd.weight"].tensor_type)
        dtype = {GGMLQuantizationType.F16: "float16",
                 GGMLQuantizationType.BF16: "bfloat16"}.get(embed_type, "float32")
        moe = self._moe()
        return ModelConfig(
            architecture=(ARCHITECTURES if moe is None else
                          _MOE_ARCHITECTURES).get(self.arch, ARCHITECTURES[self.arch]),
            vocab_size=vocab, hidden_size=hidden,
            intermediate_size=get("{arch}.feed_forward_length"),
            num_layers=get("{arch}.block_count"), num_heads=heads,
            num_kv_heads=get("{arch}.attention.head_count_kv", heads),
            head_dim=get("{arch}.attention.key_length", hidden // heads),
            max_position_embeddings=get("{arch}.context_length"),
            rms_norm_eps=float(get("{arch}.attention.layer_norm_rms_epsilon")),
            tie_word_embeddings="output.weight" not in self.tensors,
            dtype=dtype,
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
            bos_token_id=get("tokenizer.ggml.bos_token_id", None),
            qkv_bias="blk.0.attn_q.bias" in self.tensors,
            o_proj_bias="blk.0.attn_output.bias" in self.tensors,
            mlp_bias="blk.0.ffn_down.bias" in self.tensors,
            qk_norm="blk.0.attn_q_norm.weight" in self.tensors,
            rope=self._rope(), sliding_window=get("{arch}.attention.sliding_window", None),
            moe=moe)

    def _moe(self) -> MoeConfig | None:
        """The experts' sizes from the metadata (None: a dense model); a layer is sparse where
        the file has its router, `blk.N.ffn_gate_inp`."""
        count = self.field("{arch}.expert_count", 0)
        if not count:
            return None
        if self.arch not in _NORM_TOPK:
            raise ValueError(f"GGUF architecture {self.arch!r} with experts is not supported")
        get = self.field
        layers = get("{arch}.block_count")
        return MoeConfig(
            num_experts=count, top_k=get("{arch}.expert_used_count"),
            expert_intermediate_size=get("{arch}.expert_feed_forward_length",
                                         get("{arch}.feed_forward_length")),
            norm_topk_prob=_NORM_TOPK[self.arch],
            sparse_layers=tuple(f"blk.{i}.ffn_gate_inp.weight" in self.tensors
                                for i in range(layers)),
            shared_expert_intermediate_size=get("{arch}.expert_shared_feed_forward_length",
                                                get("{arch}.feed_forward_length"))
            if "blk.0.ffn_gate_shexp.weight" in self.tensors else 0,
            weights_in_model_dtype=self.arch != "llama")

    def _rope(self) -> RopeConfig:
        get = self.field
        theta = float(get("{arch}.rope.freq_base", 10000.0))
        kind = get("{arch}.rope.scaling.type", "none")
        if kind not in _ROPE_TYPES:
            raise ValueError(f"GGUF RoPE scaling {kind!r} is not supported "
                             f"(supported: {', '.join(_ROPE_TYPES)})")
        if kind == "none":
            return RopeConfig(rope_theta=theta)
        return RopeConfig(rope_type=_ROPE_TYPES[kind], rope_theta=theta,
                          factor=float(get("{arch}.rope.scaling.factor")),
                          original_max_position_embeddings=get(
                              "{arch}.rope.scaling.original_context_length", None))

    def weight_types(self) -> dict[str, int]:
        """How many tensors of each type the file holds, e.g. {"Q4_K": 97, "F32": 49}."""
        counts: dict[str, int] = {}
        for t in self.reader.tensors:
            name = GGMLQuantizationType(t.tensor_type).name
            counts[name] = counts.get(name, 0) + 1
        return counts


def _unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """Row i of the Hugging Face matrix is row index[i] of the converter's: within a head the
    converter interleaves the two halves of the rotary dims."""
    head_dim = rows // heads
    return np.arange(rows).reshape(heads, head_dim // 2, 2).transpose(0, 2, 1).reshape(-1)
