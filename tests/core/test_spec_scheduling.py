"""The scheduler with speculative decoding: a decode with k drafts is one (1 + k)-token row
inside the budget, its lookahead blocks taken at schedule time; only accepted drafts become
computed tokens; stops among them end the request there; drafts never preempt, never
overshoot max_tokens, and are never hashed into the prefix cache."""

from __future__ import annotations

import random

from carpool.core.config import SchedulerConfig
from carpool.core.request import Request, RequestStatus
from carpool.core.scheduler import Scheduler
from carpool.core.spec_config import SpeculativeConfig
from carpool.core.speculator import MIN_ACCEPTED_PER_DRAFT
from carpool.sampling_params import SamplingParams, StructuredOutputsParams
from tests.core.stepping import FakeClock

LOOP = [5, 6, 7, 8]


def make_scheduler(num_blocks=64, k=4, spec=None, **overrides):
    fields = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, block_size=4,
                  enable_prefix_caching=False)
    fields.update(overrides)
    spec = spec or SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=1,
                                     prompt_lookup_max=3, disable_by_batch_size=8)
    return Scheduler(SchedulerConfig(**fields), num_blocks=num_blocks, clock=FakeClock(),
                     speculative=spec)


def loop_request(request_id: str, repeats: int = 3, **params) -> Request:
    params.setdefault("max_tokens", 32)
    return Request(request_id, LOOP * repeats, SamplingParams(**params))


def step(scheduler: Scheduler, accept=lambda scheduled: len(scheduled.draft_token_ids),
         next_token=lambda scheduled: 99):
    """schedule + update: each speculating row accepts accept(row) of its drafts."""
    output = scheduler.schedule()
    sampled, accepted = {}, {}
    for scheduled in output.scheduled:
        if scheduled.sample:
            sampled[scheduled.request_id] = next_token(scheduled)
            if scheduled.draft_token_ids:
                accepted[scheduled.request_id] = list(
                    scheduled.draft_token_ids[:accept(scheduled)])
    scheduler.update(output, sampled, accepted)
    scheduler.block_manager.check_integrity()
    return output


def test_a_speculating_decode_is_one_row_of_one_plus_k_tokens():
    s = make_scheduler()
    s.add_request(loop_request("a"))
    step(s, next_token=lambda _: 5)  # the prefill: outputs [5], the loop goes on
    request = s.get_request("a")
    output = step(s, accept=lambda _: 2, next_token=lambda _: 42)
    (row,) = output.scheduled
    assert list(row.draft_token_ids) == [6, 7, 8, 5]
    assert list(row.token_ids) == [5, 6, 7, 8, 5] and row.num_computed_tokens == 12
    # lookahead blocks for positions 12..16 were taken before the step ran
    assert len(row.block_ids) == 5
    assert output.num_scheduled_tokens == 5
    # 2 drafts accepted, then the sampled token: computed moves by 3, not 5
    assert request.output_token_ids == [5, 6, 7, 42]
    assert request.num_computed_tokens == 12 + 3 and request.num_tokens == 16
    stats = s.speculator.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 4, 2)
    assert stats.num_accepted_tokens_per_pos == [1, 1, 0, 0]


def test_drafts_fit_the_budget_and_the_tokens_left():
    s = make_scheduler(max_num_batched_tokens=3)
    request = loop_request("a", max_tokens=10)
    s.add_request(request)
    while not request.output_token_ids:  # the prompt in chunks of 3, then its first token
        step(s, next_token=lambda _: 5)
    output = step(s)
    assert len(output.scheduled[0].draft_token_ids) == 2  # budget 3 = 1 + 2 drafts
    assert request.num_output_tokens == 1 + 3

    s = make_scheduler()
    s.add_request(loop_request("b", max_tokens=3))
    step(s, next_token=lambda _: 5)
    output = step(s)
    # 2 outputs left: 1 draft at most, so the step ends exactly at max_tokens
    assert len(output.scheduled[0].draft_token_ids) == 1
    assert not s.has_unfinished_requests()
    assert s.block_manager.num_free_blocks == 64


def test_a_stop_among_accepted_drafts_ends_the_request_there():
    s = make_scheduler()
    s.add_request(loop_request("eos", stop_token_ids=[7]))
    step(s, next_token=lambda _: 5)
    step(s)  # drafts 6 7 8 5, all accepted: the stop token 7 ends it
    assert not s.has_unfinished_requests()
    assert s.block_manager.num_free_blocks == 64


def test_min_tokens_holds_a_stop_among_accepted_drafts():
    s = make_scheduler()
    request = loop_request("m", stop_token_ids=[7], min_tokens=4)
    s.add_request(request)
    step(s, next_token=lambda _: 5)
    step(s, next_token=lambda _: 1)  # outputs 5 | 6 7 8 5 | 1: 7 came before min_tokens
    assert request.output_token_ids == [5, 6, 7, 8, 5, 1]
    assert request.status == RequestStatus.RUNNING


def test_drafts_that_do_not_fit_are_dropped_without_preempting():
    s = make_scheduler(num_blocks=4, max_model_len=16)
    s.add_request(Request("a", LOOP * 2 + [5, 6], SamplingParams(max_tokens=4)))
    step(s, next_token=lambda _: 7)  # 11 tokens: the decode's slot is in the third block
    s.block_manager.allocate("hog", 4)  # the last free block: the drafts would need it
    output = step(s)
    assert list(output.scheduled[0].token_ids) == [7]
    assert not output.preempted_ids
    assert s.num_preemptions_total == 0
    s.block_manager.free("hog")


def test_large_batches_and_grammar_requests_do_not_speculate():
    s = make_scheduler(spec=SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1,
                                              disable_by_batch_size=2))
    for i in range(3):
        s.add_request(loop_request(f"r{i}"))
    step(s, next_token=lambda _: 5)
    five = dict(accept=lambda _: 0, next_token=lambda _: 5)  # the suffix "5" always matches
    assert not any(r.draft_token_ids for r in step(s, **five).scheduled)  # 3 running > 2
    s.finish_requests(["r0"], RequestStatus.FINISHED_ABORTED)
    assert all(r.draft_token_ids for r in step(s, **five).scheduled)  # 2 running

    s = make_scheduler()
    grammar = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
        regex="[5-8]+"))
    s.add_request(Request("g", LOOP * 3, grammar))
    step(s, next_token=lambda _: 5)
    assert not step(s).scheduled[0].draft_token_ids


def test_a_grammar_requests_drafts_are_cut_to_what_its_grammar_lets_through():
    """With `grammar_drafts` set (the engine holds the matchers), a grammar request drafts:
    its n-gram drafts are cut, before blocks or budget are taken, to the count it answers;
    a cut to nothing is a plain decode. Requests without a grammar are not asked."""
    s = make_scheduler()
    asked = []

    def grammar_drafts(request_id, drafts):
        asked.append((request_id, list(drafts)))
        return 2 if len(asked) == 1 else 0
    s.speculator.grammar_drafts = grammar_drafts
    grammar = SamplingParams(max_tokens=16, structured_outputs=StructuredOutputsParams(
        regex="[5-8]+"))
    s.add_request(Request("g", LOOP * 3, grammar))
    s.add_request(loop_request("plain"))
    step(s, next_token=lambda _: 5)
    rows = {r.request_id: r for r in step(s).scheduled}
    assert asked == [("g", [6, 7, 8, 5])]
    assert rows["g"].draft_token_ids == [6, 7] and rows["g"].token_ids == [5, 6, 7]
    assert rows["plain"].draft_token_ids == [6, 7, 8, 5]
    step(s, next_token=lambda _: 5)  # (its suffix 99 occurred nowhere: no draft)
    rows = {r.request_id: r for r in step(s).scheduled}
    assert len(asked) == 2 and not rows["g"].draft_token_ids and len(rows["g"].token_ids) == 1


def test_rejected_drafts_pause_the_request_then_it_tries_again():
    s = make_scheduler(max_num_batched_tokens=128)
    s.add_request(loop_request("a", repeats=2, max_tokens=100))
    step(s, next_token=lambda _: 5)
    drafted = []
    for _ in range(40):  # the model never follows the loop: every draft rejected
        output = step(s, accept=lambda _: 0, next_token=lambda row: row.token_ids[0])
        drafted.append(bool(output.scheduled[0].draft_token_ids))
    # drafts until the running average falls below MIN_ACCEPTED_PER_DRAFT, then a pause
    first_pause = drafted.index(False)
    assert 1 <= first_pause and (1 - 0.25) ** first_pause < MIN_ACCEPTED_PER_DRAFT + 0.1
    assert any(drafted[first_pause:])  # tried again later
    assert drafted.count(True) < 20


def test_rejected_drafts_are_never_hashed_into_the_prefix_cache():
    rng = random.Random(3)
    s = make_scheduler(num_blocks=40, enable_prefix_caching=True, max_num_batched_tokens=16)
    for i in range(6):
        s.add_request(loop_request(f"r{i}", repeats=rng.randint(1, 4), max_tokens=20))
    while s.has_unfinished_requests():
        # random acceptance; rejected drafts' slots hold tokens the requests never get
        step(s, accept=lambda row: rng.randint(0, len(row.draft_token_ids)),
             next_token=lambda _: rng.choice(LOOP + [1, 2]))
        for request in s._requests.values():  # hashed blocks hold computed tokens only
            num_hashed = s.block_manager._num_hashed.get(request.request_id, 0)
            assert num_hashed <= request.num_computed_tokens // 4
    assert s.block_manager.num_free_blocks == 40
    assert s.speculator.stats.num_accepted_tokens > 0


def test_random_runs_with_preemption_leak_no_block():
    rng = random.Random(7)
    for trial in range(5):
        s = make_scheduler(num_blocks=24, max_num_batched_tokens=12, max_num_seqs=4,
                           enable_prefix_caching=trial % 2 == 0)
        for i in range(8):
            s.add_request(loop_request(f"r{i}", repeats=rng.randint(1, 3),
                                       max_tokens=rng.randint(1, 24),
                                       stop_token_ids=[rng.choice([7, 99])]))
        for _ in range(400):
            if not s.has_unfinished_requests():
                break
            step(s, accept=lambda row: rng.randint(0, len(row.draft_token_ids)),
                 next_token=lambda _: rng.choice(LOOP + [1]))
        assert not s.has_unfinished_requests()
        assert s.block_manager.num_free_blocks == 24
        # nothing kept for requests that left (finished, or aborted between steps)
        assert not s.speculator._indexes and not s.speculator._acceptance


def test_a_draft_model_decode_gets_k_slots_under_the_same_gates():
    """Method draft_model: the scheduler plans k DRAFT_SLOTs (the runner's draft model fills
    them), for any request, n-gram match or not, within the batch-size table, the budget and
    the tokens left; the runner's accepted tokens become the request's."""
    from carpool.core.scheduler_output import DRAFT_SLOT

    spec = SpeculativeConfig(method="draft_model", model="/a/draft", num_speculative_tokens=3,
                             disable_by_batch_size=1)
    s = make_scheduler(spec=spec)
    s.add_request(Request("a", [9, 10, 11], SamplingParams(max_tokens=6)))  # no repeats
    step(s, next_token=lambda _: 1)
    output = s.schedule()
    (row,) = output.scheduled
    assert list(row.draft_token_ids) == [DRAFT_SLOT] * 3
    assert list(row.token_ids) == [1, DRAFT_SLOT, DRAFT_SLOT, DRAFT_SLOT]
    s.update(output, {"a": 4}, {"a": [2, 3]})  # the draft model's tokens, two accepted
    request = s.get_request("a")
    assert request.output_token_ids == [1, 2, 3, 4] and request.num_computed_tokens == 6
    output = s.schedule()  # 2 tokens left: one draft at most
    assert list(output.scheduled[0].draft_token_ids) == [DRAFT_SLOT]
    s.update(output, {"a": 6}, {"a": [5]})
    assert request.output_token_ids == [1, 2, 3, 4, 5, 6] and request.is_finished
    s.add_request(Request("b", [9, 10, 11], SamplingParams(max_tokens=6)))
    s.add_request(Request("c", [9, 10, 11], SamplingParams(max_tokens=6)))
    step(s, next_token=lambda _: 1)
    assert not any(r.draft_token_ids for r in step(s).scheduled)  # 2 running > 1


def test_each_failed_try_doubles_the_pause():
    """A request whose drafts are never accepted pauses 8, 16, 32, ... decodes between
    tries (up to MAX_PAUSE_STEPS): the first rejection after a pause must not count as a
    success (it once did, so the pause stayed at 8 and a quarter of the decodes drafted)."""
    from carpool.core.speculator import MAX_PAUSE_STEPS

    s = make_scheduler(num_blocks=256, max_num_batched_tokens=128, max_model_len=1024)
    s.add_request(loop_request("a", repeats=2, max_tokens=600))
    step(s, next_token=lambda _: 5)
    drafted = [bool(step(s, accept=lambda _: 0, next_token=lambda row: row.token_ids[0])
                    .scheduled[0].draft_token_ids) for _ in range(500)]
    pauses, run = [], 0
    for flag in drafted:
        if flag and run:
            pauses.append(run)
        run = 0 if flag else run + 1
    assert pauses[:5] == [8, 16, 32, 64, 128]
    assert set(pauses[5:]) <= {MAX_PAUSE_STEPS}
    assert drafted.count(True) < 30


def test_a_pause_ends_early_in_growth_once_drafts_are_accepted_again():
    """After a try whose drafts are accepted, the next pause starts from 8 again."""
    s = make_scheduler(num_blocks=256, max_num_batched_tokens=128, max_model_len=1024)
    s.add_request(loop_request("a", repeats=2, max_tokens=600))
    step(s, next_token=lambda _: 5)
    accept_all = [False]
    drafted = []
    for i in range(200):
        accept_all[0] = 60 <= i < 90  # accepted for a while, then rejected again
        output = step(s, accept=lambda row: len(row.draft_token_ids) if accept_all[0] else 0,
                      next_token=lambda row: row.token_ids[0])
        drafted.append(bool(output.scheduled[0].draft_token_ids))
    pauses, run, starts = [], 0, []
    for i, flag in enumerate(drafted):
        if flag and run:
            pauses.append(run)
            starts.append(i)
        run = 0 if flag else run + 1
    after = [p for p, start in zip(pauses, starts) if start > 90]
    assert after and after[0] == 8


def test_a_draft_models_passes_are_charged_to_its_average():
    """With draft_pass_cost c, a draft of k tokens earns accepted - k * c: drafts that are
    all accepted but cost as much as they save (c = 1) pause; free ones never do."""
    def drafted(cost):
        spec = SpeculativeConfig(method="draft_model", model="/a/draft",
                                 num_speculative_tokens=3, draft_pass_cost=cost)
        s = make_scheduler(num_blocks=256, spec=spec, max_model_len=1024)
        s.add_request(Request("a", [9, 10, 11], SamplingParams(max_tokens=300)))
        step(s, next_token=lambda _: 1)
        return [bool(step(s).scheduled[0].draft_token_ids) for _ in range(40)]
    assert all(drafted(0.0))
    assert all(drafted(0.2))  # 3 - 0.6 earned per draft
    charged = drafted(1.0)  # 3 - 3 earned: pauses
    assert not all(charged) and charged.count(True) < 20


def test_a_draft_models_slots_the_runner_did_not_fill_are_not_counted():
    """Issue 61: a grammar may cut a draft model's drafts short of the k slots planned; the
    runner reports how many it drafted, and the counters and the running average count
    those: one drafted token accepted of 3 slots earns 1 - 0.3 (no pause), not 1 - 0.9; a
    draft cut to none is a plain decode, neither a draft nor a rejection."""
    spec = SpeculativeConfig(method="draft_model", model="/a/draft", num_speculative_tokens=3,
                             draft_pass_cost=0.3)
    s = make_scheduler(num_blocks=256, spec=spec, max_model_len=1024)
    s.add_request(Request("a", [9, 10, 11], SamplingParams(max_tokens=300)))
    step(s, next_token=lambda _: 1)
    for i in range(40):
        output = s.schedule()
        assert len(output.scheduled[0].draft_token_ids) == 3  # never paused
        if i % 2:
            s.update(output, {"a": 7}, {"a": [5]}, {"a": 1})  # one drafted, accepted
        else:
            s.update(output, {"a": 7}, {}, {"a": 0})  # the grammar cut every draft
    stats = s.speculator.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (20, 20, 20)
    assert stats.num_accepted_tokens_per_pos == [20]
    s.block_manager.check_integrity()
