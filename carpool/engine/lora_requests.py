"""The engine's side of LoRA adapters: which requests may name one, and their figures.

An adapter is checked (its config and tensor shapes against the base model, its rank
against `max_lora_rank`) the first time a request names its id, so a bad folder is a
ValueError naming it when the request is added, never a failed step; the runner reads the
weights when a step first needs them. An id keeps the name and folder it was first seen with.
"""

from __future__ import annotations

from carpool.lora.peft_adapter import check_adapter
from carpool.lora_request import LoraConfig, LoRARequest


class LoraRequests:
    def __init__(self, config: LoraConfig | None, model_config, runner) -> None:
        self.config = config
        self._model_config = model_config
        self._runner = runner
        self._checked: dict[int, LoRARequest] = {}

    def check(self, lora_request: LoRARequest | None) -> None:
        """ValueError unless the engine can run a request on this adapter."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {lora_request!r}")
        if self.config is None:
            raise ValueError(f"lora_request {lora_request.lora_name!r} needs an engine with "
                             "enable_lora")
        known = self._checked.get(lora_request.lora_int_id)
        if known is None:
            check_adapter(lora_request.lora_path, self._model_config, self.config.max_lora_rank)
            self._checked[lora_request.lora_int_id] = lora_request
        elif (known.lora_name, known.lora_path) != (lora_request.lora_name,
                                                    lora_request.lora_path):
            raise ValueError(f"lora_int_id {lora_request.lora_int_id} is adapter "
                             f"{known.lora_name!r} ({known.lora_path}), not "
                             f"{lora_request.lora_name!r} ({lora_request.lora_path})")

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (unloaded by name) and free its weights; requests already on it
        still finish (the runner reads it again if it must). False if it was unknown."""
        known = self._checked.pop(lora_int_id, None) is not None
        evicted = self.config is not None and self._runner.evict_adapter(lora_int_id)
        return known or evicted

    def stats(self, scheduler) -> dict:
        """`EngineStats`' LoRA fields."""
        if self.config is None:
            return {}
        running, waiting = scheduler.requests_by_adapter()
        adapters = self._runner.adapters
        return dict(lora_running=running, lora_waiting=waiting, max_lora=self.config.max_loras,
                    lora_loads=adapters.num_loads, lora_evictions=adapters.num_evictions,
                    lora_loaded_bytes=adapters.nbytes)
