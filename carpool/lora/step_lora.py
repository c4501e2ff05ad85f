"""One step's adapter rows, grouped, and the term they add after each base linear.

The runner orders a step's requests by adapter (`order_by_adapter`) before packing it, so
each adapter's rows are one contiguous slice: the base matmul runs over every row as it
would without adapters, and `StepLora.add` then adds (x·A)·B·scale over each adapter's
slice only. Base rows pay nothing; an adapter's rows pay in proportion to its rank. (The
order of requests in a packed step changes nothing else: attention, sampling and the
outputs are per request.)
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


@dataclass(frozen=True)
class StepLora:
    """The `lora` forward argument: (first row, last row + 1, weights) per adapter, and the
    kernels' `lora_add_` where the CPU route takes it (None: torch's matmuls per slice)."""

    groups: tuple[tuple[int, int, LoraWeights], ...]
    kernel: Callable | None = None

    @staticmethod
    def of(scheduled, query_starts: np.ndarray, query_lens: np.ndarray,
           weights: dict[int, LoraWeights], kernel: Callable | None = None) -> StepLora | None:
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
        return StepLora(tuple(groups), kernel) if groups else None

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
        return [self._kernel_args(layer, module) for layer in range(num_layers)
                for module in ("qkv", "o", "gate_up", "down")]

    def _add_by_kernel(self, out: torch.Tensor, x: torch.Tensor, layer: int,
                       module: str) -> None:
        """Every adapter's rows of this linear in one `lora_add_` call."""
        starts, ends, a, b, parts = self._kernel_args(layer, module)
        if a:
            self.kernel(out, x, starts, ends, a, b, parts)

    def _kernel_args(self, layer: int, module: str) -> tuple:
        starts, ends, a, b, parts = [], [], [], [], []
        for start, end, weights in self.groups:
            term = weights.layers[layer].get(module)
            if term is None:
                continue
            group = len(a)
            starts.append(start)
            ends.append(end)
            a.append(term.a)
            for col0, _, r0, r1, part_b in term.parts:
                b.append(part_b)
                parts.extend((group, col0, r0, r1))
        return starts, ends, a, b, parts
