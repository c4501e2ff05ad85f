"""POST /tokenize and /detokenize, vLLM's shapes, with the server's own tokenizer copy.

Both are bounded by the context length: a text surely longer than `max_model_len` tokens,
or more than that many ids, is a 400 naming the field (checked by length before any
tokenizing). Both run on the tokenizer's /tokenize lane (`prompts.TokenizerWorker`), never
on the event loop nor ahead of generation requests' prompts, and a client that disconnects
while its job waits takes the job with it.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from carpool.engine.tokenizer import encode_bounded
from carpool.server.chat import render_chat_prompt
from carpool.server.errors import bad_request
from carpool.server.generation import check_model, ready_engine, until_disconnected
from carpool.server.prompts import TokenizerWorker
from carpool.server.protocol import REQUEST_FIELDS, DetokenizeRequest, TokenizeRequest

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    info = ready_engine(request).info
    check_model(body.model, info)
    worker: TokenizerWorker = request.app.state.tokenizer_worker
    limit = info.max_model_len

    def tokens_of() -> list[int]:  # on the tokenizer's /tokenize lane, not the event loop
        if body.messages is not None:
            try:
                return render_chat_prompt(info.tokenizer, body.messages,
                                          body.add_generation_prompt, max_tokens=limit)
            except ValueError as exc:
                raise _naming("messages", exc) from None
        try:
            worker.check_text_can_fit(info, body.prompt)
            return encode_bounded(info.tokenizer, body.prompt,
                                  add_special_tokens=body.add_special_tokens, max_tokens=limit)
        except ValueError as exc:
            raise _naming("prompt", exc) from None

    try:
        if (body.prompt is None) == (body.messages is None):
            raise ValueError("prompt: give exactly one of prompt or messages")
        tokens = await until_disconnected(worker.run_tokenize(tokens_of), request)
    except ValueError as exc:
        raise bad_request(exc, REQUEST_FIELDS | {"messages", "prompt"}) from None
    return {"count": len(tokens), "max_model_len": info.max_model_len, "tokens": tokens}


def _naming(field: str, exc: ValueError) -> ValueError:
    """`exc` with a message that starts with `field` (what a 400's `param` is read from)."""
    message = str(exc)
    return exc if message.startswith(field) else ValueError(f"{field}: {message}")


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    info = ready_engine(request).info
    check_model(body.model, info)
    if len(body.tokens) > info.max_model_len:
        raise bad_request(ValueError(
            f"tokens: at most max_model_len ({info.max_model_len}) ids, got "
            f"{len(body.tokens)}"), {"tokens"})
    bad = [t for t in body.tokens if not 0 <= t < info.vocab_size]
    if bad:
        raise bad_request(ValueError(
            f"tokens must be ids in [0, {info.vocab_size}), got {bad[:5]}"), {"tokens"})
    worker: TokenizerWorker = request.app.state.tokenizer_worker
    text = await until_disconnected(
        worker.run_tokenize(info.tokenizer.decode, body.tokens), request)
    return {"prompt": text}
