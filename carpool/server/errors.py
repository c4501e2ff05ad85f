"""OpenAI's error body for every failure, so clients see one shape whatever went wrong.

Every rejection the server makes, including FastAPI's own request validation
(422 by default) and unknown paths, becomes
`{"error": {"message", "type", "param", "code"}}` with the status OpenAI uses.
"""

from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
          404: "invalid_request_error", 405: "invalid_request_error",
          413: "invalid_request_error", 500: "server_error", 503: "server_error"}
# A ValueError from SamplingParams / the engine starts with the field's name.
_LEADING_FIELD = re.compile(r"^([a-z_][a-z0-9_]*)\b")


class APIError(Exception):
    """An error the client should see, with its HTTP status and OpenAI fields."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None,
                 code: str | None = None, error_type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _TYPES.get(status_code, "invalid_request_error")
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.error_type, self.param, self.code)

    def response(self) -> JSONResponse:
        return _ASCIIJSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


class _ASCIIJSONResponse(JSONResponse):
    """Error messages may quote what the client sent, lone surrogates included: escape them."""

    def render(self, content: object) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_body(message: str, error_type: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def bad_request(exc: Exception, known_fields: frozenset[str] | set[str] = frozenset()) -> APIError:
    """A 400 from a ValueError; `param` is the field its message starts with, if a known one."""
    message = str(exc)
    match = _LEADING_FIELD.match(message)
    param = match.group(1) if match and match.group(1) in known_fields else None
    return APIError(400, message, param=param)


def not_found_model(name: str, served: str) -> APIError:
    return APIError(404, f"The model '{name}' does not exist; this server serves '{served}'.",
                    param="model", code="model_not_found")


def engine_error(message: str, code: str | None = None) -> APIError:
    """A request that failed in the engine: a 500, or a 400 when the request's own grammar
    failed (`code` "grammar_error"), which no retry would fix."""
    if code == "grammar_error":
        return APIError(400, message, code=code)
    return APIError(500, f"The engine failed on this request: {message}", code="engine_error")


def validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's 422 turned into a 400 naming the first bad field."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "Invalid request body.")
    # In a union (a prompt is text or token ids) the member that matched the type but not
    # its check says most: prefer a value error to "should be a valid list".
    # Otherwise the member that got furthest into the value: for `[{"content": 5}]` in a
    # text-or-items field, the item's content, not "should be a valid string".
    first = next((e for e in errors if e.get("type") == "value_error"),
                 max(errors, key=lambda e: len(_path(e.get("loc", ())))))
    if first.get("type") == "json_invalid":
        return APIError(400,
                        f"Malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}",
                        code="invalid_json")
    loc = _path(first.get("loc", ()))
    param = str(loc[0]) if loc else None
    where = f"{_where(loc)}: " if loc else ""
    message = f"{where}{first.get('msg', 'invalid value')}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error(s))"
    return APIError(400, message, param=param)


def _path(loc: tuple) -> list[str | int]:
    return [part for part in loc if not _is_type_tag(part)]


def _where(path: list[str | int]) -> str:
    """OpenAI's spelling of a location: ['input', 0, 'content'] -> 'input[0].content'."""
    where = ""
    for part in path:
        where += f"[{part}]" if isinstance(part, int) else f".{part}" if where else str(part)
    return where


def _is_type_tag(part: object) -> bool:
    """Pydantic's location parts that name a union member ('str', 'list[int]', a model's
    class name as a tagged union's tag), not a field: API fields are snake_case."""
    return part == "body" or (isinstance(part, str) and (
        part in ("str", "int", "float", "bool", "list", "dict", "none") or "[" in part
        or part[:1].isupper()))


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception the app can raise to OpenAI's error body."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in a request")
        return APIError(500, f"Internal server error: {type(exc).__name__}").response()
