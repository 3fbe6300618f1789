"""Beam search, a tester's five findings: without max_tokens the beams get what the context leaves
(they got 16), any finite length_penalty ranks the beams (a large one was a 500), the reasoning
parser splits beam replies as plain ones, `stream: true` is answered as vLLM answers it (it was a
400), and chat takes `"n": null` (OpenAI's and vLLM's chat do)."""

from __future__ import annotations

import json
from decimal import Decimal, localcontext

import httpx
import pytest

from specdec import LLM
from specdec.beam_search import BeamSearch, BeamSearchParams
from test_beam_fixes import _eos_likely

CONTEXT = 64


@pytest.fixture(scope="module")
def llm(tiny_pair):
    return LLM(str(tiny_pair[0]), dtype="float32", num_speculative_tokens=0, max_model_len=CONTEXT)


def _serve(llm, **config):
    from specdec.server import ServerConfig, build_app
    from test_server import LiveServer

    return LiveServer(build_app(llm, ServerConfig(served_model_names=("tiny",), **config)))


@pytest.fixture(scope="module")
def server(llm):
    with _serve(llm) as live, httpx.Client(base_url=live.url + "/v1", timeout=120) as http:
        http.live = live
        yield http


def _beam(body: dict) -> dict:
    return {"model": "tiny", "n": 2, "use_beam_search": True, "temperature": 0, **body}


def test_without_max_tokens_the_beams_get_what_the_context_leaves(llm, server):
    """Finding 1: as a plain request's and vLLM's (get_max_tokens before to_beam_search_params),
    the budget is max_model_len - the prompt: a long chat prompt is not refused, and each prompt of
    a completion fills its own room."""
    for words in (1, 25):                                  # the second prompt leaves a few tokens only
        body = {"model": "tiny", "messages": [{"role": "user", "content": "x " * words}], "ignore_eos": True}
        plain = server.post("/chat/completions", json={**body, "temperature": 0})
        beam = server.post("/chat/completions", json=_beam(body))
        assert plain.status_code == beam.status_code == 200, beam.text
        room = CONTEXT - plain.json()["usage"]["prompt_tokens"]
        assert plain.json()["usage"]["completion_tokens"] == room
        assert beam.json()["usage"]["completion_tokens"] == 2 * room
        assert [c["finish_reason"] for c in beam.json()["choices"]] == ["length", "length"]
    prompts = [[0, 5, 6, 7], [0] + list(range(9, 50))]
    r = server.post("/completions", json=_beam({"prompt": prompts, "max_tokens": None, "ignore_eos": True,
                                                "return_token_ids": True}))
    assert r.status_code == 200, r.text
    want = [llm.beam_search({"prompt_token_ids": p}, BeamSearchParams(2, CONTEXT - len(p), ignore_eos=True))[0]
            for p in prompts]
    assert [c["token_ids"] for c in r.json()["choices"]] == [b.tokens[len(p):] for p, o in zip(prompts, want)
                                                             for b in o.sequences]
    assert r.json()["usage"]["completion_tokens"] == 2 * sum(CONTEXT - len(p) for p in prompts)


def _exact_order(beams, eos: int, length_penalty: float) -> list:
    """The beams best first by cum / len ** length_penalty, in decimals that do not overflow."""
    with localcontext() as ctx:
        ctx.prec, ctx.Emax, ctx.Emin = 60, 10 ** 9, -10 ** 9

        def score(b):
            n = len(b.tokens) - (b.tokens[-1] == eos)
            return Decimal(b.cum_logprob) / Decimal(n) ** Decimal(length_penalty)
        return sorted(beams, key=score, reverse=True)


@pytest.fixture(scope="module")
def eosy(tiny_pair, tmp_path_factory) -> LLM:
    """The tiny target with a likely EOS (test_beam_fixes' checkpoint): beams end on it."""
    eos = LLM(str(tiny_pair[0]), dtype="float32", num_speculative_tokens=0).tokenizer.eos_token_ids[0]
    return LLM(str(_eos_likely(tiny_pair[0], tmp_path_factory.mktemp("eosy"), eos)), dtype="float32",
               num_speculative_tokens=0)


@pytest.mark.parametrize("length_penalty", [400.0, 1e5, -400.0, -1e308, 1e308])
def test_any_finite_length_penalty_ranks_the_beams(eosy, length_penalty):
    """Finding 2: len ** length_penalty past the floats was an OverflowError (or 0, a
    ZeroDivisionError) after the whole search; the beams are now ranked as exact arithmetic ranks
    them (beams that end on EOS have other lengths, so the penalty matters)."""
    llm = eosy
    eos = llm.tokenizer.eos_token_ids[0]
    params = BeamSearchParams(3, 8, length_penalty=length_penalty)
    prompt = [0, 9, 17, 33, 42]
    search = BeamSearch([prompt], params, {eos}, llm.engine.max_model_len)
    while todo := search.pending():
        outs = llm.generate([{"prompt_token_ids": b.tokens} for _, b in todo], search.step_params())
        search.advance(todo, [o.outputs[0].logprobs[0] for o in outs])
    every = search.done[0] + search.live[0]
    assert len({len(b.tokens) - (b.tokens[-1] == eos) for b in every}) > 1       # lengths differ
    got = search.result(llm.tokenizer.decode)[0].sequences
    if abs(length_penalty) < 1e300:                       # the decimals hold len ** length_penalty
        assert [b.tokens for b in got] == [b.tokens for b in _exact_order(every, eos, length_penalty)[:3]]
    assert [b.tokens for b in llm.beam_search({"prompt_token_ids": prompt}, params)[0].sequences] == \
        [b.tokens for b in got]


def test_length_penalty_on_the_server(server):
    """Finding 2, served: a large length_penalty is answered (it was a 500); one that is not a
    finite number (JSON's NaN, Infinity, 1e999) is a 400 naming it, as offline it is a ValueError
    before any step."""
    for lp in (400, 1e5, -1e308):
        for path, body in (("/completions", {"prompt": "hi"}),
                           ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            r = server.post(path, json=_beam({**body, "max_tokens": 4, "length_penalty": lp}))
            assert r.status_code == 200, r.text
            assert len(r.json()["choices"]) == 2
    for raw in ("NaN", "Infinity", "-Infinity", "1e999"):
        r = server.post("/completions", content=f'{{"model": "tiny", "prompt": "hi", "n": 2, "max_tokens": 4, '
                                                f'"use_beam_search": true, "length_penalty": {raw}}}',
                        headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "length_penalty"
    with pytest.raises(ValueError, match="length_penalty"):
        BeamSearchParams(2, 4, length_penalty=float("nan"))


def test_reasoning_parser_splits_beam_replies(llm):
    """Finding 3: with --reasoning-parser each beam reply is split as a plain reply is (deepseek_r1
    with no </think>: all of it reasoning); width 1 with ignore_eos is greedy, so the two replies
    are equal field for field. include_reasoning false leaves the thinking out of both."""
    with _serve(llm, reasoning_parser="deepseek_r1") as live, httpx.Client(base_url=live.url + "/v1",
                                                                            timeout=120) as http:
        for include in (True, False):
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                    "ignore_eos": True, "temperature": 0, "include_reasoning": include}
            plain = http.post("/chat/completions", json=body).json()["choices"][0]["message"]
            beam = http.post("/chat/completions", json={**body, "n": 1, "use_beam_search": True}).json()
            assert beam["choices"][0]["message"] == plain
            assert plain["content"] is None and (plain.get("reasoning_content") is not None) == include
        two = http.post("/chat/completions", json={**body, "include_reasoning": True, "n": 2,
                                                   "use_beam_search": True}).json()
        for c in two["choices"]:
            assert c["message"]["content"] is None and c["message"]["reasoning_content"]


def _events(r: httpx.Response) -> list:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    lines = [line[len("data: "):] for line in r.text.split("\n\n") if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_streamed_beam_search_is_answered_as_vllm_answers_it(server):
    """Finding 4: vLLM's completions do not stream beams (one event: the whole body), its chat
    streams the finished beams (each choice's role chunk, then its text). Both were a 400."""
    body = _beam({"prompt": "hi", "max_tokens": 4, "ignore_eos": True})
    whole = server.post("/completions", json=body).json()
    events = _events(server.post("/completions", json={**body, "stream": True}))
    assert len(events) == 1
    assert events[0]["choices"] == whole["choices"] and events[0]["usage"] == whole["usage"]

    body = _beam({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True})
    whole = server.post("/chat/completions", json=body).json()
    events = _events(server.post("/chat/completions", json={**body, "stream": True,
                                                            "stream_options": {"include_usage": True}}))
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
    texts, finish = {}, {}
    for e in events[:-1]:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["delta"].get("content", "")
            finish[c["index"]] = c["finish_reason"] or finish.get(c["index"])
    assert texts == {c["index"]: c["message"]["content"] for c in whole["choices"]}
    assert finish == {c["index"]: c["finish_reason"] for c in whole["choices"]}

    import openai

    client = openai.OpenAI(base_url=server.live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2,
                                                 max_tokens=4, stream=True,
                                                 extra_body={"use_beam_search": True, "ignore_eos": True}))
    assert {c.choices[0].delta.role for c in chunks} >= {"assistant"}
    got = {}
    for c in chunks:
        got[c.choices[0].index] = got.get(c.choices[0].index, "") + (c.choices[0].delta.content or "")
    assert got == texts


def test_chat_takes_n_null(server):
    """Finding 5: OpenAI's chat n is nullable and vLLM's ChatCompletionRequest takes null as 1;
    /v1/completions' n is not nullable in vLLM either (still a 400)."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": None}
    r = server.post("/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1
    r = server.post("/chat/completions", json={**chat, "use_beam_search": True, "temperature": 0})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    r = server.post("/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3, "n": None})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
