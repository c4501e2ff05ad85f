"""`speculative_config`: vLLM's keys, each bad key or value a ValueError naming it; the
batch-size table; the flag and `LLM(speculative_config=...)` build the same config."""

from __future__ import annotations

import pytest

from carpool.config import EngineConfig
from carpool.core.spec_config import DEFAULT_MAX_SPECULATIVE_BATCH, SpeculativeConfig
from tests.flags import serve_parser


def test_vllm_mapping_and_json_text_build_the_same_config():
    mapping = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
               "prompt_lookup_max": 4}
    config = SpeculativeConfig.from_dict(mapping)
    assert config == SpeculativeConfig.from_dict(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, '
        '"prompt_lookup_max": 4}')
    assert (config.num_speculative_tokens, config.prompt_lookup_min,
            config.prompt_lookup_max) == (3, 2, 4)
    assert SpeculativeConfig.from_dict(None) is None
    assert SpeculativeConfig.from_dict({}) is None


def test_one_lookup_bound_sets_the_other_as_vllm():
    assert SpeculativeConfig.from_dict({"method": "ngram",
                                        "prompt_lookup_max": 1}).prompt_lookup_min == 1
    assert SpeculativeConfig.from_dict({"method": "ngram",
                                        "prompt_lookup_min": 7}).prompt_lookup_max == 7


@pytest.mark.parametrize("mapping,names", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "eagle"}, "method"),
    ({"method": "draft_model"}, "model"),
    ({"method": "draft_model", "model": ""}, "model"),
    ({"method": "ngram", "model": "/a/draft"}, "model"),
    ({"method": "ngram", "draft_pass_cost": 0.5}, "draft_pass_cost"),
    ({"method": "draft_model", "model": "/a/draft", "draft_pass_cost": -1}, "draft_pass_cost"),
    ({"method": "draft_model", "model": "/a/draft", "draft_pass_cost": "1"},
     "draft_pass_cost"),
    ({"method": "draft_model", "model": "/a/draft", "draft_pass_cost": True},
     "draft_pass_cost"),
    ({"method": "draft_model", "model": "/a/draft", "prompt_lookup_max": 3},
     "prompt_lookup_max"),
    ({"num_speculative_tokens": 4}, "method"),
    ({"method": "ngram", "lookahead": 2}, "lookahead"),
    ({"method": "ngram", "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min"),
    ({"method": "ngram", "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens_per_batch_size": [[4, 9]]},
     "num_speculative_tokens_per_batch_size"),
    ({"method": "ngram", "num_speculative_tokens_per_batch_size": [[8, 2], [4, 4]]},
     "num_speculative_tokens_per_batch_size"),
    ({"method": "ngram", "num_speculative_tokens_per_batch_size": [4]},
     "num_speculative_tokens_per_batch_size"),
])
def test_bad_keys_and_values_name_the_key(mapping, names):
    with pytest.raises(ValueError, match=rf"speculative_config\.{names}\b"):
        SpeculativeConfig.from_dict(mapping)
    with pytest.raises(ValueError, match=rf"speculative_config\.{names}\b"):
        EngineConfig.from_args(speculative_config=mapping)


def test_not_json_and_not_a_mapping_are_errors():
    with pytest.raises(ValueError, match="speculative_config must be a JSON object"):
        SpeculativeConfig.from_dict("{method: ngram}")
    with pytest.raises(ValueError, match="speculative_config must be a mapping"):
        SpeculativeConfig.from_dict("[1, 2]")


def test_batch_size_table_and_its_default():
    default = SpeculativeConfig(num_speculative_tokens=4)
    assert default.num_tokens_for_batch(1) == 4
    assert default.num_tokens_for_batch(DEFAULT_MAX_SPECULATIVE_BATCH) == 4
    assert default.num_tokens_for_batch(DEFAULT_MAX_SPECULATIVE_BATCH + 1) == 0
    assert SpeculativeConfig(disable_by_batch_size=16).num_tokens_for_batch(16) == 4
    assert SpeculativeConfig(disable_by_batch_size=16).num_tokens_for_batch(17) == 0
    table = SpeculativeConfig(num_speculative_tokens_per_batch_size=[[1, 4], [8, 2]])
    assert [table.num_tokens_for_batch(b) for b in (1, 2, 8, 9)] == [4, 2, 2, 0]


def test_flag_reaches_the_engine_config_and_static_is_refused():
    args = serve_parser().parse_args(["--speculative-config",
                                      '{"method": "ngram", "num_speculative_tokens": 2}'])
    config = EngineConfig.from_cli_args(args)
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=2)
    assert EngineConfig.from_cli_args(serve_parser().parse_args([])).speculative_config is None
    bad = serve_parser().parse_args(["--speculative-config", '{"method": "ngram", "k": 2}'])
    with pytest.raises(ValueError, match=r"--speculative-config\.k is not a known key"):
        EngineConfig.from_cli_args(bad)
    with pytest.raises(ValueError, match="speculative_config needs the continuous scheduler"):
        EngineConfig.from_args(speculative_config={"method": "ngram"}, scheduler="static")
