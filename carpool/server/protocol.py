"""Request bodies of the OpenAI API (plus vLLM's sampling extras), and their SamplingParams.

Pydantic checks types strictly: an integer field takes only a JSON integer (not
`true`, `1.0` or `"1"`), a number field a JSON number (not `true` or `"1"`) and a
boolean field only `true` or `false` (not `1` or `"true"`); OpenAI's API refuses
those lookalikes too. Ranges are checked
once, by `SamplingParams`, whose `ValueError` names the field and becomes a 400.
Unknown fields are ignored, as vLLM does, so newer clients keep working; the
routes log one warning per request naming them (`ignored_fields`).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
)

from carpool.sampling_params import SamplingParams
from carpool.server.constraints import structured_outputs_of
from carpool.server.tools import ToolChoice, tool_choice_of

EMPTY_DEFAULTS: Mapping[str, Any] = MappingProxyType({})

TokenIds = list[StrictInt]


def _valid_unicode(text: str) -> str:
    """JSON may carry lone surrogates ("\\ud800") that are not text; no tokenizer takes them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"must be valid Unicode text, but holds a lone surrogate at "
                         f"position {exc.start}") from None
    return text


# Every string the server reads from a request (prompts, messages, stop strings, names).
Text = Annotated[str, AfterValidator(_valid_unicode)]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="allow")  # kept aside (model_extra), never used

    model: Text | None = None
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    n: StrictInt = 1
    stop: Text | list[Text] | None = None
    seed: StrictInt | None = None
    presence_penalty: StrictFloat = 0.0
    frequency_penalty: StrictFloat = 0.0
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    # vLLM's extras
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    min_tokens: StrictInt = 0
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    # top-N logprobs of every prompt token (vLLM's; such requests skip the prefix cache)
    prompt_logprobs: StrictInt | None = None
    # Prefix caching: requests share cached prompt blocks only with the same salt.
    cache_salt: Text | None = None
    # Accepted so that clients sending them get a clear 400 rather than silent neglect.
    logit_bias: dict | None = None
    # Output constrained to a grammar (server/constraints.py): OpenAI's and vLLM's names.
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None

    @property
    def ignored_fields(self) -> list[str]:
        """The request's fields this server does not know, which it ignores."""
        return sorted(self.model_extra or {})

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _check_unsupported(self) -> None:
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not supported with stream (as in vLLM; "
                             "completions stream them with echo and logprobs)")

    def _sampling_kwargs(self, defaults: Mapping[str, Any]) -> dict:
        """SamplingParams kwargs; an unset temperature / top_p / top_k / min_p /
        repetition_penalty takes the model's generation_config value (`defaults`)."""
        self._check_unsupported()
        kwargs = dict(
            n=self.n, min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, stop=self.stop or (), stop_token_ids=self.stop_token_ids or (),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens,
            prompt_logprobs=self.prompt_logprobs,
            structured_outputs=structured_outputs_of(self))
        optional = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                        min_p=self.min_p, repetition_penalty=self.repetition_penalty)
        kwargs.update({k: defaults[k] for k, v in optional.items() if v is None and k in defaults})
        kwargs.update({k: v for k, v in optional.items() if v is not None})
        return kwargs


class CompletionRequest(SamplingRequest):
    prompt: Text | list[Text] | TokenIds | list[TokenIds]
    max_tokens: StrictInt | None = 16  # OpenAI's default for legacy completions
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: Text | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids); raises if empty."""
        prompt = self.prompt
        if isinstance(prompt, str):
            prompts: list = [prompt]
        elif not prompt:
            raise ValueError("prompt must not be empty")
        elif isinstance(prompt[0], int):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        for p in prompts:
            if isinstance(p, list) and not p:
                raise ValueError("prompt must not hold an empty list of token ids")
        return prompts

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the answer is the prompt (and its logprobs) alone, as
        lm-evaluation-harness asks for loglikelihoods."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self, defaults: Mapping[str, Any] = EMPTY_DEFAULTS) -> SamplingParams:
        """With `echo`, `logprobs` covers the prompt too (its logprobs are computed); an
        echo-only request generates one token, which the response leaves out (vLLM's way)."""
        if self.suffix:
            raise ValueError("suffix is not supported")
        kwargs = self._sampling_kwargs(defaults)
        if kwargs["prompt_logprobs"] is None and self.echo:
            kwargs["prompt_logprobs"] = self.logprobs
        return SamplingParams(max_tokens=1 if self.echo_only else self.max_tokens,
                              logprobs=self.logprobs, **kwargs)


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class ToolCallFunction(BaseModel):
    name: Text
    arguments: Text


class ToolCallItem(BaseModel):
    """An assistant message's earlier tool call, as OpenAI sends it back in the history."""

    model_config = ConfigDict(extra="ignore")

    id: Text | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallItem] | None = None  # assistant
    tool_call_id: Text | None = None  # tool

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    tools: list | None = None
    tool_choice: Text | dict | None = None
    parallel_tool_calls: StrictBool = True

    def tool_choice_of(self, auto_enabled: bool = True) -> ToolChoice:
        """What `tools` and `tool_choice` allow; ValueError naming the field."""
        return tool_choice_of(self.tools, self.tool_choice, self.parallel_tool_calls,
                              auto_enabled)

    def _sampling_kwargs(self, defaults: Mapping[str, Any]) -> dict:
        kwargs = super()._sampling_kwargs(defaults)
        grammar = self.tool_choice_of().grammar()
        if grammar is not None:
            if kwargs["structured_outputs"] is not None:
                raise ValueError("tool_choice: a forced tool call cannot be combined with "
                                 "response_format or structured_outputs")
            kwargs["structured_outputs"] = grammar
        return kwargs

    def to_sampling_params(self, defaults: Mapping[str, Any] = EMPTY_DEFAULTS) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.top_logprobs is not None and self.top_logprobs < 0:
            # the upper bound is the engine's --max-logprobs, checked on admission
            raise ValueError(f"top_logprobs must be >= 0, got {self.top_logprobs}")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs,
                              **self._sampling_kwargs(defaults))


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    tokens: list[StrictInt] = Field(default_factory=list)


# Field names a 400's `param` may name (a ValueError message starting with one of them).
REQUEST_FIELDS = frozenset(CompletionRequest.model_fields) | frozenset(
    ChatCompletionRequest.model_fields)
