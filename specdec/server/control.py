"""vLLM's control endpoints, outside /v1 as there. With --api-key the routes that change the
server's state (every POST here) ask for the key as /v1 does (vLLM's key covers /v1 only, and
mounts these routes only in development mode); the GET ones stay open, as /health does.

Always (vLLM's RLHF router): `POST /pause?mode=abort|wait|keep&clear_cache=true` (no new request
enters the engine until /resume; in-flight ones are aborted with finish_reason "abort", waited
for, or frozen in place), `POST /resume`, `GET /is_paused`, `GET /get_world_size`.

With VLLM_SERVER_DEV_MODE=1 (vLLM's development routes, privileged: they change what the server
computes): `POST /reload_weights` {"weights_path", "reset_running_requests"} (the same model's
weights from a folder or .gguf, in place; loaded off the engine's thread, copied in between two
steps), `POST /collective_rpc` {"method", "args", "kwargs", "timeout"} -> {"results": [...]},
`POST /reset_prefix_cache?reset_running_requests=false`, `POST /reset_mm_cache`, and sleep mode's
`POST /sleep`, `POST /wake_up`, `GET /is_sleeping` (no sleep mode here: /sleep is a 400 saying so), and
`GET /server_info?config_format=text|json` (vLLM's fields: vllm_config, the configuration served; vllm_env,
the VLLM_* and SPECDEC_* variables set, none holding a key; system_env, the versions it runs on).

On a dead engine the routes that reach it (/pause, /resume, /reload_weights, /collective_rpc,
/reset_prefix_cache) answer 503 with the reason, as /health and the API routes do.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import os
from typing import Any, Literal

from fastapi import APIRouter, Query, Response
from pydantic import BaseModel, ConfigDict

from .errors import APIError
from .worker import PAUSE_MODES, ShuttingDown

log = logging.getLogger("specdec.server")

DEV_MODE_VARIABLE = "VLLM_SERVER_DEV_MODE"
# the routes that change the server's state: with --api-key they ask for the key (app.py), as one
# anonymous POST /pause would otherwise stop every user's generation
KEYED_PATHS = frozenset({"/pause", "/resume", "/reload_weights", "/collective_rpc", "/reset_prefix_cache",
                         "/reset_mm_cache", "/sleep", "/wake_up"})
# vLLM's runtime LoRA updates (lora.py; under /v1, which --api-key guards already): with --replicas
# every replica loads or drops the adapter, as vLLM's data-parallel client sends add_lora /
# remove_lora to every engine
LORA_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
# the routes that act on one engine: with --replicas the replica a request reaches sends it to
# every replica (server/replicas.py) rather than pausing or reloading one engine of N
CONTROL_PATHS = KEYED_PATHS | LORA_PATHS | {"/is_paused", "/get_world_size", "/is_sleeping"}


def dev_mode(environ=os.environ) -> bool:
    """vLLM's VLLM_SERVER_DEV_MODE: "1" or "true"."""
    return environ.get(DEV_MODE_VARIABLE, "0").strip().lower() in ("1", "true")


async def _on_engine(service, fn):
    """fn(engine) on the engine's thread between two steps; a ValueError is the client's 400, a
    dead engine (or one shutting down) a 503 with the reason, as /pause and /health answer."""
    try:
        return await asyncio.wrap_future(service.worker.call(fn))
    except ValueError as e:
        raise APIError(400, str(e).splitlines()[0] if str(e) else "invalid request") from None
    except ShuttingDown as e:
        raise APIError(503, str(e)) from None


def _check_alive(service) -> None:
    """A dead engine's 503 with the reason, for a route that would otherwise answer as if it lived
    (/resume) or work for nothing first (/reload_weights reads the weights)."""
    if service.worker.error is not None:
        raise APIError(503, str(service.worker.dead()))


def pause_routes(service) -> APIRouter:
    router = APIRouter()

    @router.post("/pause")
    async def pause(mode: str = Query("abort"), wait_for_inflight_requests: bool = Query(False),
                    clear_cache: bool = Query(True)):
        """vLLM's pause_generation (before a weight update)."""
        if wait_for_inflight_requests:      # vLLM's older spelling of mode=wait
            mode = "wait"
        if mode not in PAUSE_MODES:
            raise APIError(400, f"Invalid pause mode: {mode!r}. Must be one of {list(PAUSE_MODES)}.", "mode")
        try:
            await asyncio.wrap_future(service.worker.pause(mode, clear_cache))
        except ShuttingDown as e:           # a dead engine, or one shutting down: 503 with the reason, as elsewhere
            raise APIError(503, str(e)) from None
        return {"status": "paused"}

    @router.post("/resume")
    async def resume():
        _check_alive(service)
        service.worker.resume()
        return {"status": "resumed"}

    @router.get("/is_paused")
    async def is_paused():
        return {"is_paused": service.worker.paused}

    @router.get("/get_world_size")
    async def get_world_size(include_dp: bool = Query(True)):
        """Ranks a trainer's weight-transfer group must count (tensor parallel x data parallel:
        one data-parallel rank here)."""
        return {"world_size": service.llm.parallel_size}

    return router


class ReloadWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    weights_path: str | None = None
    reset_running_requests: bool = True


class CollectiveRpcRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    timeout: float | None = None


def _jsonable(value):
    """A result as JSON carries it: itself when it serializes, else its repr (a tensor, a set)."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


def dev_routes(service) -> APIRouter:
    router = APIRouter()
    llm = service.llm

    @router.post("/reload_weights")
    async def reload_weights(body: ReloadWeightsRequest | None = None):
        body = body or ReloadWeightsRequest()
        _check_alive(service)
        try:                                 # the load runs beside the engine, which keeps serving
            model = await asyncio.to_thread(llm.read_weights, body.weights_path)
        except ValueError as e:
            raise APIError(400, str(e).splitlines()[0], "weights_path") from None
        await _on_engine(service, lambda engine: llm.install_weights(model, body.reset_running_requests))
        log.info("weights reloaded from %s", body.weights_path or llm.model_path)
        return {"status": "ok", "weights_path": body.weights_path or llm.model_path}

    @router.post("/collective_rpc")
    async def collective_rpc(body: CollectiveRpcRequest):
        try:
            results = await _on_engine(service, lambda engine: llm.call_worker(
                body.method, tuple(body.args), body.kwargs, reset_running_requests=False))
        except TypeError as e:               # arguments the method does not take
            raise APIError(400, f"collective_rpc {body.method}: {e}", "args") from None
        return {"results": [_jsonable(r) for r in results]}

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = Query(False)):
        if not await _on_engine(service, lambda engine: engine.reset_prefix_cache(reset_running_requests)):
            raise APIError(409, "requests in flight hold KV blocks: the prefix cache was not reset "
                                "(reset_running_requests=true recomputes them)", "reset_running_requests")
        return Response(status_code=200)

    @router.post("/reset_mm_cache")
    async def reset_mm_cache():
        return Response(status_code=200)     # no multimodal inputs here: nothing cached

    @router.post("/sleep")
    async def sleep(level: int = Query(1)):
        try:
            llm.sleep(level)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return Response(status_code=200)

    @router.post("/wake_up")
    async def wake_up(tags: list[str] | None = Query(None)):
        try:
            llm.wake_up(tags)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return Response(status_code=200)

    @router.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": llm.is_sleeping()}

    @router.get("/server_info")
    async def server_info(config_format: Literal["text", "json"] = Query("text")):
        config = _served_config(service)
        text = ", ".join(f"{name}={value!r}" for name, value in config.items())
        return {"vllm_config": text if config_format == "text" else config, "vllm_env": _env_vars(),
                "system_env": await asyncio.to_thread(_system_env)}

    return router


def _served_config(service) -> dict:
    """/server_info's vllm_config: what this server runs, in vLLM's VllmConfig's sections, and the
    server's own settings (no API key)."""
    from ..async_llm import VllmConfigView

    view = VllmConfigView(service.llm)
    model = view.model_config
    spec = view.speculative_config
    server = {k: v for k, v in dataclasses.asdict(service.config).items() if k != "api_key"}
    config = {"model_config": {"model": model.model, "max_model_len": model.max_model_len, "dtype": str(model.dtype),
                               "runner_type": model.runner_type, "max_logprobs": model.max_logprobs},
              "scheduler_config": dataclasses.asdict(view.scheduler_config), "cache_config": vars(view.cache_config),
              "parallel_config": vars(view.parallel_config),
              "speculative_config": dataclasses.asdict(spec) if spec is not None else None, "server_config": server}
    return json.loads(json.dumps(config, default=str))        # sets, dtypes, paths: as text (vLLM's fallback=str)


def _env_vars() -> dict:
    """vLLM's vllm_env: the variables that steer the server, none whose name says it holds a key."""
    return {k: v for k, v in sorted(os.environ.items())
            if k.startswith(("VLLM_", "SPECDEC_")) and "KEY" not in k and "TOKEN" not in k}


@functools.cache
def _system_env() -> dict:
    """vLLM's system_env (its collect_env), the parts that say what runs the server."""
    import platform
    import sys
    from importlib.metadata import PackageNotFoundError, version

    import torch

    from .. import __version__

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    cuda = torch.cuda.is_available()
    return {"specdec_version": __version__, "torch_version": torch.__version__,
            "cuda_compiled_version": torch.version.cuda, "is_cuda_available": cuda,
            "gpu_models": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
            "python_version": sys.version.split()[0], "python_platform": platform.platform(),
            "cpu_count": os.cpu_count(), **{f"{n}_version": installed(n) for n in ("transformers", "fastapi", "uvicorn")}}
