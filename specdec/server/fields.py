"""The request fields beyond plain sampling: structured outputs (OpenAI's response_format,
vLLM's structured_outputs and guided_*), penalties and bias, chat roles (tools: tools.py).

Each check raises APIError(400) naming the field the client sent, so that a bad schema in
`guided_json` is reported as `guided_json`, not as an internal name.
"""

from __future__ import annotations

import math

from ..config import CONSTRAINT_KINDS, StructuredOutputsParams
from ..tokenizer import TEXT_PARTS
from .errors import APIError, clipped
from .protocol import ChatCompletionRequest, _Sampling

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs(req: _Sampling) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the request's constraint, the field that carried it); at most one field may carry one."""
    found: list[tuple[str, dict]] = []
    rf = req.response_format
    if rf is not None:
        kind = rf.get("type", "text") if isinstance(rf, dict) else None
        if kind == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            schema = js.get("schema", js.get("json_schema")) if isinstance(js, dict) else None
            if not isinstance(schema, (dict, str)):
                raise APIError(400, "response_format.json_schema.schema is required (a JSON schema object)",
                               "response_format")
            # json_schema.strict is taken either way: objects are closed as under OpenAI's strict
            # (structured.closed_objects, as vLLM's default backend compiles schemas)
            found.append(("response_format", {"json": schema}))
        elif kind == "structural_tag":
            found.append(("response_format", {"structural_tag": {k: v for k, v in rf.items() if k != "type"}}))
        elif kind != "text":
            raise APIError(400, "response_format.type must be 'text', 'json_object', 'json_schema' or "
                                f"'structural_tag', got {kind!r}", "response_format")
    for name, key in GUIDED.items():
        if getattr(req, name) is not None:
            found.append((name, {key: getattr(req, name)}))
    if req.structured_outputs is not None:
        given = {k: v for k, v in req.structured_outputs.items()
                 if v is not None and not (v is False and k in CONSTRAINT_KINDS)}
        found.append(("structured_outputs", given))
    if not found:
        return None, None
    if len(found) > 1:
        raise APIError(400, f"give one structured-output field, got {', '.join(f for f, _ in found)}", found[1][0])
    name, fields = found[0]
    if req.guided_whitespace_pattern is not None:
        fields = {**fields, "whitespace_pattern": req.guided_whitespace_pattern}
    try:
        return StructuredOutputsParams(**fields), name
    except TypeError:              # a key StructuredOutputsParams does not have
        raise APIError(400, f"{name} takes one of {', '.join(CONSTRAINT_KINDS)} (and the JSON options "
                            f"disable_any_whitespace, whitespace_pattern, disable_additional_properties, "
                            f"disable_fallback); got {', '.join(sorted(fields))}", name) from None
    except ValueError as e:
        raise APIError(400, f"{name}: {e}", name) from None


def check_grammar(engine, spec: StructuredOutputsParams | None, field: str | None) -> None:
    """Compile the constraint now: an invalid schema, regex or grammar is a 400 naming the field."""
    from ..structured import GrammarError

    if spec is None:
        return
    try:
        engine.grammars.check(spec)
    except GrammarError as e:
        raise APIError(400, f"{field} is invalid: {e.detail}", field) from None


def logit_bias(req: _Sampling, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's {"token id": bias} with string keys -> {int: float}, each bias clamped to [-100, 100]
    as vLLM's server does (a client's -1000 or -Infinity bans the token; NaN is refused by
    SamplingParams)."""
    if req.logit_bias is None:
        return None
    out = {}
    for key, bias in req.logit_bias.items():
        digits = key.strip()
        try:        # "²".isdigit() too; int() refuses more than sys.get_int_max_str_digits() digits (vLLM: 400)
            token = int(digits) if digits.isascii() and digits.isdigit() else None
        except ValueError:
            token = None
        if token is None:
            raise APIError(400, f"logit_bias keys must be token ids, got {clipped(key)!r}", "logit_bias")
        if token >= vocab_size:
            raise APIError(400, f"logit_bias token id {clipped(digits)} is outside the vocabulary [0, {vocab_size})",
                           "logit_bias")
        out[token] = min(100.0, max(-100.0, bias)) if isinstance(bias, (int, float)) and not math.isnan(bias) else bias
    return out


def check_chat(req: ChatCompletionRequest) -> None:
    """Roles OpenAI knows; a text part has its text (OpenAI's and vLLM's parts require it)."""
    for i, m in enumerate(req.messages):
        if m.role not in ROLES:
            raise APIError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m.role!r}",
                           f"messages[{i}].role")
        for j, part in enumerate(m.content if isinstance(m.content, list) else []):
            key = None if isinstance(part, str) else TEXT_PARTS.get(part.type)     # a plain string part is text
            if key is not None and getattr(part, key) is None:
                raise APIError(400, f"messages[{i}].content[{j}].{key} is required (a {part.type} part's text)",
                               f"messages[{i}].content[{j}].{key}")
