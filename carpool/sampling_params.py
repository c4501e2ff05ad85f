"""How one request wants its tokens chosen and when it should stop.

Plain Python (no tensors) so the scheduler, the server's validation and the
sampler all share one definition. Field names follow vLLM's `SamplingParams`.
A bad value raises `ValueError` naming the field, which the server turns into
an HTTP 400.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from functools import cached_property

# A temperature below this is greedy: float32 logits divided by it would overflow to inf.
# The value is vLLM's `_SAMPLING_EPS`; vLLM itself raises 0 < temperature < 0.01 to 0.01
# (with a warning) and then samples, where carpool takes the limit, greedy, for t < 1e-5.
GREEDY_TEMPERATURE_EPS = 1e-5
# float32's smallest normal number. The sampler works in float32, where a nonzero top_p,
# min_p or penalty below it becomes 0 or a denormal (top_p 1e-50 would mask every token,
# repetition_penalty 1e-300 divide by zero): such values are rejected, not clamped.
FLOAT32_TINY = 1.1754943508222875e-38
# Stop strings are matched against every step's new text on the engine thread, so their
# number and size are capped (OpenAI's API takes 4; vLLM sets no limit).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1000  # each
MAX_STOP_TOTAL_CHARS = 8192  # all of a request's stop strings together
# A request's stop_token_ids are validated one by one on admission (vLLM sets no limit), so
# their number is capped: room for every special token of today's vocabularies (Llama 3
# reserves 256) many times over. The engine adds the model's extra EOS ids, which count too.
MAX_STOP_TOKEN_IDS = 4096


_SEED_MODULUS = 2**64  # seed is at most 2**64 - 1; child seeds wrap


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain a request's output to a grammar (vLLM's names): exactly one of
    `json` (a JSON schema, as a dict or its JSON text), `json_object` (any JSON object),
    `regex`, `choice` (one of these strings) or `grammar` (Lark, or llama.cpp's GBNF).

    Plain data, so it crosses a process boundary (as JSON to the grammar checker, pickled
    to the engine process); a `json` dict is kept as its JSON
    text. Whether the schema, regex or grammar compiles is checked by the engine
    (`carpool.structured`), which raises ValueError naming `structured_outputs.<field>`.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json.dumps(self.json))
        if self.choice is not None and not isinstance(self.choice, str):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None] + (["json_object"] if self.json_object
                                                        else [])
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of json, json_object, "
                             f"regex, choice, grammar; got {given or 'none'}")
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string"
                                 f"{' or a dict' if name == 'json' else ''}, got {value!r}")
        if self.choice is not None and (isinstance(self.choice, str) or not self.choice or not all(
                isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty "
                             f"strings, got {self.choice!r}")

    @property
    def kind(self) -> str:
        """Which field is set: json, json_object, regex, choice or grammar."""
        if self.json_object:
            return "json_object"
        return next(n for n in ("json", "regex", "choice", "grammar")
                    if getattr(self, n) is not None)


@dataclass(frozen=True)
class GrammarLimits:
    """How big a request's grammar may be before the grammar library sees it.

    llguidance has no bounds of its own: a long chain of rules overflows its stack (a
    SIGSEGV), and its time grows faster than the grammar's size. Each limit is a flag
    (`--max-grammar-bytes`, ...), checked by `carpool.structured.limits`, whose error names
    the request's field, the limit and the flag. `check_timeout` bounds, in seconds, the
    server's check of a grammar in its checker process.
    """

    max_bytes: int = 128 * 1024  # UTF-8 bytes of the schema, regex, grammar or choices
    max_rules: int = 500  # Lark/GBNF rule definitions; a JSON schema's $refs
    max_depth: int = 64  # nesting of brackets in a grammar or regex, of a JSON schema
    # Choices; `|`s in a grammar or regex; enum/anyOf items. llguidance's parser fails a row
    # of more than 2,000 items on the first token anyway, after a mask that holds up the batch.
    max_alternatives: int = 2_000
    check_timeout: float = 10.0

    def __post_init__(self) -> None:
        for name, flag in FLAGS_OF_LIMITS.items():
            value = getattr(self, name)
            if name == "check_timeout":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                        0 < value < math.inf):
                    raise ValueError(f"{flag} must be a number of seconds > 0, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag} must be an integer >= 1, got {value!r}")


# GrammarLimits' fields and the names of their flags / `EngineConfig.from_args` arguments.
FLAGS_OF_LIMITS = {"max_bytes": "max_grammar_bytes", "max_rules": "max_grammar_rules",
                   "max_depth": "max_grammar_depth",
                   "max_alternatives": "max_grammar_alternatives",
                   "check_timeout": "grammar_check_timeout"}


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # completions per prompt; fanned out above the engine
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0  # EOS and stop tokens are ignored before this many outputs
    temperature: float = 1.0  # 0 (or below GREEDY_TEMPERATURE_EPS) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # >1 discourages tokens seen in prompt or output
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # same seed, same output, whatever the batch
    stop: tuple[str, ...] = ()  # stop strings, matched on the detokenized text
    # a set: the scheduler looks every sampled token up in it (any iterable of ids is taken)
    stop_token_ids: frozenset[int] = frozenset()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per output token (plus the chosen one)
    # top-N logprobs per prompt token (plus the prompt's own); the request skips the prefix cache
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # grammar-constrained output

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", _stop_token_id_set(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        _require_int("n", self.n, minimum=1)
        if self.max_tokens is not None:
            _require_int("max_tokens", self.max_tokens, minimum=1)
        _require_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        _require_float("temperature", self.temperature, 0.0, 2.0)
        _require_float("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0.0:
            raise ValueError("top_p must be in (0, 1], got 0")
        _require_int("top_k", self.top_k, minimum=0)
        _require_float("min_p", self.min_p, 0.0, 1.0)
        _require_float("repetition_penalty", self.repetition_penalty, 0.0, math.inf)
        if self.repetition_penalty == 0.0:
            raise ValueError("repetition_penalty must be > 0, got 0")
        _require_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _require_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        for name in ("top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            _require_float32_normal(name, getattr(self, name))
        if self.seed is not None:
            _require_int("seed", self.seed, minimum=-(2**63), maximum=2**64 - 1)
        _check_stop_strings(self.stop)
        if self.logprobs is not None:
            _require_int("logprobs", self.logprobs, minimum=0)
        if self.prompt_logprobs is not None:
            _require_int("prompt_logprobs", self.prompt_logprobs, minimum=0)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(f"structured_outputs must be a StructuredOutputsParams, "
                                 f"got {type(self.structured_outputs).__name__}")
            if self.min_tokens:
                # a complete grammar allows only EOS, which min_tokens would mask too
                raise ValueError("min_tokens must be 0 when structured_outputs is set")

    @property
    def is_greedy(self) -> bool:
        """Temperature 0, or so close to it (< GREEDY_TEMPERATURE_EPS) that it is the same."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def has_penalty(self) -> bool:
        """A repetition, presence or frequency penalty is set."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @cached_property
    def is_plain_greedy(self) -> bool:
        """Greedy, with no logprobs, no penalty and no min_tokens: the sampled token is the
        argmax of the raw logits. The sampler reads it for every row of every step, so it is
        worked out once (the params are frozen)."""
        return (self.is_greedy and self.logprobs is None and self.min_tokens == 0
                and not self.has_penalty)


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Completion `index` of a prompt asked for `n` of them: n=1, and seed + index (wrapping at
    2**64) so seeded completions differ. `LLM.generate` and the server fan out alike."""
    seed = params.seed
    if seed is not None:
        seed += index
        if seed >= _SEED_MODULUS:
            seed -= _SEED_MODULUS
    return dataclasses.replace(params, n=1, seed=seed)


def _require_int(name: str, value: object, *, minimum: int | None = None,
                 maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")


def _require_float(name: str, value: object, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) and not (value == math.inf and high == math.inf):
        raise ValueError(f"{name} must be a finite number, got {value}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


def _stop_token_id_set(ids: object) -> frozenset[int]:
    """The ids as a set; ValueError for more than MAX_STOP_TOKEN_IDS of them (duplicates count:
    the cap bounds the work of reading them) or one that is not an integer >= 0."""
    if isinstance(ids, (str, bytes, int)):
        raise ValueError(f"stop_token_ids must be a list of integers, got {ids!r}")
    given = ids if isinstance(ids, frozenset) else tuple(ids or ())
    if len(given) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} ids, "
                         f"got {len(given)}")
    for token_id in given:
        _require_int("stop_token_ids", token_id, minimum=0)
    return frozenset(given)


def _check_stop_strings(stop: tuple) -> None:
    """Non-empty strings, within MAX_STOP_STRINGS / MAX_STOP_STRING_CHARS / MAX_STOP_TOTAL_CHARS."""
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    for s in stop:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters "
                             f"each, got one of {len(s)}")
    total = sum(len(s) for s in stop)
    if total > MAX_STOP_TOTAL_CHARS:
        raise ValueError(f"stop strings must total at most {MAX_STOP_TOTAL_CHARS} characters, "
                         f"got {total}")


def _require_float32_normal(name: str, value: float) -> None:
    """A nonzero value must survive float32 (the sampler's dtype) as a normal number."""
    if value != 0 and abs(value) < FLOAT32_TINY:
        raise ValueError(f"{name} must be 0 or at least {FLOAT32_TINY:.6g} in magnitude "
                         f"(float32's smallest normal number, the sampler's precision), "
                         f"got {value}")
