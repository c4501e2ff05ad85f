"""Seeded benchmark workloads: which prompts, how many tokens out, and when they arrive.

- `random`: prompt and output lengths drawn uniformly around `input_len` /
  `output_len` (± `range_ratio`), prompt tokens drawn at random from the vocabulary.
- `mix`: like `random`, but half the requests want a short output and half a
  long one, shuffled: the workload where static batching's convoy shows, since
  a batch runs as long as its longest member.
- `sharegpt`: prompts and output lengths from a ShareGPT-style file (JSON list
  or JSONL of `{"conversations": [{"value": ...}, {"value": ...}, ...]}` or
  `{"prompt": ..., "completion": ... | "output_len": N}` records).
- `mixed-load`: `num_prompts` short prompts with long outputs start at once and
  keep decoding while `num_long_prompts` long prompts arrive one by one every
  `long_prompt_interval` seconds: the load where chunked prefill matters.
- `prefix-repetition`: `num_prefixes` shared "system prompts" of `prefix_len`
  tokens, each followed by a per-request suffix of about `input_len` tokens
  (`num_prompts` requests in all, shuffled), `output_len` tokens out: chat
  traffic, where prefix caching matters (vLLM's prefix-repetition dataset).

The same seed gives the same requests, so variants compared one after another
see identical work.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

WORKLOADS = ("mix", "random", "sharegpt", "mixed-load", "prefix-repetition")
_MAX_ROUNDTRIPS = 8


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    # Seconds after the benchmark starts; None: the load generator's request rate decides.
    arrival_time: float | None = None
    prompt: str | None = None  # the text form, sent over HTTP


@dataclass(frozen=True)
class WorkloadConfig:
    name: str = "mix"
    num_prompts: int = 64
    seed: int = 0
    input_len: int = 64
    output_len: int = 64  # random
    range_ratio: float = 0.25  # lengths drawn from [len * (1 - r), len * (1 + r)]
    short_output_len: int = 16  # mix, and the long prompts of mixed-load
    long_output_len: int = 192  # mix, and the decoders of mixed-load
    dataset_path: str | None = None  # sharegpt
    num_long_prompts: int = 4  # mixed-load
    long_prompt_len: int = 1536  # mixed-load
    long_prompt_interval: float = 1.0  # mixed-load, seconds between long arrivals
    max_model_len: int | None = None  # drop sharegpt records longer than this
    num_prefixes: int = 1  # prefix-repetition: distinct shared prefixes
    prefix_len: int = 768  # prefix-repetition: tokens of each shared prefix

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {self.name!r}")
        for name in ("num_prompts", "input_len", "output_len", "short_output_len",
                     "long_output_len", "long_prompt_len", "num_prefixes", "prefix_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.num_long_prompts, int) or self.num_long_prompts < 0:
            raise ValueError("num_long_prompts must be an integer >= 0, got "
                             f"{self.num_long_prompts!r}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio!r}")
        if self.long_prompt_interval < 0:
            raise ValueError(f"long_prompt_interval must be >= 0, "
                             f"got {self.long_prompt_interval!r}")
        if self.name == "sharegpt" and not self.dataset_path:
            raise ValueError("dataset_path is required for the sharegpt workload")


def build_workload(config: WorkloadConfig, tokenizer, *,
                   with_text: bool = False) -> list[BenchRequest]:
    """The requests of `config`, in submission order.

    `tokenizer` is a Hugging Face tokenizer. With `with_text`, random prompts are
    decoded to text and re-encoded until the ids match the text, so what the
    server tokenizes is what was counted.
    """
    rng = random.Random(config.seed)
    if config.name == "sharegpt":
        return _sharegpt(config, tokenizer, rng)
    sampler = _PromptSampler(tokenizer, rng, with_text)
    if config.name == "mixed-load":
        return _mixed_load(config, sampler, rng)
    if config.name == "prefix-repetition":
        return _prefix_repetition(config, sampler, rng)
    if config.name == "mix":
        shorts = config.num_prompts // 2
        num_longs = config.num_prompts - shorts
        kinds = [config.short_output_len] * shorts + [config.long_output_len] * num_longs
        rng.shuffle(kinds)
    else:
        kinds = [config.output_len] * config.num_prompts
    return [sampler.request(_around(rng, config.input_len, config.range_ratio),
                            _around(rng, out, config.range_ratio)) for out in kinds]


def _mixed_load(config: WorkloadConfig, sampler: _PromptSampler,
                rng: random.Random) -> list[BenchRequest]:
    decoders = [sampler.request(_around(rng, config.input_len, config.range_ratio),
                                _around(rng, config.long_output_len, config.range_ratio),
                                arrival=0.0)
                for _ in range(config.num_prompts)]
    longs = [sampler.request(_around(rng, config.long_prompt_len, config.range_ratio),
                             config.short_output_len, arrival=config.long_prompt_interval * (i + 1))
             for i in range(config.num_long_prompts)]
    return decoders + longs


def _prefix_repetition(config: WorkloadConfig, sampler: _PromptSampler,
                       rng: random.Random) -> list[BenchRequest]:
    prefixes = [sampler.request(config.prefix_len, 1) for _ in range(config.num_prefixes)]
    requests = []
    for i in range(config.num_prompts):
        suffix = sampler.request(_around(rng, config.input_len, config.range_ratio),
                                 config.output_len)
        requests.append(sampler.join(prefixes[i % config.num_prefixes], suffix))
    rng.shuffle(requests)
    return requests


def _around(rng: random.Random, length: int, ratio: float) -> int:
    low, high = max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))
    return rng.randint(low, high)


class _PromptSampler:
    """Random prompts of an exact token length, over the tokenizer's ordinary tokens."""

    def __init__(self, tokenizer, rng: random.Random, with_text: bool) -> None:
        special = set(tokenizer.all_special_ids)
        self.pool = [i for i in range(len(tokenizer)) if i not in special]
        if not self.pool:
            raise ValueError("the tokenizer has no ordinary tokens to build prompts from")
        self.tokenizer, self.rng, self.with_text = tokenizer, rng, with_text

    def request(self, prompt_len: int, max_tokens: int,
                arrival: float | None = None) -> BenchRequest:
        ids = self.rng.choices(self.pool, k=prompt_len)
        if not self.with_text:
            return BenchRequest(tuple(ids), max_tokens, arrival)
        ids, text = self._roundtrip(ids, prompt_len)
        return BenchRequest(tuple(ids), max_tokens, arrival, text)

    def join(self, prefix: BenchRequest, suffix: BenchRequest) -> BenchRequest:
        """`prefix`'s prompt followed by `suffix`'s, with `suffix`'s max_tokens and arrival.
        Text prompts are joined as text and re-encoded (the ids may differ at the seam)."""
        if not self.with_text:
            return BenchRequest(prefix.prompt_token_ids + suffix.prompt_token_ids,
                                suffix.max_tokens, suffix.arrival_time)
        text = prefix.prompt + suffix.prompt
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return BenchRequest(tuple(ids), suffix.max_tokens, suffix.arrival_time, text)

    def _roundtrip(self, ids: list[int], prompt_len: int) -> tuple[list[int], str]:
        """Adjust `ids` until encode(decode(ids)) == ids, keeping about `prompt_len` tokens."""
        text = self.tokenizer.decode(ids)
        for _ in range(_MAX_ROUNDTRIPS):
            encoded = self.tokenizer.encode(text, add_special_tokens=False)
            if encoded == ids:
                break
            if len(encoded) < prompt_len:
                encoded += self.rng.choices(self.pool, k=prompt_len - len(encoded))
            ids = encoded[:prompt_len]
            text = self.tokenizer.decode(ids)
        return self.tokenizer.encode(text, add_special_tokens=False), text


def _sharegpt(config: WorkloadConfig, tokenizer, rng: random.Random) -> list[BenchRequest]:
    records = _read_records(Path(config.dataset_path))
    rng.shuffle(records)
    requests = []
    for prompt, completion, output_len in records:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        if output_len is None:
            output_len = len(tokenizer.encode(completion or "", add_special_tokens=False))
        if not ids or output_len < 1:
            continue
        if config.max_model_len is not None and len(ids) + output_len > config.max_model_len:
            continue
        requests.append(BenchRequest(tuple(ids), output_len, None, prompt))
        if len(requests) == config.num_prompts:
            return requests
    if not requests:
        raise ValueError(f"dataset_path {config.dataset_path}: no usable records")
    return requests


def _read_records(path: Path) -> list[tuple[str, str | None, int | None]]:
    """(prompt, completion, output_len) per record of a JSON list or a JSONL file."""
    text = path.read_text()
    rows = json.loads(text) if text.lstrip().startswith("[") else [
        json.loads(line) for line in text.splitlines() if line.strip()]
    records = []
    for i, row in enumerate(rows):
        if "conversations" in row:
            turns = row["conversations"]
            if len(turns) < 2:
                continue
            records.append((turns[0]["value"], turns[1]["value"], None))
        elif "prompt" in row:
            records.append((row["prompt"], row.get("completion"), row.get("output_len")))
        else:
            raise ValueError(f"dataset_path {path}: record {i} has neither 'conversations' nor "
                             "'prompt'")
    return records
