"""Routes about the server rather than generation: models, probes, load, version, metrics."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import carpool
from carpool.engine.protocol import EngineClient
from carpool.lora_request import LoRARequest
from carpool.server.errors import APIError
from carpool.server.generation import check_model, ready_engine
from carpool.server.liveness import stall_message

router = APIRouter()
_STARTED = int(time.time())


_EMPTY_200 = {200: {"description": "Ready: an empty body"}}


@router.get("/health", response_class=Response, responses=_EMPTY_200)
async def health(request: Request) -> Response:
    """200 once the model is loaded and the step loop is alive; 503 before, after, while
    the server drains for shutdown, and while the engine has work but finishes no step for
    --engine-stall-timeout (so load balancers stop sending work)."""
    engine = ready_engine(request)
    state = request.app.state
    closing = state.admission.closing_reason
    if closing is not None:
        raise APIError(503, f"The server is shutting down ({closing}).",
                       code="server_shutting_down")
    stalled = stall_message(engine, state.admission, state.settings.engine_stall_timeout)
    if stalled is not None:
        raise APIError(503, stalled, code="engine_stalled")
    return Response(status_code=200)


# vLLM's (and SageMaker's) name for the same probe, in both methods.
router.add_api_route("/ping", health, methods=["GET"], response_class=Response,
                     responses=_EMPTY_200, operation_id="ping_get")
router.add_api_route("/ping", health, methods=["POST"], response_class=Response,
                     responses=_EMPTY_200, operation_id="ping_post")


@router.get("/load")
async def load(request: Request) -> dict:
    """Generation requests in flight (queued, running or streaming), for routers that send
    work to the least loaded server; vLLM's shape, plus whether the engine is stalled
    (see /health)."""
    state = request.app.state
    engine: EngineClient = state.engine
    stalled = engine.is_ready and stall_message(
        engine, state.admission, state.settings.engine_stall_timeout) is not None
    return {"server_load": len(state.admission.streams), "engine_stalled": stalled}


@router.get("/get_load")
async def get_load(request: Request) -> list[dict]:
    """SGLang's load report, which its router polls (one entry: a carpool server is one worker
    to it, whatever its --data-parallel-size): requests running and waiting, and the tokens
    their KV blocks hold."""
    snapshot = ready_engine(request).snapshot()
    stats = snapshot.stats
    block_size = request.app.state.engine.info.kv_cache_info["block_size"]
    return [{"dp_rank": 0, "num_reqs": stats.num_running + stats.num_waiting,
             "num_waiting_reqs": stats.num_waiting,
             "num_tokens": (stats.num_total_blocks - stats.num_free_blocks) * block_size}]


@router.get("/server_info")
async def server_info(request: Request) -> dict:
    """What a router asks of a worker when it registers it (SGLang's route): the model's name
    and limits, and the engine replicas behind this server."""
    engine = ready_engine(request)
    info = engine.info
    return {"served_model_name": info.served_model_name, "max_model_len": info.max_model_len,
            "max_num_seqs": info.max_num_seqs, "dp_size": engine.num_replicas,
            "version": carpool.__version__}


@router.get("/model_info")
async def model_info(request: Request) -> dict:
    """SGLang's model card, which its router reads on registration. No model or tokenizer
    path: the router would try to load that tokenizer itself, from a path of this machine."""
    info = ready_engine(request).info
    return {"served_model_name": info.served_model_name, "is_generation": True,
            "max_context_length": info.max_model_len, "vocab_size": info.vocab_size}


@router.get("/version")
async def version() -> dict:
    return {"version": carpool.__version__}


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    """The served model, then each LoRA adapter (vLLM's cards: `root` its folder, `parent`
    the model it extends)."""
    info = ready_engine(request).info
    adapters = request.app.state.lora_adapters.all()
    return {"object": "list",
            "data": [_model_card(info)] + [_adapter_card(info, a) for a in adapters]}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict:
    """The openai client's `models.retrieve`; another model's name is a 404."""
    info = ready_engine(request).info
    adapter = check_model(model_id, info, request.app.state.lora_adapters)
    return _model_card(info) if adapter is None else _adapter_card(info, adapter)


def _model_card(info) -> dict:
    return {"id": info.served_model_name, "object": "model", "created": _STARTED,
            "owned_by": "carpool", "root": info.served_model_name, "parent": None,
            "max_model_len": info.max_model_len, "quantization": info.quantization}


def _adapter_card(info, adapter: LoRARequest) -> dict:
    return {"id": adapter.lora_name, "object": "model", "created": _STARTED,
            "owned_by": "carpool", "root": adapter.lora_path,
            "parent": adapter.base_model_name or info.served_model_name,
            "max_model_len": info.max_model_len, "quantization": info.quantization}


@router.post("/v1/embeddings")
async def embeddings() -> Response:
    """A clear 404 rather than an anonymous one: the served model generates, it does not embed."""
    raise APIError(404, "This server does not serve embeddings: carpool runs generative models "
                        "only (/v1/completions, /v1/chat/completions).",
                   code="embeddings_not_supported")


@router.get("/metrics", response_class=Response, responses={
    200: {"description": "Prometheus' text format", "content": {"text/plain": {}}}})
async def metrics(request: Request) -> Response:
    """Rendered on a worker thread, never on the event loop; polls that arrive while a
    rendering is under way share it, so tight pollers cost one rendering at a time."""
    engine: EngineClient = request.app.state.engine
    if engine.metrics is None:
        return Response(b"", media_type=CONTENT_TYPE_LATEST)
    state = request.app.state
    rendering: asyncio.Future | None = getattr(state, "metrics_rendering", None)
    if rendering is None or rendering.done():
        rendering = asyncio.ensure_future(asyncio.to_thread(engine.metrics.render))
        state.metrics_rendering = rendering
    return Response(await asyncio.shield(rendering), media_type=CONTENT_TYPE_LATEST)


@router.post("/reset_prefix_cache", response_class=Response, responses={
    200: {"description": "The cache was reset: an empty body"}})
async def reset_prefix_cache(request: Request) -> Response:
    """Forget every cached prefix block (vLLM's route; running requests keep theirs)."""
    await ready_engine(request).call_utility("reset_prefix_cache")
    return Response(status_code=200)


@router.get("/stats", include_in_schema=False)
async def stats(request: Request, integrity: bool = False) -> JSONResponse:
    """The engine's latest published stats snapshot (block counts, queue lengths).

    With `?integrity=true`, fresh stats from the loop thread plus the block manager's
    integrity check: `"integrity": "ok"` or what is wrong (tests, operators).
    """
    engine = ready_engine(request)
    if not integrity:
        return JSONResponse(engine.snapshot().as_dict())
    return JSONResponse(await engine.call_utility("checked_stats"))
