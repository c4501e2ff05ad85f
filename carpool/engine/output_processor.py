"""The front end's half of a step's outputs: token ids in, text, stop strings and finishes out.

The engine-core process sends token-id deltas only (`LLMEngine(detokenize=False)`).
Here, in the HTTP process, each live request keeps its `IncrementalDetokenizer`;
a step's outputs become the deltas the streams see, with text, logprobs'
decoded tokens and stop strings applied, as vLLM V1's output processor does.

A stop string is decided here, so the engine learns of it late: the output
that completes it is delivered finished (`finish_reason "stop"`, the string as
`stop_reason`) and the request id is returned for an abort. The engine may
still send a token or its abort notice for that request; those never reach a
stream, but they reach the metrics (what the engine really computed), with the
finish reason the client saw.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from carpool.engine.detokenizer import IncrementalDetokenizer, TokenTextCache
from carpool.outputs import StepOutput
from carpool.sampling_params import SamplingParams


@dataclass(frozen=True)
class ProcessedStep:
    """One step's outputs after the front end's text work."""

    for_streams: list[StepOutput]  # with text; finished on a stop string
    for_metrics: list[StepOutput]  # the engine's outputs, stop-string finishes relabelled
    to_abort: list[str] = field(default_factory=list)  # stopped here, still live in the engine


class OutputProcessor:
    """Per-request detokenizers of the requests the engine is running; one thread uses it."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._token_texts = TokenTextCache(tokenizer)
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._stopped: dict[str, str] = {}  # request id -> the stop string that ended it here

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._detokenizers[request_id] = IncrementalDetokenizer(
            self._tokenizer, prompt_token_ids, params)

    def forget(self, request_ids: list[str]) -> None:
        """Drop requests the engine refused (their outputs will never come)."""
        for rid in request_ids:
            self._detokenizers.pop(rid, None)

    def process(self, outputs: list[StepOutput]) -> ProcessedStep:
        for_streams, for_metrics, to_abort = [], [], []
        for out in outputs:
            stop = self._stopped.get(out.request_id)
            if stop is not None:  # ended here earlier: only the metrics hear of it
                if out.finished:
                    del self._stopped[out.request_id]
                    out = _relabel(out, stop)
                for_metrics.append(out)
                continue
            detokenizer = self._detokenizers.get(out.request_id)
            if detokenizer is None:
                for_metrics.append(out)
                continue
            delta = detokenizer.update(out.new_token_ids, finished=out.finished)
            logprobs = out.new_logprobs
            if logprobs is not None:
                logprobs = [self._token_texts.fill(position) for position in logprobs]
            if delta.stop_string is None:
                for_streams.append(dataclasses.replace(out, new_text=delta.text,
                                                       new_logprobs=logprobs))
                for_metrics.append(out)
                if out.finished:
                    del self._detokenizers[out.request_id]
                continue
            del self._detokenizers[out.request_id]
            if delta.num_tokens is not None:  # the stop came before the last new token
                out = dataclasses.replace(
                    out, new_token_ids=out.new_token_ids[:delta.num_tokens],
                    num_output_tokens=out.num_output_tokens - len(out.new_token_ids)
                    + delta.num_tokens)
                logprobs = None if logprobs is None else logprobs[:delta.num_tokens]
            relabelled = _relabel(out, delta.stop_string)
            for_metrics.append(relabelled if out.finished else out)
            if not out.finished:
                self._stopped[out.request_id] = delta.stop_string
                to_abort.append(out.request_id)
            for_streams.append(dataclasses.replace(
                relabelled, new_text=delta.text, new_logprobs=logprobs,
                request_metrics=out.request_metrics))
        return ProcessedStep(for_streams, for_metrics, to_abort)


def _relabel(out: StepOutput, stop_string: str) -> StepOutput:
    """`out` as finished by `stop_string`, as the client was told."""
    return dataclasses.replace(out, finish_reason="stop", stop_reason=stop_string, error=None)
