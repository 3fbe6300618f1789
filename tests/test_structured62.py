"""A JSON schema's $ref targets outside schema positions (OpenAPI's `#/components/schemas/Pet`) are
read as llguidance resolves them: the same model compiles, closes and refuses alike wherever its $ref
points (under components, `unevaluatedProperties: false` and `$dynamicAnchor` had been refused, patterns
kept Unicode classes and recursion with no way out was missed); a format on a type list (OpenAPI 3.1's
`["string", "null"]`) is an annotation unless llguidance knows it, as vLLM reads it (it had been refused)."""

from __future__ import annotations

import logging

import pytest

from specdec import LLM
from specdec.config import StructuredOutputsParams
from specdec.defaults import BUNDLED_TARGET
from specdec.structured import GrammarError

from test_structured import _accepts


@pytest.fixture(scope="module")
def llm():
    return LLM(model=BUNDLED_TARGET, num_speculative_tokens=0)


def placed(model: dict, where: str) -> dict:
    """A schema whose root refers to model stored at where: $defs, components/schemas, a list item."""
    if where == "$defs":
        return {"$ref": "#/$defs/Pet", "$defs": {"Pet": model}}
    if where == "components":
        return {"$ref": "#/components/schemas/Pet", "components": {"schemas": {"Pet": model}}}
    return {"$ref": "#/x-models/1", "x-models": [{"const": 0}, model]}


PLACES = ["$defs", "components", "list"]
NAME = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


@pytest.mark.parametrize("where", PLACES)
@pytest.mark.parametrize("model, good, bad", [
    ({**NAME, "unevaluatedProperties": False}, '{"name":"a"}', '{"name":"a","b":1}'),
    ({**NAME, "$dynamicAnchor": "pet"}, '{"name":"a"}', '{"name":"a","b":1}'),       # closed (strict) as well
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": False}, "[1,1]", '["a"]'),
    ({"type": "object", "propertyNames": {"type": "string"}, "additionalProperties": {"type": "integer"}},
     '{"a":1}', '{"a":"b"}'),
    ({"type": "string", "pattern": "^\\s$"}, '" "', '"\u2003"'),          # xgrammar's \s: no em space
], ids=["unevaluatedProperties", "$dynamicAnchor", "uniqueItems false", "propertyNames string", "pattern"])
def test_a_model_reads_the_same_wherever_its_ref_points(llm, where, model, good, bad):
    spec = StructuredOutputsParams(json=placed(model, where))
    assert _accepts(llm, spec, good) and not _accepts(llm, spec, bad)


def test_targets_of_targets_are_followed(llm):
    """Pet refers to Tag, both under components: Tag is normalised too."""
    schema = {"$ref": "#/components/schemas/Pet", "components": {"schemas": {
        "Pet": {"type": "object", "properties": {"tag": {"$ref": "#/components/schemas/Tag"}}, "required": ["tag"]},
        "Tag": {**NAME, "unevaluatedProperties": False, "$dynamicAnchor": "tag"}}}}
    spec = StructuredOutputsParams(json=schema)
    assert _accepts(llm, spec, '{"tag":{"name":"a"}}') and not _accepts(llm, spec, '{"tag":{"name":"a","b":1}}')


def _refusal(llm, schema) -> str:
    with pytest.raises(GrammarError) as e:
        llm.engine.grammars.check(StructuredOutputsParams(json=schema))
    return str(e.value)


ARRAY = {"type": "array", "items": {"type": "integer"}}


@pytest.mark.parametrize("model, said", [
    ({**ARRAY, "uniqueItems": True}, "uniqueItems is not supported"),
    ({**ARRAY, "contains": {"const": 7}}, "contains is not supported"),
    ({"type": "object", "propertyNames": {"pattern": "^a$"}}, "propertyNames is not supported"),
    ({**ARRAY, "items": {"$dynamicRef": "#pet"}}, "$dynamicRef is not supported"),
    ({"type": "string", "format": "byte"}, 'format "byte" (at #/components/schemas/Pet) is not supported'),
], ids=["uniqueItems", "contains", "propertyNames", "$dynamicRef", "format"])
def test_what_cannot_be_enforced_is_still_refused_under_components(llm, model, said):
    assert said in _refusal(llm, placed(model, "components"))


def test_recursion_with_no_way_out_under_components_is_refused(llm):
    """A needs B needs A, both under components: refused up front, as under $defs."""
    schema = {"$ref": "#/components/schemas/A", "components": {"schemas": {
        "A": {"type": "object", "properties": {"b": {"$ref": "#/components/schemas/B"}}, "required": ["b"]},
        "B": {"type": "array", "items": {"$ref": "#/components/schemas/A"}, "minItems": 1}}}}
    assert "no JSON value matches the schema" in _refusal(llm, schema)


def test_a_format_on_a_type_list_is_an_annotation_unless_llguidance_knows_it(llm, caplog):
    """OpenAPI 3.1's nullable strings: vLLM tests a format where type is exactly "string"."""
    nullable = StructuredOutputsParams(json={"type": "object", "properties": {
        "avatar": {"type": ["string", "null"], "format": "byte"}}, "required": ["avatar"]})
    with caplog.at_level(logging.WARNING, logger="specdec.structured"):
        assert _accepts(llm, nullable, '{"avatar":"%%"}') and _accepts(llm, nullable, '{"avatar":null}')
    assert any("Unknown format: byte" in r.getMessage() and "ignored" in r.getMessage() for r in caplog.records)
    either = StructuredOutputsParams(json={"type": ["integer", "string"], "format": "int64"})
    assert _accepts(llm, either, "12") and _accepts(llm, either, '"12"')
    email = StructuredOutputsParams(json={"type": ["string", "null"], "format": "email"})      # enforced
    assert _accepts(llm, email, '"a@b.co"') and _accepts(llm, email, "null") and not _accepts(llm, email, '"a"')
