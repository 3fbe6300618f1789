"""OpenAI's Responses API (`POST /v1/responses`, vLLM's shape) on top of the chat path.

A request becomes a chat completion request (input items -> messages, `instructions` -> a system
message first, flat function tools -> chat tools, `text.format` -> response_format (vLLM's
`structured_outputs` passes as it is, but not with `text.format`), `max_output_tokens` ->
max_tokens, capped at what the context leaves as vLLM's), so templates, tools, reasoning parsers,
structured outputs and speculation behave exactly as in /v1/chat/completions; the reply becomes
output items in the order generated: a `reasoning` item (with a --reasoning-parser), a `message`
with one `output_text` part for each stretch of text, and a `function_call` item per tool call.
Streamed or not, the items are the same (one code path makes them).

Conversation state: a stored response (`store`, default true) keeps its conversation as input
items (the earlier turns', this request's and its own output items), so a later request may send
only its new input with `previous_response_id`, and means exactly what sending those items back
by hand means; `GET` and `DELETE /v1/responses/{id}` read and forget one, and
`GET /v1/responses/{id}/input_items` lists the input items it was made from. The store holds the
latest responses in memory, at most 1024 and 256 MiB of their JSON (a server restart forgets
them, as vLLM's does); `metadata` is held to OpenAI's limits (16 pairs, keys of 64 characters,
string values of 512).

Background mode (vLLM's; `background: true`, which needs `store`): the request is checked, then
answered at once with status "queued" while it runs; `GET /v1/responses/{id}` shows it
"in_progress", then the final response; `POST /v1/responses/{id}/cancel` stops it ("cancelled").
Streamed too (`stream: true`), its events are kept as they come, so a client that lost the
stream reconnects with `GET /v1/responses/{id}?stream=true&starting_after=<sequence_number>`:
the events after that one, then the live ones (vLLM's; a cancelled one's stream just ends).

Streams are OpenAI's typed server-sent events, numbered by `sequence_number`:
response.created, response.in_progress, then per item response.output_item.added, its deltas
(a reasoning's or a message's after its response.content_part.added: response.reasoning_text.delta,
response.output_text.delta; response.function_call_arguments.delta) and their .done events
(response.content_part.done after the text's), response.output_item.done, and
at the end response.completed (or response.incomplete when max_output_tokens cut it short).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Literal

from pydantic import Field, ValidationError
from starlette.datastructures import QueryParams

from ..config import SamplingParams
from .errors import APIError, bad_value, clipped
from .protocol import ChatCompletionRequest, _Body
from .responses import ChatFormat, speculative
from .responses import usage as chat_usage
from .serving import Generation

log = logging.getLogger("specdec.server")

# chat fields a Responses client knows by another name: (in messages, as param)
_NAMES = {"messages": ("input", "input"), "max_tokens": ("max_output_tokens", "max_output_tokens"),
          "response_format": ("text.format", "text"), "reasoning_effort": ("reasoning.effort", "reasoning.effort")}
# vLLM's ResponsesRequest.to_sampling_params passes these as the chat endpoint takes them
_SAMPLING = ("top_k", "min_p", "seed", "repetition_penalty", "stop", "logit_bias", "frequency_penalty",
             "presence_penalty", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output")
LOGPROBS = "message.output_text.logprobs"
# vLLM's ResponsesRequest.include values (OpenAI's); only LOGPROBS changes a reply
INCLUDABLE = ("code_interpreter_call.outputs", "computer_call_output.output.image_url", "file_search_call.results",
              "message.input_image.image_url", LOGPROBS, "reasoning.encrypted_content")


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: dict | None = Field(None, description='{"format": {"type": "text" | "json_object" | "json_schema", ...}}')
    structured_outputs: dict | None = Field(None, description="vLLM's: as on the chat endpoint, when text.format is "
                                                              "not given")
    reasoning: dict | None = Field(None, description='{"effort": "low" | "medium" | "high"} reaches the chat template as '
                                                     "reasoning_effort; the thinking is returned with a reasoning parser")
    store: bool = True
    stream: bool = False
    metadata: dict | None = Field(None, description="OpenAI's limits: at most 16 pairs, keys of at most 64 "
                                                    "characters, string values of at most 512")
    user: str | None = None
    top_logprobs: int | None = Field(None, description=f"alternatives per token, with include [{LOGPROBS!r}]")
    include: list[Literal[INCLUDABLE]] | None = Field(None, description=f"{LOGPROBS!r}: the output_text part's "
                                                                    "logprobs")
    truncation: Literal["auto", "disabled"] | None = Field("disabled", description="accepted and echoed, as "
                                                                                   "vLLM's (nothing is cut)")
    background: bool = Field(False, description="run after answering (status queued), as vLLM's; needs store")
    # vLLM's sampling extensions, as on the chat endpoint
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    include_reasoning: bool = True
    priority: int = 0                   # vLLM's: with --scheduling-policy priority, lower first
    cache_salt: str | None = Field(None, min_length=1)   # vLLM's: prefix-cache blocks shared only under the same salt


class ResponseStore:
    """The latest responses, in memory: id -> (the conversation as input items, the body).

    Bounded by count and by bytes: at most max_items responses and max_bytes of them, the oldest
    forgotten first. Each is kept as its JSON text, not as Python objects (a dict of many small
    keys takes ~8x its JSON in memory), so max_bytes is what the store holds. The default holds
    max_items ordinary responses (a few KiB to ~100 KiB each) and still more than a hundred of
    the largest a 1 MiB request body can make."""

    def __init__(self, max_items: int = 1024, max_bytes: int = 256 * 2**20):
        self.max_items, self.max_bytes, self.bytes = max_items, max_bytes, 0
        self._items: collections.OrderedDict[str, tuple[bytes, bytes]] = collections.OrderedDict()

    def put(self, rid: str, items: list[dict], body: dict) -> None:
        if rid in self._items:
            self._drop(rid)
        entry = (_json(items), _json(body))
        if sum(map(len, entry)) > self.max_bytes:       # it would push out every other: not kept
            log.warning("response %s not stored: %d bytes, more than the store's %d", rid, sum(map(len, entry)),
                        self.max_bytes)
            return
        self._items[rid] = entry
        self.bytes += sum(map(len, entry))
        while len(self._items) > self.max_items or self.bytes > self.max_bytes:
            self._drop(next(iter(self._items)))

    def get(self, rid: str, param: str | None = None) -> tuple[list[dict], bytes]:
        """A stored response: (its conversation as input items, its body as JSON) (param: the
        request field that named it, for a 404)."""
        if rid not in self._items:
            raise APIError(404, f"no stored response with id {rid!r} (only the latest {self.max_items} are kept, "
                                f"at most {self.max_bytes / 2**20:g} MiB of them, in memory)", param,
                           "response_not_found")
        items, body = self._items[rid]
        return json.loads(items), body

    def __contains__(self, rid: str) -> bool:
        return rid in self._items

    def delete(self, rid: str) -> None:
        self.get(rid)
        self._drop(rid)

    def _drop(self, rid: str) -> None:
        self.bytes -= sum(map(len, self._items.pop(rid)))


def _json(value) -> bytes:
    """As a JSON answer is written (starlette's JSONResponse)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


# OpenAI's limits on metadata (its Metadata object): a stored response keeps it
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512
_JSON_TYPES = {dict: "an object", list: "an array", int: "an integer", float: "a number", bool: "a boolean",
               type(None): "null"}


def check_request(req: ResponsesRequest) -> None:
    """What the Responses API checks beyond the chat path's checks: background mode's need
    (vLLM's: a stored response), OpenAI's metadata limits (at most 16 pairs, keys of at most 64
    characters, string values of at most 512)."""
    if req.background and not req.store:
        raise APIError(400, "background can only be used when `store` is true", "background")
    meta = req.metadata
    if meta is None:
        return
    if len(meta) > METADATA_PAIRS:
        raise APIError(400, f"metadata holds at most {METADATA_PAIRS} key-value pairs, got {len(meta)}", "metadata")
    for key, value in meta.items():
        if len(key) > METADATA_KEY_CHARS:
            raise APIError(400, f"metadata keys are at most {METADATA_KEY_CHARS} characters, got one of {len(key)} "
                                f"({key[:METADATA_KEY_CHARS]!r}...)", "metadata")
        if not isinstance(value, str):
            raise APIError(400, f"metadata.{key} must be a string, got {_JSON_TYPES.get(type(value), 'a value')}",
                           f"metadata.{key}")
        if len(value) > METADATA_VALUE_CHARS:
            raise APIError(400, f"metadata.{key} is at most {METADATA_VALUE_CHARS} characters, got {len(value)}",
                           f"metadata.{key}")


def _text(content, where: str, field: str = "content") -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.{field} must be a string or a list of text parts", "input")
    out = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            raise APIError(400, f"{where}.{field}: only text parts (input_text, output_text) are supported", "input")
        if not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}.{field}: a {part['type']} part needs a string `text`", "input")
        out.append(part["text"])
    return "\n".join(out)           # as the chat path joins text parts (vLLM's chat_utils)


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's text: its content's (reasoning_text parts), else its summary's."""
    texts = []
    for field in ("content", "summary"):
        parts = item.get(field)
        if parts is not None and not (isinstance(parts, list) and all(
                isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts)):
            raise APIError(400, f"{where}.{field} must be a list of parts, each with a string `text`", "input")
        texts.append("".join(p["text"] for p in parts or []))
    return texts[0] or texts[1]


_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def input_items(req: ResponsesRequest) -> list[dict]:
    """The request's own input as a list of items (a string is one user message), each with an id
    (its own, else a new one), by which GET /v1/responses/{id}/input_items pages them."""
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    return [{**i, "id": i.get("id") or f"{_ID_PREFIXES.get(i.get('type', 'message'), 'item')}_{uuid.uuid4().hex}"}
            if isinstance(i, dict) else i for i in items]


def input_messages(req: ResponsesRequest) -> list[dict]:
    """The request's own input as chat messages (instructions not included)."""
    return _input(req, [])[0]


def _input(req: ResponsesRequest, history: list[dict]) -> tuple[list[dict], list[str]]:
    """(a stored conversation's items and the input, as chat messages; the item each came from:
    "input[i]", or "previous_response_id" for the history's). Both are converted as one list, so
    previous_response_id means what sending its items back by hand means."""
    own = [f"input[{i}]" for i in range(len(req.input))] if isinstance(req.input, list) else ["input"]
    return _messages(history + input_items(req), ["previous_response_id"] * len(history) + own)


def _messages(items: list, names: list[str]) -> tuple[list[dict], list[str]]:
    """Input items -> (chat messages, the name of the item each came from); names[i]: item i's."""
    messages: list[dict] = []
    sources: list[str] = []
    thought, at = None, None    # a reasoning item's text (and its item): the next assistant turn's thinking

    def unclaimed() -> None:
        """A reasoning item no assistant turn follows is a turn of its own, as a stored reply keeps it."""
        nonlocal thought
        if thought:
            messages.append({"role": "assistant", "content": "", "reasoning_content": thought})
            sources.append(at)
        thought = None

    for item, where in zip(items, names):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            if not isinstance(item.get("role"), str):
                raise APIError(400, f"{where}.role is required", "input")
            if item.get("content") is None:
                raise APIError(400, f"{where}.content is required", "input")
            if item["role"] != "assistant":
                unclaimed()
            messages.append({"role": item["role"], "content": _text(item["content"], where)})
            sources.append(where)
            if thought:
                messages[-1]["reasoning_content"] = thought
            thought = None
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise APIError(400, f"{where}: a function_call needs call_id, name and arguments (strings)", "input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant" and not thought:
                # the text before it and parallel calls: one assistant turn, as a chat reply is
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call],
                                 **({"reasoning_content": thought} if thought else {})})
                sources.append(where)
            thought = None
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError(400, f"{where}: a function_call_output needs its call_id", "input")
            if not isinstance(item.get("output"), (str, list)):
                raise APIError(400, f"{where}.output must be a string or a list of input_text parts", "input")
            unclaimed()
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item["output"], where, "output")})
            sources.append(where)
        elif kind == "reasoning":     # the thinking before the assistant turn that follows (gpt-oss keeps
            text = _reasoning_text(item, where)                  # a call's analysis in its template)
            if text:                  # several in a row are joined, as a stored reply joins them
                thought, at = (thought or "") + text, at if thought else where
        else:
            raise APIError(400, f"{where}.type {kind!r} is not supported (message, function_call, "
                                "function_call_output, reasoning)", "input")
    unclaimed()
    return messages, sources


def _chat_tools(tools: list[dict] | None, choice) -> list[dict] | None:
    """The function tools as chat tools; with tool_choice allowed_tools, only those it allows."""
    out = []
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise APIError(400, f"tools[{i}]: only function tools are supported", "tools")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                                      if k in t}})
    allowed = _allowed_tools(choice, {t["function"].get("name") for t in out})
    if tools is None:
        return None
    return out if allowed is None else [t for t in out if t["function"].get("name") in allowed]


_TOOL_CHOICES = ('tool_choice must be "none", "auto", "required", {"type": "function", "name": ...} or '
                 '{"type": "allowed_tools", "mode": "auto" | "required", "tools": [{"type": "function", "name": ...}]}')


def _allowed_tools(choice, names: set) -> set | None:
    """OpenAI's tool_choice {"type": "allowed_tools", "mode", "tools"}: the names of the function
    tools it lets the model call (None for any other tool_choice); each must be one of the tools."""
    if not (isinstance(choice, dict) and choice.get("type") == "allowed_tools"):
        return None
    if choice.get("mode") not in ("auto", "required"):
        raise APIError(400, f'tool_choice.mode must be "auto" or "required", got {choice.get("mode")!r}',
                       "tool_choice.mode")
    listed = choice.get("tools")
    if not isinstance(listed, list) or not listed:
        raise APIError(400, "tool_choice.tools must list the tools the model may call", "tool_choice.tools")
    allowed = set()
    for i, t in enumerate(listed):
        if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str)):
            raise APIError(400, f'tool_choice.tools[{i}] must be {{"type": "function", "name": ...}} (only '
                                "function tools are supported)", "tool_choice.tools")
        if t["name"] not in names:
            raise APIError(400, f"tool_choice.tools[{i}] names {t['name']!r}, which is not one of the tools",
                           "tool_choice.tools")
        allowed.add(t["name"])
    return allowed


def _chat_tool_choice(choice, tools: list[dict] | None):
    """The Responses tool_choice as the chat path's: allowed_tools is its mode over the tools it
    allows (_chat_tools keeps only those), a function is named at the top level."""
    if choice == "auto" and not tools:      # vLLM's and OpenAI's default, sent without tools: no tools
        return None
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") == "allowed_tools":
        return choice["mode"]
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise APIError(400, f"{_TOOL_CHOICES}, got {json.dumps(choice)[:200]}", "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise APIError(400, "text.format must be an object", "text")
    kind = fmt.get("type")
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise APIError(400, "text.format.schema is required (a JSON schema object)", "text")
        if not isinstance(fmt.get("name"), str):         # OpenAI's and vLLM's (ResponseTextConfig): required
            raise APIError(400, "text.format.name is required (a string) with type json_schema", "text")
        return {"type": "json_schema", "json_schema": {"name": fmt["name"], "schema": fmt["schema"],
                                                       "strict": fmt.get("strict")}}
    if kind not in ("text", "json_object"):
        raise APIError(400, f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", "text")
    return {"type": kind}


def chat_request(req: ResponsesRequest, history: list[dict]) -> ChatCompletionRequest:
    """The chat completion request this Responses request means (history: a stored conversation's
    items), but for max_output_tokens, which budgeted() applies once the prompt is known."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) \
        + _input(req, history)[0]
    logprobs = LOGPROBS in (req.include or [])       # vLLM: logprobs=top_logprobs only when included
    if req.structured_outputs is not None and (req.text or {}).get("format") is not None:    # vLLM's words
        raise APIError(400, "Cannot specify both structured_outputs and text.format", "structured_outputs")
    body = {"model": req.model, "messages": messages,
            "temperature": req.temperature, "top_p": req.top_p, "tools": _chat_tools(req.tools, req.tool_choice),
            "tool_choice": _chat_tool_choice(req.tool_choice, req.tools),
            "parallel_tool_calls": req.parallel_tool_calls,
            "response_format": _response_format(req.text), "structured_outputs": req.structured_outputs,
            "include_reasoning": req.include_reasoning,
            "user": req.user, "priority": req.priority, "cache_salt": req.cache_salt, "logprobs": logprobs,
            "top_logprobs": req.top_logprobs if logprobs else None,
            "reasoning_effort": (req.reasoning or {}).get("effort"),     # OpenAI's reasoning.effort
            **{k: getattr(req, k) for k in _SAMPLING}}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        path = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in err["loc"]).lstrip(".")
        raise APIError(400, f"{path}: {err['msg']}" if path else err["msg"], path or None) from None   # renamed()


def message_sources(req: ResponsesRequest, history: list[dict]) -> list[str]:
    """Where each of chat_request's messages came from, for errors that name one."""
    return (["instructions"] if req.instructions else []) + _input(req, history)[1]


def budgeted(params: SamplingParams, req: ResponsesRequest, max_model_len: int, prompt: list[int]) -> SamplingParams:
    """max_output_tokens capped at what the context leaves after the prompt (vLLM's
    ResponsesRequest.to_sampling_params): the reply then ends incomplete, where max_tokens past
    the context is a 400 on the chat endpoint. A bad value is a 400 in chat's words (renamed())."""
    if req.max_output_tokens is None:
        return params
    room = max_model_len - len(prompt)
    cap = room if params.max_tokens is None else min(params.max_tokens, room)
    try:
        return dataclasses.replace(params, max_tokens=min(req.max_output_tokens, cap))
    except ValueError as e:
        raise bad_value(e) from None


def renamed(e: APIError, sources: list[str] | None = None) -> APIError:
    """A chat-path error under the Responses API's field names; sources (message_sources) turns
    messages[j] into the input item it came from (instructions and a stored history shift j)."""
    param, message = e.param, e.message

    def item(m: re.Match) -> str:
        j = int(m.group(1))
        return sources[j] if sources is not None and j < len(sources) else f"input[{j}]"
    message = re.sub(r"\bmessages\[(\d+)\]", item, message)
    param = re.sub(r"^messages\[(\d+)\]", item, param) if param else param
    for chat, (_, as_param) in _NAMES.items():
        if param and (param == chat or param.startswith((chat + "[", chat + "."))):
            param = as_param if chat == "response_format" else as_param + param[len(chat):]
            if chat == "messages":         # "messages must not be empty", a template's error
                message = re.sub(r"\bmessages\b", "input", message)
    message = message.replace(" in the messages,", " in the input,")      # the context-length error
    message = re.sub(r"\bresponse_format\.json_schema\.schema\b", "text.format.schema", message)
    for chat in ("max_tokens", "response_format", "reasoning_effort"):
        message = re.sub(rf"\b{chat}\b", _NAMES[chat][0], message)
    message = message.replace("the Chat Completions API", "the Responses API")
    if param == "top_logprobs":         # the engine's check says logprobs, the count's name in SamplingParams
        message = re.sub(r"^logprobs\b", "top_logprobs", message)
    return APIError(e.status, message, param, e.code)


def _message_item(text: str, status: str, logprobs: list[dict] | None = None) -> dict:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def _reasoning_item(text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(call: dict, status: str = "completed") -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


@dataclasses.dataclass(frozen=True)
class Served:
    """What a response reports beside its output, as vLLM fills it in: the sampling values used
    (the request's, else the defaults and generation_config.json's), and a counter of the
    reasoning text's tokens (output_tokens_details.reasoning_tokens). The default: the request's."""
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    top_logprobs: int | None = None
    count_tokens: Callable[[str], int] | None = None

    @classmethod
    def of(cls, params, max_output_tokens: int, count_tokens: Callable[[str], int]) -> Served:
        return cls(params.temperature, params.top_p, max_output_tokens, params.logprobs, count_tokens)


def response_body(rid: str, req: ResponsesRequest, model: str, created: int, output: list[dict],
                  finish: str | None, usage: dict | None, status: str | None = None,
                  served: Served = Served(), speculative: dict | None = None) -> dict:
    incomplete = finish in ("length", "abort")     # cut short by max_output_tokens, or aborted (POST /pause)
    status = status or ("incomplete" if incomplete else "completed")
    u = usage or {}
    thought = "".join(p["text"] for i in output if i["type"] == "reasoning" for p in i["content"])
    reasoning_tokens = 0 if not (thought and served.count_tokens) else \
        min(served.count_tokens(thought), u.get("completion_tokens", 0))
    return {"id": rid, "object": "response", "created_at": created, "model": model, "status": status,
            "output": output, "instructions": req.instructions,
            "max_output_tokens": _or(served.max_output_tokens, req.max_output_tokens),
            "previous_response_id": req.previous_response_id, "temperature": _or(served.temperature, req.temperature),
            "top_p": _or(served.top_p, req.top_p), "top_logprobs": served.top_logprobs,
            "tools": req.tools or [], "tool_choice": req.tool_choice or ("auto" if req.tools else "none"),
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "text": {**(req.text or {}), "format": (req.text or {}).get("format") or {"type": "text"}},
            "reasoning": req.reasoning, "metadata": req.metadata or {}, "user": req.user, "store": req.store,
            "truncation": req.truncation or "disabled", "background": req.background, "error": None,
            "incomplete_details": {"reason": "max_output_tokens" if finish == "length" else "abort"}
            if incomplete else None,
            "usage": None if usage is None else {
                "input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                "total_tokens": u["total_tokens"],
                # cache_write_tokens: OpenAI's count of tokens written for extended prompt caching, which
                # specdec has not (its prefix cache reuses blocks as they are computed, for no charge)
                "input_tokens_details": {"cached_tokens": u.get("prompt_tokens_details", {}).get("cached_tokens", 0),
                                         "cache_write_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": reasoning_tokens}},
            **({} if speculative is None else {"speculative": speculative})}     # as every response of this server


def _or(value, default):
    return default if value is None else value


def conversation(turn: list[dict], output: list[dict]) -> list[dict]:
    """What a stored response keeps: the conversation so far as input items (earlier turns' and
    this request's input; not the instructions, which each request gives anew) and its output
    items, as a client sends them back by hand (less the logprobs, which no prompt reads)."""
    return turn + [{**i, "content": [{k: v for k, v in p.items() if k != "logprobs"} for p in i["content"]]}
                   if i["type"] == "message" else i for i in output]


def list_input_items(store: ResponseStore, rid: str, query: QueryParams) -> dict:
    """OpenAI's GET /v1/responses/{id}/input_items (its ResponseItemList): the items a stored
    response was made from (earlier turns' and its request's input: its stored conversation less
    its own output), a page of them: query `order` "asc" | "desc" (the default: newest first),
    `after` (an item id: the items after it), `limit` (1 to 100, default 20), `include` (OpenAI's
    values; stored items hold nothing more to include). 404 for a response not stored."""
    order, after = query.get("order", "desc"), query.get("after")
    if order not in ("asc", "desc"):
        raise APIError(400, f'order must be "asc" or "desc", got {order!r}', "order")
    limit = query.get("limit", "20")
    if not (limit.isascii() and limit.isdigit() and len(limit) <= 3 and 1 <= int(limit) <= 100):   # "²".isdigit() too
        raise APIError(400, f"limit must be an integer from 1 to 100, got {clipped(limit)!r}", "limit")
    for value in query.getlist("include") + query.getlist("include[]"):     # the openai client's: include[]
        if value not in INCLUDABLE:
            raise APIError(400, f"include values are {', '.join(INCLUDABLE)}; got {value!r}", "include")
    items, body = store.get(rid)
    items = [_listed(i) for i in items[:len(items) - len(json.loads(body)["output"])]]
    items = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        start = next((k + 1 for k, i in enumerate(items) if i["id"] == after), None)
        if start is None:
            raise APIError(400, f"after: response {rid!r} has no input item with id {after!r}", "after")
    page = items[start:start + int(limit)]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + int(limit) < len(items)}


def _listed(item: dict) -> dict:
    """A stored input item in OpenAI's listed shape: typed, with a status, a message's text as
    parts (input_text; output_text with its annotations in an assistant's), a reasoning's summary."""
    kind = item.get("type", "message")
    out = {**item, "type": kind, "status": item.get("status") or "completed"}
    if kind == "message":
        part = "output_text" if item["role"] == "assistant" else "input_text"
        parts = [{"text": item["content"]}] if isinstance(item["content"], str) else item["content"]
        out["content"] = [{**p, "type": part, **({"annotations": p.get("annotations") or []} if part == "output_text"
                                                  else {})} for p in parts]
    elif kind == "reasoning":
        out["summary"] = item.get("summary") or []
    return out


async def respond(gen: Generation, fmt: ChatFormat, req: ResponsesRequest, model: str, rid: str,
                  served: Served = Served(), started: Callable[[], None] | None = None) -> tuple[dict, str | None]:
    """Run to the end: (the response body, the chat finish_reason). The items are made as the
    stream makes them (its events dropped); started() is called when the first tokens come."""
    created = int(time.time())       # Unix seconds, as OpenAI documents
    items = _ItemStream()
    async for _ in items.run(gen, fmt, started):
        pass
    return response_body(rid, req, model, created, items.output, items.finish, chat_usage(gen, items.tokens),
                         served=served, speculative=speculative(gen)), items.finish


class _ItemStream:
    """The output items of one streamed reply, as OpenAI's typed events: an item opens
    (output_item.added), takes its deltas, and closes (its .done events, output_item.done) when
    the next one opens or the reply ends. Each method returns the events it makes."""

    def __init__(self):
        self.seq = 0
        self.output: list[dict] = []
        self.open: dict | None = None
        self.calls: dict[int, dict] = {}        # a tool-call delta's index -> its item
        self.finish: str | None = None          # once run() is done: the chat finish_reason
        self.tokens = 0                         # and the tokens generated

    async def run(self, gen: Generation, fmt: ChatFormat, started: Callable[[], None] | None = None
                  ) -> AsyncIterator[str]:
        """Generate the reply: the events of its items, the last one closed at the end. Logprobs
        (include message.output_text.logprobs) go with the answer's text deltas: those of tokens
        before it (the thinking's) with its first."""
        logprobs = []
        async with gen:
            async for _, step in gen.steps():
                if started is not None:
                    started()
                    started = None
                self.tokens += len(step.token_ids)
                d = fmt.delta(0, step.text, step.logprobs or [], 0, step.finish_reason, step.stop_reason)
                if step.finished:
                    self.finish = d["finish_reason"] if d is not None else step.finish_reason
                if d is None:
                    continue
                delta, events = d["delta"], []
                logprobs += (d.get("logprobs") or {}).get("content") or []
                if delta.get("reasoning_content"):
                    events += self.text("reasoning", delta["reasoning_content"])
                calls = delta.get("tool_calls") or []
                for c in calls:            # a call going on (hermes streams arguments) precedes the text after it
                    if c["index"] in self.calls:
                        events += self.call(c)
                if delta.get("content"):
                    events += self.text("message", delta["content"], logprobs)
                    logprobs = []
                for c in calls:
                    if c["index"] not in self.calls:
                        events += self.call(c)
                for e in events:
                    yield e
        for e in self.close("incomplete" if self.finish in ("length", "abort") else "completed", logprobs):
            yield e

    def event(self, kind: str, **fields) -> str:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    def close(self, status: str = "completed", logprobs: list[dict] = ()) -> list[str]:
        """logprobs: those of tokens whose text never came (held at the end), for an open message."""
        item, self.open = self.open, None
        if item is None:
            return []
        idx, ev = self.output.index(item), self.event
        item["status"] = status
        if item["type"] == "message":
            item["content"][0]["logprobs"] += logprobs
            events = [ev("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0,
                         text=item["content"][0]["text"], logprobs=item["content"][0]["logprobs"]),
                      ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0,
                         part=item["content"][0])]
        elif item["type"] == "reasoning":
            events = [ev("response.reasoning_text.done", item_id=item["id"], output_index=idx, content_index=0,
                         text=item["content"][0]["text"]),
                      ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0,
                         part=item["content"][0])]
        else:
            events = [ev("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                         arguments=item["arguments"], name=item["name"])]
        return events + [ev("response.output_item.done", output_index=idx, item=item)]

    def begin(self, item: dict) -> list[str]:
        events = self.close()
        self.output.append(item)
        self.open, idx = item, len(self.output) - 1
        if item["type"] == "function_call":
            return events + [self.event("response.output_item.added", output_index=idx, item=item)]
        # a message's or reasoning's part comes in content_part.added (OpenAI's and vLLM's simple_streaming_events)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []} if item["type"] == "message" \
            else {"type": "reasoning_text", "text": ""}
        return events + [self.event("response.output_item.added", output_index=idx, item={**item, "content": []}),
                         self.event("response.content_part.added", item_id=item["id"], output_index=idx,
                                    content_index=0, part=part)]

    def text(self, kind: str, delta: str, logprobs: list[dict] = ()) -> list[str]:
        """Reasoning (kind "reasoning") or answer ("message") text; logprobs: an answer's tokens'."""
        events = [] if self.open is not None and self.open["type"] == kind else \
            self.begin(_reasoning_item("", "in_progress") if kind == "reasoning" else _message_item("", "in_progress"))
        self.open["content"][0]["text"] += delta
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": list(logprobs)}
        if kind == "message":
            self.open["content"][0]["logprobs"] += logprobs
        return events + [self.event(name, item_id=self.open["id"], output_index=len(self.output) - 1,
                                    content_index=0, delta=delta, **extra)]

    def call(self, c: dict) -> list[str]:
        """One tool-call delta of the chat format (its first names the function)."""
        fn, events = c.get("function") or {}, []
        if c["index"] not in self.calls:
            item = _call_item({"id": c.get("id") or f"call_{uuid.uuid4().hex}",
                               "function": {"name": fn.get("name") or "", "arguments": ""}}, "in_progress")
            events = self.begin(item)
            self.calls[c["index"]] = item
        item = self.calls[c["index"]]
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=self.output.index(item), delta=fn["arguments"]))
        return events


async def stream(gen: Generation, fmt: ChatFormat, req: ResponsesRequest, model: str, rid: str,
                 done, served: Served = Served(), started: Callable[[], None] | None = None
                 ) -> AsyncIterator[str]:
    """Typed events as the reply is generated; done(body) is called with the final response,
    started() when the first tokens come."""
    items, created = _ItemStream(), int(time.time())
    start = response_body(rid, req, model, created, [], None, None, status="in_progress", served=served)
    yield items.event("response.created", response=start)
    yield items.event("response.in_progress", response=start)
    try:
        async for e in items.run(gen, fmt, started):
            yield e
        body = response_body(rid, req, model, created, items.output, items.finish, chat_usage(gen, items.tokens),
                             served=served, speculative=speculative(gen))
        done(body)
        yield items.event("response.incomplete" if body["status"] == "incomplete" else "response.completed",
                          response=body)
    except APIError as e:       # OpenAI's ResponseErrorEvent (its own "type": "error")
        yield items.event("error", code=e.code, message=e.message, param=e.param)
    except Exception as e:      # noqa: BLE001 - a bug: still an error event, as the chat stream sends
        log.exception("a Responses stream failed")
        yield items.event("error", code=None, message=f"internal error: {type(e).__name__}", param=None)


class _Events:
    """A streamed background response's events as they come (event i has sequence_number i),
    for any number of readers, each from where it joins."""

    def __init__(self):
        self.sse: list[str] = []
        self.done = False
        self._new = asyncio.Event()

    def add(self, event: str) -> None:
        self.sse.append(event)
        self._wake()

    def end(self) -> None:
        self.done = True
        self._wake()

    def _wake(self) -> None:
        self._new.set()
        self._new = asyncio.Event()     # a fresh one for the next wait: readers never clear it

    async def after(self, seq: int) -> AsyncIterator[str]:
        """The events after sequence number seq (-1: all), then the live ones until the end."""
        i = max(seq + 1, 0)
        while True:
            while i < len(self.sse):
                yield self.sse[i]
                i += 1
            if self.done:
                return
            await self._new.wait()


class Background:
    """vLLM's background mode: responses that run after the request is answered (status
    "queued"), kept in the store as they go ("in_progress", then the final response) and
    cancellable until they end. A streamed one's events are kept for readers that reconnect:
    while it runs, then for the latest max_streams finished ones the store still holds."""

    def __init__(self, store: ResponseStore, max_streams: int = 64):
        self.store, self.max_streams = store, max_streams
        self.tasks: dict[str, asyncio.Task] = {}
        self.streams: collections.OrderedDict[str, _Events] = collections.OrderedDict()

    def start(self, rid: str, turn: list[dict], queued: dict,
              work: Callable[[Callable[[], None]], Coroutine]) -> dict:
        """Keep the queued body and run work(started) (it returns the final body; started() when
        its first tokens come); the queued body."""
        def started() -> None:
            self.store.put(rid, turn, {**queued, "status": "in_progress"})

        async def run():
            try:
                body = await work(started)
            except Exception as e:      # noqa: BLE001 - nobody waits for it: the stored response says so
                log.exception("background response %s failed", rid)
                message = e.message if isinstance(e, APIError) else f"internal error: {type(e).__name__}"
                self.store.put(rid, turn, {**queued, "status": "failed",
                                           "error": {"code": "server_error", "message": message}})
                return
            self.store.put(rid, conversation(turn, body["output"]), body)
        self.store.put(rid, turn, queued)
        task = self.tasks[rid] = asyncio.ensure_future(run())
        task.add_done_callback(lambda _: self.tasks.pop(rid, None))
        return queued

    def start_stream(self, rid: str, turn: list[dict], queued: dict,
                     events: Callable[[Callable[[], None], Callable[[dict], None]], AsyncIterator[str]]
                     ) -> AsyncIterator[str]:
        """As start, for a streamed response: events(started, done) makes its events (as stream()
        does: done(body) with the final response); they are kept as they come and the stream of
        them is returned, from the first. The run does not depend on that stream's reader: a
        client that leaves reconnects with follow()."""
        kept = self.streams[rid] = _Events()
        self._trim()

        async def work(started):
            final = []
            try:
                async for e in events(started, final.append):
                    kept.add(e)
            finally:
                kept.end()
            if not final:               # the stream ended with its error event: the response failed
                raise APIError(500, json.loads(kept.sse[-1].split("data: ", 1)[1])["message"], None)
            return final[0]
        self.start(rid, turn, queued, work)
        return kept.after(-1)

    def follow(self, rid: str, starting_after: int | None = None) -> AsyncIterator[str]:
        """vLLM's GET /v1/responses/{id}?stream=true: a background stream's events after
        sequence number starting_after (all without it), then the live ones. 404 for an unknown
        response, 400 for one not streamed in the background (or whose events are forgotten)."""
        self.store.get(rid)
        if rid not in self.streams:
            raise APIError(400, f"response {rid!r} has no stored events: only background responses created with "
                                f"stream true can be streamed again (the latest {self.max_streams} finished ones)",
                           "stream")
        return self.streams[rid].after(-1 if starting_after is None else starting_after)

    def _trim(self) -> None:
        """Forget finished streams the store forgot, then the oldest beyond max_streams."""
        done = [rid for rid, kept in self.streams.items() if kept.done]
        for i, rid in enumerate(done):
            if rid not in self.store or i < len(done) - self.max_streams:
                del self.streams[rid]

    async def cancel(self, rid: str) -> dict:
        """vLLM's cancel: a running background response stops and is kept "cancelled"; any other
        stored response is a 400, an unknown one a 404."""
        turn, raw = self.store.get(rid)
        body = json.loads(raw)
        task = self.tasks.get(rid)
        if task is None or body["status"] not in ("queued", "in_progress"):
            raise APIError(400, "Cannot cancel a synchronous response.", None)
        await self._halt(rid)
        body["status"] = "cancelled"
        self.store.put(rid, turn, body)
        return body

    async def stop(self, rid: str) -> None:
        """Its work cancelled (the engine request aborted), if it still runs, and its events
        forgotten (DELETE)."""
        await self._halt(rid)
        self.streams.pop(rid, None)

    async def _halt(self, rid: str) -> None:
        task = self.tasks.pop(rid, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
