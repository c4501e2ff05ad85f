"""Build the decoder from a Hugging Face quantized checkpoint (AWQ, GPTQ, compressed-tensors:
`hf_formats`): each linear whose tensors are quantized becomes a `QuantLinear` of its
canonical parts, every other tensor fills its float parameter as in a float checkpoint.

As for GGUF files, the network is built on the meta device and materialised empty; quantized
linears are replaced whole (a stacked q/k/v or gate/up with one part per checkpoint linear),
so no float copy of a quantized matrix is ever made.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from pathlib import Path

import torch
from torch import nn

from carpool.distributed import SINGLE, TensorParallelGroup
from carpool.models.config import ModelConfig
from carpool.models.llama import LlamaForCausalLM, StackedLinear
from carpool.models.quant.float_params import fill_float_parameters
from carpool.models.quant.hf_config import HfScheme
from carpool.models.quant.hf_formats import to_quantized
from carpool.models.quant.linear import PrepareLinear, QuantLinear

logger = logging.getLogger(__name__)
# Checkpoint tensors that are derived, not learned (older Llama exports carry them).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class Tensors:
    """Every tensor of a checkpoint's safetensors files by name, read on demand."""

    def __init__(self, files: list[Path], stack: ExitStack) -> None:
        from safetensors import safe_open

        self.where = {}
        for file in files:
            handle = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            for name in handle.keys():
                self.where[name] = handle
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> torch.Tensor:
        self.used.add(name)
        return self.where[name].get_tensor(name)


def load_hf_quantized_model(path: Path, files: list[Path], config: ModelConfig,
                            scheme: HfScheme, dtype: torch.dtype, device: torch.device,
                            tp: TensorParallelGroup = SINGLE,
                            prepare_linear: PrepareLinear | None = None) -> LlamaForCausalLM:
    """The network of the quantized checkpoint `path` on `device` (CPU) in `dtype`; each
    quantized linear goes to `prepare_linear` as soon as it is read."""
    if tp.is_parallel:
        raise ValueError(f"tensor_parallel_size > 1 is not supported with a quantized "
                         f"checkpoint ({scheme.method}) yet (quantized weights are not "
                         f"sharded); run with --tensor-parallel-size 1")
    if device.type != "cpu":
        raise ValueError(f"quantized checkpoints ({scheme.method}) run on the CPU only for "
                         f"now (device {device})")
    with torch.device("meta"):
        model = LlamaForCausalLM(config, tp).to(dtype)
    with ExitStack() as stack, torch.no_grad():
        tensors = Tensors(files, stack)
        # the quantized linears replace their meta linears before anything is allocated
        count = _quantize_linears(model, tensors, scheme, dtype, prepare_linear)
        if not count:
            raise ValueError(f"{path} declares {scheme.method} quantization but holds no "
                             f"quantized linear ({scheme.marker} tensors)")
        model = model.to_empty(device=device)
        model.model.rotary_emb.reset()
        _fill_floats(model, tensors, config, path)
    model.eval()
    model.quantization = f"{scheme.describe()} ({count} linears)"
    logger.info("%s: %s", Path(path).name, model.quantization)
    return model


def _quantize_linears(model: LlamaForCausalLM, tensors: Tensors, scheme: HfScheme,
                      dtype: torch.dtype, prepare_linear: PrepareLinear | None) -> int:
    """Replace every linear whose checkpoint linears are quantized; returns how many."""
    def part(prefix: str):
        found = {s: tensors.get(f"{prefix}.{s}") for s in scheme.suffixes
                 if tensors.has(f"{prefix}.{s}")}
        try:
            return to_quantized(scheme, found)
        except (KeyError, ValueError, RuntimeError) as exc:
            raise ValueError(f"quantized linear {prefix!r} ({scheme.describe()}): "
                             f"{type(exc).__name__} {exc}") from None

    def bias(prefixes: list[str]) -> torch.Tensor | None:
        names = [f"{p}.bias" for p in prefixes]
        if not tensors.has(names[0]):
            return None
        return torch.cat([tensors.get(n) for n in names]).to(dtype)

    count = 0
    for module_name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        parent = module_name.rpartition(".")[0]
        if isinstance(module, StackedLinear):
            prefixes = [f"{parent}.{name}" for name, _ in module.parts]
        else:
            prefixes = [module_name]
        quantized = [tensors.has(f"{p}.{scheme.marker}") for p in prefixes]
        if not any(quantized):
            continue
        if not all(quantized):
            raise ValueError(f"{module_name} stacks {prefixes}, of which only some are "
                             f"quantized")
        linear = QuantLinear([part(p) for p in prefixes], bias(prefixes))
        model.set_submodule(module_name, linear)
        if prepare_linear is not None:
            prepare_linear(linear)
        count += 1
    return count


def _fill_floats(model: LlamaForCausalLM, tensors: Tensors, config: ModelConfig,
                 path: Path) -> None:
    """Fill every remaining parameter from the checkpoint's float tensors; any tensor left
    unread is an error naming it."""
    def read(name: str):
        if not tensors.has(name):
            raise ValueError(f"checkpoint {path} lacks tensor {name!r}")
        return tensors.get(name)
    fill_float_parameters(model, config, read)
    tied_head = "lm_head.weight" if config.tie_word_embeddings else None
    unread = sorted(n for n in tensors.where if n not in tensors.used and n != tied_head
                    and not n.endswith(_IGNORED_SUFFIXES))
    if unread:
        raise ValueError(f"unexpected tensor(s) {unread[:5]}{' ...' if len(unread) > 5 else ''}"
                         f" in {path} for {config.architecture}")

