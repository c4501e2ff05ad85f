"""The float parameters a quantized checkpoint still holds (norms, biases, float matrices),
filled once its quantized layers are in place: one loop for every format, which only says how
to read a tensor by its Hugging Face name."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from carpool.models.config import ModelConfig
from carpool.models.llama import LlamaForCausalLM, checkpoint_targets


def fill_float_parameters(model: LlamaForCausalLM, config: ModelConfig,
                          read: Callable[[str], torch.Tensor]) -> None:
    """Fill every parameter left in `model` with `read(hf_name)` (which raises, naming the
    tensor, where the checkpoint lacks it or holds it quantized); re-ties a float LM head."""
    if config.tie_word_embeddings and isinstance(model.lm_head, nn.Linear):
        model.lm_head.weight = model.model.embed_tokens.weight
    targets = checkpoint_targets(model)
    if config.tie_word_embeddings:
        targets.pop("lm_head.weight", None)
    for name, target in targets.items():
        if target.param is None:
            continue
        source = read(name)
        dest = target.param[target.rows]
        if tuple(source.shape) != tuple(dest.shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(source.shape)}, expected "
                             f"{tuple(dest.shape)}")
        dest.copy_(source.to(dest.dtype))
