"""vLLM's multi-LoRA serving: adapters named in a request's `model`.

- `--enable-lora --lora-modules NAME=PATH ...` (or a JSON object {"name", "path",
  "base_model_name"} per adapter) serves each adapter under its name beside the base model;
  each gets its own lora_int_id (1, 2, ...), and /v1/models lists it with its folder as `root`
  and the base model it adapts as `parent`.
- A request whose `model` is an adapter's name runs with that adapter; a served base name (or no
  `model`) runs without one; any other name is 404 model_not_found.
- With VLLM_ALLOW_RUNTIME_LORA_UPDATING (or SPECDEC_ALLOW_RUNTIME_LORA_UPDATING) true,
  POST /v1/load_lora_adapter {"lora_name", "lora_path"} adds one ("load_inplace": true
  replaces the one of that name, under its id: new weights pushed by a training loop) and
  POST /v1/unload_lora_adapter {"lora_name"} removes one (app.py). Unloading or replacing
  changes what new requests get; requests already running keep the weights they hold. Without
  the variable these routes do not exist (404), as in vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from ..lora import LoRARequest
from .errors import APIError, clipped

log = logging.getLogger("specdec.server")

RUNTIME_UPDATING_VARIABLES = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "SPECDEC_ALLOW_RUNTIME_LORA_UPDATING")


@dataclass(frozen=True)
class LoRAModulePath:
    """One --lora-modules entry (vLLM's LoRAModulePath)."""
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str) -> LoRAModulePath:
    """argparse type of --lora-modules: `name=path`, or a JSON object {"name", "path", "base_model_name"?}."""
    if value.lstrip().startswith("{"):
        try:
            obj = json.loads(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {value!r}") from None
        unknown = sorted(set(obj) - {"name", "path", "base_model_name"}) if isinstance(obj, dict) else []
        if not isinstance(obj, dict) or unknown or not all(isinstance(obj.get(k), str) and obj[k] for k in ("name", "path")):
            why = f"unknown field {unknown[0]!r}" if unknown else 'needs "name" and "path" strings'
            raise argparse.ArgumentTypeError(f"{why}: {value!r}")
        base = obj.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise argparse.ArgumentTypeError(f'"base_model_name" must be a string: {value!r}')
        return LoRAModulePath(obj["name"], obj["path"], base)
    name, eq, path = value.partition("=")
    if not (eq and name and path):
        raise argparse.ArgumentTypeError(f'must be NAME=PATH or a JSON object {{"name": ..., "path": ...}}, got {value!r}')
    return LoRAModulePath(name, path)


def runtime_updating_allowed(environ=os.environ) -> bool:
    """vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING (or specdec's spelling): "1" or "true"."""
    return any(environ.get(v, "0").strip().lower() in ("1", "true") for v in RUNTIME_UPDATING_VARIABLES)


def model_permission(created: int) -> dict:
    """vLLM's ModelPermission, one per /v1/models entry (what its clients read; nothing is enforced)."""
    return {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
            "group": None, "is_blocking": False}


class Adapters:
    """The adapters a server routes to by name. Names are unique and distinct from the base
    model's names; ids are never reused, so an adapter unloaded and loaded again under its name
    gets fresh weights. Adapters are read and loaded by the engine (its check_lora: a ValueError
    with one line says what is wrong), on the engine's thread: `call` is EngineWorker.call."""

    def __init__(self, base_names: tuple[str, ...], enabled: bool, call: Callable[[Callable], Future]):
        self.base_names, self.enabled, self._call = base_names, enabled, call
        self._by_name: dict[str, tuple[LoRARequest, str]] = {}      # name -> (its request, parent)
        self._next_id = 1
        self._updates = asyncio.Lock()           # one load or unload at a time

    def route(self, model: str | None) -> LoRARequest | None:
        """The LoRARequest of a request's `model` (None for a base model or none named: an empty
        name too, as vLLM's _is_model_supported)."""
        if not model or model in self.base_names:
            return None
        found = self._by_name.get(model)
        if found is None:
            raise APIError(404, f"The model `{clipped(model)}` does not exist.", "model", "model_not_found")
        return found[0]

    def new_request(self, name: str, path: str) -> LoRARequest:
        """A LoRARequest for an adapter about to be added: one 400 APIError (vLLM's messages)
        when the name or path is missing or the name is taken."""
        if not name or not path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.", "lora_name" if not name else "lora_path")
        if name in self._by_name:
            raise APIError(400, f"The lora adapter '{clipped(name)}' has already been loaded. If you want to load the "
                                "adapter in place, set 'load_inplace' to True.", "lora_name")
        if name in self.base_names:
            raise APIError(400, f"'{clipped(name)}' is the name of a served base model; an adapter needs another name.", "lora_name")
        if not self.enabled:
            raise APIError(400, "LoRA is not enabled on this server (start it with --enable-lora).", "lora_name")
        request = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        return request

    def add(self, request: LoRARequest, base_model_name: str | None = None) -> None:
        """Route request.lora_name to request (already checked by the engine)."""
        parent = base_model_name if base_model_name in self.base_names else self.base_names[0]
        self._by_name[request.lora_name] = (request, parent)

    def remove(self, name: str) -> None:
        if not name:
            raise APIError(400, "'lora_name' must be provided.", "lora_name")
        if self._by_name.pop(name, None) is None:
            raise APIError(404, f"The lora adapter '{clipped(name)}' cannot be found.", "lora_name", "model_not_found")

    def cards(self, created: int | None = None) -> list[dict]:
        """/v1/models entries of the adapters (vLLM's ModelCard: root = the folder, parent = the base)."""
        created = int(time.time()) if created is None else created
        return [{"id": name, "object": "model", "created": created, "owned_by": "specdec", "root": req.lora_path,
                 "parent": parent, "permission": [model_permission(created)]} for name, (req, parent) in self._by_name.items()]

    def load_static(self, modules) -> None:
        """The --lora-modules adapters, loaded before the worker starts (ValueError: the first
        bad one)."""
        if modules and not self.enabled:
            raise ValueError("--lora-modules needs --enable-lora")
        for m in modules:
            try:
                request = self.new_request(m.name, m.path)
            except APIError as e:
                raise ValueError(f"--lora-modules {m.name}: {e.message}") from None
            self._call(lambda engine: engine.check_lora(request)).result()
            self.add(request, m.base_model_name)

    async def load(self, name: str, path: str, base_model_name: str | None = None, load_inplace: bool = False) -> None:
        """vLLM's /v1/load_lora_adapter: read and load the folder, then route `name` to it
        (400 APIError: the name is taken, or the adapter is invalid). load_inplace and a name
        already served: the folder replaces its adapter under the same id and parent (the old
        one stays if the new one is refused)."""
        from .worker import ShuttingDown

        async with self._updates:
            old = self._by_name.get(name) if load_inplace and path else None
            if old is not None:
                request = LoRARequest(name, old[0].lora_int_id, path, load_inplace=True)
                base_model_name = base_model_name or old[1]
            else:
                request = self.new_request(name, path)
            # vLLM's 404 for an adapter it cannot find; os.path.exists is False, not an OSError, for a
            # path the system cannot even look up (a name over 255 bytes, a NUL)
            if not os.path.exists(path):
                raise APIError(404, f"No adapter found for {clipped(name)!r}: {clipped(path)} does not exist", "lora_path")
            try:
                await asyncio.wrap_future(self._call(lambda engine: engine.check_lora(request)))
            except ValueError as e:
                raise APIError(400, str(e).splitlines()[0] if str(e) else "invalid LoRA adapter", "lora_path") from None
            except ShuttingDown as e:
                raise APIError(503, str(e)) from None
            # routed requests name it without load_inplace: the engine reads the folder again
            # only when asked to (vLLM had kept the flag, re-reading it for every request)
            self.add(dataclasses.replace(request, load_inplace=False), base_model_name)
        log.info("Loaded new LoRA adapter: name '%s', path '%s'", name, path)

    async def unload(self, name: str) -> None:
        """vLLM's /v1/unload_lora_adapter: new requests no longer reach the adapter (404 APIError:
        no such name); the engine drops its cached weights, running requests keep theirs."""
        from .worker import ShuttingDown

        async with self._updates:
            self.remove(name)
            try:
                await asyncio.wrap_future(self._call(lambda engine: engine.lora.remove(name)))
            except ShuttingDown:
                pass                             # nothing will run with it any more anyway
        log.info("Removed LoRA adapter: name '%s'", name)
