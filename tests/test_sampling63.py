"""review63's sampling defects: processed logprobs / logits are -inf exactly where a filter removed
the token (a probability that underflowed to 0 is not a removed token), out-of-vocabulary
stop_token_ids are refused (vLLM's rule), offline and on the server."""

from __future__ import annotations

import math

import openai
import pytest
import torch
from test_server import LiveServer

from specdec import LLM, SamplingParams
from specdec.sampling import process_rows, processed_logits
from specdec.server import ServerConfig, build_app

TEMP = 0.01          # the toy target's logits span far more than 87 * TEMP: most probabilities underflow
PROMPT = "def add(a, b):"


def _reference(llm, prompt_ids, out_ids) -> torch.Tensor:
    """[len(out_ids), V] raw logits of the rows predicting out_ids, from one uncached forward."""
    with torch.inference_mode():
        logits = llm.target(torch.tensor([prompt_ids + out_ids])).logits[0].float()
    return logits[len(prompt_ids) - 1:-1]


@pytest.fixture(scope="module")
def llms(tiny_pair, near_draft):
    target, _ = tiny_pair
    made = {}

    def get(method: str, mode: str) -> LLM:
        if (method, mode) not in made:
            spec = {"plain": dict(num_speculative_tokens=0),
                    "draft_model": dict(speculative_model=str(near_draft), num_speculative_tokens=3),
                    "ngram": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                      "prompt_lookup_min": 1, "prompt_lookup_max": 3})}[method]
            made[method, mode] = LLM(target, dtype="float32", max_model_len=128, logprobs_mode=mode, max_logprobs=-1, **spec)
        return made[method, mode]
    return get


@pytest.mark.parametrize("method", ["plain", "draft_model", "ngram"])
@pytest.mark.parametrize("mode", ["processed_logprobs", "processed_logits"])
def test_processed_modes_report_underflowed_tokens(llms, method, mode):
    """No filter: every token is reported, logits / T or log_softmax(logits / T) (vLLM's), on each
    row of a verification too; top_k 3: exactly 3 tokens finite at each position."""
    llm = llms(method, mode)
    prompt_ids = llm.tokenizer.encode(PROMPT)
    V = llm.engine.target.config.vocab_size
    for top_k in (0, 3):
        params = SamplingParams(temperature=TEMP, top_k=top_k, seed=1, max_tokens=10, ignore_eos=True, logprobs=-1)
        out = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)[0].outputs[0]
        scaled = _reference(llm, prompt_ids, list(out.token_ids)) / TEMP
        want = scaled if mode == "processed_logits" else torch.log_softmax(scaled, -1)
        for j, entry in enumerate(out.logprobs):
            got = torch.full((V,), math.nan)
            ids, values = zip(*entry.top)
            got[list(ids)] = torch.tensor(values)
            if top_k == 0:
                assert got.isfinite().all(), f"position {j}: {int((~got.isfinite()).sum())} tokens reported -inf"
                assert torch.allclose(got, want[j], rtol=1e-4, atol=1e-2)
            else:
                kept = got.isfinite()
                assert int(kept.sum()) == 3 and set(kept.nonzero().flatten().tolist()) == set(want[j].topk(3).indices.tolist())
                assert torch.allclose(got[kept], (scaled[j] if mode == "processed_logits" else
                                                  torch.log_softmax(scaled[j].masked_fill(~kept, -math.inf), -1))[kept],
                                      rtol=1e-4, atol=1e-2)
                assert (got[~kept] == -math.inf).all()


@pytest.mark.parametrize("kernel", [True, False])
def test_processed_logits_mark_exactly_the_filtered_tokens(kernel):
    """sampling.c and the PyTorch path: -inf where a control (here: a -inf logit) or a filter
    removed the token, never where the sampler can draw it, and never only because the
    probability underflowed; log_softmax of the result is the sampler's distribution."""
    torch.manual_seed(0)
    V = 2000
    raw = torch.randn(3, V) * 30            # at temperature 1 most probabilities are 0 in float32
    raw[:, 5] = -math.inf
    for kw in (dict(), dict(top_k=40), dict(top_p=0.9), dict(min_p=0.05), dict(top_k=500, min_p=1e-36),
               dict(top_k=50, top_p=0.8, min_p=0.01)):
        params = SamplingParams(temperature=1.0, **kw)
        x = processed_logits(raw, [params], [3], kernel=kernel)
        probs = process_rows(raw, [params], [3], kernel=kernel)
        assert not (x.isinf() & (probs > 0)).any()
        live = probs > 1e-30            # denormal probabilities hold few bits
        assert torch.allclose(torch.log_softmax(x, -1)[live], probs.log()[live], atol=1e-4)
        if not kw:
            assert torch.equal(x.isinf(), raw.isinf()) and torch.equal(x, raw)
        elif kw == dict(top_k=40):
            assert (x.isfinite().sum(-1) == 40).all()
        elif kw.get("min_p") == 1e-36:       # kept: p >= 1e-36 p(best), e^-82.9, under float32's softmax
            best = raw.amax(-1, keepdim=True)
            assert torch.equal(x.isfinite(), (raw >= raw.topk(500).values[:, -1:]) & (raw - best >= math.log(1e-36)))
        else:
            assert torch.equal(x.isinf(), probs == 0)


def test_oov_stop_token_ids_refused_offline(llms):
    llm = llms("plain", "processed_logprobs")
    V = llm.engine.target.config.vocab_size
    for kw in (dict(stop_token_ids=[V + 5]), dict(stop_token_ids=[3, V], min_tokens=2)):
        with pytest.raises(ValueError, match=rf"token_id\(s\) \[{kw['stop_token_ids'][-1]}\] in stop_token_ids contain "
                                             rf"out-of-vocab token ids\. Vocabulary size: {V}"):
            llm.generate([PROMPT], SamplingParams(max_tokens=3, **kw), use_tqdm=False)
    assert llm.generate([PROMPT], SamplingParams(max_tokens=3, stop_token_ids=[V - 1]), use_tqdm=False)[0].outputs


@pytest.fixture(scope="module")
def client(llms):
    llm = llms("draft_model", "processed_logprobs")
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("tiny",)))) as live, \
            openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        c.vocab = llm.engine.target.config.vocab_size
        yield c


def test_server_processed_logprobs_finite_without_filters(client):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=TEMP, seed=3, logprobs=5,
                                  extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    tops = r.choices[0].logprobs.top_logprobs
    assert len(tops) == 6
    assert all(len(t) == 5 and min(t.values()) > -9999.0 for t in tops), tops


def test_server_refuses_oov_stop_token_ids(client):
    with pytest.raises(openai.BadRequestError, match="in stop_token_ids contain out-of-vocab token ids"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3,
                                  extra_body={"stop_token_ids": [client.vocab + 5]})
    ok = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0.5, n=2, seed=1)
    assert len(ok.choices) == 2
