"""Structured outputs, wave 64.

$refs are resolved as JSON Schema 2020-12 (and llguidance) resolve them by specdec's own checks too:
a `$ref` to an `$anchor`, to a subschema's `$id`, or a pointer inside a nested `$id` (which starts
at that resource) had been read as a pointer from the root or not at all, so a definition merged
in an allOf was closed (valid replies refused), a format the grammar cannot enforce went unrefused,
recursion with no way out was admitted (then aborted mid-reply), a `$ref` to a `$dynamicAnchor`
was refused, and a structural tag's schema never matched its definitions to their $refs.

A grammar failure mid-reply ends alike in plain decoding and under speculation, greedy or sampled:
the tokens up to the failure, one EOS, finish_reason "abort" (speculation had added the EOS where
plain decoding did not, and ngram drafting had ended such a request with a quiet "stop").

A reply can no longer start a JSON value it could never finish (a subschema that can only recurse
is `false`), and a const / enum value too long for llguidance's parser to force is refused when the
request is added (it had aborted the request after its first token).
"""

from __future__ import annotations

import json
import re
import socket
import threading

import jsonschema
import openai
import pytest

from specdec import LLM, SamplingParams
from specdec.config import StructuredOutputsParams
from specdec.defaults import BUNDLED_DRAFT, BUNDLED_TARGET
from specdec.server import ServerConfig, build_app
from specdec.structured import GrammarError

from test_server import LiveServer
from test_structured import _accepts


@pytest.fixture(scope="module")
def llm():
    return LLM(model=BUNDLED_TARGET, num_speculative_tokens=0)


def _valid(schema, text: str) -> bool:
    try:
        jsonschema.Draft202012Validator(schema).validate(json.loads(text))
    except jsonschema.ValidationError:
        return False
    return True


ROOT = "https://example.com/root.json"
PET = {"type": "object", "properties": {"a": {"type": "integer"}}}
B = {"type": "object", "properties": {"b": {"type": "integer"}}}
# one definition merged in an allOf, named four ways: a definition stays open where another schema is
# intersected with it (it had been closed, refusing b, unless named by its pointer)
MERGED = {
    "pointer": {"$defs": {"Pet": PET}, "allOf": [{"$ref": "#/$defs/Pet"}, B]},
    "anchor": {"$defs": {"Pet": {**PET, "$anchor": "pet"}}, "allOf": [{"$ref": "#pet"}, B]},
    "relative $id": {"$id": ROOT, "$defs": {"Pet": {**PET, "$id": "pet.json"}}, "allOf": [{"$ref": "pet.json"}, B]},
    "absolute $id": {"$defs": {"Pet": {**PET, "$id": "https://example.com/pet"}},
                     "allOf": [{"$ref": "https://example.com/pet"}, B]},
    "$dynamicAnchor": {"$defs": {"Pet": {**PET, "$dynamicAnchor": "pet"}}, "allOf": [{"$ref": "#pet"}, B]},
    # in the resource whose $id is p, "#/$defs/Pet" is p's own Pet, not the root's
    "pointer in a nested $id": {"$ref": "https://example.com/p", "$defs": {
        "Pet": {"type": "object", "properties": {"q": {"type": "integer"}}},
        "P": {"$id": "https://example.com/p", "$defs": {"Pet": PET}, "allOf": [{"$ref": "#/$defs/Pet"}, B]}}},
}


@pytest.mark.parametrize("name", list(MERGED))
def test_refs_read_as_json_schema_reads_them(llm, name):
    schema = MERGED[name]
    spec = StructuredOutputsParams(json=schema)
    for text in ('{"a":1,"b":2}', '{"a":1}', '{"b":2}', '{"a":"x","b":2}', '{"a":1,"b":"x"}'):
        assert _accepts(llm, spec, text) == _valid(schema, text), text


@pytest.mark.parametrize("schema, where", [
    ({"$ref": "#s", "$defs": {"s": {"type": "string", "format": "byte", "$anchor": "s"}}}, "#/$defs/s"),
    ({"$id": ROOT, "$ref": "s.json", "$defs": {"s": {"type": "string", "format": "byte", "$id": "s.json"}}},
     "#/$defs/s"),
    ({"$ref": "https://example.com/p", "$defs": {"P": {"$id": "https://example.com/p", "$ref": "#/$defs/s",
                                                       "$defs": {"s": {"type": "string", "format": "byte"}}}}},
     "#/$defs/P/$defs/s"),
], ids=["anchor", "$id", "pointer in a nested $id"])
def test_what_cannot_be_enforced_is_refused_however_it_is_named(llm, schema, where):
    """A definition reached only by an anchor or an $id had counted as unused: the format was ignored."""
    with pytest.raises(GrammarError, match=f'format "byte" \\(at {re.escape(where)}\\) is not supported'):
        llm.engine.grammars.check(StructuredOutputsParams(json=schema))


@pytest.mark.parametrize("schema", [
    {"$ref": "#n", "$defs": {"n": {"$anchor": "n", "type": "object", "properties": {"c": {"$ref": "#n"}},
                                   "required": ["c"]}}},
    {"$ref": "https://example.com/n", "$defs": {"n": {"$id": "https://example.com/n", "type": "object",
                                                      "properties": {"c": {"$ref": "#"}}, "required": ["c"]}}},
], ids=["anchor", "$id"])
def test_recursion_with_no_way_out_is_refused_however_it_is_named(llm, schema):
    """As with a pointer: these had been admitted, then aborted after the reply's first tokens."""
    with pytest.raises(GrammarError, match="no JSON value matches the schema"):
        llm.engine.grammars.check(StructuredOutputsParams(json=schema))


def test_a_structural_tags_schema_reads_its_own_refs(llm):
    """The schema's paths are named after its structure (`structures[0].schema#/$defs/s`): its $refs
    (`#/$defs/s`) had matched none of them, so its definitions counted as unused."""
    schema = {"type": "object", "properties": {"s": {"$ref": "#/$defs/s"}}, "required": ["s"],
              "$defs": {"s": {"type": "string", "format": "byte"}}}
    tag = {"structures": [{"begin": "<call=f>", "schema": schema, "end": "</call>"}], "triggers": ["<call="]}
    with pytest.raises(GrammarError, match=r'format "byte" \(at structures\[0\]\.schema#/\$defs/s\) is not supported'):
        llm.engine.grammars.check(StructuredOutputsParams(structural_tag=tag))


SPECULATIVE = {"draft model": {"model": str(BUNDLED_DRAFT), "num_speculative_tokens": 3},
               "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                         "prompt_lookup_max": 3}}
# a lexer limit met after the reply's first token (README: such a grammar ends with "abort")
LEXER_LIMIT = StructuredOutputsParams(regex="a{1000000}")


@pytest.mark.parametrize("method", list(SPECULATIVE))
def test_a_grammar_failure_ends_alike_with_speculation_greedy_or_sampled(llm, method):
    """Plain decoding had ended with the failing token; a sampled draft model's step added the EOS
    drawn after it, and ngram drafting met the failure computing the next mask, emitted that EOS
    and finished "stop" with text the regex does not allow."""
    eos = llm.engine.eos_ids
    speculative = LLM(model=BUNDLED_TARGET, speculative_config=SPECULATIVE[method])
    for temperature in (0, 1.0):
        params = SamplingParams(temperature=temperature, seed=3, max_tokens=8, structured_outputs=LEXER_LIMIT)
        outputs = [o.outputs[0] for engine in (llm, speculative)
                   for o in engine.generate(["a", "a a a a"], params, use_tqdm=False)]
        for out in outputs:
            assert out.finish_reason == "abort" and out.stop_reason.startswith("structured output failed: ")
            assert out.token_ids[-1] in eos and not any(t in eos for t in out.token_ids[:-1])
            assert out.text and set(out.text) == {"a"}
        if temperature == 0:
            assert len({tuple(out.token_ids) for out in outputs}) == 1


def test_a_reply_cannot_start_a_value_it_could_never_finish(llm):
    """An item, or an optional property, whose schema requires itself: the value list or object can
    only be empty. The grammar had let the reply start one (`[{"`), forced its text until the parser's
    limit, and aborted the request; speculation gives the same reply as plain decoding."""
    node = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}}}
    listed = StructuredOutputsParams(json={**node, "type": "array", "items": {"$ref": "#/$defs/n"}})
    optional = StructuredOutputsParams(json={**node, "type": "object", "properties": {
        "c": {"$ref": "#/$defs/n"}, "d": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["d"]})
    assert _accepts(llm, listed, "[]") and not _accepts(llm, listed, '[{"c":{"c":[]}}]')
    draft = LLM(model=BUNDLED_TARGET, speculative_config=SPECULATIVE["draft model"])
    for spec, want in ((listed, []), (optional, None)):
        params = SamplingParams(temperature=0, max_tokens=16, structured_outputs=spec)
        prompts = ['[{"c": {"c": {"c": ', '{"c": {"c": ']
        plain = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        for out in plain:
            assert out.finish_reason == "stop", out.stop_reason
            value = json.loads(out.text)
            assert value == want if want is not None else set(value) == {"d"}
        assert [o.outputs[0].token_ids for o in draft.generate(prompts, params, use_tqdm=False)] == \
            [out.token_ids for out in plain]


LONG = list(range(30000))        # 168891 characters, ~60000 JSON tokens


@pytest.mark.parametrize("schema, where", [
    ({"const": LONG}, "const (at #)"),
    ({"anyOf": [{"type": "null"}, {"const": LONG}]}, "const (at #/anyOf/1)"),
    ({"type": "object", "properties": {"k": {"enum": [1, LONG]}}}, "enum[1] (at #/properties/k)"),
], ids=["const", "anyOf const", "enum"])
def test_a_value_too_long_to_write_is_refused_when_the_request_is_added(llm, schema, where):
    """llguidance forces such a value into its parser in one step once it starts, past its item limit:
    the request had aborted after '[0'."""
    with pytest.raises(ValueError, match=f"{re.escape(where)} is too long to be written"):
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(json=schema)))


def test_a_long_value_that_fits_is_written(llm):
    """A shorter const, and the long one where whitespace may follow any token (vLLM's default): there
    the forced runs are short, and the reply is written until max_tokens."""
    for spec in (StructuredOutputsParams(json={"const": LONG[:3000]}),
                 StructuredOutputsParams(json={"const": LONG}, disable_any_whitespace=False)):
        out = llm.generate(["x"], SamplingParams(temperature=0, max_tokens=6, structured_outputs=spec))[0].outputs[0]
        assert out.finish_reason == "length" and out.text.startswith("[0,")


def test_the_server_answers_400_for_a_value_too_long_to_write(llm):
    live = LiveServer(build_app(llm, ServerConfig(served_model_names=("toy",))))
    live.sock.close()                              # on a port of this suite's range instead
    for port in range(19200, 19300):
        live.sock = socket.socket()
        try:
            live.sock.bind(("127.0.0.1", port))
            break
        except OSError:
            live.sock.close()
    live.url = f"http://127.0.0.1:{port}"
    live.thread = threading.Thread(target=live.server.run, kwargs={"sockets": [live.sock]}, daemon=True)
    with live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="toy", prompt="x", max_tokens=4,
                                      extra_body={"guided_json": {"anyOf": [{"type": "null"}, {"const": LONG}]}})
        assert "const (at #/anyOf/1) is too long to be written" in e.value.message
