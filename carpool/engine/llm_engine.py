"""The step loop: schedule -> execute -> update -> detokenize, one packed batch per step.

`LLMEngine` glues the parts and owns no policy: the scheduler decides what runs,
the model runner computes one token for each request whose chunk reaches its
end, the scheduler applies the token-level stops, and the detokenizer turns the
new tokens into text deltas and applies stop strings. Each `step()` returns one
`StepOutput` per request that advanced or finished, carrying only that step's
new tokens and text.

A fault in the model step fails exactly the requests scheduled in that step;
the engine keeps serving the rest. A lost tensor-parallel rank is the exception:
`RankFailedError` leaves `step()`, since no later step can run.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from carpool.config import EngineConfig
from carpool.config.named_files import generation_config_folder
from carpool.core.request import Request, RequestStatus
from carpool.core.scheduler_output import SchedulerOutput
from carpool.default_model_path import DEFAULT_MODEL_NAME
from carpool.engine import limits
from carpool.engine.detokenizer import IncrementalDetokenizer, TokenTextCache
from carpool.engine.lora_requests import LoraRequests
from carpool.engine.request_finish import (
    final_output,
    finish_on_complete_grammar,
    finish_over_token_stop,
)
from carpool.engine.request_state import RequestState, request_metrics
from carpool.engine.runner_setup import resolve_for_model
from carpool.engine.step_stats import StepStats, spec_decode_stats
from carpool.engine.tokenizer import load_engine_tokenizer
from carpool.outputs import EngineStats, StepOutput
from carpool.runner.executor import RankFailedError
from carpool.sampling_params import SamplingParams
from carpool.structured.manager import GrammarError, StructuredOutputs
from carpool.structured.speculation import accepted_drafts

logger = logging.getLogger(__name__)

DEFAULT_SERVED_MODEL_NAME = DEFAULT_MODEL_NAME


class LLMEngine:
    # Tests only: called with each non-empty SchedulerOutput just before the model runs.
    step_hook: Callable[[SchedulerOutput], None] | None = None

    def __init__(self, config: EngineConfig, model_path: str, runner, tokenizer, scheduler,
                 clock: Callable[[], float] = time.monotonic,
                 sampling_defaults: dict | None = None, detokenize: bool = True):
        self.config = config
        self.model_path = model_path
        # False in the engine-core process: outputs carry token ids only, and the front end
        # detokenizes, applies stop strings and fills logprobs' decoded tokens.
        self.detokenize = detokenize
        # generation_config.json's sampling fields: what an unset request field means.
        self.sampling_defaults = dict(sampling_defaults or {})
        self.runner = runner
        self.quantization: str | None = getattr(runner, "quantization", None)  # e.g. "gguf (…)"
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.scheduler_config = scheduler.config
        self.model_config = runner.model_config
        self.max_model_len = self.scheduler_config.max_model_len
        self.served_model_name = config.served_model_name or (
            DEFAULT_SERVED_MODEL_NAME if config.model is None else str(config.model))
        self._clock = clock
        self._states: dict[str, RequestState] = {}
        self._aborted_outputs: list[StepOutput] = []
        self._token_texts = TokenTextCache(tokenizer)
        self._stats = StepStats()
        eos_ids = self.model_config.eos_token_ids or (
            (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ())
        self._eos_token_id = eos_ids[0] if eos_ids else None
        self._extra_eos_ids = tuple(eos_ids[1:])
        self._eos_token_ids = tuple(eos_ids)
        self._structured = StructuredOutputs(tokenizer, self.model_config.vocab_size,
                                             self._eos_token_ids, config.grammar_cache_memory,
                                             config.grammar_limits)
        self._lora = LoraRequests(config.lora, self.model_config, runner)
        if getattr(scheduler, "speculator", None) is not None:  # grammars' drafts cut here
            scheduler.speculator.grammar_drafts = self._grammar_drafts

    @classmethod
    def from_config(cls, config: EngineConfig, detokenize: bool = True) -> LLMEngine:
        """Load the model, tokenizer and KV cache named by `config` and build the scheduler.

        With `detokenize=False` outputs carry no text (see `__init__`)."""
        from carpool.core.scheduler import Scheduler
        from carpool.core.static_scheduler import StaticScheduler
        from carpool.models.generation_defaults import load_sampling_defaults
        from carpool.runner.executor import create_executor

        config, path = resolve_for_model(config)
        sched_config = config.scheduler
        # the tokenizer before the weights: what reading it takes (a GGUF file's vocabulary
        # is parsed whole) is freed before the model's memory is, not added to it
        tokenizer = load_engine_tokenizer(config, path)
        runner = create_executor(config, path)
        try:
            scheduler = (StaticScheduler(sched_config, runner.num_kv_blocks)
                         if sched_config.scheduler == "static" else
                         Scheduler(sched_config, runner.num_kv_blocks,
                                   speculative=config.speculative_config))
        except BaseException:
            runner.close()
            raise
        defaults_folder = generation_config_folder(config.generation_config, path)
        return cls(config, str(path), runner, tokenizer, scheduler,
                   sampling_defaults=load_sampling_defaults(defaults_folder)
                   if defaults_folder is not None else {}, detokenize=detokenize)

    # ---- requests in -------------------------------------------------------------------

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a text prompt (tokenized) or a token-id prompt (checked, copied)."""
        return limits.prompt_token_ids_of(prompt, self.tokenizer, self.max_model_len,
                                          self.model_config.vocab_size)

    def validate_request(self, prompt_token_ids: list[int],
                         sampling_params: SamplingParams) -> None:
        """Every check `add_request` makes, and the grammar compiled (cached; `add_request`
        does not wait for it), without adding: ValueError naming what is wrong."""
        self._check_request(prompt_token_ids, sampling_params)
        self._structured.matcher_for(sampling_params)

    def _check_request(self, prompt_token_ids: list[int],
                       sampling_params: SamplingParams) -> None:
        limits.check_single_params(sampling_params)
        limits.check_num_logprobs(sampling_params, self.config.max_logprobs,
                                  self.model_config.vocab_size)
        limits.check_context_length(len(prompt_token_ids), sampling_params, self.max_model_len)
        limits.check_stop_token_ids(sampling_params, self.model_config.vocab_size)
        limits.check_some_token_allowed(sampling_params, self.model_config.vocab_size,
                                        self._eos_token_ids)
        limits.check_fits_kv_cache(len(prompt_token_ids), sampling_params, self.max_model_len,
                                   self.scheduler_config.block_size,
                                   self.scheduler.block_manager.num_total_blocks)

    def add_request(self, request_id: str, prompt: str | list[int],
                    sampling_params: SamplingParams, arrival_time: float | None = None,
                    cache_salt: str | None = None, text_at_finish: bool = False,
                    lora_request=None) -> int:
        """Queue one request; returns its number of prompt tokens. ValueError if it is invalid.

        Requests share cached prefix blocks only with requests of the same `cache_salt` and
        LoRA adapter (`lora_request`, a `LoRARequest`; None: the base model).
        `text_at_finish`: for a caller that reads only the final text (`LLM.generate`), the
        output that finishes the request carries all of its text, decoded once, and the
        ones before it none, so no step spends time detokenizing; ignored when stop strings
        need the text every step. (An abort or error output carries no text.)"""
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_token_ids = self.encode_prompt(prompt)
        self._check_request(prompt_token_ids, sampling_params)
        self._lora.check(lora_request)
        if self._extra_eos_ids and not sampling_params.ignore_eos:
            stop_ids = sampling_params.stop_token_ids.union(self._extra_eos_ids)
            sampling_params = dataclasses.replace(sampling_params, stop_token_ids=stop_ids)
        request = Request(
            request_id=request_id, prompt_token_ids=prompt_token_ids,
            sampling_params=sampling_params,
            arrival_time=self._clock() if arrival_time is None else arrival_time,
            eos_token_id=self._eos_token_id, max_model_len=self.max_model_len,
            cache_salt=cache_salt, lora_request=lora_request)
        # A new grammar compiles off this thread; the request joins the scheduler when it has.
        matcher = self._structured.start(request_id, sampling_params)
        if not self._structured.is_compiling(request_id):
            self.scheduler.add_request(request)
        detokenizer = (IncrementalDetokenizer(self.tokenizer, prompt_token_ids, sampling_params)
                       if self.detokenize else None)
        self._states[request_id] = RequestState(
            request, detokenizer, matcher=matcher,
            text_at_finish=text_at_finish and not sampling_params.stop)
        return len(prompt_token_ids)

    def _admit_compiled(self) -> list[StepOutput]:
        """Schedule those whose grammar compiled, end those whose grammar failed (waits a
        little for a compile when nothing else can run)."""
        failed = []
        idle = not self.scheduler.has_unfinished_requests() and not self._aborted_outputs
        for request_id, matcher, error in self._structured.compiled(0.05 if idle else 0.0):
            state = self._states.pop(request_id) if error else self._states[request_id]
            if error:
                failed.append(final_output(state, "error", self._clock, error, "grammar_error"))
            else:
                state.matcher = matcher
                self.scheduler.add_request(state.request)
        return failed

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Finish these requests now and free their blocks; unknown ids are ignored.

        Each aborted request gets one last StepOutput (finish_reason "abort") from the next step().
        """
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        live = [rid for rid in dict.fromkeys(ids) if rid in self._states]
        if not live:
            return
        self._structured.forget(live)
        self.scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
        for rid in live:
            state = self._states.pop(rid)
            self._aborted_outputs.append(final_output(state, "abort", self._clock))

    def set_paused(self, request_ids: Iterable[str], paused: bool) -> None:
        """Flow control: hold these requests back (their reader is behind) or let them run."""
        if paused:
            self.scheduler.pause_requests(request_ids)
        else:
            self.scheduler.resume_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self._states) or bool(self._aborted_outputs)

    # ---- the step ----------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Run one model step over the scheduled batch; return the deltas it produced."""
        outputs, self._aborted_outputs = self._aborted_outputs + self._admit_compiled(), []
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty:
            if sched_out.finished_ids:  # the runner frees their sampler state, runs no model
                self.runner.execute(sched_out)
            self._stats.record_idle()
            return outputs
        self._stats.record_step(sched_out)
        grammar = self._structured.step_grammar(self._constrained_rows(sched_out))
        try:
            if self.step_hook is not None:
                self.step_hook(sched_out)
            if grammar is None:
                runner_out = self.runner.execute(sched_out)
            else:
                runner_out = self.runner.execute(sched_out, grammar=grammar)
        except RankFailedError:  # the tensor-parallel group is broken: no step can run
            if grammar is not None:
                grammar.wait()  # its matchers are about to be dropped
            raise
        except Exception as exc:  # a failed step must not take the engine down
            logger.exception("model step failed; failing its %d requests", len(sched_out.scheduled))
            if grammar is not None:
                grammar.wait()  # its matchers are about to be dropped
            return outputs + self._fail_step(sched_out, exc)
        for request_id, chunk in runner_out.prompt_logprobs.items():
            state = self._states.get(request_id)
            if state is not None:
                state.add_prompt_logprobs(chunk)
        advanced = self.scheduler.update(sched_out, runner_out.sampled_token_ids,
                                         runner_out.accepted_draft_ids,
                                         runner_out.num_draft_tokens)
        for request in advanced:
            state = self._states.get(request.request_id)
            if state is not None:
                outputs.append(self._advance(state, runner_out.logprobs_of(request.request_id)))
        return outputs

    def _grammar_drafts(self, request_id: str, drafts: list[int]) -> int:
        """How many of a constrained request's drafts its grammar lets a step verify."""
        state = self._states.get(request_id)
        return 0 if state is None or state.matcher is None else accepted_drafts(state.matcher,
                                                                                  drafts)

    def _constrained_rows(self, sched_out: SchedulerOutput) -> list[tuple[str, Any]]:
        """(request id, matcher) of the requests sampling this step under a grammar."""
        rows = []
        for scheduled in sched_out.scheduled:
            state = self._states.get(scheduled.request_id)
            if scheduled.sample and state is not None and state.matcher is not None:
                rows.append((scheduled.request_id, state.matcher))
        return rows

    def _advance(self, state: RequestState, positions) -> StepOutput:
        """The delta of one request that got tokens this step (`positions`: their logprobs);
        finishes it on a stop string, with `stop` when its grammar is complete, or with
        `error` when its grammar failed."""
        request = state.request
        output_token_ids = request.output_token_ids
        new_token_ids = output_token_ids[state.num_sent_tokens:]
        state.num_sent_tokens = len(output_token_ids)
        grammar_error = None
        if state.matcher is not None:
            try:
                if self._structured.advance(request.request_id, state.matcher, new_token_ids):
                    finish_on_complete_grammar(self.scheduler, request)
            except GrammarError as exc:
                grammar_error = str(exc)
                finish_over_token_stop(self.scheduler, request, RequestStatus.FINISHED_ERROR)
        if state.num_sent_tokens == len(new_token_ids):
            self._stats.num_prompt_tokens += request.num_prompt_tokens
        new_text = ""
        if state.detokenizer is not None and (request.is_finished or not state.text_at_finish):
            text_ids = request.output_token_ids if state.text_at_finish else new_token_ids
            delta = state.detokenizer.update(text_ids, finished=request.is_finished)
            new_text = delta.text
            if delta.stop_string is not None:
                new_token_ids = state.cut_output(new_token_ids, delta.num_tokens)
                finish_over_token_stop(self.scheduler, request, RequestStatus.FINISHED_STOPPED,
                                       delta.stop_string)
        self._stats.num_generated_tokens += len(new_token_ids)
        new_logprobs = None if positions is None or request.sampling_params.logprobs is None \
            else [self._token_texts.fill(p) if self.detokenize else p
                  for p in positions[:len(new_token_ids)]]
        output = StepOutput(
            request_id=request.request_id, new_token_ids=new_token_ids,
            new_text=new_text, num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=state.num_sent_tokens,
            num_cached_tokens=request.num_cached_tokens or 0, new_logprobs=new_logprobs,
            prompt_logprobs=None if request.sampling_params.prompt_logprobs is None else
            state.first_prompt_logprobs(first=state.num_sent_tokens == len(new_token_ids)))
        if request.is_finished:
            self._states.pop(request.request_id, None)
            output.finish_reason = request.finish_reason
            output.stop_reason = request.stop_reason
            output.request_metrics = request_metrics(request, self._clock)
            if request.status == RequestStatus.FINISHED_ERROR:  # (a stop string still wins)
                output.error, output.error_code = grammar_error, "grammar_error"
        return output

    def _fail_step(self, sched_out: SchedulerOutput, exc: BaseException) -> list[StepOutput]:
        # The step's blocks were hashed when it was planned, but their K/V may never have been
        # written: no later request may hit them (nor, simply, any other block).
        self.scheduler.reset_prefix_cache()
        ids = [s.request_id for s in sched_out.scheduled if s.request_id in self._states]
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
        message = f"{type(exc).__name__}: {exc}"
        return [final_output(self._states.pop(rid), "error", self._clock, message) for rid in ids]

    # ---- introspection -----------------------------------------------------------------

    def stats(self) -> EngineStats:
        """Counters since start and the last step's shape, for logs, metrics and tests."""
        blocks = self.scheduler.block_manager
        prefix_cache = self.scheduler.prefix_cache_stats
        return EngineStats(
            **self._stats.as_dict(), num_preemptions=self.scheduler.num_preemptions_total,
            prefix_cache_queries=prefix_cache.num_queries, prefix_cache_hits=prefix_cache.num_hits,
            num_free_blocks=blocks.num_free_blocks, num_total_blocks=blocks.num_total_blocks,
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=blocks.usage, num_paused=self.scheduler.num_paused,
            router_load=self.runner.router_load(), **spec_decode_stats(self.scheduler),
            **self._lora.stats(self.scheduler))

    # ---- what the async layer reads once loaded (see engine.protocol.EngineCore) --------

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def max_num_seqs(self) -> int:
        return self.scheduler_config.max_num_seqs

    @property
    def kv_cache_info(self) -> dict:
        return dict(self.runner.kv_cache_info)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block (running requests keep theirs, unshared).
        Returns how many free blocks were dropped from the cache."""
        return self.scheduler.reset_prefix_cache()

    def check_lora(self, lora_request) -> None:
        """ValueError unless requests may run on this adapter (`add_request` checks it too)."""
        self._lora.check(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget a LoRA adapter and free its weights (requests on it still finish)."""
        return self._lora.remove(lora_int_id)

    def notify_on_failure(self, callback: Callable[[BaseException], None]) -> None:
        """Have `callback(error)` called, from any thread, when the engine can no longer step
        (a tensor-parallel rank died), also while it is idle; a lone runner never fails so."""
        if hasattr(self.runner, "on_failure"):
            self.runner.on_failure = callback

    def close(self) -> None:
        """Stop what the runner started (tensor-parallel ranks); idempotent. The engine
        cannot step afterwards."""
        self.runner.close()

    def check_integrity(self) -> None:
        """Raise AssertionError if block accounting is off, or blocks are held while idle."""
        blocks = self.scheduler.block_manager
        blocks.check_integrity()
        if not self.scheduler.has_unfinished_requests():
            assert blocks.num_free_blocks == blocks.num_total_blocks, (
                f"engine idle but {blocks.num_total_blocks - blocks.num_free_blocks} blocks held")
