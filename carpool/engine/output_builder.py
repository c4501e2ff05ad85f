"""Fold per-step deltas (`StepOutput`) back into vLLM-shaped `RequestOutput`s.

One `CompletionBuilder` per engine request (one per completion of an n > 1
prompt); a `RequestOutputBuilder` gathers a prompt's completions in index order.
Text is kept as a list of chunks and joined once, so folding is O(output).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from carpool.outputs import (
    CompletionOutput,
    PositionLogprobs,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    StepOutput,
)


@dataclass
class CompletionBuilder:
    index: int
    want_logprobs: bool
    token_ids: list[int] = field(default_factory=list)
    text_chunks: list[str] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    error_code: str | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # from the first delta, when asked

    def add(self, out: StepOutput) -> None:
        self.token_ids.extend(out.new_token_ids)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.new_text:
            self.text_chunks.append(out.new_text)
        if self.want_logprobs and out.new_logprobs:
            for token_id, position in zip(out.new_token_ids, out.new_logprobs):
                self.logprobs.append(position)
                self.cumulative_logprob += position[token_id].logprob
        if out.finished:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason
            self.error, self.error_code = out.error, out.error_code
            self.metrics = out.request_metrics

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def build(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index, text="".join(self.text_chunks), token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob if self.want_logprobs else None,
            logprobs=list(self.logprobs) if self.want_logprobs else None,
            finish_reason=self.finish_reason, stop_reason=self.stop_reason)


@dataclass
class RequestOutputBuilder:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    completions: list[CompletionBuilder]

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)

    def build(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            outputs=[c.build() for c in self.completions], finished=self.finished,
            metrics=[c.metrics for c in self.completions],
            num_cached_tokens=max(c.num_cached_tokens for c in self.completions),
            prompt_logprobs=self.prompt_logprobs())

    def prompt_logprobs(self) -> list[PositionLogprobs | None] | None:
        """vLLM's `prompt_logprobs` (the prompt is shared: any completion's will do)."""
        found = next((c.prompt_logprobs for c in self.completions
                      if c.prompt_logprobs is not None), None)
        return None if found is None else found.positions()
