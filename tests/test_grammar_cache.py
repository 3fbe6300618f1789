"""A grammar is validated once, where its request is checked (the server prepares requests off its
engine thread); the engine's grammar() then only compiles the request's own matcher. Each request
has its own matcher: requests sharing a grammar run apart, and a large grammar's lexer limits are
each request's own."""

from __future__ import annotations

import json
import time

import llguidance
import pytest

from specdec import LLM, SamplingParams
from specdec.config import StructuredOutputsParams
from specdec.defaults import BUNDLED_TARGET
from specdec.structured import VALIDATED_CACHE

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "b": {"enum": ["x", "y"]}},
          "required": ["a", "b"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm():
    return LLM(model=BUNDLED_TARGET, num_speculative_tokens=0)


def _counting(monkeypatch) -> dict:
    """llguidance's LLMatcher with its validations and constructions counted."""
    counts, real = {"validated": 0, "made": 0}, llguidance.LLMatcher

    class Counted:
        def __call__(self, *a, **k):
            counts["made"] += 1
            return real(*a, **k)

        def validate_grammar_with_warnings(self, *a, **k):
            counts["validated"] += 1
            return real.validate_grammar_with_warnings(*a, **k)

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr(llguidance, "LLMatcher", Counted())
    return counts


def _builders(monkeypatch) -> list[str]:
    """llguidance's LLMatcher watched: the names of the threads that construct matchers, in order."""
    import threading

    names, real = [], llguidance.LLMatcher

    class Watched:
        def __call__(self, *a, **k):
            names.append(threading.current_thread().name)
            return real(*a, **k)

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr(llguidance, "LLMatcher", Watched())
    return names


def test_a_checked_grammar_is_not_validated_again(llm, monkeypatch):
    spec = StructuredOutputsParams(json={**SCHEMA, "title": "once"})     # a text no other test validated
    counts = _counting(monkeypatch)
    llm.engine.grammars.check(spec)                # what preparing a request does
    grammars = [llm.engine.grammars.grammar(spec) for _ in range(3)]     # what admitting does, per request
    assert counts == {"validated": 1, "made": 3}
    grammars[0].advance(grammars[0].forced([], 4) or [])
    assert grammars[1].forced([], 64) == grammars[2].forced([], 64)      # the others did not move


def test_a_large_grammar_runs_for_every_request(llm):
    """Copies of one compiled matcher share its lexer: a second request with a regex this large then
    failed on the lexer's limits where the first ran. Each request compiles its own."""
    spec = StructuredOutputsParams(regex="a{1000000}")
    for _ in range(2):
        grammar = llm.engine.grammars.grammar(spec)
        assert grammar.error is None


def test_requests_sharing_a_grammar_run_apart(llm):
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    prompts = ["def parse(data):\n    return ", "import os\n", "class Point:\n", "x = "]
    alone = [llm.generate([p], params)[0].outputs[0].text for p in prompts]
    together = [o.outputs[0].text for o in llm.generate(prompts, params)]
    assert together == alone
    for text in together:
        assert set(json.loads(text)) == {"a", "b"}


def test_the_memory_is_bounded(llm):
    for i in range(1, VALIDATED_CACHE + 2):
        llm.engine.grammars.check(StructuredOutputsParams(regex=f"a{{{i}}}"))
    assert len(llm.engine.grammars._validated) == VALIDATED_CACHE


def test_prebuilt_grammars_are_taken_at_admission(llm, monkeypatch):
    """The server compiles each choice's grammar before submitting the request (prebuild, off the
    engine's thread: llguidance lets the GIL go); admission takes one instead of compiling. They
    are kept on the request's spec, so an abandoned request leaves none behind (no shared pool)."""
    import gc
    import weakref

    spec = StructuredOutputsParams(json={**SCHEMA, "title": "prebuilt"})
    grammars = llm.engine.grammars
    grammars.prebuild(spec, 2)
    counts = _counting(monkeypatch)
    a, b = grammars.grammar(spec), grammars.grammar(spec)
    assert counts["made"] == 0 and a is not b
    grammars.grammar(spec)                         # none left: compiled here
    assert counts["made"] == 1
    other = StructuredOutputsParams(json={**SCHEMA, "title": "abandoned"})
    grammars.prebuild(other, 3)
    left = [weakref.ref(g) for g in other.__dict__["_prebuilt"]]
    del other
    gc.collect()
    assert all(ref() is None for ref in left)      # gone with the request's params


def test_a_frozen_spec_is_shared_and_not_serialized_again(llm, monkeypatch):
    """Admission of a server's request costs no schema work per choice on the engine's thread:
    the frozen spec's text is reused (no second _grammar_text) and clone() shares it (no deep copy
    of the schema); a spec not frozen (offline, a caller may change it) is still copied."""
    import specdec.structured as structured
    from specdec import SamplingParams

    spec = StructuredOutputsParams(json={**SCHEMA, "title": "frozen"})
    grammars = llm.engine.grammars
    grammars.freeze(spec)
    grammars.prebuild(spec, 4)
    calls = []
    real = structured._grammar_text
    monkeypatch.setattr(structured, "_grammar_text", lambda *a, **k: calls.append(1) or real(*a, **k))
    params = SamplingParams(max_tokens=4, structured_outputs=spec)
    assert params.clone().structured_outputs is spec
    for _ in range(4):
        llm.engine.add_request([1, 2, 3], params)
    assert calls == [] and spec.__dict__["_prebuilt"] == []
    loose = SamplingParams(structured_outputs=StructuredOutputsParams(json={**SCHEMA, "title": "loose"}))
    assert loose.clone().structured_outputs is not loose.structured_outputs
    while llm.engine.has_unfinished():
        llm.engine.step()


def test_server_requests_with_a_schema_compile_off_the_engine_thread(tiny_pair, monkeypatch):
    """Through a real server: the engine's thread builds no matcher for a structured request."""
    import httpx

    from specdec.server import ServerConfig, build_app
    from test_server import LiveServer

    llm = LLM(str(tiny_pair[0]), num_speculative_tokens=0, max_model_len=128)
    on_engine = _builders(monkeypatch)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("tiny",)))) as live:
        r = httpx.post(f"{live.url}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": ["x = ", "y = "], "n": 2, "max_tokens": 30, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}})
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            assert set(json.loads(choice["text"])) == {"a", "b"}
    # 4 matchers, all made on the grammar threads: neither the engine's nor the preparation pool's
    assert len(on_engine) == 4 and all(name.startswith("specdec-grammar") for name in on_engine), on_engine


def test_offline_generate_compiles_every_choice_ahead_on_all_cores(tiny_pair, monkeypatch):
    """LLM.generate compiles its structured choices' matchers before adding them, on grammar
    threads (llguidance lets the GIL go: the cores compile together), on its own copies: the
    caller's spec is left as it was, and the outputs are those of compiling at admission."""

    from specdec import SamplingParams

    llm = LLM(str(tiny_pair[0]), num_speculative_tokens=0, max_model_len=128)
    spec = StructuredOutputsParams(json=SCHEMA)
    params = SamplingParams(n=3, max_tokens=30, temperature=0.8, seed=5, structured_outputs=spec)
    real = llguidance.LLMatcher
    where = _builders(monkeypatch)
    out = llm.generate(["x = ", "y = "], params)
    assert len(where) == 6 and all(name.startswith("specdec-grammar") for name in where), where
    assert "_frozen" not in spec.__dict__ and "_prebuilt" not in spec.__dict__
    monkeypatch.setattr(llguidance, "LLMatcher", real)
    for o in out:
        for c in o.outputs:
            assert set(json.loads(c.text)) == {"a", "b"}
    # the same samples as matchers compiled one by one at admission (the engine's own path)
    engine = llm.engine
    reqs = [engine.add_request(llm.tokenizer.encode(p), params, seed_offset=i) for p in ("x = ", "y = ") for i in range(3)]
    while engine.has_unfinished():
        engine.step()
    assert [r.out for r in reqs] == [list(c.token_ids) for o in out for c in o.outputs]


def test_a_client_that_leaves_drops_its_queued_compiles(tiny_pair, monkeypatch):
    """Grammar compiles of a request whose client left went on to the last one (16 large-schema
    choices kept the grammar thread busy, and the next structured request waited 29.7 s); now those
    not started are dropped when the client goes."""

    import httpx

    from specdec.server import ServerConfig, build_app
    from test_server import LiveServer

    llm = LLM(str(tiny_pair[0]), num_speculative_tokens=0, max_model_len=128)
    built = _builders(monkeypatch)           # compiles started ...
    done, started = [], llguidance.LLMatcher

    class Finished:                          # ... and those finished
        def __call__(self, *a, **k):
            try:
                return started(*a, **k)
            finally:
                done.append(1)

        def __getattr__(self, name):
            return getattr(started, name)

    monkeypatch.setattr(llguidance, "LLMatcher", Finished())
    big = {"anyOf": [{"type": "object", "additionalProperties": False, "required": [f"f{i}"],
                      "properties": {f"f{i}": {"type": "string", "pattern": f"^v{i}[a-z]*$"}}} for i in range(2000)]}
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("tiny",)))) as live:
        body = {"model": "tiny", "prompt": "x", "n": 16, "max_tokens": 4,
                "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": big}}}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{live.url}/v1/completions", json=body, timeout=0.3)
        # the grammar threads go idle: every compile started has finished and none started for 2 s
        # (one runs right after another while any are queued), however slowly they run
        deadline, last, since = time.monotonic() + 90, None, time.monotonic()
        while True:
            state = (len(built), len(done))
            if state != last:
                last, since = state, time.monotonic()
            elif state[0] == state[1] and time.monotonic() - since >= 2:
                break
            assert time.monotonic() < deadline, state
            time.sleep(0.05)
        assert len(built) < 16, built                      # nothing more compiled for the departed client
        r = httpx.post(f"{live.url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "x = ", "max_tokens": 20, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}})
        assert r.status_code == 200 and set(json.loads(r.json()["choices"][0]["text"])) == {"a", "b"}
