"""POST /tokenize and /detokenize, vLLM's shapes, with the server's own tokenizer copy."""

from __future__ import annotations

from fastapi import APIRouter, Request

from carpool.server.chat import render_chat_prompt
from carpool.server.errors import bad_request
from carpool.server.generation import check_model, ready_engine
from carpool.server.protocol import REQUEST_FIELDS, DetokenizeRequest, TokenizeRequest

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    info = ready_engine(request).info
    check_model(body.model, info)

    def tokens_of() -> list[int]:  # on the tokenizer thread, not the event loop
        if body.messages is not None:
            return render_chat_prompt(info.tokenizer, body.messages, body.add_generation_prompt)
        return info.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)

    try:
        if (body.prompt is None) == (body.messages is None):
            raise ValueError("prompt: give exactly one of prompt or messages")
        tokens = await request.app.state.tokenizer_worker.run(tokens_of)
    except ValueError as exc:
        raise bad_request(exc, REQUEST_FIELDS | {"messages", "prompt"}) from None
    return {"count": len(tokens), "max_model_len": info.max_model_len, "tokens": tokens}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    info = ready_engine(request).info
    check_model(body.model, info)
    bad = [t for t in body.tokens if not 0 <= t < info.vocab_size]
    if bad:
        raise bad_request(ValueError(
            f"tokens must be ids in [0, {info.vocab_size}), got {bad[:5]}"), {"tokens"})
    return {"prompt": info.tokenizer.decode(body.tokens)}
