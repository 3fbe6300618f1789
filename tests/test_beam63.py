"""Beam search, review 63's two findings: under a logits logprobs_mode (cum_logprob sums logits,
often positive) the beams are ranked by vLLM's cum_logprob / len ** length_penalty (every beam
with a sum >= 0 tied, EOS beams first), and the server gives a beam that EOS ended
`stop_reason` = that EOS id, as vLLM's server does (it was null; the offline call keeps None)."""

from __future__ import annotations

import math
from decimal import Decimal, localcontext

import pytest

from specdec import LLM
from specdec.beam_search import BeamSearch, BeamSearchParams, BeamSearchSequence, beam_score
from test_beam_fixes import _eos_likely

PROMPT = [0, 9, 17, 33, 42]


@pytest.fixture(scope="module")
def eosy(tiny_pair, tmp_path_factory):
    """The tiny target with a likely EOS (test_beam_fixes' checkpoint): beams end on it."""
    eos = LLM(str(tiny_pair[0]), dtype="float32", num_speculative_tokens=0).tokenizer.eos_token_ids[0]
    return _eos_likely(tiny_pair[0], tmp_path_factory.mktemp("eosy63"), eos), eos


def _exact(b: BeamSearchSequence, eos: int, length_penalty: float) -> Decimal:
    """vLLM's get_beam_search_score in decimals that neither overflow nor round to 0."""
    with localcontext() as ctx:
        ctx.prec, ctx.Emax, ctx.Emin = 60, 10 ** 9, -10 ** 9
        n = len(b.tokens) - (b.tokens[-1] == eos)
        return Decimal(b.cum_logprob) / Decimal(n) ** Decimal(length_penalty)


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logits"])
@pytest.mark.parametrize("length_penalty", [1.0, 0.5, 2.0])
def test_logits_modes_rank_beams_by_vllms_score(eosy, mode, length_penalty):
    """Finding 1: the step values are logits (vLLM's beam search reads whatever logprobs_mode
    reports), so the sums are positive; the width best by cum / len ** length_penalty come back,
    best first (every positive sum ranked infinite before, so the EOS beams found first won)."""
    path, eos = eosy
    llm = LLM(str(path), dtype="float32", num_speculative_tokens=0, logprobs_mode=mode)
    params = BeamSearchParams(3, 6, length_penalty=length_penalty)
    search = BeamSearch([PROMPT], params, {eos}, llm.engine.max_model_len)
    while todo := search.pending():
        outs = llm.generate([{"prompt_token_ids": b.tokens} for _, b in todo], search.step_params())
        search.advance(todo, [o.outputs[0].logprobs[0] for o in outs])
    every = search.done[0] + search.live[0]
    assert all(b.cum_logprob > 0 for b in every) and search.done[0]
    want = sorted(every, key=lambda b: _exact(b, eos, length_penalty), reverse=True)[:3]
    got = search.result(llm.tokenizer.decode)[0].sequences
    assert [b.tokens for b in got] == [b.tokens for b in want]
    assert [b.tokens for b in llm.beam_search({"prompt_token_ids": PROMPT}, params)[0].sequences] == \
        [b.tokens for b in want]


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, -3.0, 400.0, -400.0])
def test_the_ranking_holds_for_either_sign(length_penalty):
    """Positive, zero, negative and -inf sums over lengths 3 to 9 ranked as exact arithmetic ranks
    them, also where len ** length_penalty leaves the floats; beam_score keeps the score's sign."""
    eos = 1
    cums = [4.0, 30.0, 0.5, 0.0, -0.5, -2.0, -30.0, -math.inf, 12.0, -7.0]
    beams = [BeamSearchSequence([0] * (3 + i % 4) + ([eos] if i % 3 == 0 else [5]), cum_logprob=c)
             for i, c in enumerate(cums)]
    search = BeamSearch([[0]], BeamSearchParams(len(beams), 1, length_penalty=length_penalty), {eos})
    search.done[0], search.live[0] = beams[:5], beams[5:]
    got = search.result(lambda ids: "")[0].sequences
    assert [b.cum_logprob for b in got] == \
        [b.cum_logprob for b in sorted(beams, key=lambda b: _exact(b, eos, length_penalty), reverse=True)]
    for b in beams:
        assert math.copysign(1, beam_score(b, {eos}, length_penalty)) == math.copysign(1, b.cum_logprob) or \
            b.cum_logprob == 0


def test_server_beams_ended_by_eos_report_its_id(eosy):
    """Finding 2: vLLM's OpenAIServing.beam_search builds an EOS beam with stop_reason=eos_token_id
    and its completions and chat choices carry it (a "length" beam: null); the offline
    LLM.beam_search leaves stop_reason None."""
    import openai

    from specdec.server import ServerConfig, build_app
    from test_server import LiveServer

    path, eos = eosy
    llm = LLM(str(path), dtype="float32", num_speculative_tokens=0)
    offline = llm.beam_search({"prompt_token_ids": PROMPT}, BeamSearchParams(3, 6))[0].sequences
    assert "stop" in {b.finish_reason for b in offline} and all(b.stop_reason is None for b in offline)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("tiny",)))) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        beam = {"use_beam_search": True}
        seen = []
        for n, max_tokens in ((3, 6), (4, 2)):
            r = client.completions.create(model="tiny", prompt=PROMPT, n=n, max_tokens=max_tokens, temperature=0,
                                          extra_body=beam)
            seen += [(c.finish_reason, c.stop_reason) for c in r.choices]
            messages = [{"role": "user", "content": "hi"}]
            r = client.chat.completions.create(model="tiny", messages=messages, n=n, max_tokens=max_tokens,
                                               temperature=0, extra_body=beam)
            chat = [(c.finish_reason, c.stop_reason) for c in r.choices]
            chunks = client.chat.completions.create(model="tiny", messages=messages, n=n, max_tokens=max_tokens,
                                                    temperature=0, stream=True, extra_body=beam)
            streamed = {c.choices[0].index: (c.choices[0].finish_reason, c.choices[0].stop_reason)
                        for c in chunks if c.choices and c.choices[0].finish_reason}
            assert [streamed[i] for i in range(n)] == chat
            seen += chat
    assert {f for f, _ in seen} == {"stop", "length"}
    assert all(s == (eos if f == "stop" else None) for f, s in seen)
