"""OpenAI's embeddings endpoint (`POST /v1/embeddings`, vLLM's shape) for a model served with
runner "pooling" (specdec/pooling.py), and vLLM's score (`/score`, `/v1/score`) and rerank
(`/rerank`, `/v1/rerank`, `/v2/rerank`: Jina's and Cohere's shape) endpoints, which score an
embedding model's pairs by the cosine similarity of their embeddings, and `/classify` for a
sequence classifier (label probabilities per input).

The input is a string, a list of strings, a list of token ids or a list of those; each becomes
one embedding, computed on the engine's thread (EngineWorker.call) so that it never races a
decoding step. `encoding_format` "base64" packs the float32 values little-endian, as OpenAI's
client decodes them; `dimensions` is accepted for matryoshka models only. vLLM's extensions:
`truncate_prompt_tokens` (keep the last k tokens), `add_special_tokens` (default true),
`normalize`. A server whose model generates answers 404 here, and a pooling server answers 404 on
the generation endpoints, as vLLM registers only the routes its runner serves.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from typing import Literal

from fastapi import APIRouter
from pydantic import Field

from ..pooling import PoolingParams
from .errors import APIError
from .protocol import ChatMessage, _Body


class EmbeddingRequest(_Body):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | None = Field(None, description="vLLM extension: one conversation through the chat "
                                                                 "template, instead of input")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, description="vLLM extension: keep each input's last k tokens")
    add_special_tokens: bool | None = Field(None, description="vLLM extension: default true for input, false for "
                                                              "messages (the template writes them)")
    normalize: bool | None = Field(None, description="vLLM extension: default, the model's pooler")
    add_generation_prompt: bool = Field(False, description="vLLM extension, with messages")
    continue_final_message: bool = Field(False, description="vLLM extension, with messages")
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None


def embedding_routes(service) -> tuple[APIRouter, APIRouter]:
    """(/v1/embeddings, the score and rerank routes at their vLLM paths)."""
    router, top = APIRouter(prefix="/v1"), APIRouter()

    @router.post("/embeddings")
    async def embeddings(body: EmbeddingRequest):
        if service.llm.runner != "pooling":
            raise APIError(404, f"the model {service.config.model_name!r} does not support the Embeddings API "
                                "(serve an embedding model, or this one with --runner pooling / --convert embed)")
        if service.llm.classifier is not None:    # vLLM registers a classifier's routes only
            raise APIError(404, f"the model {service.config.model_name!r} is a sequence classifier: it answers "
                                "/classify, /score and /rerank, not the Embeddings API")
        if service.lora_request(body.model) is not None:
            raise APIError(400, "LoRA adapters are not applied to embeddings", "model")
        start = time.perf_counter()
        prompts = await service.off_loop(_inputs, service, body)
        params = PoolingParams(body.dimensions, body.normalize, body.truncate_prompt_tokens)
        try:
            future = service.worker.call(lambda engine: service.llm.embed(
                [{"prompt_token_ids": ids} for ids in prompts], params), work=True)
            outputs = await asyncio.wrap_future(future)
        except ValueError as e:
            raise APIError(400, str(e), "dimensions" if "dimensions" in str(e) else "input") from None
        data = [{"object": "embedding", "index": i, "embedding": _encode(o.outputs.embedding, body.encoding_format)}
                for i, o in enumerate(outputs)]
        tokens = sum(len(o.prompt_token_ids) for o in outputs)
        service.metrics.pooled([len(o.prompt_token_ids) for o in outputs], time.perf_counter() - start)
        return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": service.model_name(None, body.model), "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def run(fn):
        """fn on the engine's thread; the request counted in the metrics (its outputs' tokens)."""
        start = time.perf_counter()
        try:
            outs = await asyncio.wrap_future(service.worker.call(fn, work=True))
        except ValueError as e:
            raise APIError(400, str(e)) from None
        service.metrics.pooled([len(o.prompt_token_ids) for o in outs], time.perf_counter() - start)
        return outs

    def check(model: str | None) -> None:
        if service.llm.runner != "pooling" or (service.llm.classifier is not None
                                                and len(service.llm.classifier.labels) != 1):
            raise APIError(404, f"the model {service.config.model_name!r} does not support the Score API "
                                "(serve an embedding model, or this one with --runner pooling / --convert embed)")
        if service.lora_request(model) is not None:
            raise APIError(400, "LoRA adapters are not applied to scores", "model")

    async def score(body: ScoreRequest):
        check(body.model)
        for name, side in (("text_1", body.text_1), ("text_2", body.text_2)):
            if not side or (isinstance(side, list) and not all(side)):
                raise APIError(400, f"{name} must hold non-empty text", name)
        outs = await run(lambda engine: service.llm.score(body.text_1, body.text_2, body.truncate_prompt_tokens))
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": service.model_name(None, body.model),
                "data": [{"index": i, "object": "score", "score": o.outputs.score} for i, o in enumerate(outs)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def rerank(body: RerankRequest):
        check(body.model)
        if not body.query or not body.documents or not all(body.documents):
            raise APIError(400, "query and documents must hold non-empty text", "documents")
        if body.top_n is not None and body.top_n < 0:         # 0 (vLLM's default): every document
            raise APIError(400, f"top_n must be >= 0, got {body.top_n}", "top_n")
        outs = await run(lambda engine: service.llm.score(body.query, body.documents, body.truncate_prompt_tokens))
        order = sorted(range(len(outs)), key=lambda i: -outs[i].outputs.score)[:body.top_n or len(outs)]
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": service.model_name(None, body.model),
                "usage": {"total_tokens": sum(len(o.prompt_token_ids) for o in outs)},
                "results": [{"index": i, "document": {"text": body.documents[i]},
                             "relevance_score": outs[i].outputs.score} for i in order]}

    async def classify(body: ClassifyRequest):
        if service.llm.runner != "pooling" or service.llm.classifier is None:
            raise APIError(404, f"the model {service.config.model_name!r} does not support the Classification API "
                                "(serve a sequence classifier: architectures like Qwen2ForSequenceClassification)")
        if service.lora_request(body.model) is not None:
            raise APIError(400, "LoRA adapters are not applied to classification", "model")
        prompts = await service.off_loop(_inputs, service, body)
        outs = await run(lambda engine: service.llm.classify([{"prompt_token_ids": ids} for ids in prompts],
                                                             body.truncate_prompt_tokens))
        labels = service.llm.classifier.labels
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        data = [{"index": i, "label": labels[max(range(len(o.outputs.probs)), key=o.outputs.probs.__getitem__)],
                 "probs": o.outputs.probs, "num_classes": o.outputs.num_classes} for i, o in enumerate(outs)]
        return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": service.model_name(None, body.model), "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}

    async def pooling(body: EmbeddingRequest):
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
            outs = await run(lambda engine: service.llm.classify(prompts, body.truncate_prompt_tokens))
            data = [o.outputs.probs for o in outs]
        else:
            params = PoolingParams(body.dimensions, body.normalize, body.truncate_prompt_tokens)
            outs = await run(lambda engine: service.llm.embed(prompts, params))
            data = [o.outputs.embedding for o in outs]
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        return {"id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": service.model_name(None, body.model),
                "data": [{"index": i, "object": "pooling", "data": _encode(d, body.encoding_format)}
                         for i, d in enumerate(data)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    top.add_api_route("/pooling", pooling, methods=["POST"])
    for path in ("/classify", "/v1/classify"):
        top.add_api_route(path, classify, methods=["POST"])
    for path in ("/score", "/v1/score"):
        top.add_api_route(path, score, methods=["POST"])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        top.add_api_route(path, rerank, methods=["POST"])
    return router, top


class ClassifyRequest(_Body):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool | None = None


class ScoreRequest(_Body):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None


class RerankRequest(_Body):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = None
    truncate_prompt_tokens: int | None = None


def _inputs(service, body) -> list[list[int]]:
    """The `input` (or the `messages`, through the chat template) of a pooling body as token
    ids, each checked (off the event loop: Service.off_loop)."""
    x, messages = body.input, getattr(body, "messages", None)
    if (x is None) == (messages is None):
        raise APIError(400, "give either input or messages", "input")
    add = body.add_special_tokens if body.add_special_tokens is not None else messages is None
    encode = lambda text: service.tokenizer.encode(text, add_special_tokens=add)  # noqa: E731
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


def _encode(vec: list[float], fmt: str):
    if fmt == "float":
        return vec
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
