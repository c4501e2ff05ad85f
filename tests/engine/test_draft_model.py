"""Speculative method `draft_model` with a smaller draft: a truncated copy of the target
(its first layer) keeps every greedy output token-identical on all four architectures while
chunked prefill preempts requests; the batch-size and acceptance gates stop drafts that do
not pay; a draft that cannot draft for the target, or a combination the draft path does not
run, is refused with an error naming the option."""

from __future__ import annotations

import json
import shutil

import pytest

from carpool import LLM
from carpool.config import EngineConfig
from carpool.testing.checkpoints import truncated_checkpoint
from tests.engine.conftest import SEPARATED
from tests.engine.test_speculative_decoding import (
    ARCHS,
    SETTINGS,
    assert_clean,
    greedy,
    repetitive_prompts,
)


@pytest.fixture(scope="module")
def truncated(separated_checkpoint, tmp_path_factory):
    """truncated(arch) -> (target folder, its 1-layer copy)."""
    cache = {}

    def make(arch):
        if arch not in cache:
            target = separated_checkpoint(arch)
            cache[arch] = (str(target), str(truncated_checkpoint(
                target, tmp_path_factory.mktemp(f"draft_{arch}"), num_layers=1)))
        return cache[arch]
    return make


def draft_config(draft: str, **extra) -> dict:
    """Drafts in every step these small batches run, the draft's passes free to the pause
    (unless `extra` says otherwise)."""
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": 3,
            "disable_by_batch_size": 64, "draft_pass_cost": 0, **extra}


@pytest.mark.parametrize("arch", ARCHS)
def test_a_smaller_draft_keeps_greedy_outputs_under_chunking_and_preemption(arch, truncated):
    path, draft = truncated(arch)
    prompts = repetitive_prompts(7)
    setting = SETTINGS["chunked_preemption"]
    with LLM(path, dtype="float32", device="cpu", **setting) as plain:
        expected = greedy(plain, prompts, 48)
    with LLM(path, dtype="float32", device="cpu", speculative_config=draft_config(draft),
             **setting) as llm:
        assert greedy(llm, prompts, 48) == expected
        stats = llm.stats()
        assert_clean(llm)
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert stats.num_preemptions > 0


def test_the_batch_size_gate_stops_drafts_in_larger_steps(truncated, monkeypatch):
    """Four requests running together, drafts allowed up to one running: none drafts, and
    the draft model never runs (not even their prefills: a large batch pays nothing for
    it); alone, a request catches its draft up and drafts, its output unchanged."""
    from carpool.runner.draft_proposer import DraftProposer

    path, draft = truncated("qwen3")
    forwards = []
    original = DraftProposer._forward
    monkeypatch.setattr(DraftProposer, "_forward",
                        lambda self, rows, *masks: forwards.append(len(rows))
                        or original(self, rows, *masks))
    prompts = [[5, 6, 7, 8] * 3, [9, 10, 11] * 4, [12, 13] * 6, [14] * 12]
    with LLM(path, dtype="float32", device="cpu", num_kv_blocks=128) as plain:
        expected = greedy(plain, prompts, 16, ignore_eos=True)
    with LLM(path, dtype="float32", device="cpu", num_kv_blocks=128,
             speculative_config=draft_config(draft, disable_by_batch_size=1)) as llm:
        assert greedy(llm, prompts, 16, ignore_eos=True) == expected
        assert llm.stats().spec_decode_num_drafts == 0 and forwards == []
        # one request alone: drafts after catching its draft KV up from position 0
        assert greedy(llm, prompts[:1], 16, ignore_eos=True) == expected[:1]
        assert llm.stats().spec_decode_num_drafts > 0 and forwards
        assert_clean(llm)


def test_the_acceptance_gate_pauses_a_draft_that_is_never_right(make_checkpoint,
                                                                separated_checkpoint):
    """An unrelated draft (another random model, same vocabulary) is never accepted: its
    requests pause drafting after a few rejections, so most steps are plain decodes."""
    path = str(separated_checkpoint("qwen3"))
    stranger = str(make_checkpoint("qwen3", seed=5, num_hidden_layers=1, **SEPARATED))
    prompts, max_tokens = repetitive_prompts(7), 64
    with LLM(path, dtype="float32", device="cpu", num_kv_blocks=256) as plain:
        expected = greedy(plain, prompts, max_tokens, ignore_eos=True)
    with LLM(path, dtype="float32", device="cpu", num_kv_blocks=256,
             speculative_config=draft_config(stranger)) as llm:
        assert greedy(llm, prompts, max_tokens, ignore_eos=True) == expected
        stats = llm.stats()
    assert stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens // 10
    # (without the pause every decode would draft: about len(prompts) * max_tokens; with
    # pauses that stayed at 8 decodes, a quarter of them)
    assert 0 < stats.spec_decode_num_drafts < len(prompts) * max_tokens // 4


def test_a_draft_that_cannot_draft_for_the_target_is_refused(make_checkpoint,
                                                             separated_checkpoint, tmp_path):
    path = str(separated_checkpoint("llama"))

    def refused(draft, says, **arguments):
        with pytest.raises(ValueError, match=says):
            EngineConfig.from_args(path, speculative_config=draft_config(str(draft)),
                                   **arguments)
    refused(make_checkpoint("llama", vocab_size=640), r"speculative_config\.model: the "
            r"draft's vocab_size \(640\) differs from the target's \(512\)")
    swapped = tmp_path / "swapped"
    shutil.copytree(path, swapped)
    tokenizer = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (swapped / "tokenizer.json").write_text(json.dumps(tokenizer))
    refused(swapped, r"speculative_config\.model: the draft's tokenizer\.json")
    refused(make_checkpoint("qwen3_moe"), r"speculative_config\.model: a mixture-of-experts")
    refused(tmp_path / "no-such-draft", r"speculative_config\.model: .*no-such-draft")
    refused(make_checkpoint("llama", max_position_embeddings=64),
            r"speculative_config\.model: the draft's max_position_embeddings \(64\) is below "
            r"max_model_len \(2048\)")
    refused(path, r"speculative_config\.method 'draft_model' does not support "
            r"tensor_parallel_size", tensor_parallel_size=2)
    refused(path, r"speculative_config\.method 'draft_model' does not support enable_lora",
            enable_lora=True)
    with pytest.raises(ValueError, match=r"speculative_config\.prompt_lookup_min"):
        EngineConfig.from_args(path, speculative_config=draft_config(path, prompt_lookup_min=2))


def test_the_pause_charges_a_draft_for_its_passes(truncated):
    """Unset, draft_pass_cost is the draft's weight bytes over the target's; a draft as
    costly as the target (itself) earns nothing net even when every draft is accepted, so
    its requests pause, and their outputs stay those without speculation."""
    path, draft = truncated("qwen3")
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3,
            "disable_by_batch_size": 64}
    cost = EngineConfig.from_args(path, speculative_config=spec).speculative_config
    assert 0.3 < cost.draft_pass_cost < 0.9  # 1 of 2 layers, plus the embeddings and head
    itself = EngineConfig.from_args(path, speculative_config={**spec, "model": path})
    assert itself.speculative_config.draft_pass_cost == 1.0
    prompts, max_tokens = repetitive_prompts(7), 64
    with LLM(path, dtype="float32", device="cpu", num_kv_blocks=256) as plain:
        expected = greedy(plain, prompts, max_tokens, ignore_eos=True)
    drafts = {}
    for charged in (0, None):
        config = {**spec, "model": path, "draft_pass_cost": charged}
        with LLM(path, dtype="float32", device="cpu", num_kv_blocks=256,
                 speculative_config=config) as llm:
            assert greedy(llm, prompts, max_tokens, ignore_eos=True) == expected
            stats = llm.stats()
            assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
            drafts[charged] = stats.spec_decode_num_drafts
    assert 0 < drafts[None] < drafts[0] * 3 // 4  # (paused between tries of 3 drafts)
