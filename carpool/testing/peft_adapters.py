"""Random LoRA adapters written by the `peft` package itself, and its greedy outputs: the
reference carpool's adapters are compared with (tests/lora, benchmarks/lora_bench.py)."""

from __future__ import annotations

import os
from pathlib import Path

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_adapter(base_dir: str | os.PathLike, out_dir: str | os.PathLike, *, seed: int = 0,
                  rank: int = 8, alpha: float = 16, target_modules=("q_proj", "v_proj"),
                  use_rslora: bool = False, dtype: str = "float32", **lora_args) -> Path:
    """Save a PEFT LoRA adapter of the model in `base_dir` with random non-zero A and B
    (`init_lora_weights=False`, seeded); returns its folder."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=getattr(torch, dtype))
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules),
                        use_rslora=use_rslora, init_lora_weights=False, lora_dropout=0.0,
                        task_type="CAUSAL_LM", **lora_args)
    torch.manual_seed(seed)
    # (PEFT widens adapter weights to float32 unless asked not to: keep the given dtype)
    model = get_peft_model(base, config, autocast_adapter_dtype=False)
    with torch.no_grad():  # B at A's scale, so that the adapter changes the greedy tokens
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.5)
    out = Path(out_dir)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


class PeftGreedy:
    """Greedy tokens of the base model with an adapter applied by PEFT, float32, one prompt
    at a time (transformers' `generate`); models and answers cached."""

    def __init__(self, base_dir: str | os.PathLike) -> None:
        self.base_dir = str(base_dir)
        self._models: dict[str | None, object] = {}
        self._cache: dict[tuple, list[int]] = {}

    def __call__(self, adapter_dir: str | os.PathLike | None, prompt_ids: list[int],
                 max_new_tokens: int) -> list[int]:
        import torch

        key = (None if adapter_dir is None else str(adapter_dir), tuple(prompt_ids),
               max_new_tokens)
        if key not in self._cache:
            model = self._model(key[0])
            input_ids = torch.tensor([prompt_ids])
            with torch.no_grad():
                out = model.generate(input_ids=input_ids,
                                     attention_mask=torch.ones_like(input_ids),
                                     do_sample=False, max_new_tokens=max_new_tokens)
            self._cache[key] = out[0, len(prompt_ids):].tolist()
        return self._cache[key]

    def _model(self, adapter_dir: str | None):
        import torch
        from transformers import AutoModelForCausalLM

        if adapter_dir not in self._models:
            model = AutoModelForCausalLM.from_pretrained(self.base_dir, dtype=torch.float32)
            if adapter_dir is not None:
                from peft import PeftModel
                model = PeftModel.from_pretrained(model, adapter_dir)
            self._models[adapter_dir] = model.eval()
        return self._models[adapter_dir]
