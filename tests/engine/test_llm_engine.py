"""LLMEngine and LLM behaviour: validation, abort, faults, stop strings, batch invariance,
seeded sampling, n > 1, chat, logprobs and the stats they report."""

from __future__ import annotations

import dataclasses
import random

import pytest

from carpool import LLM, SamplingParams
from carpool.config import EngineConfig
from carpool.engine.llm_engine import LLMEngine

from carpool.testing.checkpoints import random_prompt

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(separated_checkpoint):
    return str(separated_checkpoint("llama"))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=256, max_model_len=512)


def make_engine(model_dir, **scheduler) -> LLMEngine:
    config = EngineConfig.from_args(model_dir, dtype="float32", device="cpu", num_kv_blocks=64,
                                    max_model_len=256, **scheduler)
    return LLMEngine.from_config(config)


def run_to_end(engine: LLMEngine) -> dict[str, list]:
    """Step until idle; request id -> its StepOutputs in order."""
    outputs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def prompts(seed: int, num: int, low: int = 1, high: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_prompt(rng, rng.randint(low, high)) for _ in range(num)]


# ---- validation ----------------------------------------------------------------------------

@pytest.mark.parametrize("prompt, params, message", [
    ("", SamplingParams(), "prompt must not be empty"),
    ([], SamplingParams(), "prompt must not be empty"),
    ([1, 512], SamplingParams(), r"prompt token id 512 is out of range \[0, 512\)"),
    ([1, -1], SamplingParams(), "out of range"),
    ([1, 2.0], SamplingParams(), "must be integers, got 2.0"),
    ([True], SamplingParams(), "must be integers"),
    ([1] * 250, SamplingParams(max_tokens=10), "maximum context length is 256 tokens. However, "
     r"you requested 260 tokens \(250 in the prompt, 10 for the completion\)"),
    ([1] * 256, SamplingParams(max_tokens=None), "maximum context length is 256"),
    ([1, 2], SamplingParams(n=2), "n=1"),
    ([1, 2], SamplingParams(stop_token_ids=[3, 600, 512]),
     r"^stop_token_ids must be ids in \[0, 512\), got \[512, 600\]"),
    # too long, refused before its ids are walked (or a huge text tokenized whole)
    ([1] * 2_000_000, SamplingParams(), "maximum context length is 256 tokens. However, the "
     "prompt has 2000000 tokens"),
    ("hello world " * 100_000, SamplingParams(), "maximum context length is 256 tokens. "
     "However, the prompt has more than"),
])
def test_add_request_rejects_bad_input(model_dir, prompt, params, message):
    engine = make_engine(model_dir)
    with pytest.raises(ValueError, match=message):
        engine.add_request("r", prompt, params)
    assert not engine.has_unfinished_requests()


def test_add_request_rejects_duplicates_and_requests_that_never_fit(model_dir):
    engine = make_engine(model_dir, block_size=4)  # 64 blocks of 4 = 256 tokens
    assert engine.add_request("a", [1, 2, 3], GREEDY) == 3
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [4], GREEDY)
    engine.abort_request("a")
    run_to_end(engine)
    engine.add_request("a", [4], GREEDY)  # a finished id may be used again
    config = EngineConfig.from_args(model_dir, dtype="float32", device="cpu", num_kv_blocks=8,
                                    max_model_len=256, block_size=4)
    tiny = LLMEngine.from_config(config)
    with pytest.raises(ValueError, match="8 blocks"):
        tiny.add_request("b", [1] * 30, SamplingParams(max_tokens=10))


def test_numpy_token_ids_are_accepted_as_ints(model_dir):
    import numpy as np

    engine = make_engine(model_dir)
    assert engine.add_request("r", list(np.arange(5, 12)), GREEDY) == 7
    assert engine.scheduler.get_request("r").prompt_token_ids == list(range(5, 12))
    assert all(type(t) is int for t in engine.scheduler.get_request("r").prompt_token_ids)


def test_max_tokens_none_fills_up_to_max_model_len(model_dir):
    engine = make_engine(model_dir)
    engine.add_request("r", [1] * 250, SamplingParams(max_tokens=None, ignore_eos=True,
                                                      temperature=0.0))
    outs = run_to_end(engine)["r"]
    assert outs[-1].num_output_tokens == 6 and outs[-1].finish_reason == "length"


def test_bad_prompt_in_a_list_leaves_nothing_queued(llm):
    with pytest.raises(ValueError, match="out of range"):
        llm.generate(["ok", {"prompt_token_ids": [1, 99999]}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="2 sampling_params for 3 prompts"):
        llm.generate(["a", "b", "c"], [GREEDY, GREEDY], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.stats().num_waiting == 0


# ---- abort and faults ----------------------------------------------------------------------

def test_abort_frees_blocks_and_reports_once(model_dir):
    engine = make_engine(model_dir)
    for i, prompt in enumerate(prompts(1, 4)):
        engine.add_request(f"r{i}", prompt, GREEDY)
    engine.step()
    engine.step()
    free_before = engine.stats().num_free_blocks
    engine.abort_request(["r1", "r3", "unknown"])
    assert engine.stats().num_free_blocks > free_before  # freed at once, not next step
    outs = engine.step()
    aborted = [o for o in outs if o.finish_reason == "abort"]
    assert sorted(o.request_id for o in aborted) == ["r1", "r3"]
    assert all(o.request_metrics.finished_time is not None for o in aborted)
    engine.abort_request("r1")  # already gone: ignored
    rest = run_to_end(engine)
    assert set(rest) == {"r0", "r2"}
    assert all(rest[r][-1].finish_reason == "length" for r in rest)
    engine.check_integrity()
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_fault_fails_only_that_steps_requests(model_dir):
    engine = make_engine(model_dir, max_num_seqs=2)
    for i, prompt in enumerate(prompts(2, 4)):
        engine.add_request(f"r{i}", prompt, GREEDY)
    engine.step()  # r0, r1 run; r2, r3 wait for a seat

    def explode(sched_out):
        raise RuntimeError("device on fire")

    engine.step_hook = explode
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == ["r0", "r1"]
    assert all(o.finish_reason == "error" and "device on fire" in o.error for o in outs)
    engine.step_hook = None
    rest = run_to_end(engine)
    assert set(rest) == {"r2", "r3"}
    assert [len(sum((o.new_token_ids for o in rest[r]), [])) for r in rest] == [24, 24]
    engine.check_integrity()


# ---- outputs -------------------------------------------------------------------------------

def test_step_outputs_are_deltas_that_add_up(model_dir):
    engine = make_engine(model_dir, max_num_batched_tokens=16)
    engine.add_request("r", list(range(40)), SamplingParams(temperature=0.0, max_tokens=10,
                                                            ignore_eos=True))
    outs = run_to_end(engine)["r"]
    assert sum(len(o.new_token_ids) for o in outs) == 10 == outs[-1].num_output_tokens
    assert [o.num_output_tokens for o in outs] == list(range(1, 11))  # prefill chunks say nothing
    assert not any(o.finished for o in outs[:-1])
    metrics = outs[-1].request_metrics
    assert (metrics.arrival_time <= metrics.first_scheduled_time
            <= metrics.first_token_time <= metrics.finished_time)
    assert metrics.num_preemptions == 0


def test_stop_string_through_the_engine(llm):
    prompt = {"prompt_token_ids": list(range(100, 130))}
    full = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    text = full.text
    # A 4-character stop string from the middle of the text (random models emit stray
    # bytes, shown as U+FFFD; the stop string avoids them).
    start = next(i for i in range(len(text) // 2, len(text) - 4)
                 if "\ufffd" not in text[i:i + 4])
    stop = text[start:start + 4]
    for include in (False, True):
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                stop=[stop], include_stop_str_in_output=include)
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        cut = text.index(stop) + (len(stop) if include else 0)
        assert out.text == text[:cut]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.token_ids == full.token_ids[:len(out.token_ids)]
        assert len(out.token_ids) < 40
    assert llm.stats().num_free_blocks == llm.stats().num_total_blocks


def test_stop_token_ids_and_logprobs(llm):
    prompt = {"prompt_token_ids": list(range(7, 30))}
    full = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                               logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(full.logprobs) == 12
    for token_id, position in zip(full.token_ids, full.logprobs):
        assert token_id in position and position[token_id].rank == 1  # greedy: the top token
        assert len(position) >= 3
        assert position[token_id].decoded_token == llm.get_tokenizer().decode([token_id])
    assert full.cumulative_logprob == pytest.approx(
        sum(p[t].logprob for t, p in zip(full.token_ids, full.logprobs)))
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                              stop_token_ids=[stop_id]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == full.token_ids[:first + 1]
    assert out.outputs[0].stop_reason == stop_id and out.outputs[0].finish_reason == "stop"


# ---- invariance and seeds ------------------------------------------------------------------

def test_batch_invariance_greedy(llm):
    target = {"prompt_token_ids": prompts(3, 1, 150, 150)[0]}
    alone = llm.generate(target, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": p} for p in prompts(4, 20, 1, 120)]
    batch = llm.generate(others[:10] + [target] + others[10:], GREEDY, use_tqdm=False)
    assert batch[10].outputs[0].token_ids == alone


def test_seeded_sampling_is_batch_independent(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=42, ignore_eos=True)
    target = {"prompt_token_ids": list(range(50, 80))}
    alone = llm.generate(target, params, use_tqdm=False)[0].outputs[0]
    noise = [{"prompt_token_ids": p} for p in prompts(5, 12)]
    noisy_params = [SamplingParams(temperature=1.0, max_tokens=20, seed=i if i % 2 else None)
                    for i in range(12)]
    batch = llm.generate(noise[:6] + [target] + noise[6:],
                         noisy_params[:6] + [params] + noisy_params[6:], use_tqdm=False)
    assert batch[6].outputs[0].token_ids == alone.token_ids
    assert batch[6].outputs[0].text == alone.text
    other_seed = llm.generate(target, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20,
                                                     seed=43, ignore_eos=True), use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != alone.token_ids


def test_n_fans_out_with_seed_plus_index(llm):
    prompt = {"prompt_token_ids": list(range(10, 20))}
    params = dict(temperature=1.0, max_tokens=16, ignore_eos=True)
    out = llm.generate(prompt, SamplingParams(n=3, seed=7, **params), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for i, completion in enumerate(out.outputs):
        single = llm.generate(prompt, SamplingParams(seed=7 + i, **params), use_tqdm=False)[0]
        assert completion.token_ids == single.outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3


# ---- front doors ---------------------------------------------------------------------------

def test_text_prompts_and_input_order(llm):
    texts = ["def f(x):", "import os\n", "class A:"]
    outs = llm.generate(texts, GREEDY, use_tqdm=True)
    tokenizer = llm.get_tokenizer()
    for text, out in zip(texts, outs):
        assert out.prompt == text and out.prompt_token_ids == tokenizer.encode(text)
        by_ids = llm.generate({"prompt_token_ids": out.prompt_token_ids}, GREEDY,
                              use_tqdm=False)[0]
        assert by_ids.outputs[0].token_ids == out.outputs[0].token_ids
        assert by_ids.prompt is None


def test_chat_uses_the_template(llm):
    messages = [{"role": "user", "content": "hello"}]
    out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    assert out.prompt == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt)
    two = llm.chat([messages, messages + [{"role": "assistant", "content": "hi"}]], GREEDY,
                   use_tqdm=False)
    assert two[0].outputs[0].token_ids == out.outputs[0].token_ids and len(two) == 2


def test_stats_report_the_work_done(model_dir):
    engine = make_engine(model_dir, max_num_batched_tokens=32)
    engine.add_request("a", list(range(50)), GREEDY)
    engine.add_request("b", list(range(5)), GREEDY)
    engine.step()
    stats = engine.stats()
    assert stats.last_step_num_tokens == 32 == stats.last_step_num_prefill_tokens
    assert stats.num_running == 1 and stats.num_waiting == 1
    assert 0 < stats.kv_cache_usage <= 1
    run_to_end(engine)
    stats = engine.stats()
    assert stats.num_generated_tokens == 48 and stats.num_prompt_tokens == 55
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks == 64
    assert stats.kv_cache_usage == 0.0 and stats.num_steps >= 24


def test_generate_raises_on_engine_errors_and_cleans_up_on_interrupt(model_dir):
    llm = LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=256)
    batch = [{"prompt_token_ids": p} for p in prompts(6, 3)]
    calls = []

    def fail_once(sched_out, exc):
        calls.append(1)
        if len(calls) == 2:
            raise exc

    llm.engine.step_hook = lambda s: fail_once(s, RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="failed in the engine.*boom"):
        llm.generate(batch, GREEDY, use_tqdm=False)
    calls.clear()
    llm.engine.step_hook = lambda s: fail_once(s, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        llm.generate(batch, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()
    llm.engine.step_hook = None
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [24, 24, 24]


def test_llm_refuses_trust_remote_code():
    from carpool import LLM

    with pytest.raises(ValueError, match="trust_remote_code"):
        LLM(trust_remote_code=True)


def test_text_at_finish_is_the_text_the_steps_add_up_to(model_dir):
    """`LLM.generate`'s requests decode their text once, when they finish: the same text as
    the per-step deltas of a streamed request (a random model's stray bytes included), and
    none before the finishing output; a request with stop strings still decodes each step."""
    engine = make_engine(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    batch = prompts(seed=11, num=6)
    for i, prompt in enumerate(batch):
        engine.add_request(f"step-{i}", prompt, params)
        engine.add_request(f"end-{i}", prompt, params, text_at_finish=True)
    outputs = run_to_end(engine)
    for i in range(len(batch)):
        stepped, at_end = outputs[f"step-{i}"], outputs[f"end-{i}"]
        assert [o.new_token_ids for o in at_end] == [o.new_token_ids for o in stepped]
        assert all(o.new_text == "" for o in at_end[:-1])
        assert at_end[-1].new_text == "".join(o.new_text for o in stepped) != ""
    text = "".join(o.new_text for o in outputs["step-0"])
    start = next(i for i in range(len(text) // 2, len(text) - 2)
                 if "\ufffd" not in text[i:i + 2])  # stray bytes aside, as above
    stop = text[start:start + 2]
    engine.add_request("stop", batch[0], dataclasses.replace(params, stop=[stop]),
                       text_at_finish=True)
    outs = run_to_end(engine)["stop"]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop
    assert "".join(o.new_text for o in outs) == text[:text.index(stop)]
    assert len(outs) < 30
