"""OpenAI's embeddings endpoint (`POST /v1/embeddings`, vLLM's shape) for a model served with
runner "pooling" (specdec/pooling.py), and vLLM's score (`/score`, `/v1/score`) and rerank
(`/rerank`, `/v1/rerank`, `/v2/rerank`: Jina's and Cohere's shape) endpoints, which score an
embedding model's pairs by the cosine similarity of their embeddings, and `/classify` for a
sequence classifier (label probabilities per input).

The input is a string, a list of strings, a list of token ids or a list of those; each becomes
one embedding, computed on the engine's thread (EngineWorker.call) so that it never races a
decoding step; a client that leaves stops its request before the next forward (a 499), as
vLLM aborts it. `encoding_format` "base64" packs the values as `embed_dtype` (vLLM's: float32,
as OpenAI's client decodes them, float16 or bfloat16) in `endianness` (native, little, big);
`dimensions` is accepted for matryoshka models only. vLLM's extensions:
`truncate_prompt_tokens` (keep the last k tokens: a text's BOS kept, as offline),
`add_special_tokens` (default true), `normalize` (its newer name `use_activation`, as
PoolingParams reads it offline), and on /classify, /score, /rerank `use_activation` (false: the
raw logits; its deprecated names `activation`, `softmax`). A
server whose model generates answers 404 here, and a pooling server answers 404 on the
generation endpoints, as vLLM registers only the routes its runner serves.
"""

from __future__ import annotations

import asyncio
import base64
import sys
import threading
import time
import uuid
from typing import Literal

import torch
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field

from ..pooling import Aborted, PoolingParams, abort_when, lower_prompt, use_activation
from .errors import APIError
from .protocol import ChatMessage, _Body


class _Inputs(_Body):
    """A pooling request's input, or vLLM's extension: one conversation through the chat template."""
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | None = Field(None, description="vLLM extension: one conversation through the chat "
                                                                 "template, instead of input")
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, description="vLLM extension: keep each input's last k tokens")
    add_special_tokens: bool | None = Field(None, description="vLLM extension: default true for input, false for "
                                                              "messages (the template writes them)")
    add_generation_prompt: bool = Field(False, description="vLLM extension, with messages")
    continue_final_message: bool = Field(False, description="vLLM extension, with messages")
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None


class _Activation(_Body):
    use_activation: bool | None = Field(None, description="vLLM extension: false gives the raw logits")
    activation: bool | None = Field(None, description="deprecated: use_activation")
    softmax: bool | None = Field(None, description="deprecated: use_activation")


class EmbeddingRequest(_Inputs, _Activation):
    encoding_format: Literal["float", "base64"] = "float"
    embed_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    endianness: Literal["native", "little", "big"] = "native"
    dimensions: int | None = None
    normalize: bool | None = Field(None, description="vLLM extension: default, the model's pooler")


def embedding_routes(service) -> tuple[APIRouter, APIRouter]:
    """(/v1/embeddings, the score and rerank routes at their vLLM paths)."""
    router, top = APIRouter(prefix="/v1"), APIRouter()

    @router.post("/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request):
        if service.llm.runner != "pooling":
            raise APIError(404, f"the model {service.config.model_name!r} does not support the Embeddings API "
                                "(serve an embedding model, or this one with --runner pooling / --convert embed)")
        if service.llm.classifier is not None:    # vLLM registers a classifier's routes only
            raise APIError(404, f"the model {service.config.model_name!r} is a sequence classifier: it answers "
                                "/classify, /score and /rerank, not the Embeddings API")
        if service.lora_request(body.model) is not None:
            raise APIError(400, "LoRA adapters are not applied to embeddings", "model")
        prompts = await service.off_loop(_inputs, service, body)
        params = _embed_params(body)
        outputs = await run(request, lambda engine: service.llm.embed(
            [{"prompt_token_ids": ids} for ids in prompts], params),
            lambda e: "dimensions" if "dimensions" in str(e) else "input")
        if outputs is None:
            return Response(status_code=499)
        data = [{"object": "embedding", "index": i, "embedding": _encode(o.outputs.embedding, body)}
                for i, o in enumerate(outputs)]
        return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": service.model_name(None, body.model), "data": data, "usage": _usage(outputs)}

    async def run(request: Request, fn, param=lambda e: None):
        """fn on the engine's thread; the request counted in the metrics (its outputs' tokens).
        None when the client leaves first: the call stops before its next forward (vLLM aborts a
        pooling request whose client disconnects), so the requests after it do not wait for it."""
        start = time.perf_counter()
        stop = threading.Event()

        def guarded(engine):
            with abort_when(stop.is_set):
                return fn(engine)
        work = asyncio.wrap_future(service.worker.call(guarded, work=True))
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            stop.set()
            await asyncio.gather(work, return_exceptions=True)
            return None
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        try:
            outs = work.result()
        except Aborted:
            return None
        except ValueError as e:
            raise APIError(400, str(e), param(e)) from None
        service.metrics.pooled([len(o.prompt_token_ids) for o in outs], time.perf_counter() - start)
        return outs

    def check(model: str | None) -> None:
        if service.llm.runner != "pooling" or (service.llm.classifier is not None
                                                and len(service.llm.classifier.labels) != 1):
            raise APIError(404, f"the model {service.config.model_name!r} does not support the Score API "
                                "(serve an embedding model, or this one with --runner pooling / --convert embed)")
        if service.lora_request(model) is not None:
            raise APIError(400, "LoRA adapters are not applied to scores", "model")

    async def score(body: ScoreRequest, request: Request):
        check(body.model)
        (name_1, data_1), (name_2, data_2) = body.sides()
        for name, side in ((name_1, data_1), (name_2, data_2)):
            if not side or (isinstance(side, list) and not all(side)):
                raise APIError(400, f"{name} must hold non-empty text", name)
        params = PoolingParams(use_activation=use_activation(body))
        outs = await run(request, lambda engine: service.llm.score(data_1, data_2, body.truncate_prompt_tokens,
                                                                   pooling_params=params))
        if outs is None:
            return Response(status_code=499)
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": service.model_name(None, body.model),
                "data": [{"index": i, "object": "score", "score": o.outputs.score} for i, o in enumerate(outs)],
                "usage": _usage(outs)}

    async def rerank(body: RerankRequest, request: Request):
        check(body.model)
        if not body.query or not body.documents or not all(body.documents):
            raise APIError(400, "query and documents must hold non-empty text", "documents")
        if body.top_n is not None and body.top_n < 0:         # 0 (vLLM's default): every document
            raise APIError(400, f"top_n must be >= 0, got {body.top_n}", "top_n")
        params = PoolingParams(use_activation=use_activation(body))
        outs = await run(request, lambda engine: service.llm.score(body.query, body.documents,
                                                                   body.truncate_prompt_tokens, pooling_params=params))
        if outs is None:
            return Response(status_code=499)
        order = sorted(range(len(outs)), key=lambda i: -outs[i].outputs.score)[:body.top_n or len(outs)]
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": service.model_name(None, body.model),
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "results": [{"index": i, "document": {"text": body.documents[i]},
                             "relevance_score": outs[i].outputs.score} for i in order]}

    async def classify(body: ClassifyRequest, request: Request):
        if service.llm.runner != "pooling" or service.llm.classifier is None:
            raise APIError(404, f"the model {service.config.model_name!r} does not support the Classification API "
                                "(serve a sequence classifier: architectures like Qwen2ForSequenceClassification)")
        if service.lora_request(body.model) is not None:
            raise APIError(400, "LoRA adapters are not applied to classification", "model")
        prompts = await service.off_loop(_inputs, service, body)
        params = PoolingParams(use_activation=use_activation(body))
        outs = await run(request, lambda engine: service.llm.classify(
            [{"prompt_token_ids": ids} for ids in prompts], body.truncate_prompt_tokens, pooling_params=params))
        if outs is None:
            return Response(status_code=499)
        labels = service.llm.classifier.labels
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        data = [{"index": i, "label": labels[max(range(len(o.outputs.probs)), key=o.outputs.probs.__getitem__)],
                 "probs": o.outputs.probs, "num_classes": o.outputs.num_classes} for i, o in enumerate(outs)]
        return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": service.model_name(None, body.model), "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}

    async def pooling(body: EmbeddingRequest, request: Request):
        """vLLM's generic pooling endpoint: each input's pooled output (an embedding model's
        vector; a classifier's probabilities)."""
        if service.llm.runner != "pooling":
            raise APIError(404, f"the model {service.config.model_name!r} does not support the Pooling API "
                                "(serve it with --runner pooling)")
        if service.lora_request(body.model) is not None:
            raise APIError(400, "LoRA adapters are not applied to pooling", "model")
        prompts = [{"prompt_token_ids": ids} for ids in await service.off_loop(_inputs, service, body)]
        if service.llm.classifier is not None:
            for name in ("dimensions", "normalize"):
                if getattr(body, name) is not None:
                    raise APIError(400, f"{name} applies to embeddings; this model is a sequence classifier "
                                        "(its pooled output is the class probabilities)", name)
            params = PoolingParams(use_activation=use_activation(body))
            outs = await run(request, lambda engine: service.llm.classify(prompts, body.truncate_prompt_tokens,
                                                                          pooling_params=params))
            data = outs and [o.outputs.probs for o in outs]
        else:
            outs = await run(request, lambda engine: service.llm.embed(prompts, _embed_params(body)))
            data = outs and [o.outputs.embedding for o in outs]
        if outs is None:
            return Response(status_code=499)
        return {"id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": service.model_name(None, body.model),
                "data": [{"index": i, "object": "pooling", "data": _encode(d, body)} for i, d in enumerate(data)],
                "usage": _usage(outs)}

    top.add_api_route("/pooling", pooling, methods=["POST"])
    for path in ("/classify", "/v1/classify"):
        top.add_api_route(path, classify, methods=["POST"])
    for path in ("/score", "/v1/score"):
        top.add_api_route(path, score, methods=["POST"])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        top.add_api_route(path, rerank, methods=["POST"])
    return router, top


class ClassifyRequest(_Inputs, _Activation):
    """vLLM's ClassificationRequest: input, or (its ClassificationChatRequest) messages."""


# vLLM's ScoreRequest forms, in the order it tries them: (first side, second side)
_SCORE_SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))


class ScoreRequest(_Activation):
    model: str | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    truncate_prompt_tokens: int | None = None

    def sides(self) -> tuple[tuple[str, object], tuple[str, object]]:
        """The two sides to pair, by the first form whose fields the body has."""
        for a, b in _SCORE_SIDES:
            if getattr(self, a) is not None and getattr(self, b) is not None:
                return (a, getattr(self, a)), (b, getattr(self, b))
        raise APIError(400, "give the texts to score as queries and documents (or data_1 and data_2, or text_1 "
                            "and text_2)", "queries")


class RerankRequest(_Activation):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = None
    truncate_prompt_tokens: int | None = None


def _embed_params(body: EmbeddingRequest) -> PoolingParams:
    """An embedding body's PoolingParams: vLLM's use_activation is its newer name of normalize."""
    normalize = body.normalize if body.normalize is not None else use_activation(body)
    return PoolingParams(body.dimensions, normalize, body.truncate_prompt_tokens)


def _usage(outs) -> dict:
    """vLLM's UsageInfo of a pooling request (its inputs' tokens; no completion)."""
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _inputs(service, body) -> list[list[int]]:
    """The `input` (or the `messages`, through the chat template) of a pooling body as token
    ids, each checked (off the event loop: Service.off_loop); a text truncated as offline."""
    x, messages = body.input, getattr(body, "messages", None)
    if (x is None) == (messages is None):
        raise APIError(400, "give either input or messages", "input")
    add = body.add_special_tokens if body.add_special_tokens is not None else messages is None
    lower = service.llm._encoder_config.get("do_lower_case")     # sentence_bert_config.json's (vLLM's)
    try:
        keep = service.llm._truncation(body.truncate_prompt_tokens)
    except ValueError as e:
        raise APIError(400, str(e), "truncate_prompt_tokens") from None

    def encode(text: str) -> list[int]:
        # vLLM's left-truncating tokenizer: a text's last tokens with its BOS kept (token ids are
        # cut to their last k as given, by LLM.embed / classify)
        text = lower_prompt(text) if lower else text
        if keep is None:
            return service.tokenizer.encode(text, add_special_tokens=add)
        try:
            return service.tokenizer.encode_last(text, keep, add_special_tokens=add)
        except ValueError as e:
            raise APIError(400, str(e), "truncate_prompt_tokens") from None

    if messages is not None:
        prompts = [encode(service._chat_text(body))]
    elif isinstance(x, str):
        prompts = [encode(x)]
    elif not x:
        raise APIError(400, "input must not be empty", "input")
    elif isinstance(x[0], int):
        prompts = [list(x)]
    elif isinstance(x[0], str):
        prompts = [encode(t) for t in x]
    else:
        prompts = [list(p) for p in x]
    vocab = service.engine.target.config.vocab_size
    for ids in prompts:
        if not ids:
            raise APIError(400, "an input must not be empty", "input")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", "input")
    return prompts


def _encode(vec: list[float], body):
    """A vector as the body asks: floats, or base64 of its embed_dtype values in its endianness."""
    if body.encoding_format == "float":
        return vec
    t = torch.tensor(vec, dtype=getattr(torch, body.embed_dtype))
    raw = (t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)).numpy()
    order = sys.byteorder if body.endianness == "native" else body.endianness
    return base64.b64encode(raw.astype(raw.dtype.newbyteorder("<" if order == "little" else ">")).tobytes()).decode()
