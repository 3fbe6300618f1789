"""build_app(llm, config): the FastAPI application around one LLM.

One app owns one LLM: its worker thread is the only caller of the engine. Routes stay thin;
validation lives in serving.py, response shapes in responses.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from .. import __version__
from ..llm import LLM
from ..tracing import TRACE_HEADERS
from .config import ServerConfig
from .control import KEYED_PATHS, dev_routes, pause_routes
from .beam import beam_chat, beam_completion
from .embeddings import embedding_routes
from .errors import APIError, ApiKeyGuard, BodyLimit, app_path, error_response, install_error_handlers
from .lora import model_permission
from .metrics import RequestCounter, StatLogger
from .protocol import (BatchChatCompletionRequest, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ErrorResponse,
                       LoadLoRAAdapterRequest, TokenizeRequest, UnloadLoRAAdapterRequest)
from .responses import ChatFormat, CompletionFormat, collect, speculative, stream
from .responses_api import (Background, ResponseStore, ResponsesRequest, Served, budgeted, chat_request, check_request,
                            conversation, input_items, list_input_items, message_sources, renamed, respond,
                            response_body, stream as stream_response)
from .serving import REQUEST_TRACE, Service, echo_only
from .worker import ShuttingDown

_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 500, 503)}


def build_app(llm: LLM, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    service = Service(llm, config)
    if config.log_stats:
        service.metrics.stat_logger = StatLogger(service.engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.worker.start()
        # the grammar engine's tokenizer (a few hundred ms for a 50k vocabulary) is built in the
        # background, so the first JSON-mode request does not stall the event loop on it
        warm = asyncio.get_running_loop().run_in_executor(None, service.engine.grammars.prepare)
        stats = asyncio.create_task(_log_stats(service.metrics.stat_logger, config.log_stats_interval)) \
            if service.metrics.stat_logger is not None else None
        yield
        if stats is not None:
            stats.cancel()
        await warm
        # uvicorn has already let in-flight requests finish; this drains anything left queued
        profiler = service.engine.profiler
        if profiler is not None and profiler.active:      # a trace still recording is written, not lost
            with contextlib.suppress(ShuttingDown):        # (on the engine's thread, which started it)
                await asyncio.wrap_future(service.worker.call(lambda engine: profiler.stop()))
        await asyncio.to_thread(service.worker.stop)
        service.close()
        if service.engine.tracer is not None:      # the last requests' spans leave before the process
            await asyncio.to_thread(service.engine.tracer.flush)

    docs = {"docs_url": None, "redoc_url": None, "openapi_url": None} if config.disable_fastapi_docs else {}
    app = FastAPI(title="specdec", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible API with speculative decoding statistics.", **docs)
    # vLLM's --root-path: the app's, not uvicorn's (which prefixed every request's path with it), so that
    # both /v1/models and /proxy/v1/models answer, and /docs finds its schema either way
    app.root_path = config.root_path
    app.state.service = service
    install_error_handlers(app)
    load = ServerLoad()
    app.include_router(_public_routes(service, load))
    app.state.responses = ResponseStore()       # the Responses API's stored responses (replicas look here)
    api = [_api_routes(service), _responses_routes(service, app.state.responses), _token_routes(service),
           *embedding_routes(service)]
    if config.allow_runtime_lora_updating:
        api.append(_lora_routes(service))
    if service.engine.profiler is not None:
        api.append(_profile_routes(service))
    for router in api:
        app.include_router(router, responses=_ERRORS)
    # control routes (vLLM's RLHF router; its development routes with VLLM_SERVER_DEV_MODE=1)
    for router in [pause_routes(service), *([dev_routes(service)] if config.dev_mode else [])]:
        app.include_router(router, responses=_ERRORS)
    # middleware added later wraps what was added before (the last one sees a request first)
    if config.enable_server_load_tracking:
        app.add_middleware(_TrackLoad, load=load)
    # SageMaker's POST /invocations: the body, as BodyLimit replays it, picks the route
    app.add_middleware(_Invocations, routes=_invocation_routes(service))
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)
    # each request to the API once in requests_total (413s included; 401s are not let this far)
    app.add_middleware(RequestCounter, metrics=service.metrics, routes=[r for router in api for r in router.routes])
    if config.api_key:      # the key is checked before the body is read
        app.add_middleware(ApiKeyGuard, key=config.api_key, paths=KEYED_PATHS)
    app.add_middleware(_RequestIds, echo=config.enable_request_id_headers)
    # outermost: a browser's preflight (which carries no key) is answered, and every response,
    # errors included, carries the CORS headers a page needs to read it
    app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                       allow_methods=list(config.allowed_methods), allow_headers=list(config.allowed_headers),
                       allow_credentials=config.allow_credentials)
    return app


async def _log_stats(logger: StatLogger, interval: float) -> None:
    """vLLM's periodic stats lines, every `interval` seconds while the server runs."""
    while True:
        await asyncio.sleep(interval)
        logger.log()


class _RequestIds:
    """ASGI middleware: each request's id, for its completion ids and log lines (vLLM's
    _base_request_id): its X-Request-Id header, else a new uuid. With `echo` (vLLM's
    --enable-request-id-headers) every response carries it back as X-Request-Id."""

    def __init__(self, app, echo: bool):
        self.app, self.echo = app, echo

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        raw = headers.get(b"x-request-id")
        if raw is not None and len(raw) > MAX_REQUEST_ID_BYTES:
            # the id names the response, every stream chunk and log line: a 1 MB header made a
            # 500-token stream 176 MB (no body limit covers headers); such an id is not taken
            raw = None
        rid = raw.decode("latin-1") if raw else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        # Starlette's outermost error middleware answers an unexpected exception's 500 past this
        # wrapper: errors._unexpected reads this to put the id on that answer too
        state["echo_request_id"] = self.echo
        trace = {name: headers[key].decode("latin-1") for name in TRACE_HEADERS
                 if (key := name.encode()) in headers} or None

        async def with_id(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", rid.encode("latin-1"))]}
            await send(message)

        token = REQUEST_TRACE.set(trace)       # W3C trace context: the engine's spans go under it
        try:
            await self.app(scope, receive, with_id if self.echo else send)
        finally:
            REQUEST_TRACE.reset(token)


MAX_REQUEST_ID_BYTES = 512


def _request_id(request: Request) -> str:
    return request.state.request_id


class ServerLoad:
    """GET /load's figure: requests in flight to the routes that run the model (with
    --enable-server-load-tracking; otherwise it stays 0, as vLLM's does)."""

    # vLLM's load-tracked routes (load_aware_call), those this server has
    PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch", "/v1/responses", "/v1/embeddings", "/pooling",
                       "/classify", "/v1/classify", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"})

    def __init__(self):
        self.value = 0


def _invocation_routes(service: Service) -> list[tuple[str, str, tuple[str, ...]]]:
    """/invocations' candidates, in vLLM's order, for what this model serves: (path, vLLM's
    request type, the keys a body of that type has (any one of them))."""
    if service.llm.runner != "pooling":
        return [("/v1/chat/completions", "ChatCompletionRequest", ("messages",)),
                ("/v1/completions", "CompletionRequest", ("prompt",))]
    classifier = service.llm.classifier
    routes = [("/classify", "ClassificationRequest", ("input", "messages"))] if classifier is not None else \
        [("/v1/embeddings", "EmbeddingRequest", ("input", "messages"))]
    if classifier is None or len(classifier.labels) == 1:      # score: each of vLLM's ScoreRequest forms
        routes += [("/score", "ScoreRequest", ("text_1", "queries", "data_1")), ("/rerank", "RerankRequest", ("query",))]
    return routes


class _Invocations:
    """ASGI middleware: vLLM's POST /invocations (SageMaker's inference route; GET/POST /ping is
    its health check): the body's shape picks the API route that answers it (`messages`: chat
    completions, `prompt`: completions; on a pooling model `input`: embeddings or classify,
    `text_1`: score, `query`: rerank), which then runs as if called by its own path (its errors,
    streaming, metrics and load counting). A body none of them takes is a 400 naming the
    request types, as vLLM's. Behind --api-key it needs the key, as /v1 does (vLLM's does not)."""

    def __init__(self, app, routes):
        self.app, self.routes = app, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or app_path(scope) != "/invocations":
            return await self.app(scope, receive, send)
        if scope["method"] != "POST":
            return await error_response(405, "/invocations takes POST", None, None,
                                        {"allow": "POST"})(scope, receive, send)
        message = await receive()           # BodyLimit read the body and replays it whole
        try:
            body = json.loads(message.get("body", b"") or b"null")
        except ValueError:
            body = None
        path = next((p for p, _, keys in self.routes if isinstance(body, dict) and any(k in body for k in keys)),
                    None)
        if path is None:
            names = ", ".join(name for _, name, _ in self.routes)
            return await error_response(400, f"Cannot find suitable handler for request. Expected one of: "
                                             f"{names}")(scope, receive, send)
        root = scope.get("root_path", "")
        # in place: the middleware outside (the request counter) sees the route that answered
        scope["path"] = root + path
        scope["raw_path"] = scope["path"].encode()
        replayed = [message]

        async def replay():
            return replayed.pop() if replayed else await receive()

        await self.app(scope, replay, send)


class _TrackLoad:
    """ASGI middleware: counts a POST to one of ServerLoad.PATHS from its arrival to the last byte
    of its answer (a stream's end) or the client leaving."""

    def __init__(self, app, load: ServerLoad):
        self.app, self.load = app, load

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or app_path(scope) not in ServerLoad.PATHS:
            return await self.app(scope, receive, send)
        self.load.value += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.value -= 1


def _public_routes(service: Service, load: ServerLoad) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health():
        worker = service.worker
        if not worker.alive:            # vLLM's 503 once check_health() raises EngineDeadError
            return error_response(503, str(worker.dead()) if worker.error is not None else "the engine is not running")
        try:
            service.llm.check_health()        # a tensor-parallel group that has stopped cannot serve
        except Exception as e:
            reason = str(e).splitlines()[0] if str(e) else repr(e)    # (a !r in the braces had quoted every message)
            return error_response(503, f"the engine cannot serve: {reason}")
        return {"status": "ok"}

    @router.get("/ping")
    async def ping():
        """vLLM's (SageMaker's health check): /health's answer."""
        return await health()

    router.add_api_route("/ping", ping, methods=["POST"], name="ping_post", include_in_schema=False)

    @router.get("/load")
    async def server_load():
        return {"server_load": load.value}

    @router.get("/version")
    async def version():
        return {"version": __version__}

    @router.get("/metrics")
    async def metrics():
        return Response(service.metrics.render(), media_type=service.metrics.content_type)

    return router


def _token_routes(service: Service) -> APIRouter:
    """vLLM's /tokenize and /detokenize (outside /v1, as there: no API key)."""
    router = APIRouter()

    # off the event loop, the answer's JSON included (a 1 MB prompt's ~600k ids: ~0.35 s through
    # FastAPI's encoder on the loop)
    if service.config.enable_tokenizer_info_endpoint:
        @router.get("/tokenizer_info")
        async def tokenizer_info():
            """vLLM's (--enable-tokenizer-info-endpoint): the tokenizer's configuration."""
            return JSONResponse(service.tokenizer.info(service.config.chat_template))

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return await service.off_loop(lambda: JSONResponse(service.tokenize(body)))

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return await service.off_loop(lambda: JSONResponse(service.detokenize(body)))

    return router


def _api_routes(service: Service) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.get("/models")
    async def models():
        now = int(time.time())
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": now, "owned_by": "specdec", "root": service.llm.model_path,
             "parent": None, "max_model_len": service.engine.max_model_len, "permission": [model_permission(now)]}
            for name in service.config.served_model_names] + service.adapters.cards(now)}

    @router.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        arrival = time.perf_counter()
        rid = f"cmpl-{_request_id(request)}"
        lora = service.lora_request(body.model)
        if body.use_beam_search:
            return await _beam(request, beam_completion(service, body, arrival, lora, rid))
        prompts, params = await service.off_loop(service.prepare_completion, body)
        if not await _compiled(request, service, prompts, params):
            return Response(status_code=499)
        fmt = CompletionFormat(service.tokenizer, params.logprobs is not None, service.echo_texts(body, prompts),
                               _as_ids(body, service.config), prompts, params.best_of or params.n)
        fmt.want_prompt_logprobs = body.prompt_logprobs is not None
        fmt.return_token_ids = bool(body.return_token_ids)
        gen = service.generation(prompts, params, arrival, body.priority, lora, rid, cache_salt=body.cache_salt)
        gen.echo_only = echo_only(body)
        return await _respond(request, gen, fmt, service.model_name(lora, body.model), body, rid)

    @router.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        arrival = time.perf_counter()
        rid = f"chatcmpl-{_request_id(request)}"
        lora = service.lora_request(body.model)
        if body.use_beam_search:
            return await _beam(request, beam_chat(service, body, arrival, lora, rid))
        prepared = await service.off_loop(lambda: _prepare_chat(service, body))
        if not await _compiled(request, service, prepared[0], prepared[1]):
            return Response(status_code=499)
        gen, fmt = _chat_run(service, body, prepared, arrival, lora, rid)
        return await _respond(request, gen, fmt, service.model_name(lora, body.model), body, rid)

    @router.post("/chat/completions/batch")
    async def chat_completions_batch(body: BatchChatCompletionRequest, request: Request):
        """vLLM's batch chat: every conversation runs as its own chat completion, all at once (the
        engine batches them); one choice per conversation, index i; usage summed."""
        arrival = time.perf_counter()
        rid = f"chatcmpl-{_request_id(request)}"
        lora = service.lora_request(body.model)
        for refused, message, param in (
                (body.stream, "Batch chat completions do not support streaming. Please set `stream` to false.",
                 "stream"),
                (body.tools, "Batch chat completions do not support tools. Please leave `tools` out.", "tools"),
                (body.use_beam_search, "Batch chat completions do not support beam search. Please set "
                                       "`use_beam_search` to False.", "use_beam_search"),
                (body.n not in (None, 1), "Batch chat completions do not support `n > 1`. Please set `n` to 1.",
                 "n")):
            if refused:
                raise APIError(400, message, param)
        singles = [body.single(conversation) for conversation in body.messages]
        prepared = await service.off_loop(lambda: [_prepare_one(service, one, i) for i, one in enumerate(singles)])
        prompts = [p for one in prepared for p in one[0]]
        if not await _compiled(request, service, prompts, prepared[0][1]):
            return Response(status_code=499)
        model = service.model_name(lora, body.model)
        runs = [_chat_run(service, one, prep, arrival, lora, f"{rid}_{i}")
                for i, (one, prep) in enumerate(zip(singles, prepared))]
        bodies = await _unless_gone(request, _all_of(collect(gen, fmt, model, rid) for gen, fmt in runs))
        if bodies is _GONE:
            return Response(status_code=499)
        choices = []
        for i, b in enumerate(bodies):
            choices += [{**c, "index": i} for c in b["choices"]]
        return JSONResponse({**{k: v for k, v in bodies[0].items() if k not in ("choices", "usage", "speculative", "prompt_logprobs", "prompt_token_ids")},
                             "choices": choices, "usage": _summed([b["usage"] for b in bodies]),
                             "speculative": speculative(*(gen for gen, _ in runs))})

    return router


def _prepare_chat(service: Service, body: ChatCompletionRequest):
    """(prompts, params, tools, prediction) of one chat request: its template, checks and parameters."""
    return (*service.prepare_chat(body), service.prediction_ids(body))


def _prepare_one(service: Service, body: ChatCompletionRequest, i: int):
    """A batch's conversation i prepared; its errors name it (messages[i]...)."""
    try:
        return _prepare_chat(service, body)
    except APIError as e:
        if e.param is not None and e.param.startswith("messages"):
            e.param = f"messages[{i}]" + e.param[len("messages"):]
        e.message = f"conversation {i}: {e.message}"
        raise


def _chat_run(service: Service, body: ChatCompletionRequest, prepared, arrival: float, lora, rid: str):
    """One chat request queued on the engine, and the format of its reply."""
    prompts, params, tools, prediction = prepared
    # a constrained reply (structured outputs, named or required calls) thinks before its grammar holds
    reasoning = service.reasoning_for(params)
    fmt = ChatFormat(service.tokenizer, params.logprobs is not None, _as_ids(body, service.config),
                     service.chat_role(body), prompts[0], tools, reasoning, body.include_reasoning,
                     service.chat_echo(body))
    fmt.want_prompt_logprobs = body.prompt_logprobs is not None
    fmt.return_token_ids = bool(body.return_token_ids)
    return service.generation(prompts, params, arrival, body.priority, lora, rid, prediction,
                              cache_salt=body.cache_salt), fmt


def _summed(usages: list[dict]) -> dict:
    """Usage bodies added up, field by field (nested details too)."""
    out: dict = {}
    for u in usages:
        for key, value in u.items():
            out[key] = _summed([out.get(key, {}), value]) if isinstance(value, dict) else out.get(key, 0) + value
    return out


async def _all_of(coros) -> list:
    """Every coroutine's result, in order; when one fails the others are cancelled (their engine
    requests aborted) and its error is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _profile_routes(service: Service) -> APIRouter:
    """vLLM's /start_profile and /stop_profile (present only with --profiler-config or
    VLLM_TORCH_PROFILER_DIR): torch.profiler on the engine's thread between two steps; the
    trace is written before /stop_profile answers."""
    router = APIRouter()

    @router.post("/start_profile")
    async def start_profile():
        await asyncio.wrap_future(service.worker.call(lambda engine: engine.profiler.start()))
        return Response(status_code=200)

    @router.post("/stop_profile")
    async def stop_profile():
        await asyncio.wrap_future(service.worker.call(lambda engine: engine.profiler.stop()))
        return Response(status_code=200)

    return router


def _lora_routes(service: Service) -> APIRouter:
    """vLLM's runtime adapter updates (present only with VLLM_ALLOW_RUNTIME_LORA_UPDATING): a
    plain-text "Success: ..." answer, or an error (400: name taken, adapter invalid; 404: unknown)."""
    router = APIRouter(prefix="/v1")

    @router.post("/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        await service.adapters.load(body.lora_name, body.lora_path, load_inplace=body.load_inplace)
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @router.post("/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        await service.adapters.unload(body.lora_name)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    return router


def _responses_routes(service: Service, store: ResponseStore) -> APIRouter:
    """OpenAI's Responses API over the chat path (responses_api.py)."""
    router = APIRouter(prefix="/v1")
    background = Background(store)

    @router.post("/responses")
    async def create(body: ResponsesRequest, request: Request):
        arrival = time.perf_counter()
        check_request(body)
        history = []
        if body.previous_response_id:
            history, stored = store.get(body.previous_response_id, "previous_response_id")
            status = json.loads(stored).get("status")
            if status in ("queued", "in_progress"):     # its reply is not in the chain yet: it would be left out
                raise APIError(400, f"previous response {body.previous_response_id!r} is still {status}: continue "
                                    "it once it has completed (or cancel it)", "previous_response_id")

        def prepare():      # off the event loop, as the chat route's preparation
            try:
                chat = chat_request(body, history)
                prompts, params, tools = service.prepare_chat(chat)
                params = budgeted(params, body, service.engine.max_model_len, prompts[0])
                return chat, service.lora_request(chat.model), prompts, params, tools
            except APIError as e:
                raise renamed(e, message_sources(body, history)) from None

        chat, lora, prompts, params, tools = await service.off_loop(prepare)
        try:
            if not await _compiled(request, service, prompts, params):
                return Response(status_code=499)
        except APIError as e:
            raise renamed(e, message_sources(body, history)) from None
        model = service.model_name(lora, chat.model)
        reasoning = service.reasoning_for(params)
        fmt = ChatFormat(service.tokenizer, params.logprobs is not None, service.config.return_tokens_as_token_ids,
                         service.config.response_role, prompts[0], tools, reasoning, body.include_reasoning)
        # the values used, as vLLM echoes them (no max_output_tokens: what the context leaves)
        served = Served.of(params, params.max_tokens or service.engine.max_model_len - len(prompts[0]),
                           lambda text: len(service.tokenizer.encode(text, add_special_tokens=False)))
        rid = f"resp_{uuid.uuid4().hex}"
        turn = history + input_items(body)

        def keep(response: dict) -> None:
            if body.store:
                store.put(rid, conversation(turn, response["output"]), response)

        gen = service.generation(prompts, params, arrival, chat.priority, lora, rid, cache_salt=chat.cache_salt)
        if body.background:         # answered now; the client reads it by id (or cancels it)
            async def work(started):
                return (await respond(gen, fmt, body, model, rid, served, started))[0]
            queued = response_body(rid, body, model, int(time.time()), [], None, None, "queued", served)
            if body.stream:         # its events kept as they come: a client reconnects with GET ?stream=true
                events = background.start_stream(rid, turn, queued, lambda started, done: stream_response(
                    gen, fmt, body, model, rid, done, served, started))
                return StreamingResponse(events, media_type="text/event-stream", headers={"cache-control": "no-cache"})
            return background.start(rid, turn, queued, work)
        if body.stream:
            return StreamingResponse(stream_response(gen, fmt, body, model, rid, keep, served),
                                     media_type="text/event-stream",
                                     headers={"cache-control": "no-cache"})

        async def run():
            response, _ = await respond(gen, fmt, body, model, rid, served)
            keep(response)
            return response
        return await _until_done(request, run())

    @router.get("/responses/{rid}")
    async def read(rid: str, stream: bool = False, starting_after: int | None = None):
        if stream:      # vLLM's: a background stream's events after starting_after, then the live ones
            return StreamingResponse(background.follow(rid, starting_after), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache"})
        return Response(store.get(rid)[1], media_type="application/json")

    @router.get("/responses/{rid}/input_items")
    async def read_input_items(rid: str, request: Request):
        return list_input_items(store, rid, request.query_params)

    @router.delete("/responses/{rid}")
    async def forget(rid: str):
        store.get(rid)
        await background.stop(rid)
        store.delete(rid)
        return {"id": rid, "object": "response", "deleted": True}

    @router.post("/responses/{rid}/cancel")
    async def cancel(rid: str):
        return await background.cancel(rid)

    return router


def _as_ids(body, config: ServerConfig) -> bool:
    """A request's return_tokens_as_token_ids, else the server's (--return-tokens-as-token-ids)."""
    return config.return_tokens_as_token_ids if body.return_tokens_as_token_ids is None else body.return_tokens_as_token_ids


async def _respond(request: Request, gen, fmt, model: str, body, response_id: str):
    if body.stream:
        opts = body.stream_options
        # --enable-force-include-usage: every stream ends with its usage, as if it asked
        include_usage = bool(opts and opts.include_usage) or request.app.state.service.config.enable_force_include_usage
        return StreamingResponse(stream(gen, fmt, model, include_usage, bool(opts and opts.continuous_usage_stats),
                                        response_id), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})
    return await _until_done(request, collect(gen, fmt, model, response_id))


_GONE = object()


async def _unless_gone(request: Request, coro):
    """coro's result, unless the client leaves first: then its work is cancelled (its engine slots
    or queued grammar compiles freed at once) and _GONE is returned."""
    work = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:       # the handler itself cancelled (shutdown, run-batch's Ctrl-C): so is its work
        for task in (work, gone):
            task.cancel()
        await asyncio.gather(work, gone, return_exceptions=True)
        raise
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    if not work.done():
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        return _GONE
    return work.result()


async def _until_done(request: Request, coro):
    """The JSON body coro builds, unless the client leaves first (a 499)."""
    body = await _unless_gone(request, coro)
    return Response(status_code=499) if body is _GONE else JSONResponse(body)


async def _beam(request: Request, coro):
    """A beam search's answer (beam.py): its JSON body, or with stream its events (a list: the
    beams are known only at the end); a 499 if the client leaves first."""
    answer = await _unless_gone(request, coro)
    if answer is _GONE:
        return Response(status_code=499)
    if isinstance(answer, list):
        return StreamingResponse(iter(answer), media_type="text/event-stream", headers={"cache-control": "no-cache"})
    return JSONResponse(answer)


async def _compiled(request: Request, service, prompts, params) -> bool:
    """The request's grammars compiled (Service.compile_grammars), unless the client leaves first:
    then its compiles not yet started are dropped and False is returned (a 499, as _until_done's);
    a grammar that cannot start raises its APIError (400)."""
    if params.structured_outputs is None:
        return True
    return await _unless_gone(request, service.compile_grammars(prompts, params)) is not _GONE


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
