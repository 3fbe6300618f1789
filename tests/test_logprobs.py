"""Logprobs come from the verification forward: each emitted token's figure equals a reference
computed from the model's own logits over the whole output (one uncached forward), in both
modes, for plain decoding, draft chains and trees, greedy and sampled, in a batch."""

from __future__ import annotations

import json
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
    if mode == "raw_logits":
        logp = logits
    elif mode == "processed_logits" and not params.greedy:
        logp = (logits / params.temperature).masked_fill(process(logits, params) == 0, -math.inf)
    elif mode == "processed_logits":
        logp = logits
    elif mode == "processed_logprobs" and not params.greedy:
        logp = process(logits, params).log()
    else:
        logp = torch.log_softmax(logits, -1)
    chosen = logp.gather(1, torch.tensor(out_ids)[:, None])[:, 0].tolist()
    top = logp.topk(top_n, -1) if top_n else None
    return chosen, top


def close(a: float, b: float) -> bool:
    return a == b or abs(a - b) < TOL          # -inf: a token top-k / top-p removed (processed modes)


def check(llm, outputs, params, mode):
    for o in outputs:
        for c in o.outputs:
            assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids) > 0
            chosen, top = reference(llm, o.prompt_token_ids, c.token_ids, params, mode, params.logprobs)
            got = [x.logprob for x in c.logprobs]
            assert [x.token_id for x in c.logprobs] == c.token_ids
            assert all(close(a, b) for a, b in zip(got, chosen)), (got, chosen)
            assert math.isclose(c.cumulative_logprob, sum(got))
            for j, x in enumerate(c.logprobs):
                assert len(x.top) == params.logprobs
                assert all(close(v, w) for (_, v), w in zip(x.top, top.values[j].tolist()))
                assert x.top[0][1] >= x.logprob - TOL


@pytest.fixture(scope="module")
def llms(tiny_pair, near_draft):
    target, draft = tiny_pair
    common = dict(dtype="float32", max_model_len=128)
    return {"plain": LLM(target, num_speculative_tokens=0, **common),
            "draft_model": LLM(target, speculative_model=str(near_draft), num_speculative_tokens=3, **common),
            "ngram": LLM(target, speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}, **common)}


@pytest.mark.parametrize("name", ["plain", "draft_model", "ngram"])
@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logprobs", "processed_logits", "raw_logits"])
def test_logprobs_equal_the_models_own(llms, name, mode):
    llm = llms[name]
    default = llm.engine.logprobs_mode
    llm.engine.logprobs_mode = mode
    try:
        greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)
        check(llm, llm.generate(PROMPTS, greedy), greedy, mode)
        sampled = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, n=2, max_tokens=20, ignore_eos=True,
                                 logprobs=2)
        outs = llm.generate(PROMPTS, sampled)
        check(llm, outs, sampled, mode)
        if mode.startswith("processed"):      # every emitted token was possible under p
            assert all(x.logprob > FLOOR for o in outs for c in o.outputs for x in c.logprobs)
    finally:
        llm.engine.logprobs_mode = default


def test_raw_logprobs_are_the_default_as_in_vllm(tiny_pair):
    from specdec.cli import main

    assert LLM(tiny_pair[0], num_speculative_tokens=0, max_model_len=64).engine.logprobs_mode == "raw_logprobs"
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(tiny_pair[0]), "--logprobs-mode", "raw", "x"])
    assert e.value.code == 2


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


def prompt_reference(llm, prompt_ids, top_n):
    """Raw logprob of each prompt token after the first, and the top_n at its position."""
    with torch.inference_mode():
        logp = torch.log_softmax(llm.target(torch.tensor([prompt_ids])).logits[0, :-1].float(), -1)
    return logp.gather(1, torch.tensor(prompt_ids[1:])[:, None])[:, 0].tolist(), logp.topk(top_n, -1) if top_n else None


def prompt_ranks(llm, prompt_ids):
    """1 + how many tokens the model finds likelier than each prompt token (after the first)."""
    with torch.inference_mode():
        logp = torch.log_softmax(llm.target(torch.tensor([prompt_ids])).logits[0, :-1].float(), -1)
    chosen = logp.gather(1, torch.tensor(prompt_ids[1:])[:, None])
    return ((logp > chosen).sum(-1) + 1).tolist()


@pytest.mark.parametrize("name", ["plain", "draft_model"])
def test_prompt_logprobs_equal_the_models_own_through_chunked_prefill(tiny_pair, near_draft, name):
    """vLLM's SamplingParams.prompt_logprobs: the prefill's own rows, chunk by chunk (8 tokens a
    step here), raw; the output is what the same request decodes without them."""
    target, _ = tiny_pair
    spec = dict(speculative_model=str(near_draft), num_speculative_tokens=3) if name == "draft_model" else {}
    llm = LLM(target, dtype="float32", max_model_len=128, max_num_batched_tokens=8, max_num_seqs=8, **spec)
    prompts = [PROMPTS[0] * 5, PROMPTS[1], "x"]          # 3 chunks and more, one, and a 1-token prompt
    params = SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=3)
    outs = llm.generate(prompts, params)
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
    for o, p in zip(outs, plain):
        ids, lps = o.prompt_token_ids, o.prompt_logprobs
        assert len(lps) == len(ids) and lps[0] is None and p.prompt_logprobs is None
        assert o.outputs[0].token_ids == p.outputs[0].token_ids
        if len(ids) == 1:
            continue
        chosen, top = prompt_reference(llm, ids, 3)
        assert [x.token_id for x in lps[1:]] == ids[1:]
        assert max(abs(x.logprob - c) for x, c in zip(lps[1:], chosen)) < TOL
        ranks = prompt_ranks(llm, ids)
        assert [x.rank for x in lps[1:]] == ranks
        for j, x in enumerate(lps[1:]):
            assert [t for t, _ in x.top] == top.indices[j].tolist()
            assert all(abs(v - w) < TOL for (_, v), w in zip(x.top, top.values[j].tolist()))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-2)          # -1 is vLLM's "every token"


def test_max_logprobs_bounds_what_a_request_may_ask(tiny_pair):
    """vLLM's --max-logprobs: 20 by default; more is refused before anything runs; -1 allows the
    whole vocabulary, whose alternatives are then every token, best first."""
    target, _ = tiny_pair
    llm = LLM(target, dtype="float32", max_model_len=64, num_speculative_tokens=0)
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"{field} must be at most 20 \\(max_logprobs\\), got 21"):
            llm.generate("x", SamplingParams(max_tokens=2, **{field: 21}))
    wide = LLM(target, dtype="float32", max_model_len=64, num_speculative_tokens=0, max_logprobs=-1)
    vocab = wide.target.config.vocab_size
    out = wide.generate("x y", SamplingParams(temperature=0, max_tokens=2, logprobs=vocab, prompt_logprobs=vocab))[0]
    for lp in out.outputs[0].logprobs + out.prompt_logprobs[1:]:
        values = [v for _, v in lp.top]
        assert len(lp.top) == vocab and values == sorted(values, reverse=True)
    with pytest.raises(ValueError, match="max_logprobs must be an integer"):
        LLM(target, dtype="float32", num_speculative_tokens=0, max_logprobs=-2)


def test_prompt_logprobs_bypass_the_prefix_cache(tiny_pair):
    """A prompt whose blocks are cached is still scored in full (every position's row is needed);
    without prompt_logprobs the same prompt takes the cached blocks."""
    target, _ = tiny_pair
    llm = LLM(target, dtype="float32", max_model_len=128, enable_prefix_caching=True, block_size=4)
    prompt = PROMPTS[2] * 3
    first = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))[0]
    again = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))[0]
    assert again.stats.cached_tokens == 0 and again.prompt_logprobs == first.prompt_logprobs
    assert all(x is not None and x.top == () for x in again.prompt_logprobs[1:])
    cached = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2))[0]
    assert cached.stats.cached_tokens > 0 and cached.outputs[0].token_ids == first.outputs[0].token_ids


def test_prompt_logprobs_survive_preemption(tiny_pair):
    """A preempted request asking for prompt logprobs is recomputed with nothing of its prompt left
    to score (was an IndexError that failed the whole step); its figures equal a roomy pool's."""
    target, _ = tiny_pair
    probe = LLM(target, dtype="float32", num_speculative_tokens=0, max_model_len=128, max_num_seqs=1)
    per = probe.engine.target.kv_bytes_per_slot(dtype=probe.engine.kv_dtype)
    ids = probe.tokenizer.encode("".join(f"def f{i}(x): return x * {i}\n" for i in range(12)))
    prompts = [{"prompt_token_ids": ids[i * 5:i * 5 + 60]} for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, prompt_logprobs=1 if i % 2 == 0 else None)
              for i in range(6)]
    kw = dict(dtype="float32", num_speculative_tokens=0, max_model_len=128, max_num_seqs=4)
    small = LLM(target, kv_cache_memory=per * 16 * 10, **kw)
    got = small.generate(prompts, params)
    want = LLM(target, **kw).generate(prompts, params)
    assert small.engine.num_preemptions > 0
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert (g.prompt_logprobs is None) == (w.prompt_logprobs is None)
        if w.prompt_logprobs is not None:
            assert [x.logprob if x else None for x in g.prompt_logprobs] == \
                pytest.approx([x.logprob if x else None for x in w.prompt_logprobs], abs=1e-5)


def test_tied_alternatives_are_listed_by_token_id_whatever_the_batch():
    """A grammar's masked tokens all score the same: which of them top_logprobs lists, and in what
    order, is by token id, not by the batch's shape (a request alone or among many)."""
    from specdec.config import SamplingParams as Params
    from specdec.logprobs import step_logprobs

    V = 4096
    gen = torch.Generator().manual_seed(0)
    row = torch.full((V,), -1e4)
    row[[7, 300, 2000]] = torch.tensor([3.0, 2.0, 2.0])        # two tied leaders, then thousands tied
    params = Params(temperature=0, logprobs=5)
    alone = step_logprobs(row[None], [(params, [0], [7])], "raw_logprobs")[0][0]
    others = torch.randn(70, V, generator=gen)
    batch = torch.cat([others[:33], row[None], others[33:]])
    wanted = [(params, [i], [0]) for i in range(33)] + [(params, [33], [7])] + \
        [(params, [i], [0]) for i in range(34, 71)]
    among = step_logprobs(batch, wanted, "raw_logprobs")[33][0]
    assert alone.top == among.top
    assert [t for t, _ in alone.top] == [7, 300, 2000, 0, 1]


def test_raw_logprobs_under_a_grammar_see_its_mask(tiny_pair, near_draft):
    """vLLM applies a grammar's bitmask to the logits before its sampler, so its raw logprobs of a
    constrained request are spread over the allowed tokens alone (guided_choice's confidence
    scores): here too, plain and speculative alike (they were the unconstrained distribution:
    the chosen token at rank 10, none of the top five allowed)."""
    from specdec.config import StructuredOutputsParams

    params = SamplingParams(temperature=0, max_tokens=16, logprobs=20,
                            structured_outputs=StructuredOutputsParams(choice=["def add", "class Point"]))
    outs = [LLM(str(tiny_pair[0]), max_model_len=128, **kw).generate(["x = 1\n"], params)[0].outputs[0]
            for kw in ({"num_speculative_tokens": 0}, {"speculative_model": str(near_draft), "num_speculative_tokens": 3})]
    assert outs[0].text in ("def add", "class Point") and outs[0].token_ids == outs[1].token_ids
    for entry in outs[0].logprobs:
        assert entry.rank == 1 and entry.top[0][0] == entry.token_id
        assert sum(math.exp(lp) for _, lp in entry.top if lp > FLOOR) == pytest.approx(1.0, abs=1e-4)
    for a, b in zip(outs[0].logprobs, outs[1].logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_completions_logprobs_minus_one_lists_the_whole_vocabulary(tiny_pair):
    """With --max-logprobs -1, a completions request's logprobs -1 lists every token at each
    position, as chat's top_logprobs -1 and offline do (it had listed the chosen token alone)."""
    import httpx

    from specdec.server import ServerConfig, build_app
    from test_server import LiveServer

    target, _ = tiny_pair
    llm = LLM(target, dtype="float32", max_model_len=64, num_speculative_tokens=0, max_logprobs=-1)
    vocab = llm.target.config.vocab_size
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("t",)))) as live:
        for stream in (False, True):
            r = httpx.post(live.url + "/v1/completions", timeout=60, json={
                "prompt": "x y", "max_tokens": 2, "temperature": 0, "logprobs": -1, "stream": stream})
            assert r.status_code == 200, r.text
            if stream:
                chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
                tops = [t for c in chunks for ch in c["choices"] if ch.get("logprobs") for t in ch["logprobs"]["top_logprobs"]]
            else:
                tops = r.json()["choices"][0]["logprobs"]["top_logprobs"]
            # tokens that decode alike share one key (OpenAI's {text: logprob} shape)
            names = len({llm.tokenizer.decode([i]) for i in range(vocab)})
            assert len(tops) == 2 and all(len(t) == names for t in tops), [len(t) for t in tops]
