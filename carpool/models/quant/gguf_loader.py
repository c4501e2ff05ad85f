"""Build the decoder from a GGUF file: quantized matrices become `QuantLinear` /
`QuantEmbedding` modules over their canonical form, float tensors fill the parameters as a
safetensors checkpoint's do (`loader.checkpoint_targets`).

The network is built on the meta device and materialised empty, as for safetensors; each
linear whose checkpoint tensors are quantized is then replaced whole (all its stacked parts,
each in its own type), so no float copy of a quantized matrix is ever made.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from carpool.distributed import SINGLE, TensorParallelGroup
from carpool.models.config import ModelConfig
from carpool.models.llama import LlamaForCausalLM, StackedLinear
from carpool.models.loader import build_model
from carpool.models.moe import CHECKPOINT_NAMES, SparseMoeBlock
from carpool.models.quant.experts import QuantExperts
from carpool.models.quant.float_params import fill_float_parameters
from carpool.models.quant.gguf_blocks import to_float, to_quantized
from carpool.models.quant.gguf_file import GgufFile
from carpool.models.quant.linear import PrepareLinear, QuantEmbedding, QuantLinear

logger = logging.getLogger(__name__)


def load_gguf_model(path: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                    tp: TensorParallelGroup = SINGLE,
                    prepare_linear: PrepareLinear | None = None) -> LlamaForCausalLM:
    """The network of GGUF file `path` on `device` (CPU) with activations in `dtype`; each
    quantized linear goes to `prepare_linear` as soon as it is read."""
    if tp.is_parallel:
        raise ValueError("tensor_parallel_size > 1 is not supported with a GGUF file yet "
                         "(quantized weights are not sharded); run with "
                         "--tensor-parallel-size 1")
    if device.type != "cpu":
        raise ValueError(f"GGUF files run on the CPU only for now (device {device})")
    file = GgufFile(path)
    with torch.device("meta"):
        model = build_model(config, tp).to(dtype)
    with torch.no_grad():
        # the quantized modules replace their meta linears before anything is allocated, so
        # no float copy of a quantized matrix is ever made, not even an empty one
        _quantize_modules(model, file, dtype, prepare_linear)
        model = model.to_empty(device=device)
        model.model.rotary_emb.reset()
        fill_float_parameters(model, config, lambda name: _read_float(file, name))
        file.release_pages()
    model.eval()
    model.quantization = f"gguf ({describe_types(file)})"
    logger.info("GGUF %s: %s", Path(path).name, model.quantization)
    return model


def describe_types(file: GgufFile) -> str:
    """The tensor types a file holds with their counts, e.g. "Q4_K x97, Q6_K x13, F32 x49"."""
    counts = sorted(file.weight_types().items(), key=lambda kv: -kv[1])
    return ", ".join(f"{name} x{count}" for name, count in counts)


def _quantize_modules(model: LlamaForCausalLM, file: GgufFile, dtype: torch.dtype,
                      prepare_linear: PrepareLinear | None) -> None:
    """Replace every linear (and the embedding) whose file tensors are quantized, handing
    each new linear to `prepare_linear` before the next is read."""
    def put(module_name: str, linear: QuantLinear) -> None:
        _set(model, module_name, linear)
        if prepare_linear is not None:
            prepare_linear(linear)

    embed_name = "model.embed_tokens.weight"
    kept: dict[str, object] = {}  # the embedding, which a tied LM head reads again

    def part(hf_name: str):
        if hf_name in kept:
            return kept[hf_name]
        data, qtype = file.tensor(hf_name)
        try:
            converted = (to_quantized(data, qtype) if file.is_quantized(hf_name)
                         else to_float(data, qtype).to(dtype))
        except ValueError as exc:
            raise ValueError(f"tensor {file.gguf_name(hf_name)!r} in {file.path.name}: "
                             f"{exc}") from None
        file.release_pages()  # its blocks are converted: only the converted copy stays
        if hf_name == embed_name:
            kept[hf_name] = converted
        return converted

    def bias(prefix: str, names: list[str]) -> torch.Tensor | None:
        found = [f"{prefix}.{n}.bias" for n in names]
        if not file.has(found[0]):
            return None
        return torch.cat([to_float(*file.tensor(n)).to(dtype) for n in found])

    for module_name, module in list(model.named_modules()):
        if isinstance(module, SparseMoeBlock):
            experts = _quantized_experts(module_name, module, file, part, prepare_linear)
            if experts is not None:
                module.experts = experts
        if not isinstance(module, nn.Linear) or module_name == "lm_head":
            continue
        if isinstance(module, StackedLinear):
            prefix, names = module_name.rpartition(".")[0], [p for p, _ in module.parts]
        else:
            prefix, names = module_name.rpartition(".")[0], [module_name.rpartition(".")[2]]
        weights = [f"{prefix}.{n}.weight" for n in names]
        if not any(file.is_quantized(w) for w in weights):
            continue
        put(module_name, QuantLinear([part(w) for w in weights], bias(prefix, names)))
    if file.is_quantized(embed_name):
        model.model.embed_tokens = QuantEmbedding(part(embed_name), dtype)
    head = embed_name if model.config.tie_word_embeddings else "lm_head.weight"
    if file.is_quantized(head):
        put("lm_head", QuantLinear([part(head)], None))


def _quantized_experts(module_name: str, block: SparseMoeBlock, file: GgufFile, part,
                       prepare_linear: PrepareLinear | None) -> QuantExperts | None:
    """The block's experts as quantized linears, one gate/up and one down per expert, each
    read alone from its layer's stacked tensors (`part`) and handed to `prepare_linear`
    (None: float experts, which fill the stacked parameters)."""
    block_name, (gate, up, down) = CHECKPOINT_NAMES[block.style]
    prefix = f"{module_name.rpartition('.')[0]}.{block_name}.experts"
    if not any(file.is_quantized(f"{prefix}.0.{p}.weight") for p in (gate, up, down)):
        return None
    gate_ups, downs = [], []
    for e in range(block.experts.gate_up_proj.shape[0]):
        gate_ups.append(QuantLinear([part(f"{prefix}.{e}.{gate}.weight"),
                                     part(f"{prefix}.{e}.{up}.weight")], None))
        downs.append(QuantLinear([part(f"{prefix}.{e}.{down}.weight")], None))
        if prepare_linear is not None:
            prepare_linear(gate_ups[-1])
            prepare_linear(downs[-1])
    return QuantExperts(gate_ups, downs)


def _read_float(file: GgufFile, name: str):
    """A float tensor of the file by its Hugging Face name; ValueError for a quantized one.
    One expert of a stacked tensor is read alone, so no float copy of a whole layer's
    experts is made beside the parameter it fills."""
    if file.is_quantized(name):
        raise ValueError(f"tensor {file.gguf_name(name)!r} of type {file.type_name(name)} "
                         f"cannot fill {name} (a float parameter)")
    return to_float(*file.tensor(name))


def _set(model: nn.Module, dotted: str, module: nn.Module) -> None:
    parent, _, child = dotted.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
