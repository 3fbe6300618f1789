"""OpenAI's Predicted Outputs: a request's `prediction` (text the reply is expected to repeat) is
a draft source of its own. The reply is exactly the one without it (greedy: identical; sampling:
the target's distribution), in fewer target forwards when the reply follows the prediction;
usage counts accepted and rejected prediction tokens as OpenAI does."""

from __future__ import annotations

import collections

import httpx
import numpy as np
import openai
import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.prediction import Prediction
from specdec.sampling import process

GREEDY = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
PROMPT = "def add(a, b):"


def test_the_draft_follows_the_prediction_and_rejoins_it():
    p = Prediction.of([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert p.draft([], 3).tolist() == [1, 2, 3]                      # nothing written yet: its start
    assert p.draft([1, 2, 3, 4], 3).tolist() == [5, 6, 7]            # still on it
    assert p.draft([1, 2, 3, 4, 5, 6, 0, 0], 3).tolist() == []       # left it: no 2-token rejoin
    assert p.draft([1, 2, 3, 4, 5, 6, 0, 0, 7, 8], 3).tolist() == [9]   # rejoined after an edit
    assert p.draft([1, 2, 3, 4, 5, 6, 0, 0, 7, 8, 9], 3).tolist() == []   # its end
    assert Prediction.of([]) is None


def _run(engine, prompt, params, prediction=None):
    r = engine.add_request(prompt, params, prediction=prediction)
    while engine.has_unfinished():
        engine.step()
    return r


@pytest.fixture(scope="module")
def engines(tiny_pair):
    target, draft = tiny_pair
    return {"ngram": LLM(str(target), speculative_config={"method": "ngram", "num_speculative_tokens": 4}),
            "draft": LLM(str(target), speculative_model=str(draft), num_speculative_tokens=4),
            "plain": LLM(str(target))}


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_replies_are_identical_whatever_the_prediction(engines, method):
    llm = engines[method]
    prompt = llm.tokenizer.encode(PROMPT)
    plain = _run(engines["plain"].engine, prompt, GREEDY)
    out = list(plain.out)
    without = _run(llm.engine, prompt, GREEDY)
    assert without.out == out
    V = llm.target.config.vocab_size
    rng = np.random.default_rng(0)
    cases = {"exact": out, "edited": out[:15] + [3, 4, 5] + out[20:], "shuffled": list(rng.permutation(out)),
             "garbage": rng.integers(0, V, 40).tolist(), "longer": out + out}
    for name, pred in cases.items():
        r = _run(llm.engine, prompt, GREEDY, pred)
        assert r.out == out, name
        assert r.stats.prediction_tokens == len(pred)
        assert 0 <= r.stats.accepted_prediction_tokens <= min(len(pred), len(out))
        # OpenAI's: the prediction's tokens that appear in the reply (in order) and those that do not
        assert r.stats.accepted_prediction_tokens + r.stats.rejected_prediction_tokens == len(pred)
        assert r.stats.rejected_prediction_tokens == {"exact": 0, "edited": 3, "longer": len(out)}.get(
            name, r.stats.rejected_prediction_tokens)
        if name == "exact":       # while the reply follows it: drafts of up to 8 (max_k), 9 tokens a forward, K=4 or not
            assert r.stats.target_forward_passes <= len(out) // 9 + 2 < without.stats.target_forward_passes
            assert r.stats.accepted_prediction_tokens == len(out)
    edited = _run(llm.engine, prompt, GREEDY, cases["edited"])
    assert edited.stats.accepted_prediction_tokens == len(out) - 5   # out[15:20] gone, 3 tokens put in
    assert edited.stats.target_forward_passes <= len(out) // 3      # it rejoined after the edit


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_accepted_prediction_tokens_are_in_the_output(engines, method):
    """A draft verification kept but max_tokens (or a stop string) cut from the output is not an
    accepted prediction token: OpenAI's count is what of the prediction the completion holds."""
    llm = engines[method]
    prompt = llm.tokenizer.encode(PROMPT)
    out = list(_run(engines["plain"].engine, prompt, GREEDY).out)
    text = llm.tokenizer.decode(out)
    for n in (3, 5, 9):
        # max_tokens: drafts are cut to the room left; a stop string ends a step's tokens after them
        stop = llm.tokenizer.decode(out[:n + 1])[len(llm.tokenizer.decode(out[:n])):]
        assert stop and text.count(stop) >= 1
        for params in (SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                       SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, stop=[stop])):
            r = _run(llm.engine, prompt, params, out)
            got = len(r.out)
            assert 0 < got <= n + 1 and r.out == out[:got]
            acc, rej = r.stats.accepted_prediction_tokens, r.stats.rejected_prediction_tokens
            assert acc == got and acc + rej == len(out), (params, got, acc)
            assert r.stats.target_forward_passes < got or got <= 2        # the prediction was drafted


def test_a_plain_engine_takes_no_draft_from_it(engines):
    llm = engines["plain"]
    prompt = llm.tokenizer.encode(PROMPT)
    out = _run(llm.engine, prompt, GREEDY).out
    r = _run(llm.engine, prompt, GREEDY, list(out))
    # OpenAI's counts are the content's (all of it appears), however many forwards it took: one a token
    assert r.out == out and r.stats.accepted_prediction_tokens == len(out) == r.stats.prediction_tokens
    assert r.stats.target_forward_passes == len(out) and r.stats.draft_tokens == 0
    with pytest.raises(ValueError, match="prediction token ids must be integers"):
        llm.engine.add_request(prompt, GREEDY, prediction=[10 ** 9])


def test_sampling_keeps_the_targets_distribution(engines):
    """top_k 3 at temperature 1: the first reply token's frequencies over 600 seeded requests,
    each with a prediction whose first token is the third most likely one, against the target's
    exact probabilities (chi-square, 2 degrees of freedom, p > 0.001)."""
    llm = engines["ngram"]
    prompt = llm.tokenizer.encode(PROMPT)
    params = dict(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    with torch.no_grad():
        p = process(llm.target(torch.tensor([prompt])).logits[0, -1:].float(), SamplingParams(**params))[0]
    support = torch.nonzero(p).flatten().tolist()
    third = min(support, key=lambda t: float(p[t]))
    n = 600
    reqs = [llm.engine.add_request(prompt, SamplingParams(**params, seed=s), prediction=[third, third, third])
            for s in range(n)]
    while llm.engine.has_unfinished():
        llm.engine.step()
    got = collections.Counter(r.out[0] for r in reqs)
    assert set(got) <= set(support)
    chi2 = sum((got[t] - n * float(p[t])) ** 2 / (n * float(p[t])) for t in support)
    assert chi2 < 13.8, (chi2, got, {t: round(float(p[t]), 3) for t in support})
    assert sum(r.stats.draft_tokens for r in reqs) > 0      # the drafts were tried


def test_the_server_takes_openais_prediction():
    """The bundled toy target (a trained tokenizer: its reply's text tokenizes back to the reply's tokens)."""
    from specdec.defaults import BUNDLED_TARGET
    from specdec.server import ServerConfig, build_app
    from test_server import LiveServer

    llm = LLM(str(BUNDLED_TARGET), speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    config = ServerConfig(served_model_names=("m",), chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with LiveServer(build_app(llm, config)) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x")
        ask = dict(model="m", messages=[{"role": "user", "content": PROMPT}], max_tokens=40, temperature=0,
                   extra_body={"ignore_eos": True})
        plain = client.chat.completions.create(**ask)
        text = plain.choices[0].message.content
        assert plain.usage.completion_tokens_details is None
        for prediction in ({"type": "content", "content": text},
                           {"type": "content", "content": [{"type": "text", "text": text[:20]},
                                                           {"type": "text", "text": text[20:]}]}):
            fast = client.chat.completions.create(**ask, prediction=prediction, n=2)
            assert [c.message.content for c in fast.choices] == [text, text]
            details = fast.usage.completion_tokens_details
            assert details.accepted_prediction_tokens > 20
            assert details.rejected_prediction_tokens <= 2 * 4      # the reply's own text: (almost) all of it appears
            assert fast.model_extra["speculative"]["target_forward_passes"] < \
                2 * plain.model_extra["speculative"]["target_forward_passes"]
        predicted = len(llm.tokenizer.encode(text, add_special_tokens=False))
        odd = client.chat.completions.create(**ask, prediction={"type": "content", "content": text + " zebra quartz"})
        extra = len(llm.tokenizer.encode(text + " zebra quartz", add_special_tokens=False)) - predicted
        assert odd.usage.completion_tokens_details.rejected_prediction_tokens >= extra > 0
        stream = client.chat.completions.create(**ask, prediction={"type": "content", "content": text}, stream=True,
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > 20
        for bad, param in (({"type": "text", "content": "x"}, "prediction"), ({"type": "content"}, "prediction"),
                           ({"type": "content", "content": [{"type": "image"}]}, "prediction.content"),
                           ({"type": "content", "content": 3}, "prediction.content")):
            r = httpx.post(live.url + "/v1/chat/completions", json={**ask, "extra_body": None, "prediction": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_followed_prediction_drafts_past_the_servers_k(tiny_pair):
    """K=2 (the default model's): while the reply follows the prediction its drafts run up to max_k
    (8), not 2; once the reply leaves it, drafts are the policy's K again until one is kept whole."""
    target, _ = tiny_pair
    llm = LLM(str(target), speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    prompt = llm.tokenizer.encode(PROMPT)
    out = list(_run(llm.engine, prompt, GREEDY).out)
    exact = _run(llm.engine, prompt, GREEDY, out)
    assert exact.out == out
    assert exact.stats.target_forward_passes <= len(out) // 9 + 2          # 3 a forward at most with K=2
    assert len(exact.stats.drafted_per_position) == 8                        # drafts as long as max_k
    edited = _run(llm.engine, prompt, GREEDY, out[:10] + [3, 4, 5] + out[13:])
    assert edited.out == out and edited.stats.target_forward_passes < len(out) // 3


def test_common_subsequence_is_the_longest():
    """OpenAI's counts rest on an in-order alignment of prediction and reply: the bit-parallel
    longest common subsequence equals the dynamic program's (difflib's matching blocks, used
    before, are not the longest, and took 29 s on the engine's thread for a 300,000-token
    prediction); a short prediction a reply repeats counts each of its tokens once (an 8-token
    prediction had been counted 23 accepted tokens, once per rejoin)."""
    from specdec.prediction import Prediction, common_subsequence

    def dp(a, b):
        prev = [0] * (len(b) + 1)
        for x in a:
            cur = [0]
            for j, y in enumerate(b):
                cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
            prev = cur
        return prev[-1]
    rng = np.random.default_rng(1)
    for _ in range(400):
        a = rng.integers(0, 4, rng.integers(0, 40)).tolist()
        b = rng.integers(0, 4, rng.integers(0, 40)).tolist()
        assert common_subsequence(a, b) == dp(a, b), (a, b)
    pred = Prediction.of([7, 8] * 4)
    assert pred.appearing_in([7, 8] * 30) == 8 and pred.appearing_in([8, 7]) == 2 and pred.appearing_in([9]) == 0
