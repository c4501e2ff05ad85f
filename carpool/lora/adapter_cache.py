"""The adapters held in memory: at most `max_cpu_loras`, the least recently used evicted.

A request carries its adapter's folder (`LoRARequest`), so an evicted adapter is simply
read again when a request for it runs next: eviction never fails a request. A step's own
adapters (at most `max_loras`, which the scheduler holds) are never evicted by that step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from carpool.lora.peft_adapter import LoraWeights
from carpool.lora_request import LoRARequest


class AdapterCache:
    def __init__(self, capacity: int, load: Callable[[LoRARequest], LoraWeights]) -> None:
        if capacity < 1:
            raise ValueError(f"max_cpu_loras must be >= 1, got {capacity}")
        self.capacity = capacity
        self._load = load
        self._loaded: OrderedDict[int, LoraWeights] = OrderedDict()  # by lora_int_id, LRU first
        self.num_loads = 0
        self.num_evictions = 0

    def __contains__(self, lora_int_id: int) -> bool:
        return lora_int_id in self._loaded

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self._loaded.values())

    def activate(self, requests: Iterable[LoRARequest]) -> dict[int, LoraWeights]:
        """The weights of these adapters (one step's), loading those not held and evicting
        the least recently used others to stay within capacity."""
        wanted = {r.lora_int_id: r for r in requests}
        if len(wanted) > self.capacity:
            raise ValueError(f"a step uses {len(wanted)} adapters, more than max_cpu_loras "
                             f"({self.capacity})")
        out = {}
        for lora_id, request in wanted.items():
            weights = self._loaded.get(lora_id)
            if weights is None:
                self._make_room(keep=wanted.keys())
                weights = self._load(request)
                self._loaded[lora_id] = weights
                self.num_loads += 1
            self._loaded.move_to_end(lora_id)
            out[lora_id] = weights
        return out

    def evict(self, lora_int_id: int) -> bool:
        """Drop one adapter now (unloaded by name); False if it was not held."""
        if self._loaded.pop(lora_int_id, None) is None:
            return False
        self.num_evictions += 1
        return True

    def _make_room(self, keep) -> None:
        while len(self._loaded) >= self.capacity:
            victim = next((i for i in self._loaded if i not in keep), None)
            if victim is None:
                return
            self.evict(victim)
