"""Structured outputs beside a reasoning parser, as vLLM's (enable_in_reasoning off by default):
the think block is free and the grammar constrains what follows `</think>`, speculation losing
nothing; JSON-schema keywords and formats llguidance lacks are ignored with a warning (xgrammar's
reading); vLLM's newer structural_tag form."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.config import StructuredOutputsConfig, StructuredOutputsParams
from specdec.structured import GrammarError

from conftest import make_checkpoint, make_tokenizer, noisy_head_copy

REGEX = "[0-9]{3}"


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """(target, draft, </think> id, prompt ids): a tiny checkpoint whose tokenizer has <think> and
    </think> as tokens and whose greedy reply, after a few tokens, writes </think> (its LM head
    row is a scaled copy of the row of a token the reply would have written there)."""
    import transformers
    from tokenizers import AddedToken, Tokenizer

    root = tmp_path_factory.mktemp("think")
    make_tokenizer(root / "tok")
    tok = Tokenizer.from_file(str(root / "tok" / "tokenizer.json"))
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tok.save(str(root / "tok" / "tokenizer.json"))
    base = make_checkpoint(root / "base", seed=0, layers=2, tokenizer_from=root / "tok")
    start, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    prompt = tok.encode("def add(a, b):\n    return", add_special_tokens=False).ids + [start]
    free = LLM(str(base), num_speculative_tokens=0, dtype="float32").generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].token_ids
    # a token first written at the 4th place or later: </think> takes its place there
    at = next(i for i, t in enumerate(free) if i >= 3 and t not in free[:i])
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        model.lm_head.weight[end] = model.lm_head.weight[free[at]] * 1.05
    target = root / "target"
    model.save_pretrained(target)
    for f in (root / "tok").iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    return target, noisy_head_copy(target, root / "draft", noise=0.2), end, prompt


def _run(llm, prompt, spec=None, max_tokens=24):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=spec)
    return list(llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids)


def test_think_block_free_answer_constrained_and_lossless(thinker):
    target, draft, end, prompt = thinker
    config = {"reasoning_parser": "deepseek_r1"}
    plain = LLM(str(target), num_speculative_tokens=0, dtype="float32", structured_outputs_config=config)
    free = _run(plain, prompt)
    assert end in free[1:]                              # the model thinks, then closes the block
    spec = StructuredOutputsParams(regex=REGEX)
    got = _run(plain, prompt, spec)
    cut = got.index(end) + 1
    assert got[:cut] == free[:cut]                      # the think block as unconstrained
    answer = plain.tokenizer.decode(got[cut:], skip_special_tokens=True)
    assert re.fullmatch(REGEX, answer), answer          # the answer is the grammar's
    for kw in ({"speculative_model": str(draft), "num_speculative_tokens": 4},
               {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 2}}):
        fast = LLM(str(target), dtype="float32", structured_outputs_config=config, **kw)
        assert _run(fast, prompt, spec) == got, kw
        for n in (3, 5, 6, 7):                          # the marker met at each place of a draft
            assert _run(fast, prompt, spec, max_tokens=cut + n) == got[:cut + n]


def test_draft_accepted_across_the_marker(thinker):
    """A draft model that agrees with the target: drafts that cross </think> are verified with
    the free masks before it and the grammar's after it, and accepted."""
    target, _, end, prompt = thinker
    config = {"reasoning_parser": "qwen3"}
    plain = LLM(str(target), num_speculative_tokens=0, dtype="float32", structured_outputs_config=config)
    same = LLM(str(target), speculative_model=str(target), num_speculative_tokens=6, dtype="float32",
               structured_outputs_config=config)
    spec = StructuredOutputsParams(regex=REGEX)
    out = same.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=24,
                                                                     structured_outputs=spec))[0]
    assert list(out.outputs[0].token_ids) == _run(plain, prompt, spec)
    assert end in out.outputs[0].token_ids and out.stats.accepted_tokens > 0


def test_enable_in_reasoning_and_a_prompt_that_closed_the_block(thinker):
    """enable_in_reasoning: the grammar from the first token (as with no parser); a prompt whose
    last marker is </think> (a template that closed the block) has ended reasoning: likewise."""
    target, _, end, prompt = thinker
    spec = StructuredOutputsParams(regex=REGEX)
    want = _run(LLM(str(target), num_speculative_tokens=0, dtype="float32"), prompt, spec)
    assert end not in want
    on = LLM(str(target), num_speculative_tokens=0, dtype="float32",
             structured_outputs_config={"reasoning_parser": "deepseek_r1", "enable_in_reasoning": True})
    assert _run(on, prompt, spec) == want
    reasoner = LLM(str(target), num_speculative_tokens=0, dtype="float32",
                   structured_outputs_config={"reasoning_parser": "deepseek_r1"})
    closed = prompt + [end]
    got = _run(reasoner, closed, spec)
    assert end not in got and re.fullmatch(REGEX, reasoner.tokenizer.decode(got, skip_special_tokens=True))


def test_config_is_validated():
    assert StructuredOutputsConfig.of({"enable_in_reasoning": True}).enable_in_reasoning
    with pytest.raises(ValueError, match="reasoning_parser"):
        StructuredOutputsConfig.of({"reasoning_parser": "nope"})
    with pytest.raises(ValueError, match="enable_in_reasoning"):
        StructuredOutputsConfig.of({"enable_in_reasoning": "yes"})


# ---- JSON schemas: what llguidance lacks is ignored with a warning, as xgrammar ignores it ----

BASE = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}
LENIENT = {
    "not": {**BASE, "not": {"required": ["b"]}},
    "if/then/else": {**BASE, "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}, "else": {}},
    "dependentRequired": {**BASE, "dependentRequired": {"b": ["a"]}},
    "dependentSchemas": {**BASE, "dependentSchemas": {"b": {"required": ["a"]}}},
    **{f: {"type": "object", "properties": {"x": {"type": "string", "format": f}}, "required": ["x"]}
       for f in ("uri-reference", "uri-template", "json-pointer", "relative-json-pointer")},
}


@pytest.fixture(scope="module")
def smol(smollm2):
    return LLM(smollm2, num_speculative_tokens=0)


@pytest.mark.parametrize("name", list(LENIENT))
def test_schema_keywords_and_formats_are_ignored_with_a_warning(smol, name, caplog):
    spec = StructuredOutputsParams(json=LENIENT[name])
    with caplog.at_level(logging.WARNING, logger="specdec.structured"):
        smol.engine.grammars.check(spec)
    assert any("ignored" in r.getMessage() for r in caplog.records)
    out = smol.generate("Give JSON.", SamplingParams(temperature=0, max_tokens=12, structured_outputs=spec))[0]
    assert out.outputs[0].text.startswith('{"')          # the schema's object, its other keywords kept


def test_unevaluated_properties_read_as_additional_properties(smol):
    """xgrammar's reading: `unevaluatedProperties: false` closes the object, a schema types its
    other keys (the lenient reading alone would leave it open)."""
    from test_structured import _accepts

    closed = StructuredOutputsParams(json={**BASE, "unevaluatedProperties": False})
    assert _accepts(smol, closed, '{"a":1,"b":"x"}') and not _accepts(smol, closed, '{"a":1,"c":2}')
    typed = StructuredOutputsParams(json={**BASE, "unevaluatedProperties": {"type": "integer"}})
    assert _accepts(smol, typed, '{"a":1,"c":2}') and not _accepts(smol, typed, '{"a":1,"c":"x"}')


def test_a_bad_schema_is_still_refused(smol):
    with pytest.raises(GrammarError):
        smol.engine.grammars.check(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}))


# ---- vLLM's newer structural_tag form: {"type": "structural_tag", "format": {...}} ----

def test_structural_tag_format(smol):
    import json

    fmt = {"type": "triggered_tags", "triggers": ["<f="],
           "tags": [{"begin": "<f=a>", "content": {"type": "json_schema", "json_schema": {
               "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}, "end": "</f>"}]}
    legacy = {"structures": [{"begin": "<f=a>", "schema": fmt["tags"][0]["content"]["json_schema"], "end": "</f>"}],
              "triggers": ["<f="]}
    grammars = smol.engine.grammars
    for tag in ({"type": "structural_tag", "format": fmt}, json.dumps({"format": fmt})):
        assert grammars.check(StructuredOutputsParams(structural_tag=tag)) == \
            grammars.check(StructuredOutputsParams(structural_tag=legacy))
    for bad, said in (({"type": "tag", "begin": "<a>", "content": {"type": "any_text"}, "end": "</a>"}, "'tag' is not supported"),
                      ({**fmt, "at_least_one": True}, "at_least_one is not supported"),
                      ({**fmt, "tags": [{"begin": "<f=a>", "content": {"type": "any_text"}, "end": "</f>"}]},
                       "content must be")):
        with pytest.raises(GrammarError, match=re.escape(said)):
            grammars.check(StructuredOutputsParams(structural_tag={"format": bad}))


def test_the_server_hands_its_reasoning_parser_to_the_grammar(thinker):
    """--reasoning-parser is the engine's structured-outputs reasoning parser too (vLLM's): a
    constrained chat reply thinks freely, its think block comes back as reasoning_content and its
    answer is the grammar's, streamed or not (the grammar had held the reply from its first
    token, leaving a reasoning model no think block)."""
    import openai

    from specdec.server import ServerConfig, build_app
    from test_server import LiveServer

    target, _, _, prompt = thinker
    llm = LLM(str(target), num_speculative_tokens=0, dtype="float32")
    text = llm.tokenizer.decode(prompt)
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}<think>"
    assert llm.tokenizer.encode(text.removesuffix("<think>") + "<think>", add_special_tokens=False) == prompt
    config = ServerConfig(served_model_names=("t",), reasoning_parser="deepseek_r1", chat_template=template)
    with LiveServer(build_app(llm, config)) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x")
        ask = dict(model="t", messages=[{"role": "user", "content": text.removesuffix("<think>")}], max_tokens=24,
                   temperature=0, extra_body={"structured_outputs": {"regex": REGEX}})
        msg = client.chat.completions.create(**ask).choices[0].message
        thought = getattr(msg, "reasoning_content", None) or msg.model_extra.get("reasoning_content")
        assert thought and re.fullmatch(REGEX, msg.content), (thought, msg.content)
        parts = {"reasoning_content": "", "content": ""}
        for chunk in client.chat.completions.create(**ask, stream=True):
            delta = chunk.choices[0].delta if chunk.choices else None
            for key in parts:
                parts[key] += (getattr(delta, key, None) or (delta.model_extra or {}).get(key) or "") if delta else ""
        assert parts == {"reasoning_content": thought, "content": msg.content}
