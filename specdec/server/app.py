"""build_app(llm, config): the FastAPI application around one LLM.

One app owns one LLM: its worker thread is the only caller of the engine. Routes stay thin;
validation lives in serving.py, response shapes in responses.py.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from .. import __version__
from ..llm import LLM
from .config import ServerConfig
from .beam import beam_chat, beam_completion
from .embeddings import embedding_routes
from .errors import APIError, ApiKeyGuard, BodyLimit, error_response, install_error_handlers
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ErrorResponse,
                       LoadLoRAAdapterRequest, TokenizeRequest, UnloadLoRAAdapterRequest)
from .responses import ChatFormat, CompletionFormat, collect, stream
from .responses_api import (ResponseStore, ResponsesRequest, chat_request, conversation, input_messages, renamed,
                            respond, stream as stream_response)
from .serving import Service, echo_only

_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 500, 503)}


def build_app(llm: LLM, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    service = Service(llm, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.worker.start()
        # the grammar engine's tokenizer (a few hundred ms for a 50k vocabulary) is built in the
        # background, so the first JSON-mode request does not stall the event loop on it
        warm = asyncio.get_running_loop().run_in_executor(None, service.engine.grammars.prepare)
        yield
        await warm
        # uvicorn has already let in-flight requests finish; this drains anything left queued
        await asyncio.to_thread(service.worker.stop)

    docs = {"docs_url": None, "redoc_url": None, "openapi_url": None} if config.disable_fastapi_docs else {}
    app = FastAPI(title="specdec", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible API with speculative decoding statistics.", **docs)
    app.state.service = service
    install_error_handlers(app, service.metrics.rejected)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes, on_reject=service.metrics.rejected)
    if config.api_key:      # added last = outermost: the key is checked before the body is read
        app.add_middleware(ApiKeyGuard, key=config.api_key, on_reject=service.metrics.rejected)
    # outermost: a browser's preflight (which carries no key) is answered, and every response,
    # errors included, carries the CORS headers a page needs to read it
    app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                       allow_methods=list(config.allowed_methods), allow_headers=list(config.allowed_headers),
                       allow_credentials=config.allow_credentials)
    app.include_router(_public_routes(service))
    app.include_router(_api_routes(service), responses=_ERRORS)
    app.include_router(_responses_routes(service, ResponseStore()), responses=_ERRORS)
    app.include_router(_token_routes(service), responses=_ERRORS)
    for router in embedding_routes(service):
        app.include_router(router, responses=_ERRORS)
    if config.allow_runtime_lora_updating:
        app.include_router(_lora_routes(service), responses=_ERRORS)
    return app


def _public_routes(service: Service) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health():
        if not service.worker.alive:
            return error_response(503, "the engine is not running")
        return {"status": "ok"}

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

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return service.tokenize(body)

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return service.detokenize(body)

    return router


def _api_routes(service: Service) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.get("/models")
    async def models():
        now = int(time.time())
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": now, "owned_by": "specdec", "root": service.llm.model_path,
             "parent": None, "max_model_len": service.engine.max_model_len}
            for name in service.config.served_model_names] + service.adapters.cards(now)}

    @router.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        arrival = time.perf_counter()
        lora = service.lora_request(body.model)
        if body.use_beam_search:
            return await _until_done(request, beam_completion(service, body, arrival, lora))
        prompts, params = service.prepare_completion(body)
        fmt = CompletionFormat(service.tokenizer, params.logprobs is not None, service.echo_texts(body, prompts),
                               _as_ids(body, service.config), prompts, params.best_of or params.n)
        fmt.want_prompt_logprobs = body.prompt_logprobs is not None
        gen = service.generation(prompts, params, arrival, body.priority, lora)
        gen.echo_only = echo_only(body)
        return await _respond(request, gen, fmt, service.model_name(lora), body)

    @router.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        arrival = time.perf_counter()
        lora = service.lora_request(body.model)
        if body.use_beam_search:
            return await _until_done(request, beam_chat(service, body, arrival, lora))
        prompts, params, tools = service.prepare_chat(body)
        # a constrained reply (structured outputs, named or required calls) has no think block
        reasoning = service.config.reasoning_parser if params.structured_outputs is None else None
        fmt = ChatFormat(service.tokenizer, params.logprobs is not None, _as_ids(body, service.config),
                         service.config.response_role, prompts[0], tools, reasoning, body.include_reasoning,
                         service.chat_echo(body))
        fmt.want_prompt_logprobs = body.prompt_logprobs is not None
        return await _respond(request, service.generation(prompts, params, arrival, body.priority, lora), fmt,
                              service.model_name(lora), body)

    return router


def _lora_routes(service: Service) -> APIRouter:
    """vLLM's runtime adapter updates (present only with VLLM_ALLOW_RUNTIME_LORA_UPDATING): a
    plain-text "Success: ..." answer, or an error (400: name taken, adapter invalid; 404: unknown)."""
    router = APIRouter(prefix="/v1")

    @router.post("/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        await service.adapters.load(body.lora_name, body.lora_path)
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @router.post("/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        await service.adapters.unload(body.lora_name)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    return router


def _responses_routes(service: Service, store: ResponseStore) -> APIRouter:
    """OpenAI's Responses API over the chat path (responses_api.py)."""
    router = APIRouter(prefix="/v1")

    @router.post("/responses")
    async def create(body: ResponsesRequest, request: Request):
        arrival = time.perf_counter()
        history = store.get(body.previous_response_id, "previous_response_id")[0] if body.previous_response_id else []
        turn = history + input_messages(body)
        chat = chat_request(body, history)
        try:
            lora = service.lora_request(chat.model)
            prompts, params, tools = service.prepare_chat(chat)
        except APIError as e:
            raise renamed(e) from None
        model = service.model_name(lora)
        reasoning = service.config.reasoning_parser if params.structured_outputs is None else None
        fmt = ChatFormat(service.tokenizer, False, False, service.config.response_role, prompts[0], tools, reasoning,
                         body.include_reasoning)
        rid = f"resp_{uuid.uuid4().hex}"

        def keep(response: dict) -> None:
            if body.store:
                store.put(rid, conversation(turn, response["output"]), response)

        gen = service.generation(prompts, params, arrival, chat.priority, lora)
        if body.stream:
            return StreamingResponse(stream_response(gen, fmt, body, model, rid, keep), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache"})

        async def run():
            response, _ = await respond(gen, fmt, body, model, rid)
            keep(response)
            return response
        return await _until_done(request, run())

    @router.get("/responses/{rid}")
    async def read(rid: str):
        return store.get(rid)[1]

    @router.delete("/responses/{rid}")
    async def forget(rid: str):
        store.delete(rid)
        return {"id": rid, "object": "response", "deleted": True}

    return router


def _as_ids(body, config: ServerConfig) -> bool:
    """A request's return_tokens_as_token_ids, else the server's (--return-tokens-as-token-ids)."""
    return config.return_tokens_as_token_ids if body.return_tokens_as_token_ids is None else body.return_tokens_as_token_ids


async def _respond(request: Request, gen, fmt, model: str, body):
    if body.stream:
        opts = body.stream_options
        include_usage = bool(opts and opts.include_usage)
        return StreamingResponse(stream(gen, fmt, model, include_usage, include_usage and opts.continuous_usage_stats),
                                 media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})
    return await _until_done(request, collect(gen, fmt, model))


async def _until_done(request: Request, coro):
    """The JSON body coro builds, unless the client leaves first (then its work is cancelled)."""
    work = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(_disconnected(request))
    await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    if not work.done():
        work.cancel()               # the client left: cancelling frees its engine slots now
        await asyncio.gather(work, return_exceptions=True)
        return Response(status_code=499)
    return JSONResponse(work.result())


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
