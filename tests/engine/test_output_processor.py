"""The front end's OutputProcessor over a token-ids-only engine (the engine-core process's
`LLMEngine(detokenize=False)`) gives what the detokenizing engine gives: the same text,
finish reasons, stop strings, token ids and logprobs' decoded tokens."""

from __future__ import annotations

from carpool import SamplingParams
from carpool.config import EngineConfig
from carpool.engine.llm_engine import LLMEngine
from carpool.engine.output_processor import OutputProcessor
from carpool.engine.tokenizer import load_tokenizer


def _engine(model_dir: str, detokenize: bool) -> LLMEngine:
    config = EngineConfig.from_args(model_dir, dtype="float32", device="cpu", num_kv_blocks=64,
                                    max_model_len=256)
    return LLMEngine.from_config(config, detokenize=detokenize)


def _fold(outputs) -> dict[str, dict]:
    folded: dict[str, dict] = {}
    for out in outputs:
        entry = folded.setdefault(out.request_id, {"text": "", "ids": [], "decoded": []})
        entry["text"] += out.new_text
        entry["ids"] += out.new_token_ids
        for position in out.new_logprobs or []:
            entry["decoded"] += sorted((t, lp.decoded_token) for t, lp in position.items())
        if out.finished:
            entry.update(finish=out.finish_reason, stop=out.stop_reason)
    return folded


def test_front_end_text_matches_the_detokenizing_engine(separated_checkpoint):
    model_dir = str(separated_checkpoint("llama"))
    prompt = list(range(100, 130))
    probe = _engine(model_dir, detokenize=True)
    probe.add_request("probe", prompt, SamplingParams(temperature=0.0, max_tokens=30,
                                                      ignore_eos=True))
    text = ""
    while probe.has_unfinished_requests():
        text += "".join(o.new_text for o in probe.step())
    start = next(i for i in range(len(text) // 2, len(text) - 3)
                 if "\ufffd" not in text[i:i + 3])
    stop = text[start:start + 3]  # from the middle: it ends a request early
    requests = {
        "plain": SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2),
        "stop": SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop]),
        "stop-kept": SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                    stop=[stop], include_stop_str_in_output=True),
        "never": SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                stop=["\x00never"]),
    }
    expected_engine, split_engine = (_engine(model_dir, d) for d in (True, False))
    processor = OutputProcessor(load_tokenizer(model_dir))
    for rid, params in requests.items():
        expected_engine.add_request(rid, prompt, params)
        split_engine.add_request(rid, prompt, params)
        processor.add(rid, prompt, params)
    expected = []
    while expected_engine.has_unfinished_requests():
        expected += expected_engine.step()
    delivered, num_aborts = [], 0
    while split_engine.has_unfinished_requests():
        step = processor.process(split_engine.step())
        assert all(not o.new_text for o in step.for_metrics)  # the engine made no text
        delivered += step.for_streams
        split_engine.abort_request(step.to_abort)  # what the client sends the engine
        num_aborts += len(step.to_abort)
    got, want = _fold(delivered), _fold(expected)
    assert got == want
    assert want["stop"]["finish"] == "stop" and want["stop"]["stop"] == stop
    assert want["plain"]["decoded"] and all(d is not None for _, d in want["plain"]["decoded"])
    assert num_aborts == 2
    assert [o.request_id for o in delivered if o.finished].count("stop") == 1
    split_engine.check_integrity()
