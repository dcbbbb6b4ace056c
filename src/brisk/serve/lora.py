"""Adapters on the server, vLLM's way: `--lora-modules name=path`, the OpenAI `model` field picks one, GET
/v1/models lists them, POST /v1/load_lora_adapter and /v1/unload_lora_adapter change the set at run time.

The registry only maps names to LoRARequests (validated when registered: format, shapes, rank); the engine
thread loads an adapter into a slot when a request first needs it (lora/manager.py). Unloading drops the
name; the slot it occupied is reused by the next adapter that needs one (LRU, never while requests use it).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from brisk.lora.adapter import AdapterError
from brisk.lora.request import LoRARequest
from brisk.serve.protocol import ClientError

if TYPE_CHECKING:
    from fastapi import FastAPI

    from brisk.engine.llm_engine import LLMEngine


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def parse_lora_modules(items: tuple[str, ...] | list[str]) -> dict[str, str]:
    """('name=path', ...) -> {name: path}; ValueError naming the bad item."""
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--lora-modules takes name=path, got {item!r}")
        out[name.strip()] = path.strip()
    return out


class LoRARegistry:
    def __init__(self, engine: LLMEngine, modules: dict[str, str], base_name: str) -> None:
        self.manager = engine.lora_manager
        self.base_name = base_name
        self._lock = threading.Lock()
        self._next_id = 1
        self.adapters: dict[str, LoRARequest] = {}
        if modules and self.manager is None:
            raise ValueError("--lora-modules needs --enable-lora")
        for name, path in modules.items():
            self.add(name, path)

    @property
    def enabled(self) -> bool:
        return self.manager is not None

    def add(self, name: str, path: str) -> LoRARequest:
        """Validate and register an adapter (AdapterError / ValueError say what is wrong)."""
        assert self.manager is not None
        with self._lock:
            if name in self.adapters or name == self.base_name:
                raise ValueError(f"the name {name!r} is already served; unload it first or pick another name")
            request = LoRARequest(name, self._next_id, path)
            self.manager.check_adapter(request)  # format, shapes and rank, before any request uses it
            self._next_id += 1
            self.adapters[name] = request
            return request

    def remove(self, name: str) -> bool:
        with self._lock:
            return self.adapters.pop(name, None) is not None

    def get(self, model: str | None) -> LoRARequest | None:
        return None if model is None else self.adapters.get(model)


def install_lora_routes(app: FastAPI, registry: LoRARegistry, dependencies: list[Any]) -> None:
    from fastapi.responses import PlainTextResponse

    def need_lora() -> None:
        if not registry.enabled:
            raise ClientError("this server was started without --enable-lora; it serves no adapters",
                              code="lora_disabled")

    @app.post("/v1/load_lora_adapter", dependencies=dependencies, response_class=PlainTextResponse,
              response_model=None)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        need_lora()
        try:
            registry.add(body.lora_name, body.lora_path)
        except (AdapterError, ValueError) as e:
            raise ClientError(str(e), param="lora_path", code="invalid_lora_adapter") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=dependencies, response_class=PlainTextResponse,
              response_model=None)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        need_lora()
        if not registry.remove(body.lora_name):
            raise ClientError(f"the LoRA adapter {body.lora_name!r} is not loaded (see GET /v1/models)",
                              param="lora_name", code="model_not_found", status_code=404, err_type="not_found_error")
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
