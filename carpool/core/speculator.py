"""Which decodes speculate, with which draft tokens: the one place that decides it.

The scheduler asks `Speculator.propose` for every running request about to decode one token;
a non-empty answer (k draft tokens) makes that decode a (1 + k)-token row verified in the
same step. A request drafts nothing when

  - the step runs more requests than the config's batch-size table allows (at larger batches
    the verify rows cost more than the accepted tokens save),
  - it has a grammar and no one told the speculator how many drafts a grammar accepts
    (`grammar_drafts`, set by the engine, which holds the matchers),
  - it has at most one output token left (`max_tokens`, `max_model_len`): drafts never
    overshoot, so the tokens a step may emit end where they would without speculation,
  - its recent drafts were mostly rejected: below MIN_ACCEPTED_PER_DRAFT accepted tokens per
    draft (a running average; a draft model's drafts are charged `draft_pass_cost` per
    token drafted) it stops drafting for a while, then tries again, waiting twice as long
    after each failed try, up to MAX_PAUSE_STEPS decodes,
  - or its tokens' suffix occurred nowhere before (n-gram lookup found nothing).

With a draft model (method `draft_model`) the decision is the same, but the tokens are not
known here: the answer is k `DRAFT_SLOT` placeholders, which the runner's draft model fills
in before the step runs (`runner/draft_proposer.py`); the core stays free of tensors.

Under a grammar (structured outputs), n-gram drafts are cut here to the prefix the grammar
lets a step verify (`grammar_drafts`: tokens it accepts, short of one that completes it;
`structured/speculation.py`), so none of the step's blocks or budget go to tokens that
cannot be kept; a cut to nothing is a plain decode. A draft model draws its drafts under the
grammar's masks and the runner cuts them by the same rule. Every verified position is then
sampled under its own mask, so the output keeps its grammar, and greedy outputs equal those
without speculation.

`record` takes the verified counts back (from `Scheduler.update`) for the averages and the
counters `SpecDecodeStats` holds (vLLM's spec_decode_* metrics): the drafts the runner
verified, which under a grammar may be fewer than a draft model's slots (the runner reports
them, `ModelRunnerOutput.num_draft_tokens`); a draft cut to none counts as a plain decode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from carpool.core.ngram_proposer import NgramIndex
from carpool.core.request import Request
from carpool.core.scheduler_output import DRAFT_SLOT
from carpool.core.spec_config import SpeculativeConfig

# A draft pays when its accepted tokens outweigh what its k extra rows add to the step: 0.1
# of a step on a model whose decode reads its weights (135M, short contexts), 0.3-0.5 on the
# tiny built-in model (host work per row) or at a 2,000-token context (five queries'
# attention), lab 55. A request whose drafts earn fewer accepted tokens than this per step
# stops drafting a while.
MIN_ACCEPTED_PER_DRAFT = 0.5
_AVERAGE_WEIGHT = 0.25  # of the newest draft in the running average
_FIRST_PAUSE_STEPS, MAX_PAUSE_STEPS = 8, 128
# Where a request's average starts, and restarts after a pause; a try whose average stays at
# or above it ends the growth of the pauses (a try whose drafts miss falls below it at once).
_RESTART_AVERAGE = 2 * MIN_ACCEPTED_PER_DRAFT


@dataclass
class SpecDecodeStats:
    """Counters since start: drafts verified, their tokens, the accepted ones (and by position)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_drafted:
            per_pos.extend([0] * (num_drafted - len(per_pos)))
        for position in range(num_accepted):
            per_pos[position] += 1


@dataclass
class _Acceptance:
    """One request's running average of accepted tokens per draft, and its pause."""

    average: float = _RESTART_AVERAGE
    paused_steps: int = 0
    next_pause: int = _FIRST_PAUSE_STEPS


class Speculator:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.stats = SpecDecodeStats()
        self._indexes: dict[str, NgramIndex] = {}
        self._acceptance: dict[str, _Acceptance] = {}
        # (request id, drafts) -> how many of them the request's grammar lets a step verify;
        # None: requests with a grammar do not speculate
        self.grammar_drafts: Callable[[str, list[int]], int] | None = None

    def propose(self, request: Request, batch_size: int, token_budget: int) -> list[int]:
        """Draft tokens for the request's next decode in a step of `batch_size` running
        requests with `token_budget` tokens left (its own decode token included); [] for a
        plain decode."""
        k = self.config.num_tokens_for_batch(batch_size)  # first: large batches stop here
        constrained = request.sampling_params.structured_outputs is not None
        if k == 0 or (constrained and self.grammar_drafts is None):
            return []
        k = min(k, token_budget - 1,
                request.max_output_tokens - request.num_output_tokens - 1)
        if k <= 0:
            return []
        acceptance = self._acceptance.get(request.request_id)
        if acceptance is not None and acceptance.paused_steps:
            acceptance.paused_steps -= 1
            return []
        if self.config.method == "draft_model":
            return [DRAFT_SLOT] * k
        index = self._indexes.get(request.request_id)
        if index is None:
            index = NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max)
            self._indexes[request.request_id] = index
        drafts = index.propose(request, k)
        if constrained and drafts:
            drafts = drafts[:self.grammar_drafts(request.request_id, drafts)]
        return drafts

    def record(self, request_id: str, num_drafted: int, num_accepted: int,
               running: bool = True) -> None:
        """A draft of `num_drafted` tokens was verified and `num_accepted` of them accepted;
        `running`: the request goes on (else it is only counted: it left, or `forget` ran)."""
        self.stats.record(num_drafted, num_accepted)
        if not running:
            return
        acceptance = self._acceptance.setdefault(request_id, _Acceptance())
        # a draft model's passes are charged against what they earned (n-gram: free)
        earned = num_accepted - num_drafted * (self.config.draft_pass_cost or 0.0)
        acceptance.average += _AVERAGE_WEIGHT * (earned - acceptance.average)
        if acceptance.average >= _RESTART_AVERAGE:  # holding the level a try starts from:
            acceptance.next_pause = _FIRST_PAUSE_STEPS  # a success (a miss falls below it)
        elif acceptance.average < MIN_ACCEPTED_PER_DRAFT:
            # pause, then try again from an average that a few misses bring down again
            acceptance.paused_steps = acceptance.next_pause
            acceptance.next_pause = min(2 * acceptance.next_pause, MAX_PAUSE_STEPS)
            acceptance.average = _RESTART_AVERAGE

    def forget(self, request_id: str) -> None:
        """The request left: drop its index and average."""
        self._indexes.pop(request_id, None)
        self._acceptance.pop(request_id, None)
