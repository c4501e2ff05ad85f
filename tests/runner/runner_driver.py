"""A hand-driven stand-in for the scheduler, so runner tests need nothing but the runner.

`Driver` plays the scheduler's side of the contract: per step it feeds each
active request the next chunk of its prompt + outputs, hands out KV blocks from
a shuffled free list, can preempt a request (drop its blocks, recompute from 0)
and reports finished ids on the following step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from carpool.core.scheduler_output import ScheduledRequest, SchedulerOutput
from carpool.sampling_params import SamplingParams


@dataclass
class DriverRequest:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival_step: int = 0
    outputs: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    lora_request: object = None  # its LoRA adapter (a LoRARequest), None: the base model

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.outputs


class Driver:
    def __init__(self, runner, *, chunk: int = 16, padding: int = 0, seed: int = 0) -> None:
        self.runner, self.chunk, self.padding = runner, chunk, padding
        self.free_blocks = list(range(runner.num_kv_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.num_steps = 0

    def run(self, requests: list[DriverRequest], preempt_at: dict[int, str] | None = None):
        """Step until every request has max_tokens outputs; returns {id: outputs}."""
        preempt_at = preempt_at or {}
        active = list(requests)
        finished: list[str] = []
        while active:
            if self.num_steps in preempt_at:
                self._preempt(next(r for r in active if r.request_id == preempt_at[self.num_steps]))
            scheduled = [self._schedule(r) for r in active if r.arrival_step <= self.num_steps]
            out = self.runner.execute(SchedulerOutput(scheduled=scheduled, finished_ids=finished,
                                                      num_padding_tokens=self.padding))
            finished = self._update(active, scheduled, out)
            active = [r for r in active if r.request_id not in finished]
            self.num_steps += 1
        self.runner.execute(SchedulerOutput(finished_ids=finished))
        return {r.request_id: r.outputs for r in requests}

    def _schedule(self, req: DriverRequest) -> ScheduledRequest:
        num_new = min(self.chunk, len(req.tokens) - req.num_computed)
        end = req.num_computed + num_new
        while len(req.blocks) * self.runner.block_size < end:
            req.blocks.append(self.free_blocks.pop())
        return ScheduledRequest(req.request_id, req.tokens[req.num_computed:end], req.num_computed,
                                list(req.blocks), end == len(req.tokens), req.params,
                                req.prompt, list(req.outputs), lora_request=req.lora_request)

    def _update(self, active, scheduled, out) -> list[str]:
        by_id = {r.request_id: r for r in active}
        finished = []
        for s in scheduled:
            req = by_id[s.request_id]
            req.num_computed += len(s.token_ids)
            if s.request_id in out.sampled_token_ids:
                req.outputs.append(out.sampled_token_ids[s.request_id])
                req.logprobs.append(out.logprobs.get(s.request_id))
                if len(req.outputs) == req.params.max_tokens:
                    self.free_blocks.extend(req.blocks)
                    finished.append(req.request_id)
            elif s.sample:
                raise AssertionError(f"{s.request_id} asked to sample but got no token")
        return finished

    def _preempt(self, req: DriverRequest) -> None:
        self.free_blocks.extend(req.blocks)
        req.blocks, req.num_computed = [], 0


def hf_greedy(path, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy generate, one prompt alone (stops at EOS, which is kept)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_tokens,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


