"""Compiled grammars are kept: a request's grammar is compiled once where it is checked (the
server prepares requests off its engine thread) and each request runs a copy, never the engine
thread compiling it again; copies advance apart."""

from __future__ import annotations

import json

import llguidance
import pytest

from specdec import LLM, SamplingParams
from specdec.config import StructuredOutputsParams
from specdec.defaults import BUNDLED_TARGET
from specdec.structured import COMPILED_CACHE

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "b": {"enum": ["x", "y"]}},
          "required": ["a", "b"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm():
    return LLM(model=BUNDLED_TARGET, num_speculative_tokens=0)


def _counting(monkeypatch) -> list:
    """llguidance's LLMatcher, its constructions (compilations) counted."""
    made, real = [], llguidance.LLMatcher

    class Counted:
        def __call__(self, *a, **k):
            made.append(1)
            return real(*a, **k)

        def __getattr__(self, name):            # validate_grammar_with_warnings and the rest
            return getattr(real, name)

    monkeypatch.setattr(llguidance, "LLMatcher", Counted())
    return made


def test_checked_grammar_is_not_compiled_again(llm, monkeypatch):
    spec = StructuredOutputsParams(json={**SCHEMA, "title": "once"})     # a text no other test compiled
    made = _counting(monkeypatch)
    llm.engine.grammars.check(spec)                # what preparing a request does
    assert len(made) == 1
    grammars = [llm.engine.grammars.grammar(spec) for _ in range(3)]     # what admitting does, per request
    assert len(made) == 1
    grammars[0].advance(grammars[0].forced([], 4) or [])
    assert grammars[1].forced([], 64) == grammars[2].forced([], 64)      # the others did not move


def test_requests_sharing_a_grammar_run_apart(llm):
    """Batched requests with one schema (each a copy of the compiled matcher) give what each gives alone."""
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    prompts = ["def parse(data):\n    return ", "import os\n", "class Point:\n", "x = "]
    alone = [llm.generate([p], params)[0].outputs[0].text for p in prompts]
    together = [o.outputs[0].text for o in llm.generate(prompts, params)]
    assert together == alone
    for text in together:
        assert set(json.loads(text)) == {"a", "b"}


def test_the_cache_is_bounded(llm, monkeypatch):
    made = _counting(monkeypatch)
    specs = [StructuredOutputsParams(regex=f"a{{{i}}}") for i in range(1, COMPILED_CACHE + 2)]
    for spec in specs:
        llm.engine.grammars.check(spec)
    assert len(llm.engine.grammars._compiled) == COMPILED_CACHE
    llm.engine.grammars.grammar(specs[0])          # pushed out: compiled again, once
    assert len(made) == COMPILED_CACHE + 2
