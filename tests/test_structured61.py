"""JSON-schema keywords the grammar cannot enforce are refused, naming the keyword and where it is
(they had been left out with a log line, and outputs that broke the schema came back as "stop"),
as vLLM refuses them; constraints that no finite text satisfies are refused up front (they had
run until llguidance's parser limit, then aborted with a message about lexemes)."""

from __future__ import annotations

import logging

import openai
import pytest

from specdec import LLM, SamplingParams
from specdec.config import StructuredOutputsParams
from specdec.defaults import BUNDLED_TARGET
from specdec.server import ServerConfig, build_app
from specdec.structured import GrammarError

from test_server import LiveServer
from test_structured import _accepts


@pytest.fixture(scope="module")
def llm():
    return LLM(model=BUNDLED_TARGET, num_speculative_tokens=0)


def _refusal(llm, schema) -> str:
    with pytest.raises(GrammarError) as e:
        llm.engine.grammars.check(StructuredOutputsParams(json=schema))
    return str(e.value)


ARRAY = {"type": "array", "items": {"type": "integer"}}
REFUSED = {
    "uniqueItems": ({**ARRAY, "uniqueItems": True}, "#"),
    "contains": ({"type": "object", "properties": {"a": {**ARRAY, "contains": {"const": 7}}}}, "#/properties/a"),
    "contains, minContains": ({"$defs": {"l": {**ARRAY, "contains": {"const": 7}, "minContains": 2}}, "$ref": "#/$defs/l"},
                    "#/$defs/l"),
    "contains, maxContains": ({"anyOf": [{"type": "null"}, {**ARRAY, "contains": {"const": 7}, "maxContains": 1}]}, "#/anyOf/1"),
    "propertyNames": ({"type": "array", "prefixItems": [{"type": "object", "propertyNames": {"pattern": "^[a-c]$"}}]},
                      "#/prefixItems/0"),
    "$dynamicRef": ({**ARRAY, "items": {"$dynamicRef": "#meta"}}, "#/items"),
    'format "idn-email"': ({"type": "object", "additionalProperties": {"type": "string", "format": "idn-email"}},
                           "#/additionalProperties"),
}


@pytest.mark.parametrize("keyword", list(REFUSED))
def test_unenforceable_keywords_are_refused_naming_where(llm, keyword):
    schema, where = REFUSED[keyword]
    message = _refusal(llm, schema)
    assert message.startswith(f"structured_outputs.json is invalid: {keyword} (at {where}) is not supported"), message


def test_the_reported_schema_is_refused_not_answered_with_duplicates(llm):
    schema = {"type": "array", "items": {"const": 1}, "minItems": 2, "maxItems": 2, "uniqueItems": True}
    with pytest.raises(ValueError, match="uniqueItems"):
        llm.generate(["x = "], SamplingParams(temperature=0, max_tokens=10,
                                              structured_outputs=StructuredOutputsParams(json=schema)))


def test_a_keyword_reached_only_through_a_ref_is_refused_too(llm):
    """A schema under a non-schema position (reached by $ref) is not walked here: llguidance's own
    reading of it says what it would leave out, and that is refused."""
    schema = {"$ref": "#/components/l", "components": {"l": {**ARRAY, "uniqueItems": True}}}
    assert "uniqueItems is not supported" in _refusal(llm, schema)


def test_names_and_values_are_not_keywords(llm):
    """A property named like a keyword, keywords inside const / enum / default values, keywords that
    constrain nothing, and keywords under an ignored `not`: all compiled as before."""
    spec = StructuredOutputsParams(json={
        "type": "object",
        "properties": {"contains": {"type": "integer"}, "uniqueItems": {"const": {"uniqueItems": True}},
                       "propertyNames": {"enum": [{"contains": 1}]},
                       "tags": {**ARRAY, "uniqueItems": False, "minContains": 2, "default": {"format": "nope"}},
                       "map": {"type": "object", "propertyNames": {"type": "string"}},
                       "n": {"type": "integer", "format": "int32", "not": {**ARRAY, "uniqueItems": True}}},
        "required": ["contains", "uniqueItems"]})
    assert _accepts(llm, spec, '{"contains":3,"uniqueItems":{"uniqueItems":true},"tags":[1,1],"n":2}')


def test_formats_of_untyped_nodes_and_unused_definitions_pass(llm):
    """A format checks strings only (xgrammar's reading, vLLM's default): an untyped node's
    (OpenAPI's {"format": "int64"}, a const with a format) is an annotation, as it was before the
    refusals; a definition no $ref reaches shapes no value, so what it holds is not refused."""
    spec = StructuredOutputsParams(json={
        "type": "object",
        "properties": {"n": {"format": "int64", "description": "an id"}, "v": {"const": "1.0", "format": "semver"},
                       "a": {"$ref": "#/$defs/Used"}},
        "$defs": {"Unused": {**ARRAY, "uniqueItems": True}, "Used": {"type": "string"}},
        "required": ["n", "a"]})
    assert _accepts(llm, spec, '{"n":5,"a":"x"}')
    used = {"type": "object", "properties": {"a": {"$ref": "#/$defs/Used"}}, "$defs": {"Used": {**ARRAY, "uniqueItems": True}}}
    assert "uniqueItems (at #/$defs/Used)" in _refusal(llm, used)


def test_ignored_keywords_stay_ignored_with_a_warning(llm, caplog):
    """What xgrammar (vLLM's default backend) leaves out is still left out, logged."""
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}},
                                         "required": ["a"], "not": {"required": ["b"]},
                                         "dependencies": {"a": ["b"]}})
    with caplog.at_level(logging.WARNING, logger="specdec.structured"):
        llm.engine.grammars.check(spec)
    assert any("ignored" in r.getMessage() for r in caplog.records)


def test_unevaluated_items_read_as_items(llm):
    """xgrammar's reading, as unevaluatedProperties is read as additionalProperties."""
    closed = StructuredOutputsParams(json={"type": "array", "prefixItems": [{"type": "integer"}],
                                           "unevaluatedItems": False})
    assert _accepts(llm, closed, "[1]") and not _accepts(llm, closed, "[1,2]")


# ---- no finite text ----

ENDLESS = {
    "required self": (StructuredOutputsParams(json={
        "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
        "$ref": "#/$defs/n"}), "no JSON value matches the schema"),
    "mutual": (StructuredOutputsParams(json={
        "$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                  "b": {"type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 1}},
        "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}),
        "no JSON value matches the schema"),
    "lark": (StructuredOutputsParams(grammar='start: "a" start\n'), "start can only recurse"),
    "lark rules": (StructuredOutputsParams(grammar='start: x{1,3}\nx: "(" (x | y) ")"\ny: "[" x "]"\n'),
                   "start, x, y can only recurse"),
    "captured": (StructuredOutputsParams(grammar='start: x\nx[capture]: "a" x\n'), "start, x can only recurse"),
    "gbnf": (StructuredOutputsParams(grammar='root ::= "a" root\n'), "root can only recurse"),
}


@pytest.mark.parametrize("name", list(ENDLESS))
def test_constraints_without_finite_text_are_refused(llm, name):
    spec, said = ENDLESS[name]
    with pytest.raises(GrammarError, match=said):
        llm.engine.grammars.check(spec)


@pytest.mark.parametrize("spec", [
    StructuredOutputsParams(json={"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}}},
                                  "$ref": "#/$defs/n"}),
    StructuredOutputsParams(json={"type": "object", "properties": {"c": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
                                  "required": ["c"]}),
    StructuredOutputsParams(json={"properties": {"c": {"$ref": "#"}}, "required": ["c"]}),     # any non-object
    StructuredOutputsParams(grammar='start: "a" start | "b"\n'),
    StructuredOutputsParams(grammar='start: x | "b"\nx: "a" x\n'),
    StructuredOutputsParams(grammar='start: x*\nx: "a" x\n'),
    StructuredOutputsParams(grammar='start: x{0,2} "b"\nx: "a" x\n'),
    StructuredOutputsParams(grammar='start: x\nx[capture]: "a" x | "b"\n'),
    StructuredOutputsParams(grammar='root ::= x\nx ::= "a" x | "b"\n'),
], ids=lambda s: s.kind)
def test_recursion_with_a_way_out_is_kept(llm, spec):
    llm.engine.grammars.check(spec)


def test_a_branch_with_no_end_aborts_saying_so(llm):
    """A grammar that can end but has a branch that cannot: admitted; a model that enters the
    branch stops with "abort" and a message that says the forced text may have no end."""
    spec = StructuredOutputsParams(grammar='start: x | "b"\nx: "a" x\n')
    grammar = llm.engine.grammars.grammar(spec)
    a = llm.get_tokenizer().encode("a", add_special_tokens=False)
    for _ in range(3):
        grammar.masks([[]])
        grammar.forced([], 4)
        grammar.advance(a)
    assert grammar.error.startswith("the text the constraint forces from here outgrew the parser: it may have no end")


def test_the_server_answers_400(llm):
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("toy",)))) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           extra_body={"guided_json": {**ARRAY, "uniqueItems": True}})
        assert "guided_json is invalid: uniqueItems (at #) is not supported" in e.value.message
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="toy", prompt="x", max_tokens=4,
                                      extra_body={"guided_grammar": 'root ::= "a" root\n'})
        assert "no finite text matches the grammar" in e.value.message
