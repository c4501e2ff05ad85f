"""A draft model's proposals (speculative method `draft_model`): the k draft tokens of every
speculating request of a step, from k batched forwards of a smaller model that shares the
target's tokenizer.

The draft has its own KV pool with the target's block size and number of blocks, indexed by
the target's block tables, so the scheduler and block manager know nothing of it: the
blocks a speculating decode reserves for its 1 + k tokens hold the draft's K/V of the same
positions. The scheduler plans k `DRAFT_SLOT`s per speculating decode (`core/speculator.py`);
`propose` replaces them before the target's forward:

    pass 1:  the step's prefill chunks (no logits: the draft's KV then holds the prompts;
             only in steps small enough for the batch-size table to allow drafts, so a
             large batch never runs the draft: its requests catch up when it shrinks),
             and per speculating request its tokens from where its draft KV ends through
             its newest token t (t alone after a rejection; the last draft and t after a
             round that kept every draft; more after steps it decoded without drafting)
             -> d1, and q1, the probabilities d1 was drawn from
    pass i:  d(i-1) at the next position -> di, qi               (i = 2..k, 1 row each)

`verified` then sets where each request's draft KV is right: C + min(accepted + 1, k) for
a request at C computed tokens (t and the accepted drafts; the k-th draft is never fed).
Rejected drafts' slots are overwritten by the next round. Plain decodes do not run the draft
(a step that drafts nothing costs nothing extra); the request catches up when it next drafts.

Under a grammar a request drafts under its grammar's masks (the matcher's state after its
drafts so far, `StepGrammar.masks_after`), so q is the masked distribution, and it stops
drafting before a token that would complete the grammar (the target samples that one): it
may fill fewer than its k slots, or none (the runner reports how many it filled, so the
scheduler's counters and averages count only those).

A draft's KV that is wrong (a prefix-cache hit on blocks an earlier request filled while
its draft lagged) costs acceptance, never correctness: the target verifies every token.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from carpool.attention import AttentionBackend, AttentionShape
from carpool.core.scheduler_output import ScheduledRequest, SchedulerOutput
from carpool.models.config import ModelConfig, load_model_config
from carpool.models.loader import load_model
from carpool.platform import Platform
from carpool.runner import kv_cache
from carpool.runner.input_batch import build_input_batch
from carpool.runner.sampler import Sampler
from carpool.structured.bitmask import GrammarBitmask
from carpool.structured.speculation import StepGrammar

logger = logging.getLogger(__name__)

# Added to a request's seed for the draft's own generator: drafts and verification draw
# independent numbers (the same seed would replay the target's uniforms in the draft).
DRAFT_SEED_OFFSET = 0x9E37_79B9_7F4A_7C15


@dataclasses.dataclass(frozen=True)
class Drafted:
    """One step's proposals: the step with its draft slots filled, and per sampled
    speculating request the probabilities each draft was drawn from ([k, V] float32)."""

    scheduler_output: SchedulerOutput
    probs: dict[str, torch.Tensor]


class DraftProposer:
    def __init__(self, path: Path, *, dtype: torch.dtype, device: torch.device,
                 platform: Platform, attention_backend: str, block_size: int,
                 num_kv_blocks: int, seed: int, eos_token_ids: tuple[int, ...],
                 tokens_for_batch: Callable[[int], int]) -> None:
        """`platform`: the draft's own (its CPU route follows its shape); the pool has the
        target's `block_size` and `num_kv_blocks` (+ the scratch block);
        `tokens_for_batch`: the batch-size table (`SpeculativeConfig.num_tokens_for_batch`)."""
        self._tokens_for_batch = tokens_for_batch
        self.config: ModelConfig = load_model_config(path)
        config = self.config
        self.attention: AttentionBackend = platform.attention_backend(
            attention_backend, AttentionShape(config.num_heads, config.num_kv_heads,
                                              config.head_dim, config.sliding_window,
                                              dtype=dtype), device)
        self.model = load_model(path, config, dtype, device)
        platform.prepare_model(self.model)
        self.device, self.block_size, self.num_kv_blocks = device, block_size, num_kv_blocks
        spec = kv_cache.KVCacheSpec.from_model(config, block_size, dtype)
        self.kv_caches = kv_cache.allocate_kv_caches(spec, num_kv_blocks, device,
                                                     self.attention, platform.kv_cache_zeros)
        kernels = platform.compiled_kernels()
        self.sampler = Sampler(device, eos_token_ids, seed + 1,
                               argmax_rows=None if kernels is None else kernels.argmax_rows,
                               request_seed_offset=DRAFT_SEED_OFFSET)
        self._computed: dict[str, int] = {}  # request id -> positions its draft KV holds
        logger.info("draft model %s: %d layers, KV pool %d bytes (beside the target's)",
                    path, config.num_layers, spec.bytes_per_block * (num_kv_blocks + 1))

    def propose(self, scheduler_output: SchedulerOutput,
                grammar: StepGrammar | None = None) -> Drafted:
        """Run the step's prefill chunks through the draft and fill every speculating
        request's draft slots (see the module docstring); a request in `grammar` drafts
        under its grammar's masks and stops drafting before a token its grammar does not
        let the step verify (`StepGrammar.accepted_drafts`), so it may get fewer drafts
        than slots, or none (a plain decode)."""
        self.sampler.free(scheduler_output.finished_ids)
        for request_id in (*scheduler_output.finished_ids, *scheduler_output.preempted_ids):
            self._computed.pop(request_id, None)
        scheduled = scheduler_output.scheduled
        speculating = [r for r in scheduled if r.draft_token_ids]
        rows = [ScheduledRequest(r.request_id, r.token_ids, r.num_computed_tokens, r.block_ids,
                                 False, r.sampling_params)
                for r in scheduled
                if not r.draft_token_ids and r.num_computed_tokens < len(r.prompt_token_ids)]
        if not speculating and not self._tokens_for_batch(len(scheduled)):
            rows = []  # no draft in a step this large: prompts catch up if it shrinks
        for row in rows:
            self._computed[row.request_id] = row.num_computed_tokens + len(row.token_ids)
        for request in speculating:  # pass 1's rows: catch up through the newest token
            computed = request.num_computed_tokens
            start = min(self._computed.get(request.request_id, 0), computed)
            rows.append(ScheduledRequest(
                request.request_id, [*_tokens(request, start, computed), request.token_ids[0]],
                start, request.block_ids, True, request.sampling_params,
                request.prompt_token_ids, request.output_token_ids))
        if not rows:
            return Drafted(scheduler_output, {})
        drafts: dict[str, list[int]] = {r.request_id: [] for r in speculating}
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in speculating}
        ended: set[str] = set()  # requests whose grammar stopped their drafts
        for i in range(max((len(r.draft_token_ids) for r in speculating), default=0) + 1):
            if i:  # pass i + 1: each request still drafting feeds its newest draft
                rows = [_next_row(r, drafts[r.request_id]) for r in speculating
                        if len(r.draft_token_ids) > i and r.request_id not in ended]
                if not rows:
                    break
            constrained = [(r.request_id, drafts[r.request_id]) for r in rows
                           if r.sample and grammar is not None and r.request_id in grammar]
            tokens, q = self._forward(rows, grammar.masks_after(constrained)
                                      if constrained else None)
            for j, row in enumerate(r for r in rows if r.sample):
                drafts[row.request_id].append(tokens[j])
                if q is not None and not row.sampling_params.is_greedy:
                    probs[row.request_id].append(q[j])
            for request_id, own in constrained:
                kept = grammar.accepted_drafts(request_id, own)
                if kept < len(own):  # it completes the grammar: the target samples it
                    ended.add(request_id)
                    del own[kept:], probs[request_id][kept:]
            if not speculating:
                break
        return Drafted(_filled(scheduler_output, drafts),
                       {rid: torch.stack(rows) for rid, rows in probs.items() if rows})

    def verified(self, speculating: list[ScheduledRequest],
                 accepted: dict[str, list[int]]) -> None:
        """The target kept `accepted` of each request's drafts: its draft KV is right
        through its newest token and those drafts (at most the k - 1 it was fed)."""
        for request in speculating:
            k = len(request.draft_token_ids)
            num_accepted = len(accepted.get(request.request_id, ()))
            self._computed[request.request_id] = (request.num_computed_tokens
                                                  + min(num_accepted + 1, k))

    def _forward(self, rows: list[ScheduledRequest], bitmask: GrammarBitmask | None = None
                 ) -> tuple[list[int], torch.Tensor | None]:
        """One draft forward over `rows`; a token (and q) per row with sample=True, drawn
        under `bitmask` where it has the row's request."""
        step = SchedulerOutput(scheduled=rows)
        batch = build_input_batch(step, block_size=self.block_size,
                                  scratch_block=self.num_kv_blocks, device=self.device)
        meta = self.attention.build_metadata(batch.layout)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, self.attention,
                            meta)
        if not batch.sampled:
            return [], None
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        return self.sampler.draw_draft(logits, batch.sampled, bitmask)


def _tokens(request: ScheduledRequest, start: int, end: int) -> list[int]:
    """The request's prompt + output tokens [start, end)."""
    prompt, num_prompt = request.prompt_token_ids, len(request.prompt_token_ids)
    head = list(prompt[start:min(end, num_prompt)]) if start < num_prompt else []
    return head + list(request.output_token_ids[max(start - num_prompt, 0):
                                                max(end - num_prompt, 0)])


def _next_row(request: ScheduledRequest, drafts: list[int]) -> ScheduledRequest:
    """The request's newest draft, one position on; its output tokens end with its drafts
    where penalties or min_tokens read them (as the target's verify rows do)."""
    params = request.sampling_params
    outputs = request.output_token_ids
    if params.has_penalty or params.min_tokens > 0:
        outputs = [*outputs, *drafts]
    return ScheduledRequest(request.request_id, [drafts[-1]],
                            request.num_computed_tokens + len(drafts), request.block_ids, True,
                            params, request.prompt_token_ids, outputs)


def _filled(scheduler_output: SchedulerOutput,
            drafts: dict[str, list[int]]) -> SchedulerOutput:
    """The step with each speculating request's draft slots replaced by its drafts."""
    scheduled = []
    for r in scheduler_output.scheduled:
        if r.draft_token_ids:
            own = drafts[r.request_id]
            r = ScheduledRequest(r.request_id, [*r.token_ids[:1], *own], r.num_computed_tokens,
                                 r.block_ids, r.sample, r.sampling_params, r.prompt_token_ids,
                                 r.output_token_ids, own, r.lora_request)
        scheduled.append(r)
    return dataclasses.replace(scheduler_output, scheduled=scheduled)
