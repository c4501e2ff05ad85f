"""One step's adapter rows, grouped, and the term they add after each base linear.

The runner orders a step's requests by adapter (`order_by_adapter`) before packing it, so
each adapter's rows are one contiguous slice: the base matmul runs over every row as it
would without adapters, and `StepLora.add` then adds (x·A)·B·scale over each adapter's
slice only. Base rows pay nothing; an adapter's rows pay in proportion to its rank. (The
order of requests in a packed step changes nothing else: attention, sampling and the
outputs are per request.)

The kernel's weight arguments (every layer's A and B lists) depend only on which adapters a
step runs, in order, and consecutive steps mostly run the same ones: `KernelTerms` keeps them
for the last such set, so a step adds only its rows (the lists of 120 linears' tensors took
longer to build in Python than the decode step's LoRA products).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from carpool.core.scheduler_output import SchedulerOutput
from carpool.lora.peft_adapter import LoraWeights


def adapter_id(scheduled) -> int:
    lora = scheduled.lora_request
    return 0 if lora is None else lora.lora_int_id


def order_by_adapter(scheduler_output: SchedulerOutput) -> SchedulerOutput:
    """The step with its requests sorted by adapter id (base first), stable; the same
    object when no request has an adapter."""
    scheduled = scheduler_output.scheduled
    if all(s.lora_request is None for s in scheduled):
        return scheduler_output
    return replace(scheduler_output, scheduled=sorted(scheduled, key=adapter_id))


MODULES = ("qkv", "o", "gate_up", "down")  # a layer's linears, in the layer stack's order


class KernelTerms:
    """`lora_add_`'s weight arguments for one ordered set of adapters, per layer and linear:
    (which of the set's adapters it has, A per adapter, B per part, parts); the last set's
    are kept (the runner holds one, steps share it)."""

    def __init__(self) -> None:
        self._adapters: tuple[LoraWeights, ...] = ()
        self._terms: dict[tuple[int, str], tuple[tuple[int, ...], list, list, list[int]]] = {}

    def of(self, adapters: tuple[LoraWeights, ...]) -> dict:
        """(layer, module) -> (adapter indices, a, b, parts) for these adapters, in order."""
        if len(adapters) != len(self._adapters) or any(
                mine is not theirs for mine, theirs in zip(adapters, self._adapters)):
            self._terms = {}
            self._adapters = adapters
        return self._terms

    def clear(self) -> None:
        """Forget the set (an adapter unloaded: its tensors are not held here after)."""
        self._adapters, self._terms = (), {}

    @staticmethod
    def build(adapters: tuple[LoraWeights, ...], layer: int, module: str) -> tuple:
        indices: list[int] = []
        a, b, parts = [], [], []
        for index, weights in enumerate(adapters):
            term = weights.layers[layer].get(module)
            if term is None:
                continue
            group = len(a)
            indices.append(index)
            a.append(term.a)
            for col0, _, r0, r1, part_b in term.parts:
                b.append(part_b)
                parts.extend((group, col0, r0, r1))
        return tuple(indices), a, b, parts


@dataclass(frozen=True)
class StepLora:
    """The `lora` forward argument: (first row, last row + 1, weights) per adapter, and the
    kernels' `lora_add_` where the CPU route takes it (None: torch's matmuls per slice), with
    the runner's `KernelTerms` (None: built for this step alone)."""

    groups: tuple[tuple[int, int, LoraWeights], ...]
    kernel: Callable | None = None
    terms: KernelTerms | None = None

    @staticmethod
    def of(scheduled, query_starts: np.ndarray, query_lens: np.ndarray,
           weights: dict[int, LoraWeights], kernel: Callable | None = None,
           terms: KernelTerms | None = None) -> StepLora | None:
        """Groups of an `order_by_adapter` step; None when no row has an adapter."""
        groups: list[tuple[int, int, LoraWeights]] = []
        current, start = 0, 0
        for i, s in enumerate(scheduled):
            lora_id = adapter_id(s)
            if lora_id != current:
                row = int(query_starts[i])
                if current:
                    groups.append((start, row, weights[current]))
                current, start = lora_id, row
        if current:
            last = len(scheduled) - 1
            groups.append((start, int(query_starts[last] + query_lens[last]), weights[current]))
        return StepLora(tuple(groups), kernel, terms) if groups else None

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, module: str) -> None:
        """out[rows] += x[rows]·A·B·scale for each adapter's rows, in place."""
        if self.kernel is not None and out.is_contiguous() and x.is_contiguous():
            self._add_by_kernel(out, x, layer, module)
            return
        for start, end, weights in self.groups:
            term = weights.layers[layer].get(module)
            if term is None:
                continue
            shrunk = x[start:end].mm(term.a)
            rows = out[start:end]
            for col0, col1, r0, r1, b in term.parts:
                if col0 == 0 and col1 == rows.shape[1]:
                    rows.addmm_(shrunk if r0 == 0 and r1 == shrunk.shape[1]
                                else shrunk[:, r0:r1], b)
                else:
                    rows[:, col0:col1].addmm_(shrunk[:, r0:r1], b)

    def stack_terms(self, num_layers: int) -> list[tuple]:
        """The C++ layer stack's `lora` argument: `lora_add_`'s arguments for every layer's
        qkv, o, gate_up and down, in that order."""
        known, rows = self._known_terms(), {}
        return [self._kernel_args(layer, module, known, rows) for layer in range(num_layers)
                for module in MODULES]

    def _add_by_kernel(self, out: torch.Tensor, x: torch.Tensor, layer: int,
                       module: str) -> None:
        """Every adapter's rows of this linear in one `lora_add_` call."""
        starts, ends, a, b, parts = self._kernel_args(layer, module, self._known_terms(), {})
        if a:
            self.kernel(out, x, starts, ends, a, b, parts)

    def _known_terms(self) -> dict:
        adapters = tuple(weights for _, _, weights in self.groups)
        return {} if self.terms is None else self.terms.of(adapters)

    def _kernel_args(self, layer: int, module: str, known: dict, rows: dict) -> tuple:
        """(starts, ends, a, b, parts) of the adapters that change this linear; `rows` keeps
        the starts and ends of each subset of adapters met (mostly one: all of them)."""
        term = known.get((layer, module))
        if term is None:
            adapters = tuple(weights for _, _, weights in self.groups)
            term = known[(layer, module)] = KernelTerms.build(adapters, layer, module)
        indices, a, b, parts = term
        bounds = rows.get(indices)
        if bounds is None:
            groups = self.groups
            bounds = rows[indices] = ([groups[i][0] for i in indices],
                                      [groups[i][1] for i in indices])
        return (*bounds, a, b, parts)
