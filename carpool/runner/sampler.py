"""Choose the next token of every sampled request at once, from its last logits.

Vectorised across the batch; per-request knobs become per-row tensors. Order:
min_tokens mask -> repetition / presence / frequency penalties -> greedy rows
take the argmax; the others: temperature (below 1e-5: greedy) -> min_p -> top_k -> top_p -> draw.
The draw inverts each row's cumulative distribution at one uniform number, which
picks token i with probability probs[i] (`draw_by_inverse_cdf`); a seeded request
takes its number from its own `torch.Generator`, so the same seed gives the same
tokens whatever else is in the batch (and across preemption: the generator lives
until the request ends). One number per row, not one per vocabulary entry: the
exponential race it replaced (argmax of probs / Exp(1) noise) drew 100 x 49,152
numbers a step, 114 ms of a 135M model's ~230 ms decode step on 2 cores.

A grammar-constrained request's row first loses every token its grammar does not allow
(`GrammarBitmask`, computed by the engine's matcher); other rows are not touched.

Logprobs are the log-softmax of the *raw* model logits, before any penalty,
temperature or truncation (vLLM's default "raw_logprobs" mode): they describe
the model, not the sampling settings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from carpool.core.scheduler_output import ScheduledRequest
from carpool.outputs import Logprob, PositionLogprobs
from carpool.runner.penalties import apply_min_tokens, apply_penalties, needs_processing
from carpool.runner.truncation import apply_min_p, apply_top_k_top_p
from carpool.structured.bitmask import GrammarBitmask


@dataclass(frozen=True)
class Proposals:
    """A draft model's proposals, per logits row: the draft token that follows the row
    (-1: none, the row is a bonus row or a plain decode) and q, the probabilities the draft
    drew it from ([N, V] float32; a greedy row's is not read)."""

    draft_ids: torch.Tensor  # [N] int64
    probs: torch.Tensor  # [N, V] float32


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[PositionLogprobs | None]  # one per row; None where not asked


class Sampler:
    """Holds the global generator and each seeded request's generator."""

    def __init__(self, device: torch.device, eos_token_ids: tuple[int, ...], seed: int = 0,
                 argmax_rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 request_seed_offset: int = 0) -> None:
        """argmax_rows: the compiled kernels' `argmax_rows` (float32 and bfloat16 CPU rows,
        `greedy_ids`' answers in one vector pass;
        docs/lab/27-dtype-auto-as-vllm-s-the-servers.md), or None: `greedy_ids`.
        request_seed_offset: added to a request's seed for its generator (a draft model's
        sampler: its numbers must not repeat the target's)."""
        self.device = device
        self._seed_offset = request_seed_offset
        self._argmax_rows = argmax_rows
        self.eos_token_ids = tuple(eos_token_ids)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}

    def free(self, request_ids) -> None:
        """Forget the generators of requests that ended."""
        for request_id in request_ids:
            self._request_generators.pop(request_id, None)

    @property
    def num_request_generators(self) -> int:
        return len(self._request_generators)

    def sample(self, logits: torch.Tensor, requests: list[ScheduledRequest],
               grammar_bitmask: GrammarBitmask | None = None,
               proposals: Proposals | None = None) -> SamplerOutput:
        """logits [N, V] (float32 or the model's dtype), row i for requests[i] -> one token
        (and logprobs) per row. `grammar_bitmask` masks the rows of the constrained requests it
        names (in place, once they are float32). `proposals`: a draft model's tokens and
        probabilities for the rows they follow; a sampled row with one takes it or a token of
        the residual (`rejection_tokens`).

        Greedy rows with nothing to process take the argmax of the logits as they come: widening
        bfloat16 to float32 is exact and keeps their order, and skipping it saves writing and
        reading the float32 copy (docs/lab/26-prefix-blocks-shared-within-the-step-that.md)."""
        if grammar_bitmask is None and all(r.sampling_params.is_plain_greedy for r in requests):
            return SamplerOutput(token_ids=self._greedy_ids(logits).tolist(),
                                 logprobs=[None] * len(requests))  # fast path
        wants_logprobs = any(r.sampling_params.logprobs is not None for r in requests)
        plain_greedy = (all(r.sampling_params.is_greedy for r in requests)
                        and not needs_processing(requests, self.eos_token_ids))
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if wants_logprobs else None
        if grammar_bitmask is not None:
            apply_grammar_bitmask(logits, requests, grammar_bitmask)
        token_ids = (self._greedy_ids(logits) if plain_greedy
                     else self._sample_processed(logits.clone(), requests, proposals))
        token_list = token_ids.tolist()
        return SamplerOutput(token_ids=token_list,
                             logprobs=_gather_logprobs(raw_logprobs, token_ids, requests))

    def _greedy_ids(self, logits: torch.Tensor) -> torch.Tensor:
        if (self._argmax_rows is not None and logits.device.type == "cpu" and logits.dim() == 2
                and logits.stride(-1) == 1 and logits.shape[-1] > 0
                and logits.dtype in (torch.float32, torch.bfloat16)):
            return self._argmax_rows(logits)
        return greedy_ids(logits)

    def _sample_processed(self, logits: torch.Tensor, requests: list[ScheduledRequest],
                          proposals: Proposals | None = None) -> torch.Tensor:
        greedy, greedy_tokens, probs = self._processed(logits, requests)
        if probs is None:
            return greedy_tokens
        uniforms = self._uniforms(requests)
        drawn = draw_by_inverse_cdf(probs, uniforms)
        if proposals is not None:
            drawn = rejection_tokens(probs, uniforms, drawn, proposals)
        return torch.where(greedy, greedy_tokens, drawn)

    def _processed(self, logits: torch.Tensor, requests: list[ScheduledRequest]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(greedy rows, every row's argmax after min_tokens and penalties, the probabilities
        a sampled row draws from: None when every row is greedy), `logits` changed in place."""
        apply_min_tokens(logits, requests, self.eos_token_ids)
        apply_penalties(logits, requests)
        logits = _finite(logits)
        greedy = torch.tensor([r.sampling_params.is_greedy for r in requests], device=self.device)
        greedy_tokens = self._greedy_ids(logits)
        if bool(greedy.all()):
            return greedy, greedy_tokens, None
        params = [r.sampling_params for r in requests]
        temperature = torch.tensor([1.0 if p.is_greedy else p.temperature for p in params],
                                   device=self.device, dtype=logits.dtype)
        logits = _finite(logits / temperature[:, None])
        logits = apply_min_p(logits, params)
        logits = apply_top_k_top_p(logits, params)
        return greedy, greedy_tokens, torch.softmax(logits, dim=-1)

    def draw_draft(self, logits: torch.Tensor, requests: list[ScheduledRequest],
                   grammar_bitmask: GrammarBitmask | None = None
                   ) -> tuple[list[int], torch.Tensor | None]:
        """A draft model's tokens, one per row, and the float32 [N, V] probabilities the
        sampled rows drew them from (q; None when every row is greedy): processed as the
        target's rows are (grammar mask, min_tokens, penalties, temperature, min_p, top_k,
        top_p), so q is close to p where the draft is good."""
        logits = logits.float()
        if grammar_bitmask is not None:
            apply_grammar_bitmask(logits, requests, grammar_bitmask)
        greedy, greedy_tokens, probs = self._processed(logits, requests)
        if probs is None:
            return greedy_tokens.tolist(), None
        drawn = draw_by_inverse_cdf(probs, self._uniforms(requests))
        return torch.where(greedy, greedy_tokens, drawn).tolist(), probs

    def _uniforms(self, requests: list[ScheduledRequest]) -> torch.Tensor:
        """One U[0, 1) float64 number per row: seeded rows from their own generator, others
        from the global one."""
        uniforms = torch.rand(len(requests), generator=self.generator, device=self.device,
                              dtype=torch.float64)
        for row, req in enumerate(requests):
            seed = req.sampling_params.seed
            if seed is None or req.sampling_params.is_greedy:
                continue
            generator = self._request_generators.get(req.request_id)
            if generator is None:
                generator = torch.Generator(device=self.device).manual_seed(
                    (seed + self._seed_offset) & 0xFFFF_FFFF_FFFF_FFFF)
                self._request_generators[req.request_id] = generator
            uniforms[row] = self._draw(generator)
        return uniforms

    def _draw(self, generator: torch.Generator) -> torch.Tensor:
        return torch.rand(1, generator=generator, device=self.device, dtype=torch.float64)[0]

    def seeded_states(self, requests: list[ScheduledRequest]) -> dict[str, torch.Tensor | None]:
        """Before a step that may draw more numbers than it keeps (speculative rows): each
        seeded sampled request's generator state (None: not created yet)."""
        states = {}
        for req in requests:
            if req.sampling_params.seed is not None and not req.sampling_params.is_greedy:
                generator = self._request_generators.get(req.request_id)
                states[req.request_id] = None if generator is None else generator.get_state()
        return states

    def rewind(self, request_id: str, seed: int, state: torch.Tensor | None,
               num_draws: int) -> None:
        """Set a seeded request's generator to `state` (None: fresh from `seed`) advanced by
        `num_draws` rows, as if the step had drawn only for the rows it kept."""
        generator = torch.Generator(device=self.device)
        if state is None:
            generator.manual_seed(seed)
        else:
            generator.set_state(state)
        for _ in range(num_draws):
            self._draw(generator)
        self._request_generators[request_id] = generator


def rejection_tokens(probs: torch.Tensor, uniforms: torch.Tensor, drawn: torch.Tensor,
                     proposals: Proposals) -> torch.Tensor:
    """Rejection sampling of a draft model's tokens (Leviathan et al., Chen et al.): a row
    followed by draft d, drawn from q, keeps d with probability min(1, p(d) / q(d)) (its
    uniform u: u * q(d) < p(d)); otherwise its token is drawn from the residual
    max(0, p - q), renormalised, with the next row's uniform (the row after a rejection is
    discarded, so its number is free, and independent of u). Every kept token then has the
    target's distribution p. Rows without a draft keep `drawn`. A rejected d has
    p(d) < q(d), so the residual never draws it: the token differs from the draft, which is
    how `spec_verify.verify` finds the rejection."""
    rows = (proposals.draft_ids >= 0).nonzero().flatten()
    if not rows.numel():
        return drawn
    drafts = proposals.draft_ids[rows][:, None]
    p, q = probs[rows], proposals.probs[rows].to(probs.dtype)
    accept = uniforms[rows] * q.gather(1, drafts)[:, 0].double() < p.gather(1, drafts)[:, 0]
    residual = (p - q).clamp(min=0)
    empty = residual.sum(-1) <= 0  # p == q up to rounding: then d is (almost) never rejected
    residual = torch.where(empty[:, None], p.scatter(1, drafts, 0.0), residual)
    resampled = draw_by_inverse_cdf(residual, uniforms[rows + 1])
    drawn = drawn.clone()
    drawn[rows] = torch.where(accept, drafts[:, 0], resampled)
    return drawn


# Entries per block of the two-level search in draw_by_inverse_cdf.
CDF_BLOCK = 256


def draw_by_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs [N, V] (rows of non-negative weights), uniforms [N] float64 in [0, 1) -> [N]
    token ids, row i's the first t with cumsum(probs[i])[t] > uniforms[i] * sum(probs[i]).

    Two levels, so that no float32 running sum spans the vocabulary (its rounding would
    reach ~1e-3 over 150k entries): blocks of CDF_BLOCK entries are summed in float32
    (error ~1e-7 of a block), the block sums accumulated in float64 pick the block, and
    the block's own float64 running sum picks the entry. A zero-weight entry is never
    drawn: where rounding pushes the target past a block's or a row's last positive
    weight, the draw is that entry."""
    num_rows, vocab = probs.shape
    padding = (-vocab) % CDF_BLOCK
    blocks = (F.pad(probs, (0, padding)) if padding else probs).view(num_rows, -1, CDF_BLOCK)
    block_sums = blocks.sum(-1).double()  # [N, B]
    ends = block_sums.cumsum(-1)
    targets = (uniforms * ends[:, -1])[:, None]
    block = torch.minimum(torch.searchsorted(ends, targets, right=True).squeeze(1),
                          _last_positive(block_sums))
    starts = ends.gather(1, (block - 1).clamp(min=0)[:, None]).squeeze(1)
    starts = torch.where(block > 0, starts, torch.zeros_like(starts))
    weights = blocks[torch.arange(num_rows, device=probs.device), block]  # [N, CDF_BLOCK]
    within = torch.searchsorted(weights.double().cumsum(-1), targets - starts[:, None],
                                right=True).squeeze(1)
    return block * CDF_BLOCK + torch.minimum(within, _last_positive(weights))


def _last_positive(weights: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N]: each row's last index with a positive weight (K - 1 if none)."""
    return weights.shape[-1] - 1 - (weights > 0).flip(-1).to(torch.uint8).argmax(-1)


def apply_grammar_bitmask(logits: torch.Tensor, requests: list[ScheduledRequest],
                          grammar_bitmask: GrammarBitmask) -> None:
    """-inf, in place, on every token a constrained row's grammar does not allow. A request
    with n mask rows (a speculating one: a row per verified position) has its first n logits
    rows masked by them, in order.

    On the CPU each constrained row is masked by numpy in place, on one thread: torch's
    masked fill of a vocabulary-wide row is a parallel region per call, which on a busy
    machine waits for its second thread (measured at tens of ms per step with 8 rows on
    the shared 2-core box). Elsewhere, one masked fill over the gathered rows.
    """
    # each request's next row (its first; a speculating request's rows follow it)
    row_of = {r.request_id: i for i, r in reversed(list(enumerate(requests)))}
    pairs = []
    for i, rid in enumerate(grammar_bitmask.request_ids):
        if rid in row_of:
            pairs.append((row_of[rid], i))
            row_of[rid] += 1
    if not pairs:
        return
    disallowed = grammar_bitmask.disallowed(logits.shape[-1])  # (R, V) bool, numpy
    if logits.device.type == "cpu" and logits.is_contiguous():
        values = logits.numpy()
        for row, index in pairs:
            np.putmask(values[row], disallowed[index], -np.inf)
        return
    rows = torch.tensor([row for row, _ in pairs], device=logits.device)
    mask = torch.from_numpy(disallowed[[index for _, index in pairs]]).to(logits.device)
    logits[rows] = logits[rows].masked_fill(mask, float("-inf"))


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """Each row's largest logit's index (the first of equals, NaN above all, as `argmax`):
    `max`'s indices, which on CPU took a third of `argmax`'s time over 150 x 49,152 float32
    rows (2 threads)."""
    return logits.max(dim=-1).indices


def _finite(logits: torch.Tensor) -> torch.Tensor:
    """Overflowed logits (a huge repetition penalty, a small temperature) made safe for softmax:
    +inf becomes the dtype's largest value, NaN (0 * inf) -inf; -inf (masked) stays."""
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max,
                           neginf=float("-inf"))


def _gather_logprobs(raw_logprobs: torch.Tensor | None, token_ids: torch.Tensor,
                     requests: list[ScheduledRequest]) -> list[PositionLogprobs | None]:
    """Chosen token's logprob and rank, plus the top-N, for rows that asked for them."""
    if raw_logprobs is None:
        return [None] * len(requests)
    wanted = [r.sampling_params.logprobs for r in requests]
    max_n = max(n for n in wanted if n is not None)
    chosen = raw_logprobs.gather(1, token_ids[:, None])  # (N, 1)
    chosen_rank = ((raw_logprobs > chosen).sum(dim=-1) + 1).tolist()
    top_values, top_ids = raw_logprobs.topk(max(max_n, 1), dim=-1)
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    chosen, token_list = chosen[:, 0].tolist(), token_ids.tolist()
    result: list[PositionLogprobs | None] = []
    for row, n in enumerate(wanted):
        if n is None:
            result.append(None)
            continue
        entry: PositionLogprobs = {token_list[row]: Logprob(chosen[row], rank=chosen_rank[row])}
        for rank, (token, value) in enumerate(zip(top_ids[row][:n], top_values[row][:n]), 1):
            entry.setdefault(token, Logprob(value, rank=rank))
        result.append(entry)
    return result
