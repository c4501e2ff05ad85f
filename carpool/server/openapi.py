"""The OpenAPI document as the server answers: FastAPI's, with its errors corrected.

FastAPI documents a 422 for every body it validates and a JSON body for every route;
this server answers bad input with a 400 in OpenAI's error body (`errors.py`), may
answer 401 (the API key), 413 (the body limit), 404 (another model), 503 (loading,
overloaded, draining, stalled) and 500 on any route that can, and its probes and
/reset_prefix_cache answer with an empty body. `openapi_document` rewrites FastAPI's
document to say so (schemathesis's conformance checks hold it:
tests/reliability/test_openapi_conformance.py).
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

_ERROR_SCHEMA = {
    "title": "ErrorResponse", "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "null"]}}}}}
_ERROR_DESCRIPTIONS = {
    "400": "Invalid request: OpenAI's error body, `param` naming the field",
    "401": "Missing or invalid API key (with --api-key)",
    "404": "Another model's name, or a route this server does not serve",
    "413": "Request body over --max-request-body-bytes",
    "500": "The engine failed on this request",
    "503": "Loading, overloaded, shutting down or stalled (see Retry-After)",
}
# Routes that answer without the engine, and so never 503.
_ALWAYS_UP = ("/version", "/metrics", "/load")


def openapi_document(app: FastAPI, is_protected: Callable[[str], bool]) -> dict:
    """FastAPI's document for `app` with the responses corrected (cached on the app, as
    FastAPI's own)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, description=app.description,
                      routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas["ErrorResponse"] = _ERROR_SCHEMA
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    for path, operations in doc.get("paths", {}).items():
        for method, operation in operations.items():
            _correct(path, method, operation, is_protected(path))
    app.openapi_schema = doc
    return doc


def _correct(path: str, method: str, operation: dict, protected: bool) -> None:
    responses = operation["responses"]
    codes = set()
    if responses.pop("422", None) is not None:
        codes.add("400")
    if "requestBody" in operation:
        codes |= {"400", "404", "413"}
    if "{model_id" in path or path == "/v1/embeddings":
        codes.add("404")
    if protected:
        codes.add("401")
    if path not in _ALWAYS_UP:
        codes |= {"500", "503"}
    for code in sorted(codes):
        responses[code] = {"description": _ERROR_DESCRIPTIONS[code], "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    if path == "/v1/embeddings":
        responses.pop("200", None)  # never served
    if method == "post" and path in ("/v1/completions", "/v1/chat/completions",
                                     "/v1/responses"):
        responses["200"].setdefault("content", {})["text/event-stream"] = {
            "schema": {"type": "string"}}
