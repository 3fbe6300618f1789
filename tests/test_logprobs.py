"""Logprobs come from the verification forward: each emitted token's figure equals a reference
computed from the model's own logits over the whole output (one uncached forward), in both
modes, for plain decoding, draft chains and trees, greedy and sampled, in a batch."""

from __future__ import annotations

import math

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.logprobs import FLOOR
from specdec.sampling import process

PROMPTS = ["def add(a, b):", "class Point:", "for i in range(10):", "import os\n"]
TOL = 2e-4


def reference(llm, prompt_ids, out_ids, params, mode, top_n):
    """[(logprob of each output token, its top_n)] from one forward over prompt + output."""
    ids = torch.tensor([prompt_ids + out_ids])
    with torch.inference_mode():
        logits = llm.target(ids).logits[0, len(prompt_ids) - 1:-1].float()      # rows predicting out_ids
    if mode == "processed_logprobs" and not params.greedy:
        logp = process(logits, params).log().clamp_min(FLOOR)
    else:
        logp = torch.log_softmax(logits, -1)
    chosen = logp.gather(1, torch.tensor(out_ids)[:, None])[:, 0].tolist()
    top = logp.topk(top_n, -1) if top_n else None
    return chosen, top


def check(llm, outputs, params, mode):
    for o in outputs:
        for c in o.outputs:
            assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids) > 0
            chosen, top = reference(llm, o.prompt_token_ids, c.token_ids, params, mode, params.logprobs)
            got = [x.logprob for x in c.logprobs]
            assert [x.token_id for x in c.logprobs] == c.token_ids
            assert max(abs(a - b) for a, b in zip(got, chosen)) < TOL, (got, chosen)
            assert math.isclose(c.cumulative_logprob, sum(got))
            for j, x in enumerate(c.logprobs):
                assert len(x.top) == params.logprobs
                assert all(abs(v - w) < TOL for (_, v), w in zip(x.top, top.values[j].tolist()))
                assert x.top[0][1] >= x.logprob - TOL


@pytest.fixture(scope="module")
def llms(tiny_pair, near_draft):
    target, draft = tiny_pair
    common = dict(dtype="float32", max_model_len=128)
    return {"plain": LLM(target, num_speculative_tokens=0, **common),
            "draft_model": LLM(target, speculative_model=str(near_draft), num_speculative_tokens=3, **common),
            "ngram": LLM(target, speculative_config={"method": "ngram", "num_speculative_tokens": 4}, **common)}


@pytest.mark.parametrize("name", ["plain", "draft_model", "ngram"])
@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logprobs"])
def test_logprobs_equal_the_models_own(llms, name, mode):
    llm = llms[name]
    llm.engine.logprobs_mode = mode
    try:
        greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)
        check(llm, llm.generate(PROMPTS, greedy), greedy, mode)
        sampled = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, n=2, max_tokens=20, ignore_eos=True,
                                 logprobs=2)
        outs = llm.generate(PROMPTS, sampled)
        check(llm, outs, sampled, mode)
        if mode == "processed_logprobs":      # every emitted token was possible under p
            assert all(x.logprob > FLOOR for o in outs for c in o.outputs for x in c.logprobs)
    finally:
        llm.engine.logprobs_mode = "processed_logprobs"


def test_speculation_emitted_several_tokens_per_step(llms):
    """The checks above cover accepted drafts and bonus tokens, not only one token per step."""
    llm = llms["draft_model"]
    out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0))
    assert sum(o.stats.accepted_tokens for o in out) > 0
    assert all(x.top == () for o in out for x in o.outputs[0].logprobs)


def test_tree_logprobs(heads_llm):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    out = heads_llm.generate(PROMPTS[:2], params)
    assert sum(o.stats.accepted_tokens for o in out) > 0
    check(heads_llm, out, params, "processed_logprobs")


@pytest.fixture(scope="module")
def heads_llm(tiny_pair, tmp_path_factory):
    """EAGLE trees (untrained heads built from the target's LM head: some nodes are accepted)."""
    from test_heads import _heads_dirs

    target, _ = tiny_pair
    dirs = _heads_dirs(target, tmp_path_factory.mktemp("heads"))
    return LLM(target, speculative_config={"method": "eagle", "model": str(dirs["eagle"]), "num_speculative_tokens": 8},
               dtype="float32", max_model_len=128)
