"""OpenAI tool calling (function calling) with vLLM's `tool_choice` semantics.

- `"none"`: the tools are given to the chat template (which may show them to the model), unless
  the server runs vLLM's `--exclude-tools-when-tool-choice-none`; the reply is text.
- A tool's name is any string, as vLLM takes it (MCP bridges name tools `server.tool`, up to
  128 characters); OpenAI's own API allows 1-64 letters, digits, `_` and `-`.
- named, `{"type": "function", "function": {"name": N}}`: the reply is constrained (structured
  outputs) to N's `parameters` schema and returned as one call of N (finish_reason "stop", as
  OpenAI answers a forced function). An object that lists its properties takes no others unless
  its schema says so (`structured.closed_objects`: vLLM's default backend compiles schemas that way), so a call
  holds the declared parameters and a function without any gets `{}`.
- `"required"`: the reply is constrained to a JSON array of `{"name": ..., "parameters": ...}`
  objects, each one of the tools with its own schema, at least one (exactly one when
  `parallel_tool_calls` is false); returned as calls, finish_reason "tool_calls". The tools'
  `$defs` move to the array schema's root, where their references resolve (vLLM's). An array
  cut short (finish_reason "length") gives no calls and null content, as vLLM's.
- `"auto"` (the default when tools are given): the model writes freely and the server's
  `--tool-call-parser` takes its calls out of the text; it needs `--enable-auto-tool-choice`,
  as in vLLM; with `parallel_tool_calls` false only the first call is returned. Parsers: `hermes` (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks anywhere in the text: Hermes 2 Pro / 3, Qwen2.5), `llama3_json` (`{"name": ...,
  "parameters": {...}}` objects anywhere in the reply, as vLLM's: joined by `;`, after a
  `<|python_tag|>`, or among prose, which is then dropped (content null); Llama 3.1 / 3.2),
  `pythonic`, whose calls are the whole reply (`[f(a=1), g(b="x")]`: Llama 3.2 / 4's pythonic
  templates, ToolACE; a call whose arguments are not JSON, `1e999` among them, is left out and
  its siblings kept, as vLLM's); `mistral` reads the calls after a `[TOOL_CALLS]` marker (a
  special token, so replies keep special tokens), the text before it being content, as vLLM's
  MistralToolParser: a JSON array `[{"name": ..., "arguments": {...}}]` (Mistral 7B v0.3; what
  follows the array is ignored) or, from Mistral's v11 tokenizers on (Mistral Small 3.1+,
  Devstral, Magistral), `name{args}` (`name[ARGS]{args}` as Hugging Face tokenizers decode it)
  after each marker; its calls get Mistral's 9-character alphanumeric ids, which Mistral's chat
  templates require of the calls sent back (so do named and required calls on such a server).
  `openai` (gpt-oss): its calls are harmony messages addressed `to=functions.NAME`, whose body
  is the arguments; the harmony reasoning parser (reasoning.py) finds them, so this parser
  needs it (a gpt-oss model chooses it by itself). A call is sent once its message has ended
  (at the reply's end: `<|call|>` stops generation); one cut off by max_tokens is no call (vLLM
  returns only completed messages); arguments that are JSON are re-serialized, as vLLM does.

A parser never fails a reply: whatever it raises (a RecursionError on deeply nested brackets
among them) means "no call", and the reply is text (vLLM's parsers catch Exception alike).

A constrained reply is lossless under speculation like every structured output: the grammar
masks p and q alike, and verification keeps exactly the constrained target's tokens.

Streams: a named call streams its arguments as they are generated; `required` sends its calls
when the array is complete (at the end); `auto` with hermes streams the text outside the call
blocks and each call as vLLM's Hermes2ProToolParser (and OpenAI) stream one: a first delta with
its index, id, type and name (arguments "") once the name has been read, then its arguments in
pieces as they are generated, which join to the non-streamed arguments (a piece holds only what
later text cannot change: a number once it ends, a closing bracket once it comes, `\\u00e9` as
`é`; arguments that are a string, a number or null are sent whole when the block ends). A block
whose name has been sent stays a call, with the arguments sent, if it then turns out not to
parse (the reply cut off inside it, text after its object, nesting past the recursion limit;
the non-streamed reply makes it text) or a key given twice changes what was sent (json.loads
keeps the last value): vLLM's parser has the same limit. mistral streams the text before
`[TOOL_CALLS]` and llama3_json the text before the first `{` or `<|python_tag|>`, holding what
follows to the end; with pythonic a reply that begins like a call is held to the end (then sent
as calls, or as text if it does not parse), any other streams as text. The content streamed
equals the non-streamed content, except llama3_json's prose before its calls, sent before they
are known, and a hermes block whose name has been sent (above).
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass

from ..config import StructuredOutputsParams
from ..structured import closed_objects
from .errors import APIError
from .reasoning import held_back

PARSERS = ("hermes", "llama3_json", "pythonic", "mistral", "openai")
_MISTRAL_NAME = re.compile(r"^[^\s{}\[\]]+$")   # v11's `name{args}`: a name is what precedes the brace
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses its tools (None when it sends none)."""
    mode: str                                  # "none" | "named" | "required" | "auto"
    tools: tuple[dict, ...]                    # the request's tools, as sent (for the chat template)
    name: str | None = None                    # named: the function
    parser: str | None = None                  # auto: the server's --tool-call-parser
    mistral_ids: bool = False                  # calls get Mistral's 9-character ids (--tool-call-parser mistral)
    constraint: StructuredOutputsParams | None = None   # named / required: the reply's grammar
    parallel: bool = True                      # auto: parallel_tool_calls (false: the first call only)

    @property
    def template_tools(self) -> list[dict]:
        return [dict(t) for t in self.tools]


def plan_tools(tools, tool_choice, parallel_tool_calls, enable_auto: bool, parser: str | None) -> ToolPlan | None:
    """Validate a request's tools and tool_choice; a 400 names the field at fault."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice is only allowed when tools are given", "tool_choice")
        return None
    functions = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise APIError(400, f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., '
                                f'"parameters": {{...}}}}}}', "tools")
        name = fn.get("name")
        if not isinstance(name, str):
            raise APIError(400, f"tools[{i}].function.name must be a string, got {name!r}", "tools")
        if name in functions:
            raise APIError(400, f"tools[{i}].function.name {name!r} is given twice", "tools")
        params = fn.get("parameters")
        params = _EMPTY_PARAMETERS if params is None else params     # null: as omitted (vLLM's)
        if not isinstance(params, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise APIError(400, f"tools[{i}].function.description must be a string", "tools")
        functions[name] = closed_objects(params)
    plain = tuple(tools)
    choice = "auto" if tool_choice is None else tool_choice
    ids = parser == "mistral"
    if choice == "none":
        return ToolPlan("none", plain)
    if choice == "auto":
        if not (enable_auto and parser):
            raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                                'set (or send tool_choice "required", "none" or a named function)', "tool_choice")
        return ToolPlan("auto", plain, parser=parser, parallel=parallel_tool_calls is not False, mistral_ids=ids)
    if choice == "required":
        defs, bare = _hoisted_defs(functions)
        one = [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]}, "parameters": p},
                "required": ["name", "parameters"], "additionalProperties": False} for n, p in bare.items()]
        schema = {"type": "array", "minItems": 1, "items": one[0] if len(one) == 1 else {"anyOf": one}}
        schema.update(defs)
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan("required", plain, constraint=StructuredOutputsParams(json=schema), mistral_ids=ids)
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise APIError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                                '"function": {"name": ...}}', "tool_choice")
        if name not in functions:
            raise APIError(400, f"tool_choice names {name!r}, which is not one of the tools", "tool_choice")
        return ToolPlan("named", plain, name=name, constraint=StructuredOutputsParams(json=functions[name]),
                        mistral_ids=ids)
    raise APIError(400, f'tool_choice must be "none", "auto", "required" or a named function, got {choice!r}',
                   "tool_choice")


def _hoisted_defs(functions: dict) -> tuple[dict, dict]:
    """(the tools' $defs merged, each tool's schema without them): nested under the `required`
    array, a `#/$defs/...` reference resolves from the root (vLLM's get_tool_schema_defs); a name
    two tools define differently is a 400."""
    defs, bare = {"$defs": {}, "definitions": {}}, {}
    for name, params in functions.items():
        for where in defs:
            for key, value in (params.get(where) or {}).items():
                if key in defs[where] and defs[where][key] != value:
                    raise APIError(400, f"tools define {where} {key!r} differently ({name!r} and an earlier tool)",
                                   "tools")
                defs[where][key] = value
        bare[name] = {k: v for k, v in params.items() if k not in defs}
    return {k: v for k, v in defs.items() if v}, bare


_ALPHANUMERIC = string.ascii_letters + string.digits


def call_id(mistral: bool = False) -> str:
    """A call's id: vLLM's `chatcmpl-tool-<hex>`, or (mistral) 9 letters and digits, as vLLM's
    MistralToolCall: Mistral's chat templates refuse any other id in the calls sent back."""
    if mistral:
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_call(name: str, arguments: str, mistral: bool = False) -> dict:
    """One call as OpenAI returns it."""
    return {"id": call_id(mistral), "type": "function", "function": {"name": name, "arguments": arguments}}


_call = tool_call


def _arguments(value) -> str:
    """A call's arguments as a JSON string: a string that is itself a serialized JSON object is
    those arguments (vLLM's hermes decodes it once); any other value is serialized, a bare
    string "hello" to '"hello"', as vLLM's."""
    if isinstance(value, str):
        try:
            if isinstance(json.loads(value), dict):
                return value
        except (ValueError, RecursionError):
            pass
    return json.dumps(value, ensure_ascii=False)


def json_arguments(text: str) -> str:
    """Arguments written as JSON, re-serialized (vLLM's harmony calls: `json.dumps(json.loads(...))`);
    any other text as it stands."""
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except Exception:  # noqa: BLE001 - not JSON (or nested past the recursion limit): as written
        return text


def _required_calls(text: str, mistral: bool = False) -> list[dict] | None:
    """The calls of a complete `required` array, or None when the text is not one (cut short)."""
    try:
        items = json.loads(text)
        if not isinstance(items, list) or not all(isinstance(x, dict) and isinstance(x.get("name"), str)
                                                  for x in items):
            return None
        return [_call(x["name"], _arguments(x.get("parameters", {})), mistral) for x in items]
    except Exception:  # noqa: BLE001 - not JSON, or a RecursionError on deep nesting: no calls
        return None


# ---- hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call> ----
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def _hermes_call(body: str) -> dict | None:
    try:
        obj = json.loads(body)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        return _call(obj["name"], _arguments(obj.get("arguments", obj.get("parameters", {}))))
    except Exception:  # noqa: BLE001 - not JSON, or a RecursionError on deep nesting: no call
        return None


_RUN = re.compile(r'[^"\\\x00-\x1f]+')                 # string characters json.dumps writes as they are
_SCALAR = re.compile(r"[-+.0-9A-Za-z]+")               # a number, true / false / null, NaN / Infinity
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")
_ESCAPED = {'"': '\\"', "\\": "\\\\", "/": "/", "b": "\\b", "f": "\\f", "n": "\\n", "r": "\\r", "t": "\\t"}
_CLOSERS = {"}": "{", "]": "["}


class _CallReader:
    """A hermes block's JSON object read as it arrives. For each top-level key it keeps the part
    of `json.dumps(value, ensure_ascii=False)` that later text can no longer change: brackets and
    separators as they come, keys once complete, string contents as they come with escapes written
    as json.dumps writes them (`\\u00e9` is `é`, `\\/` is `/`), numbers and literals once a
    delimiter ends them (1 may be 10). broken: the text can no longer be one JSON object."""

    def __init__(self):
        self.stack: list[str] = []       # the open "{" / "[", the call object's first
        self.expect = "start"            # start | key_or_end | key | colon | value | value_or_end | comma_or_end | end
        self.string = ""                 # "" | "key" | "value": inside a string of that kind
        self.key_text = ""               # the key being read, as json.dumps writes it
        self.scalar: str | None = None   # the number or literal being read
        self.rest = ""                   # an escape cut short: read with the next text
        self.key: str | None = None      # the top-level key whose value is being read
        self.inside = False              # reading that value
        self.values: dict[str, str] = {}  # top-level key -> its value as written so far
        self.done: set[str] = set()      # top-level keys whose value is complete
        self.broken = False

    def feed(self, text: str) -> None:
        s, i = self.rest + text, 0
        self.rest = ""
        while i < len(s) and not self.broken:
            if self.string:
                i = self._string(s, i)
            elif self.scalar is not None:
                i = self._scalar(s, i)
            else:
                i = self._token(s, i)
            if i < 0:                    # wait for more text
                self.rest = s[-i - 1:]
                return

    def _put(self, piece: str) -> None:
        if self.string == "key":
            self.key_text += piece
        elif self.inside:
            self.values[self.key] += piece

    def _token(self, s: str, i: int) -> int:
        c, want = s[i], self.expect
        if c in " \t\n\r":
            return i + 1
        if want == "start" and c == "{":
            self.stack.append("{")
            self.expect = "key_or_end"
        elif want in ("key_or_end", "key") and c == '"':
            self.string, self.key_text = "key", ""
        elif want == "colon" and c == ":":
            self._put(": ")
            self.expect = "value"
        elif want == "comma_or_end" and c == ",":
            self._put(", ")
            self.expect = "key" if self.stack[-1] == "{" else "value"
        elif c in _CLOSERS and want in ("comma_or_end", "key_or_end" if c == "}" else "value_or_end") \
                and self.stack[-1] == _CLOSERS[c]:
            self._put(c)
            self.stack.pop()
            self._value_done()
        elif want in ("value", "value_or_end") and (c in '{["-' or c.isalnum()):
            if len(self.stack) == 1:     # a top-level value begins (a key given twice: its last value, as json.loads)
                self.inside, self.values[self.key] = True, ""
                self.done.discard(self.key)
            if c in "{[":
                self._put(c)
                self.stack.append(c)
                self.expect = "key_or_end" if c == "{" else "value_or_end"
            elif c == '"':
                self._put(c)
                self.string = "value"
            else:
                self.scalar = ""
                return i
        else:
            self.broken = True
        return i + 1

    def _value_done(self) -> None:
        if len(self.stack) == 1 and self.inside:
            self.inside = False
            self.done.add(self.key)
        self.expect = "comma_or_end" if self.stack else "end"

    def _scalar(self, s: str, i: int) -> int:
        m = _SCALAR.match(s, i)
        if m:
            self.scalar += m.group()
            if m.end() == len(s):        # the number may go on
                return m.end()
            i = m.end()
        try:
            value = json.loads(self.scalar)
        except ValueError:
            self.broken = True
            return i
        self._put(json.dumps(value))
        self.scalar = None
        self._value_done()
        return i

    def _string(self, s: str, i: int) -> int:
        """Reads from s[i] on in a string; -(i + 1): wait for more text from s[i]."""
        if m := _RUN.match(s, i):
            self._put(m.group())
            return m.end()
        c = s[i]
        if c == '"':
            kind, self.string = self.string, ""
            if kind == "key":
                if len(self.stack) == 1:
                    self.key = json.loads(f'"{self.key_text}"')
                else:
                    self._put(f'"{self.key_text}"')
                self.expect = "colon"
            else:
                self._put(c)
                self._value_done()
            return i + 1
        if c != "\\":                    # a raw control character: json.loads refuses it
            self.broken = True
            return i
        esc = s[i + 1:i + 2]
        if esc != "u":
            if not esc:
                return -(i + 1)
            if esc not in _ESCAPED:
                self.broken = True
                return i
            self._put(_ESCAPED[esc])
            return i + 2
        if not _HEX4.fullmatch(s[i + 2:i + 6]):
            if len(s) - i < 6 and all(h in string.hexdigits for h in s[i + 2:]):
                return -(i + 1)
            self.broken = True
            return i
        code, end = int(s[i + 2:i + 6], 16), i + 6
        if 0xD800 <= code <= 0xDBFF:     # a high surrogate joins a low one that follows (json.loads)
            after = s[end:end + 6]
            if "\\u".startswith(after[:2]) and len(after) < 6:
                return -(i + 1)
            if after.startswith("\\u"):
                if not _HEX4.fullmatch(after[2:]):
                    self.broken = True
                    return i
                low = int(after[2:], 16)
                if 0xDC00 <= low <= 0xDFFF:
                    code, end = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00), end + 6
        self._put(json.dumps(chr(code), ensure_ascii=False)[1:-1])
        return end


def _hermes_split(text: str) -> tuple[str, list[dict]]:
    """(text outside the call blocks, the calls). A block that does not parse stays text; a last
    block left open (the reply ended inside it) is a call if what follows the tag parses."""
    content, calls, at = [], [], 0
    while True:
        start = text.find(_OPEN, at)
        if start < 0:
            content.append(text[at:])
            break
        content.append(text[at:start])
        end = text.find(_CLOSE, start)
        body = text[start + len(_OPEN):end if end >= 0 else len(text)]
        call = _hermes_call(body)
        if call is None:
            content.append(text[start:end + len(_CLOSE)] if end >= 0 else text[start:])
        else:
            calls.append(call)
        if end < 0:
            break
        at = end + len(_CLOSE)
    return "".join(content), calls


# ---- llama3_json: JSON calls anywhere in the reply; pythonic: the whole reply ----
_PYTHON_TAG, _TOOL_CALLS = "<|python_tag|>", "[TOOL_CALLS]"


def _llama3_json_calls(text: str) -> list[dict] | None:
    """The `{"name": ..., "parameters": {...}}` (or "arguments") objects in the reply, as vLLM's
    Llama3JsonToolParser finds them: each `{` outside an object already read is tried, and one
    that does not begin such an object is text (prose around the calls, `;` between them, a
    <|python_tag|> before them); None when there is no call."""
    calls, at, dec = [], 0, json.JSONDecoder()
    while (at := text.find("{", at)) >= 0:
        try:
            obj, end = dec.raw_decode(text, at)
        except Exception:  # noqa: BLE001 - not JSON, or a RecursionError on deep nesting: text
            at += 1
            continue
        at = end
        if (call := _json_call(obj)) is not None:
            calls.append(call)
    return calls or None


def _json_call(obj) -> dict | None:
    """obj as a llama3_json call: a name, and arguments that are a JSON object."""
    args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(args, dict)):
        return None
    try:
        return _call(obj["name"], _arguments(args))
    except RecursionError:                   # nesting past the limit: no call
        return None


_JSON_WORDS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")   # "" starts each: text ran out
_NUMBER_TAIL = re.compile(r"\.|[eE][-+]?")                 # 1. / 1e / 1e- : the number goes on
# text that ends in a \uXXXX escape (a surrogate pair's second half too): json reports it as an
# "Invalid \uXXXX escape" at its `u`, even with its 4 digits when nothing follows them
_ESCAPE_TAIL = re.compile(r"\\?u[0-9a-fA-F]{0,4}")


def _json_call_at(text: str) -> bool | int | None:
    """For a stream's text from a `{`: True when it begins a call object (_llama3_json_calls'
    kind), None while it may still (JSON cut short: the error is at its end, inside an
    unterminated string or a \\u escape, or at a literal or number not yet complete), else where
    to go on reading text (past the object that is no call, or past this `{`)."""
    try:
        obj, end = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError as e:
        rest = text[e.pos:]
        cut = (e.msg.startswith("Unterminated string") or any(w.startswith(rest) for w in _JSON_WORDS)
               or _NUMBER_TAIL.fullmatch(rest) is not None
               or (e.msg.startswith("Invalid \\uXXXX") and _ESCAPE_TAIL.fullmatch(rest) is not None))
        return None if cut else 1
    except Exception:  # noqa: BLE001 - a RecursionError on deep nesting: text, as _llama3_json_calls
        return 1
    return True if _json_call(obj) is not None else end


def _pythonic_calls(text: str) -> list[dict] | None:
    """`[f(a=1, b="x"), g()]`: a Python list of calls with literal keyword arguments; a call whose
    arguments are not JSON is left out and its siblings kept (vLLM's), None when none is left."""
    import ast

    s = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
    try:
        tree = ast.parse(s, mode="eval").body
    except Exception:  # noqa: BLE001 - SyntaxError; RecursionError / MemoryError on deep nesting
        return None
    if not isinstance(tree, ast.List) or not all(isinstance(node, ast.Call) for node in tree.elts):
        return None
    calls = [c for c in map(_pythonic_call, tree.elts) if c is not None]
    return calls or None


def _pythonic_call(node) -> dict | None:
    import ast

    if node.args or not isinstance(node.func, (ast.Name, ast.Attribute)):
        return None
    try:
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        # a set, bytes or complex is no JSON, nor is 1e999 (inf): Infinity is no JSON to a client
        arguments = json.dumps(args, ensure_ascii=False, allow_nan=False)
    except Exception:  # noqa: BLE001 - not literals, not JSON, or nested past the recursion limit
        return None
    if len(args) != len(node.keywords):        # **kwargs
        return None
    return _call(ast.unparse(node.func), arguments)


def _mistral_split(text: str) -> tuple[str, list[dict]]:
    """(the text before the first [TOOL_CALLS], the calls after it), as vLLM's MistralToolParser
    reads them; (text, []) when there is no marker or what follows one is not calls."""
    at = text.find(_TOOL_CALLS)
    if at < 0:
        return text, []
    calls = []
    for segment in text[at + len(_TOOL_CALLS):].split(_TOOL_CALLS):
        found = _mistral_segment(segment.strip())
        if found is None:
            return text, []
        calls += found
    return text[:at], calls


def _mistral_segment(s: str) -> list[dict] | None:
    """What follows one marker: v0.3's JSON array (or one object) of `{"name", "arguments"}`, or the
    v11 tokenizers' `name{args}` (`name[ARGS]{args}` in a Hugging Face decoding). Text after the
    JSON is ignored, as vLLM's raw_decode ignores it."""
    dec = json.JSONDecoder()
    try:
        if s.startswith(("[", "{")):
            items = dec.raw_decode(s)[0]
            items = [items] if isinstance(items, dict) else items
            if not isinstance(items, list) or not items or not all(
                    isinstance(x, dict) and isinstance(x.get("name"), str) for x in items):
                return None
            return [_call(x["name"], _arguments(x.get("arguments", x.get("parameters", {}))), True) for x in items]
        brace = s.find("{")
        name = s[:brace].replace("[ARGS]", "").strip()
        if brace < 0 or not _MISTRAL_NAME.match(name):
            return None
        args = dec.raw_decode(s, brace)[0]
        return [_call(name, _arguments(args), True)] if isinstance(args, dict) else None
    except Exception:  # noqa: BLE001 - not JSON, or a RecursionError on deep nesting: no calls
        return None


_PYTHONIC_STARTS = ("[", "<|python_start|>")
# parser -> where its calls may begin (a stream sends the text before, holds the rest to the end)
_MARKS = {"mistral": (_TOOL_CALLS,), "llama3_json": ("{", _PYTHON_TAG)}


def _may_be_call(text: str) -> bool:
    """Whether a pythonic reply beginning with `text` may still turn out to be calls."""
    s = text.lstrip()
    return any(s.startswith(m) or m.startswith(s) for m in _PYTHONIC_STARTS)


def _split(parser: str, text: str) -> tuple[str, list[dict]]:
    """(text outside the calls, the calls) of a finished reply."""
    if parser == "hermes":
        return _hermes_split(text)
    if parser == "mistral":
        return _mistral_split(text)
    if parser == "openai":            # harmony calls: taken out by the reasoning parser (responses.ChatFormat)
        return text, []
    if parser == "llama3_json":
        calls = _llama3_json_calls(text)
    else:
        calls = _pythonic_calls(text) if _may_be_call(text) and text.strip() else None
    return ("", calls) if calls else (text, [])


def extract(plan: ToolPlan, text: str, finish_reason: str | None) -> tuple[str | None, list[dict], str | None]:
    """A finished reply -> (message content, tool calls, finish_reason)."""
    if plan.mode == "named":
        return None, [_call(plan.name, text, plan.mistral_ids)], finish_reason
    if plan.mode == "required":
        calls = _required_calls(text, plan.mistral_ids)
        if calls is None:      # cut short (length): no calls, and not the broken array as content (vLLM's)
            return None, [], finish_reason
        return None, calls, "tool_calls" if finish_reason == "stop" else finish_reason
    if plan.mode == "auto":
        content, calls = _split(plan.parser, text)
        calls = calls if plan.parallel else calls[:1]        # parallel_tool_calls false: the first (vLLM's)
        content = content if content.strip() else None
        return content, calls, "tool_calls" if calls and finish_reason == "stop" else finish_reason
    return text, [], finish_reason


@dataclass
class ToolStream:
    """One streamed choice: feed() each step's text, finish() at the end; both return
    (content delta, tool-call deltas)."""
    plan: ToolPlan
    buf: str = ""
    calls: int = 0
    in_call: bool = False
    shown: bool = False            # non-whitespace content sent: whitespace is sent as it comes
    held_ws: str = ""              # whitespace-only content not sent yet
    holding: bool = True           # whole-reply parsers: the reply so far may be calls
    block: str = ""                # hermes: the open block's text read so far (buf: what may be </tool_call>)
    reader: _CallReader | None = None
    sent: str | None = None        # hermes: the open block's arguments sent; None: its name not sent yet
    index: int = 0                 # hermes: the open block's call index, once its name is sent
    _named_id: str = ""

    def __post_init__(self):
        self._named_id = call_id(self.plan.mistral_ids)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self.plan.mode == "named":
            if not text:
                return "", []
            return "", [self._named_delta(text)]
        if self.plan.mode == "required":
            self.buf += text
            return "", []
        if self.plan.mode != "auto" or self.plan.parser == "openai":      # openai: harmony calls, found elsewhere
            return text, []
        if self.plan.parser in _MARKS:
            return self._feed_marked(text), []
        if self.plan.parser != "hermes":
            return self._feed_whole(text), []
        self.buf += text
        out, deltas = [], []
        while True:
            if not self.in_call:
                start = self.buf.find(_OPEN)
                if start < 0:
                    keep = held_back(self.buf, _OPEN)
                    out.append(self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                out.append(self.buf[:start])
                self.buf, self.in_call = self.buf[start + len(_OPEN):], True
                self.reader = _CallReader()
            end = self.buf.find(_CLOSE)
            if end < 0:
                keep = held_back(self.buf, _CLOSE)
                deltas += self._read_block(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            body, self.buf, self.in_call = self.block + self.buf[:end], self.buf[end + len(_CLOSE):], False
            closed = self._close_block(body)
            if closed is None:
                out.append(_OPEN + body + _CLOSE)
            deltas += closed or []
        return self._content("".join(out)), deltas

    def finish(self, finish_reason: str | None) -> tuple[str, list[dict], str | None]:
        """What is still held, and the choice's finish_reason."""
        if self.plan.mode == "named":
            deltas = [] if self.calls else [self._named_delta("")]
            return "", deltas, finish_reason
        if self.plan.mode == "required":
            calls = _required_calls(self.buf, self.plan.mistral_ids)
            if calls is None:                  # cut short: nothing, as extract() returns
                return "", [], finish_reason
            return "", [self._delta(c) for c in calls], "tool_calls" if finish_reason == "stop" else finish_reason
        if self.plan.mode != "auto" or self.plan.parser == "openai":
            return "", [], finish_reason
        if self.plan.parser == "pythonic":
            if not self.holding:
                return "", [], finish_reason
            content, calls = _split(self.plan.parser, self.buf)
            self.buf, self.holding = "", False
            deltas = [d for d in map(self._delta, calls) if d is not None]
            return self._content(content), deltas, "tool_calls" if calls and finish_reason == "stop" else finish_reason
        rest, deltas = self.buf, []
        if self.in_call and self.plan.parser in _MARKS:       # rest: the first mark and all that followed
            rest, calls = _split(self.plan.parser, rest)
            deltas = [d for d in map(self._delta, calls) if d is not None]
        elif self.in_call:
            rest = self.block + rest
            closed = self._close_block(rest)
            rest, deltas = (_OPEN + rest, []) if closed is None else ("", closed)
        self.buf = ""
        text = self._content(rest) + (self.held_ws if self.shown else "")
        reason = "tool_calls" if self.calls and finish_reason == "stop" else finish_reason
        return text, deltas, reason

    def _feed_marked(self, text: str) -> str:
        """mistral, llama3_json: the text before the first place a call may begin ([TOOL_CALLS];
        <|python_tag|> or a `{` that opens a call object) streams, a possible marker's start held
        back; from there the reply is held to the end (finish() reads its calls, or sends it as
        text). A `{` is held only while it may still open a call, as _llama3_json_calls reads
        them: JSON not yet complete, then an object with a name and arguments; code and other
        JSON stream on as text once they show they are not one."""
        self.buf += text
        if self.in_call:
            return ""
        out, marks = [], _MARKS[self.plan.parser]
        while True:
            at = min((i for i in map(self.buf.find, marks) if i >= 0), default=-1)
            if at < 0:
                keep = max(held_back(self.buf, m) for m in marks)
                out.append(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            out.append(self.buf[:at])
            self.buf = self.buf[at:]
            if self.plan.parser != "llama3_json" or self.buf.startswith(_PYTHON_TAG):
                self.in_call = True
                break
            verdict = _json_call_at(self.buf)
            if verdict is None:               # may still open a call: held until more text decides
                break
            if verdict is True:
                self.in_call = True
                break
            out.append(self.buf[:verdict])   # not a call: text up to where the next `{` may be tried
            self.buf = self.buf[verdict:]
        return self._content("".join(out))

    def pending(self) -> tuple[str, ...]:
        """The text fed and not yet sent, as it was fed, in parts (what a failed parser gives back
        as content; joined only then)."""
        if self.plan.mode in ("named", "required") or self.plan.parser == "openai":
            return (self.buf,)
        opened = _OPEN if self.in_call and self.plan.parser == "hermes" else ""
        return self.held_ws, opened, self.block, self.buf

    def _read_block(self, text: str) -> list[dict]:
        """hermes: an open block's new text (no part of </tool_call>). Once its name is known the
        call is sent with the arguments read so far, then what its arguments gain (_CallReader:
        only what later text cannot change, so the pieces join to the arguments extract() returns)."""
        self.block += text
        r = self.reader
        r.feed(text)
        if r.broken:
            return []
        deltas = []
        if self.sent is None:
            name = json.loads(r.values["name"]) if "name" in r.done else None
            if not isinstance(name, str) or (self.calls and not self.plan.parallel):
                return []
            self.index, self.sent = self.calls, ""
            self.calls += 1
            deltas.append({"index": self.index, "id": call_id(), "type": "function",
                           "function": {"name": name, "arguments": ""}})
        key = "arguments" if "arguments" in r.values else "parameters"
        args = r.values.get(key, "")
        if args[:1] in ("{", "[") and len(args) > len(self.sent) and args.startswith(self.sent):
            piece, self.sent = args[len(self.sent):], args
            if deltas:
                deltas[0]["function"]["arguments"] = piece
            else:
                deltas.append({"index": self.index, "function": {"arguments": piece}})
        # arguments held (a string, a number) are sent at the close; changed ones (a key given twice,
        # "arguments" after "parameters") are the docstring's limit
        return deltas

    def _close_block(self, body: str) -> list[dict] | None:
        """hermes: a block's end (its closing tag, or the reply's). None: the block is text; else
        the call's deltas: the whole call, or what its arguments lack of what extract() returns."""
        call, sent = _hermes_call(body), self.sent
        self.block, self.reader, self.sent = "", None, None
        if sent is None:
            if call is None:
                return None
            d = self._delta(call)
            return [] if d is None else [d]
        args = call["function"]["arguments"] if call is not None else sent
        if args == sent or not args.startswith(sent):    # see the docstring: a name sent is a call
            return []
        return [{"index": self.index, "function": {"arguments": args[len(sent):]}}]

    def _feed_whole(self, text: str) -> str:
        """Whole-reply parsers: hold the reply while it may be calls; once it cannot, send it as text."""
        if not self.holding:
            return self._content(text)
        self.buf += text
        if _may_be_call(self.buf):
            return ""
        text, self.buf, self.holding = self.buf, "", False
        return self._content(text)

    def _content(self, text: str) -> str:
        if not text:
            return ""
        if not text.strip():
            if self.shown:
                return text
            self.held_ws += text
            return ""
        text, self.held_ws, self.shown = self.held_ws + text, "", True
        return text

    def _delta(self, call: dict) -> dict | None:
        if self.calls and self.plan.mode == "auto" and not self.plan.parallel:
            return None                        # parallel_tool_calls false: the first call only
        d = {"index": self.calls, **call}
        self.calls += 1
        return d

    def _named_delta(self, text: str) -> dict:
        if self.calls:
            return {"index": 0, "function": {"arguments": text}}
        self.calls = 1
        return {"index": 0, "id": self._named_id, "type": "function",
                "function": {"name": self.plan.name, "arguments": text}}
