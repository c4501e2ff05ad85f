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
from collections.abc import Sequence
from typing import Any

from carpool.config import EngineConfig
from carpool.engine.llm_engine import LLMEngine
from carpool.engine.output_builder import CompletionBuilder, RequestOutputBuilder
from carpool.engine.tokenizer import Message, encode_chat, render_chat
from carpool.lora_request import LoRARequest
from carpool.outputs import EngineStats, RequestOutput
from carpool.sampling_params import SamplingParams, child_params


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any):
        """`model`: a Hugging Face folder or hub id (None: the built-in model). Keyword
        arguments are `EngineConfig.from_args`'s, vLLM's names: dtype, device, seed,
        max_model_len, max_num_seqs, max_num_batched_tokens, enable_chunked_prefill,
        enable_prefix_caching, num_kv_blocks, kv_cache_memory, gpu_memory_utilization,
        block_size, scheduler, ..., and the CPU switches by their flags' names (cpu_kernels=
        False, ...; carpool.cpu_options). ValueError names a bad argument and the numbers."""
        self._attach(LLMEngine.from_config(EngineConfig.from_args(model, **engine_args)))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An LLM over an engine built from a ready EngineConfig (the CLI's path)."""
        llm = cls.__new__(cls)
        llm._attach(LLMEngine.from_config(config))
        return llm

    def _attach(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._request_counter = itertools.count()

    def close(self) -> None:
        """Stop the tensor-parallel ranks this LLM started (nothing to do for one rank);
        `with LLM(...) as llm:` does it on leaving."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses when given no SamplingParams: the checkpoint's
        generation_config.json sampling fields over SamplingParams' defaults (as vLLM)."""
        return SamplingParams(**self.engine.sampling_defaults)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's name); True once done."""
        self.engine.reset_prefix_cache()
        return True

    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 ) -> list[RequestOutput]:
        """Complete every prompt; returns one RequestOutput per prompt, in input order.

        `prompts`: a string, a `{"prompt_token_ids": [...]}` dict (optionally with
        "prompt"), or a list of those. `sampling_params`: one for all, or one per prompt.
        `lora_request`: the LoRA adapter (with `enable_lora`) for all, or one per prompt
        (None: the base model).
        """
        inputs = [self._parse_prompt(p) for p in _as_prompt_list(prompts)]
        return self._run(inputs, sampling_params, use_tqdm, lora_request)

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
             use_tqdm: bool, lora_request=None) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = _params_per_prompt(sampling_params, len(inputs))
        loras = _loras_per_prompt(lora_request, len(inputs))
        builders, children = self._plan(inputs, params_list, loras)
        added: list[str] = []
        try:
            for child in children:
                self.engine.add_request(child.request_id, child.prompt_token_ids, child.params,
                                        text_at_finish=True,  # only the final text is read
                                        lora_request=child.lora_request)
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

    def _plan(self, inputs, params_list,
              loras) -> tuple[list[RequestOutputBuilder], list[_Child]]:
        """One builder per prompt and one engine request per completion, all validated."""
        builders: list[RequestOutputBuilder] = []
        children: list[_Child] = []
        for (prompt, prompt_ids), params, lora in zip(inputs, params_list, loras):
            self.engine.check_lora(lora)
            request_id = str(next(self._request_counter))
            builder = RequestOutputBuilder(request_id, prompt, prompt_ids, [])
            for index in range(params.n):
                params_i = child_params(params, index)
                self.engine.validate_request(prompt_ids, params_i)
                completion = CompletionBuilder(index, params.logprobs is not None)
                builder.completions.append(completion)
                child_id = request_id if params.n == 1 else f"{request_id}-{index}"
                children.append(_Child(child_id, prompt_ids, params_i, builder, completion,
                                       lora))
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
    lora_request: LoRARequest | None = None


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


def _loras_per_prompt(lora_request, num_prompts: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise ValueError(f"got {len(loras)} lora_request for {num_prompts} prompts; pass one, "
                         "or one per prompt")
    return loras


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
