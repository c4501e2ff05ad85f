"""Speculative decoding's settings, under vLLM's `speculative_config` keys, validated when built.

    LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                            "prompt_lookup_min": 2, "prompt_lookup_max": 5})
    carpool serve --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
    LLM(speculative_config={"method": "draft_model", "model": PATH,
                            "num_speculative_tokens": 3})

`from_dict` takes the user's mapping (or its JSON text); an unknown key or a bad value is a
`ValueError` naming `speculative_config.<key>`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields

SPECULATIVE_METHODS = ("ngram", "draft_model")
NGRAM_ONLY_KEYS = ("prompt_lookup_min", "prompt_lookup_max")
# Speculation pays while a step is bound by reading the weights: a (k+1)-row verify then
# costs about what a 1-row decode costs. With more requests in the step the linears' rows
# grow k+1 times and it no longer does, so by default it runs only while at most this many
# requests decode (lab 55 measured it).
DEFAULT_MAX_SPECULATIVE_BATCH = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # k: the most tokens proposed per request per step
    # draft_model: the drafting model's folder (same tokenizer and vocabulary as the target;
    # checked when the engine loads it)
    model: str | None = None
    # draft_model (carpool's): what one draft pass costs as a share of a target decode step,
    # which the acceptance pause charges per drafted token; None: the draft's weight bytes
    # over the target's (a decode reads its weights), set when the engine config is built.
    draft_pass_cost: float | None = None
    # n-gram prompt lookup: the longest suffix of the request's tokens, from prompt_lookup_max
    # down to prompt_lookup_min tokens, found earlier in its prompt or output.
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # vLLM's: no speculation in a step where more than this many requests run (None: the
    # table below, else its default [[DEFAULT_MAX_SPECULATIVE_BATCH, k]]).
    disable_by_batch_size: int | None = None
    # [[batch size up to, tokens], ...] ascending: how many tokens a request may draft in a
    # step that runs that many requests; above the last row, none.
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPECULATIVE_METHODS}, "
                             f"got {self.method!r}")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError("speculative_config.model (the draft model's folder) is required "
                             f"with method 'draft_model', got {self.model!r}")
        for name in ("model", "draft_pass_cost"):
            if self.method != "draft_model" and getattr(self, name) is not None:
                raise ValueError(f"speculative_config.{name} is for method 'draft_model' "
                                 f"only, not {self.method!r}")
        cost = self.draft_pass_cost
        if cost is not None and (isinstance(cost, bool) or not isinstance(cost, (int, float))
                                 or not 0 <= cost < float("inf")):
            raise ValueError("speculative_config.draft_pass_cost must be a number >= 0, "
                             f"got {cost!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            _check_positive(name, getattr(self, name))
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) "
                             f"must be <= prompt_lookup_max ({self.prompt_lookup_max})")
        if self.disable_by_batch_size is not None:
            _check_positive("disable_by_batch_size", self.disable_by_batch_size)
        table = self.num_speculative_tokens_per_batch_size
        if table is not None:
            object.__setattr__(self, "num_speculative_tokens_per_batch_size",
                               _checked_table(table, self.num_speculative_tokens))

    @classmethod
    def from_dict(cls, value: Mapping | str | None) -> SpeculativeConfig | None:
        """The config a user's mapping (or its JSON text) describes; None for None or {}."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config must be a JSON object: {exc}") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a mapping, got {type(value).__name__}")
        if not value:
            return None
        known = {f.name for f in fields(cls)}
        for key in value:
            if key not in known:
                raise ValueError(f"speculative_config.{key} is not a known key; known: "
                                 f"{sorted(known)}")
        arguments = dict(value)
        low, high = arguments.get("prompt_lookup_min"), arguments.get("prompt_lookup_max")
        if low is None and high is not None:  # vLLM: one given sets the other
            arguments["prompt_lookup_min"] = min(high, cls.prompt_lookup_min)
        elif high is None and low is not None:
            arguments["prompt_lookup_max"] = max(low, cls.prompt_lookup_max)
        if "method" not in arguments:
            raise ValueError("speculative_config.method is required, one of "
                             f"{SPECULATIVE_METHODS}")
        if arguments["method"] == "draft_model":
            for key in NGRAM_ONLY_KEYS:
                if key in value:
                    raise ValueError(f"speculative_config.{key} is for method 'ngram' only "
                                     "(a draft model proposes without a lookup)")
        return cls(**arguments)

    @staticmethod
    def check_engine(speculative, tensor_parallel_size: int, enable_lora: bool,
                     scheduler: str) -> None:
        """ValueError naming speculative_config where speculation cannot run: the scheduler
        that plans draft rows is the continuous one, and a draft model runs on one rank,
        without adapters."""
        if not isinstance(speculative, SpeculativeConfig):
            raise ValueError(f"speculative_config must be a SpeculativeConfig, "
                             f"got {speculative!r}")
        if scheduler != "continuous":
            raise ValueError(f"speculative_config needs the continuous scheduler, "
                             f"got {scheduler!r}")
        if speculative.method != "draft_model":
            return
        for bad, name in ((tensor_parallel_size != 1, "tensor_parallel_size > 1"),
                          (enable_lora, "enable_lora")):
            if bad:
                raise ValueError(f"speculative_config.method 'draft_model' does not "
                                 f"support {name}")

    def num_tokens_for_batch(self, batch_size: int) -> int:
        """How many tokens a request may draft in a step that runs `batch_size` requests."""
        table = self.num_speculative_tokens_per_batch_size
        if table is None:
            limit = (DEFAULT_MAX_SPECULATIVE_BATCH if self.disable_by_batch_size is None
                     else self.disable_by_batch_size)
            return self.num_speculative_tokens if batch_size <= limit else 0
        for up_to, num_tokens in table:
            if batch_size <= up_to:
                return num_tokens
        return 0


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"speculative_config.{name} must be a positive integer, got {value!r}")


def _checked_table(table, most: int) -> tuple[tuple[int, int], ...]:
    name = "speculative_config.num_speculative_tokens_per_batch_size"
    try:
        rows = tuple((row[0], row[1]) for row in table if len(row) == 2)
    except (TypeError, KeyError, IndexError):
        rows = ()
    if not rows or len(rows) != len(table) or any(
            isinstance(v, bool) or not isinstance(v, int) for row in rows for v in row):
        raise ValueError(f"{name} must be a non-empty list of [batch size, tokens] integer "
                         f"pairs, got {table!r}")
    sizes = [size for size, _ in rows]
    if sizes != sorted(set(sizes)) or sizes[0] < 1:
        raise ValueError(f"{name} batch sizes must be positive and ascending, got {sizes}")
    if any(not 0 <= n <= most for _, n in rows):
        raise ValueError(f"{name} tokens must be in [0, num_speculative_tokens ({most})]")
    return rows
