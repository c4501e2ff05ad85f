"""Which op first makes a request's numbers depend on its batch: a per-op trace of one request.

`OpTrace(engine, request_id)` attached to an `LLMEngine` records, while the engine steps,
the output rows of one request at every module of the model (every layer's norms,
projections, rotary, the attention backend's call, the final norm and the LM head), keyed by
the token position each row belongs to. Run the same request twice, alone and inside a
batch (or chunked, preempted, after a prefix-cache hit), and `first_difference` names the
first op, in forward order, whose rows differ bitwise at some position: the place where
batch invariance breaks. A position computed twice (recomputed after a preemption) keeps its
last rows; a prefix-cache hit leaves its cached positions unrecorded, and they are compared
only where both traces hold them.

Rows are mapped through the step's `SchedulerOutput` (`LLMEngine.step_hook`): during the
forward an op's tensors with one row per packed token give the request's rows; after it
(`compute_logits`) tensors with one row per sampled request give its sampled row. Requests
asking for prompt logprobs are not supported (their logits rows are neither).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(frozen=True)
class OpDifference:
    op: str  # module name (`model.layers.3.mlp.down_proj`), `#i` for a tuple output's i-th
    position: int  # the first token position whose rows differ
    max_abs_diff: float


@dataclass
class _StepRows:
    """Where the traced request sits in the current step."""

    packed_start: int | None = None
    positions: tuple[int, ...] = ()
    num_tokens: int = 0
    sampled_row: int | None = None
    num_sampled: int = 0
    in_forward: bool = False


@dataclass
class OpTrace:
    """Records one request's rows at every op while attached (a context manager)."""

    engine: object  # an LLMEngine with an in-process ModelRunner (`engine.runner`)
    request_id: str
    records: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)  # op names, first call first
    _step: _StepRows = field(default_factory=_StepRows)
    _handles: list = field(default_factory=list)
    _attention_calls: int = 0
    _stack: object = None

    def __enter__(self) -> OpTrace:
        runner = self.engine.runner
        model: nn.Module = runner.model
        # The C++ layer stack runs the layers without their modules; its hidden states are
        # the modules' to the bit (tests/runner/test_layer_stack.py), so the trace takes them.
        self._stack = getattr(model, "layer_stack", None)
        if self._stack is not None:
            model.layer_stack = None
        self._previous_hook = self.engine.step_hook
        self.engine.step_hook = self._on_step
        for name, module in model.named_modules():
            if name and not isinstance(module, nn.ModuleList):
                self._handles.append(module.register_forward_hook(self._recorder(name)))
        self._handles.append(model.register_forward_pre_hook(self._forward_begins))
        self._handles.append(model.register_forward_hook(self._forward_ends))
        attention = runner.attention
        original = attention.forward

        def traced(q, k, v, kv_cache, meta, scale):
            out = original(q, k, v, kv_cache, meta, scale)
            self._record(f"attention[{self._attention_calls}]", out)
            self._attention_calls += 1
            return out

        attention.forward = traced
        self._attention = attention
        return self

    def __exit__(self, *exc_info) -> None:
        for handle in self._handles:
            handle.remove()
        del self._attention.forward  # back to the class's method
        self.engine.step_hook = self._previous_hook
        if self._stack is not None:
            self.engine.runner.model.layer_stack = self._stack

    def _on_step(self, scheduler_output) -> None:
        if self._previous_hook is not None:
            self._previous_hook(scheduler_output)
        step = _StepRows(num_tokens=scheduler_output.num_scheduled_tokens)
        start = 0
        for req in scheduler_output.scheduled:
            if req.request_id == self.request_id:
                step.packed_start = start
                step.positions = tuple(range(req.num_computed_tokens,
                                             req.num_computed_tokens + req.num_new_tokens))
                if req.sample:
                    step.sampled_row = step.num_sampled
            step.num_sampled += req.sample
            start += req.num_new_tokens
        self._step = step

    def _forward_begins(self, module, args) -> None:
        self._step.in_forward = True
        self._attention_calls = 0

    def _forward_ends(self, module, args, output) -> None:
        self._step.in_forward = False

    def _recorder(self, name: str):
        def hook(module, args, output) -> None:
            if isinstance(output, torch.Tensor):
                self._record(name, output)
            elif isinstance(output, tuple):
                for i, item in enumerate(output):
                    if isinstance(item, torch.Tensor):
                        self._record(f"{name}#{i}", item)
        return hook

    def _record(self, name: str, tensor: torch.Tensor) -> None:
        step = self._step
        if step.packed_start is None or tensor.dim() == 0:
            return
        if step.in_forward and tensor.shape[0] == step.num_tokens:
            rows = tensor[step.packed_start:step.packed_start + len(step.positions)]
            positions = step.positions
        elif (not step.in_forward and step.sampled_row is not None
              and tensor.shape[0] == step.num_sampled):
            rows = tensor[step.sampled_row:step.sampled_row + 1]
            positions = step.positions[-1:]
        else:
            return
        if name not in self.records:
            self.records[name] = {}
            self.order.append(name)
        by_position = self.records[name]
        for position, row in zip(positions, rows):
            by_position[position] = row.detach().clone()


def first_difference(expected: OpTrace, actual: OpTrace) -> OpDifference | None:
    """The first op (in `expected`'s forward order) whose rows differ bitwise at a position
    both traces hold, and the first such position; None when every shared row is equal.
    ValueError when the traces share no op and position (nothing was compared)."""
    compared = 0
    for op in expected.order:
        theirs = actual.records.get(op, {})
        for position, row in sorted(expected.records[op].items()):
            other = theirs.get(position)
            if other is None:
                continue
            compared += 1
            if not torch.equal(row, other):
                diff = (row.float() - other.float()).abs().max().item()
                return OpDifference(op, position, diff)
    if compared == 0:
        raise ValueError(f"the traces of {expected.request_id!r} and {actual.request_id!r} "
                         f"share no recorded op and position")
    return None
