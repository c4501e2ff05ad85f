"""Load a checkpoint's safetensors weights (`paths.resolve_model_path` finds the checkpoint).

Weights are read with `safetensors` only, never pickle: a single
`model.safetensors`, or shards listed in `model.safetensors.index.json`. The
network is built on the meta device (no random init of a large model), then
materialised on the target device and filled tensor by tensor, so every
parameter is accounted for: a missing or unexpected tensor raises, naming it.
Under tensor parallelism a rank reads only its shard of each tensor
(`safe_open(...).get_slice`), so no rank ever holds the whole checkpoint.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from carpool.distributed import SINGLE, TensorParallelGroup
from carpool.models.config import ModelConfig
from carpool.models.llama import LlamaForCausalLM, Target, checkpoint_targets
from carpool.models.moe import MoeForCausalLM
from carpool.models.paths import resolve_model_path as resolve_model_path  # re-exported
from carpool.models.quant.hf_config import check_quantization
from carpool.models.quant.linear import PrepareLinear
from carpool.models.registry import get_architecture_spec

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Checkpoint tensors that are derived, not learned (older Llama exports carry them).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint, single or sharded. Raises naming what is missing."""
    index = path / INDEX_FILE
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise FileNotFoundError(f"shard(s) {missing} listed in {index} not found")
        return [path / s for s in shards]
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    raise FileNotFoundError(
        f"no {SINGLE_FILE} or {INDEX_FILE} in {path} (only safetensors checkpoints are supported)")


def load_model(path: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device,
               tp: TensorParallelGroup = SINGLE,
               quantization: str | None = None,
               prepare_linear: PrepareLinear | None = None) -> LlamaForCausalLM:
    """Build this rank's shard of the network for `config` on `device` in `dtype` and fill it
    from `path`'s weights (a GGUF file: `quant.gguf_loader`; a config.json with a
    quantization_config: `quant.hf_loader`). `quantization` is --quantization (None or
    "auto": the checkpoint's own), checked against the checkpoint. `prepare_linear` gets
    each quantized linear as soon as it is read (the platform packs it then: one loaded copy
    at a time, `Platform.quant_linear_packer`)."""
    scheme = check_quantization(path, quantization)
    if config.moe is not None and scheme is not None:
        raise ValueError(f"{scheme.method} checkpoints of a mixture-of-experts model "
                         f"({config.architecture}) are not supported yet; serve its float "
                         f"checkpoint or a GGUF file")
    if path.suffix.lower() == ".gguf":
        from carpool.models.quant.gguf_loader import load_gguf_model
        return load_gguf_model(path, config, dtype, device, tp, prepare_linear)
    if scheme is not None:
        from carpool.models.quant.hf_loader import load_hf_quantized_model
        return load_hf_quantized_model(path, weight_files(path), config, scheme, dtype,
                                       device, tp, prepare_linear)
    with torch.device("meta"):
        model = build_model(config, tp).to(dtype)
    model = model.to_empty(device=device)
    with torch.no_grad():  # vocabulary padding rows stay zero (and never hold NaN)
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
    if config.tie_word_embeddings:  # to_empty re-creates parameters; tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb.reset()
    _fill_parameters(model, weight_files(path), config, device)
    model.eval()
    return model


def build_model(config: ModelConfig, tp: TensorParallelGroup = SINGLE) -> LlamaForCausalLM:
    """This rank's network for `config` (parameters uninitialised): `MoeForCausalLM` for a
    mixture of experts, else `LlamaForCausalLM`."""
    if config.moe is not None:
        return MoeForCausalLM(config, tp, get_architecture_spec(config.architecture).moe)
    return LlamaForCausalLM(config, tp)


def _fill_parameters(model: LlamaForCausalLM, files: list[Path], config: ModelConfig,
                     device: torch.device) -> None:
    from safetensors import safe_open

    params = checkpoint_targets(model)
    if config.tie_word_embeddings:
        params.pop("lm_head.weight")
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue  # some tied checkpoints store it anyway; the embedding wins
                if name not in params:
                    raise ValueError(f"unexpected tensor {name!r} in {file.name} "
                                     f"for {config.architecture}")
                _fill(params[name], f.get_slice(name), name, file.name, device)
                loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint {files[0].parent} lacks tensor(s) {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}")


def _fill(target: Target, source, name: str, file_name: str, device: torch.device) -> None:
    """Copy the target's shard of the checkpoint tensor `source` (a safetensors slice, read
    lazily) into its rows; checks the checkpoint tensor's full shape first."""
    if target.param is None:
        return
    dest = target.param[target.rows]
    shard = target.shard
    expected = list(dest.shape)
    if shard is not None:
        expected[shard.dim] = shard.full
    shape = list(source.get_shape())
    if shape != expected:
        raise ValueError(f"tensor {name!r} in {file_name} has shape {tuple(shape)}, "
                         f"expected {tuple(expected)}")
    if shard is None:
        tensor = source[:]
    else:
        dest = dest.narrow(shard.dim, 0, shard.num_loaded)
        span = slice(shard.start, shard.start + shard.num_loaded)
        tensor = source[span] if shard.dim == 0 else source[:, span]
    with torch.no_grad():
        dest.copy_(tensor.to(device=device, dtype=dest.dtype))
