"""The offline API, shaped like vLLM's: `LLM(model).generate(prompts, sampling_params)`.

`LLM` owns one `LLMEngine` and drives its step loop until every prompt is
done. A prompt with `n > 1` is fanned out into n engine requests (child i
gets `seed + i` when a seed is given) and folded back into one
`RequestOutput`. Everything is validated before the first request is added,
so a bad prompt in a list leaves nothing half-queued.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any, Sequence

from carpool.config import EngineConfig
from carpool.core.config import SchedulerConfig
from carpool.engine.llm_engine import LLMEngine
from carpool.engine.output_builder import CompletionBuilder, RequestOutputBuilder
from carpool.engine.tokenizer import Message, encode_chat, render_chat
from carpool.outputs import RequestOutput
from carpool.sampling_params import SamplingParams

_SEED_MODULUS = 2**64  # SamplingParams.seed is at most 2**64 - 1; child seeds wrap


class LLM:
    def __init__(self, model: str | None = None, *, dtype: str = "auto",
                 max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 max_model_len: int | None = None, enable_chunked_prefill: bool = True,
                 max_num_partial_prefills: int = 1, max_long_partial_prefills: int = 1,
                 long_prefill_token_threshold: int = 0, block_size: int = 16,
                 num_kv_blocks: int | None = None, kv_cache_memory: int | None = None,
                 gpu_memory_utilization: float = 0.9, scheduler: str = "continuous",
                 preemption_policy: str = "newest", enable_prefix_caching: bool = True,
                 device: str = "auto", seed: int = 0,
                 served_model_name: str | None = None, trust_remote_code: bool = False):
        if trust_remote_code:
            raise ValueError("trust_remote_code is not supported: carpool runs only its own "
                             "model code over safetensors weights")
        scheduler_len = max_model_len or SchedulerConfig.max_model_len
        if max_num_batched_tokens is None:
            max_num_batched_tokens = SchedulerConfig.max_num_batched_tokens
            if not enable_chunked_prefill:
                max_num_batched_tokens = max(max_num_batched_tokens, scheduler_len)
        scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=scheduler_len, enable_chunked_prefill=enable_chunked_prefill,
            max_num_partial_prefills=max_num_partial_prefills,
            max_long_partial_prefills=max_long_partial_prefills,
            long_prefill_token_threshold=long_prefill_token_threshold, block_size=block_size,
            preemption_policy=preemption_policy, scheduler=scheduler,
            enable_prefix_caching=enable_prefix_caching)
        config = EngineConfig(
            model=model, dtype=dtype, device=device, seed=seed,
            served_model_name=served_model_name, num_kv_blocks=num_kv_blocks,
            kv_cache_memory=kv_cache_memory, gpu_memory_utilization=gpu_memory_utilization,
            scheduler=scheduler_config, max_model_len=max_model_len)
        self._attach(LLMEngine.from_config(config))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        """An LLM over an engine built from a ready EngineConfig (the CLI's path)."""
        llm = cls.__new__(cls)
        llm._attach(LLMEngine.from_config(config))
        return llm

    def _attach(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses when given no SamplingParams: the checkpoint's
        generation_config.json sampling fields over SamplingParams' defaults (as vLLM)."""
        return SamplingParams(**self.engine.sampling_defaults)

    def stats(self) -> dict:
        return self.engine.stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's name); True once done."""
        self.engine.reset_prefix_cache()
        return True

    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt; returns one RequestOutput per prompt, in input order.

        `prompts`: a string, a `{"prompt_token_ids": [...]}` dict (optionally with
        "prompt"), or a list of those. `sampling_params`: one for all, or one per prompt.
        """
        inputs = [self._parse_prompt(p) for p in _as_prompt_list(prompts)]
        return self._run(inputs, sampling_params, use_tqdm)

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or a list of them,
        rendered through the tokenizer's chat template."""
        is_one = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if is_one else list(messages)
        tokenizer = self.engine.tokenizer
        kwargs = dict(chat_template=chat_template, add_generation_prompt=add_generation_prompt)
        inputs = []
        for conversation in conversations:
            ids = encode_chat(tokenizer, conversation, **kwargs)
            self.engine.encode_prompt(ids)  # token ids in range, not empty
            inputs.append((render_chat(tokenizer, conversation, **kwargs), ids))
        return self._run(inputs, sampling_params, use_tqdm)

    # ---- internals ---------------------------------------------------------------------

    def _parse_prompt(self, prompt: Any) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.engine.encode_prompt(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = self.engine.encode_prompt(list(prompt["prompt_token_ids"]))
                return prompt.get("prompt"), ids
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], self.engine.encode_prompt(prompt["prompt"])
        raise ValueError("each prompt must be a string or a dict with 'prompt_token_ids' "
                         f"(or 'prompt'), got {prompt!r:.80}")

    def _run(self, inputs: list[tuple[str | None, list[int]]], sampling_params,
             use_tqdm: bool) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = _params_per_prompt(sampling_params, len(inputs))
        builders, children = self._plan(inputs, params_list)
        added: list[str] = []
        try:
            for child in children:
                self.engine.add_request(child.request_id, child.prompt_token_ids, child.params)
                added.append(child.request_id)
            self._drive(children, len(builders), use_tqdm)
        except BaseException:
            self.engine.abort_request(added)
            while self.engine.has_unfinished_requests():  # deliver the aborts, free the blocks
                self.engine.step()
            raise
        failed = [(b.request_id, c.error) for b in builders for c in b.completions
                  if c.finish_reason == "error"]
        if failed:
            raise RuntimeError(f"{len(failed)} request(s) failed in the engine; "
                               f"first: {failed[0][0]}: {failed[0][1]}")
        return [b.build() for b in builders]

    def _plan(self, inputs, params_list) -> tuple[list[RequestOutputBuilder], list[_Child]]:
        """One builder per prompt and one engine request per completion, all validated."""
        builders: list[RequestOutputBuilder] = []
        children: list[_Child] = []
        for (prompt, prompt_ids), params in zip(inputs, params_list):
            request_id = str(next(self._request_counter))
            builder = RequestOutputBuilder(request_id, prompt, prompt_ids, [])
            for index in range(params.n):
                params_i = child_params(params, index)
                self.engine.validate_request(prompt_ids, params_i)
                completion = CompletionBuilder(index, params.logprobs is not None)
                builder.completions.append(completion)
                child_id = request_id if params.n == 1 else f"{request_id}-{index}"
                children.append(_Child(child_id, prompt_ids, params_i, builder, completion))
            builders.append(builder)
        return builders, children

    def _drive(self, children: list[_Child], num_prompts: int, use_tqdm: bool) -> None:
        """Step the engine until every child request has finished, folding its deltas."""
        by_id = {child.request_id: child for child in children}
        progress = _Progress(num_prompts, use_tqdm)
        num_left = len(children)
        while num_left:
            if not self.engine.has_unfinished_requests():
                raise RuntimeError(f"engine went idle with {num_left} requests unfinished")
            for out in self.engine.step():
                child = by_id.get(out.request_id)
                if child is None:
                    continue
                child.completion.add(out)
                if out.finished:
                    num_left -= 1
                    if child.builder.finished:
                        progress.prompt_done(len(child.prompt_token_ids),
                                             child.builder.num_output_tokens)
        progress.close()


@dataclasses.dataclass
class _Child:
    """One engine request: a prompt's completion `completion.index`."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    builder: RequestOutputBuilder
    completion: CompletionBuilder


class _Progress:
    """tqdm bar: prompts done, with input and output tokens per second of the finished ones."""

    def __init__(self, total: int, enabled: bool):
        self._bar = None
        if enabled and total:
            from tqdm.auto import tqdm
            self._bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
        self._start = time.perf_counter()
        self._num_input_tokens = 0
        self._num_output_tokens = 0

    def prompt_done(self, num_input_tokens: int, num_output_tokens: int) -> None:
        if self._bar is None:
            return
        self._num_input_tokens += num_input_tokens
        self._num_output_tokens += num_output_tokens
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        self._bar.set_postfix_str(f"input: {self._num_input_tokens / elapsed:.1f} tok/s, "
                                  f"output: {self._num_output_tokens / elapsed:.1f} tok/s",
                                  refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _as_prompt_list(prompts: Any) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, Sequence):
        if prompts and all(isinstance(p, int) for p in prompts):
            raise ValueError("a list of ints is ambiguous; pass token ids as "
                             "{'prompt_token_ids': [...]}")
        return list(prompts)
    raise ValueError(f"prompts must be a string, a dict or a list of them, "
                     f"got {type(prompts).__name__}")


def _params_per_prompt(sampling_params, num_prompts: int) -> list[SamplingParams]:
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    params_list = list(sampling_params)
    if len(params_list) != num_prompts:
        raise ValueError(f"got {len(params_list)} sampling_params for {num_prompts} prompts; "
                         "pass one, or one per prompt")
    for params in params_list:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
    return params_list


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Completion `index` of a prompt: n=1, and seed + index so seeded completions differ."""
    seed = params.seed
    if seed is not None:
        seed += index
        if seed >= _SEED_MODULUS:
            seed -= _SEED_MODULUS
    return dataclasses.replace(params, n=1, seed=seed)
