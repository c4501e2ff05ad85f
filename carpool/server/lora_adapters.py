"""The LoRA adapters this server serves by name, as vLLM's: `--lora-modules`, `"model":
"<adapter>"` in a request, `/v1/models` cards with their `parent`, and loading and
unloading at run time (`POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`, only with
`--allow-runtime-lora-updating`).

The front end owns the names: each adapter gets an id once, never reused, so a reloaded
adapter is a new one to the engine (its own prefix-cache blocks). An adapter is checked
against the base model (config and tensor shapes, rank against `--max-lora-rank`) before its
name is served; unloading forgets the name at once, while requests already on it finish.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from carpool.config import EngineConfig
from carpool.config.named_files import load_model_config_of
from carpool.lora.peft_adapter import check_adapter
from carpool.lora_request import LoRARequest
from carpool.server.errors import APIError
from carpool.server.generation import ready_engine

router = APIRouter()


def parse_lora_modules(values: list[str] | None) -> tuple[LoRARequest, ...]:
    """`--lora-modules` values, `name=path` or JSON {"name", "path", "base_model_name"}, as
    LoRARequests with ids 1, 2, ...; ValueError naming a bad one."""
    modules: list[LoRARequest] = []
    for value in values or ():
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
                name, path = spec["name"], spec["path"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"lora_modules: {value!r} is not JSON with 'name' and 'path' "
                                 f"({exc})") from None
            base = spec.get("base_model_name")
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"lora_modules: {value!r} is not name=path or JSON")
            base = None
        if any(m.lora_name == name for m in modules):
            raise ValueError(f"lora_modules: the name {name!r} is given twice")
        modules.append(LoRARequest(name, len(modules) + 1, path, base))
    return tuple(modules)


def adapter_check(config: EngineConfig) -> Callable[[str], None] | None:
    """`check(path)`: ValueError unless the folder is an adapter of `config`'s model within
    its max_lora_rank; None where LoRA is off."""
    if config.lora is None:
        return None
    model_config = load_model_config_of(config.model)
    max_rank = config.lora.max_lora_rank

    def check(path: str) -> None:
        check_adapter(path, model_config, max_rank)
    return check


def check_lora_modules(config: EngineConfig, modules: tuple[LoRARequest, ...]) -> None:
    """Before the port binds: each `--lora-modules` adapter checked against the model."""
    if not modules:
        return
    check = adapter_check(config)
    if check is None:
        raise ValueError("lora_modules needs enable_lora")
    for module in modules:
        check(module.lora_path)


class ServedAdapters:
    """Name -> `LoRARequest` of the adapters served now; `check(path)` raises ValueError
    unless the folder is an adapter of the base model (None: LoRA is off)."""

    def __init__(self, modules: tuple[LoRARequest, ...] = (),
                 check: Callable[[str], None] | None = None,
                 allow_updates: bool = False) -> None:
        self._by_name = {m.lora_name: m for m in modules}
        self._next_id = max((m.lora_int_id for m in modules), default=0) + 1
        self.check = check  # set by `serve` (it knows the model)
        self.allow_updates = allow_updates

    def get(self, name: str) -> LoRARequest | None:
        return self._by_name.get(name)

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    def all(self) -> list[LoRARequest]:
        return list(self._by_name.values())

    async def load(self, name: str, path: str) -> LoRARequest:
        if self.check is None:
            raise APIError(400, "LoRA adapters are off: start the server with --enable-lora",
                           code="lora_disabled")
        if name in self._by_name:
            raise APIError(400, f"The LoRA adapter '{name}' has already been loaded.",
                           param="lora_name", code="lora_already_loaded")
        try:
            await asyncio.to_thread(self.check, path)
        except ValueError as exc:
            raise APIError(400, str(exc), param="lora_path", code="invalid_lora_adapter") from None
        adapter = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        self._by_name[name] = adapter
        return adapter

    def unload(self, name: str) -> LoRARequest:
        adapter = self._by_name.pop(name, None)
        if adapter is None:
            raise APIError(404, f"The LoRA adapter '{name}' cannot be found.",
                           param="lora_name", code="lora_not_found")
        return adapter


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's field; the name decides


def _adapters(request: Request) -> ServedAdapters:
    adapters: ServedAdapters = request.app.state.lora_adapters
    if not adapters.allow_updates:
        raise APIError(404, "Loading and unloading LoRA adapters at run time is off: start the "
                            "server with --allow-runtime-lora-updating", code="not_found")
    return adapters


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> str:
    adapter = await _adapters(request).load(body.lora_name, body.lora_path)
    return f"Success: LoRA adapter '{adapter.lora_name}' added successfully."


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request) -> str:
    adapter = _adapters(request).unload(body.lora_name)
    await ready_engine(request).call_utility("remove_lora", adapter.lora_int_id)
    return f"Success: LoRA adapter '{adapter.lora_name}' removed successfully."
