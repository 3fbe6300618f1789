"""Method "suffix", a bug hunter's D1-D5: a datastore of another vocabulary is refused when it
loads and no draft outside the target's vocabulary reaches its forward (D1); a request aborted
while preempted leaves no proposer state behind (D2); the response cache holds each finished
request's response, whatever its prefill's chunking, preemption or prefix caching did (D3); a
greedy request with a seed reads the cache (D4); max_spec_factor caps drafts at floor(factor x
match length), 0 included, as vLLM does (D5)."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.defaults import BUNDLED_TARGET as TOY_TARGET
from specdec.proposers import Draft, RequestContext
from specdec.proposers.suffix import HEADER_TOKENS, SuffixProposer, SuffixSettings, load_datastore, save_datastore
from specdec.proposers.suffix_index import SuffixIndex
from specdec.sampling import make_generator

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def toy():
    """The toy target, plain, with its vocabulary size and a prompt's greedy answer."""
    plain = LLM(model=str(TOY_TARGET), num_speculative_tokens=0)
    prompt = plain.tokenizer.encode("def fibonacci(n):\n")
    ref = list(plain.generate({"prompt_token_ids": prompt}, GREEDY)[0].outputs[0].token_ids)
    return plain, plain.engine.target.config.vocab_size, prompt, ref


# -- D1 ------------------------------------------------------------------------------------------

def test_a_datastore_of_another_vocabulary_is_refused_in_one_line(toy, tmp_path, caplog):
    _, V, prompt, ref = toy
    save_datastore(SuffixIndex.build([prompt + [V + 5, 7]], 16), tmp_path / "big_ids")
    with pytest.raises(ValueError) as e:
        LLM(model=str(TOY_TARGET), speculative_config={"method": "suffix", "model": str(tmp_path / "big_ids")})
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path / "big_ids") in msg and str(V + 5) in msg and str(V) in msg
    # a recorded vocabulary (what `specdec train suffix` now writes) is compared too: another size
    # whose ids fit is a warning (one tokenizer may sit under vocabularies padded to other sizes)
    save_datastore(SuffixIndex.build([prompt + ref], 16), tmp_path / "other", vocab_size=2 * V)
    assert json.loads((tmp_path / "other" / "config.json").read_text())["vocab_size"] == 2 * V
    with caplog.at_level(logging.WARNING, logger="specdec.proposers.suffix"):
        load_datastore(tmp_path / "other", V)
    assert any(str(2 * V) in r.getMessage() and str(V) in r.getMessage() for r in caplog.records)
    # the same vocabulary, and a datastore without the record whose ids fit, load
    save_datastore(SuffixIndex.build([prompt + ref], 16), tmp_path / "same", vocab_size=V)
    save_datastore(SuffixIndex.build([prompt + ref], 16), tmp_path / "old")
    for name in ("same", "old"):
        llm = LLM(model=str(TOY_TARGET), speculative_config={"method": "suffix", "model": str(tmp_path / name)})
        assert llm.engine.proposer.datastore.max_token == max(prompt + ref)
    with pytest.raises(ValueError, match=">= 0"):
        SuffixIndex.build([[1, -3, 2]], 8)


def test_drafts_outside_the_vocabulary_never_reach_the_forward(toy, caplog):
    """A datastore that slipped past the check (set on the proposer here): its drafts are cut
    before the first out-of-vocabulary token, once warned; output stays the plain one."""
    _, V, prompt, ref = toy
    llm = LLM(model=str(TOY_TARGET), speculative_config={
        "method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_cached_requests": 0})
    llm.engine.proposer.datastore = SuffixIndex.build([prompt + ref[:2] + [V, V + 7] + ref[2:]], 32)
    target = llm.engine.target
    forward, fed = target.forward, []

    def checked(tokens, *args, **kwargs):
        fed.append(tokens.clone())
        assert int(tokens.max()) < V and int(tokens.min()) >= 0, "a token outside the vocabulary was fed"
        return forward(tokens, *args, **kwargs)

    target.forward = checked
    with caplog.at_level(logging.WARNING, logger="specdec.engine"):
        outs = [llm.generate({"prompt_token_ids": prompt}, GREEDY)[0] for _ in range(2)]
    assert all(list(o.outputs[0].token_ids) == ref for o in outs)
    assert outs[0].stats.accepted_tokens >= 2           # the two in-vocabulary drafts were kept
    warned = [r for r in caplog.records if "outside the target's vocabulary" in r.getMessage()]
    assert len(warned) == 1 and "suffix" in warned[0].getMessage()


def test_the_engine_cuts_chains_and_trees_at_out_of_vocabulary_tokens(toy):
    _, V, _, _ = toy
    eng = LLM(model=str(TOY_TARGET), speculative_config={"method": "suffix"}).engine
    chain = Draft(torch.tensor([3, 4, V, 5]))
    tree = Draft(torch.tensor([3, V, 4, 6, 7]), None, [-1, -1, 0, 1, 0])     # node 3 lies below the bad node 1
    first = Draft(torch.tensor([-1, 4]))
    drafts, host = eng._on_host([chain, None, tree, first, Draft(torch.tensor([9]))])
    assert drafts[0].tokens.tolist() == [3, 4] and drafts[1] is None and drafts[3] is None
    assert drafts[2].tokens.tolist() == [3, 4, 7] and drafts[2].parents == [-1, 0, 0]
    assert drafts[4].tokens.tolist() == [9] and host == [3, 4, 3, 4, 7, 9]


# -- D2 ------------------------------------------------------------------------------------------

def _small_pool(spec, **kw):
    probe = LLM(model=str(TOY_TARGET), speculative_config=spec, max_model_len=128)
    per_block = 16 * probe.target.kv_bytes_per_slot()
    return LLM(model=str(TOY_TARGET), speculative_config=spec, max_model_len=128,
               kv_cache_memory=probe.engine.blocks.max_blocks_per_seq * per_block, **kw)


@pytest.mark.parametrize("method", ["suffix", "ngram"])
def test_a_request_aborted_while_preempted_leaves_no_proposer_state(method):
    llm = _small_pool({"method": method, "num_speculative_tokens": 4})
    eng, prop = llm.engine, llm.engine.proposer
    ids = list(range(100, 1600))
    reqs = [eng.add_request(ids[s:s + n], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
            for s, n in ((100, 98), (400, 10), (900, 60), (1300, 30))]
    aborted = set()
    while eng.has_unfinished():
        eng.step()
        for r in reqs:
            if r.num_preemptions and r.status != "running" and r.request_id not in aborted and not r.finished:
                eng.abort(r.request_id)
                aborted.add(r.request_id)
    assert aborted                                    # some request was aborted while preempted
    assert not prop.ctx
    if method == "suffix":
        assert not prop._seq and not prop._prompt_len
    # one never admitted (aborted while it waits for its first seat) is taken too
    r = eng.add_request(ids[:5], GREEDY)
    eng.abort(r.request_id)
    assert not prop.ctx


# -- D3 ------------------------------------------------------------------------------------------

def test_a_request_aborted_in_its_prefill_adds_nothing_to_the_cache():
    llm = LLM(model=str(TOY_TARGET), speculative_config={"method": "suffix", "num_speculative_tokens": 4},
              max_num_batched_tokens=16, enable_chunked_prefill=True)
    eng = llm.engine
    r = eng.add_request(list(range(200, 320)), SamplingParams(temperature=0, max_tokens=20))
    for _ in range(3):
        eng.step()
    assert not r.out and 0 < r.num_cached < 119
    eng.abort(r.request_id)
    eng.proposer.cache.wait()
    assert len(eng.proposer.cache.docs) == 0


def test_a_request_preempted_in_its_prefill_caches_only_its_response():
    spec = {"method": "suffix", "num_speculative_tokens": 4}
    probe = LLM(model=str(TOY_TARGET), speculative_config=spec, max_model_len=256)
    per_block = 16 * probe.target.kv_bytes_per_slot()
    llm = LLM(model=str(TOY_TARGET), speculative_config=spec, max_model_len=256, max_num_batched_tokens=8, max_num_seqs=8,
              kv_cache_memory=16 * per_block, enable_chunked_prefill=True)
    eng = llm.engine
    pa, pb = list(range(1000, 1030)), list(range(2000, 2200))
    a = eng.add_request(pa, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(3):
        eng.step()
    b = eng.add_request(pb, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    assert b.num_preemptions
    eng.proposer.cache.wait()
    docs = sorted(tuple(d.tolist()) for d in eng.proposer.cache.docs)
    want = sorted(tuple(p[-HEADER_TOKENS:] + r.seq[len(p):]) for p, r in ((pa, a), (pb, b)))
    assert docs == want


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_fully_cached_and_one_token_prompts_join_the_cache(prefix_caching):
    llm = LLM(model=str(TOY_TARGET), speculative_config={"method": "suffix", "num_speculative_tokens": 4},
              enable_prefix_caching=prefix_caching)
    prompt = list(range(300, 300 + 33))                 # two full blocks before the last token
    for _ in range(3):
        llm.generate({"prompt_token_ids": prompt}, GREEDY)
    llm.generate({"prompt_token_ids": [42]}, GREEDY)
    cache = llm.engine.proposer.cache
    cache.wait()
    assert len(cache.docs) == 4
    assert all(d[:HEADER_TOKENS].tolist() == prompt[-HEADER_TOKENS:] for d in list(cache.docs)[:3])
    assert cache.docs[3][0] == 42 and len(cache.docs[3]) > GREEDY.max_tokens


# -- D4 ------------------------------------------------------------------------------------------

def _ctx(params, V=16384):
    return RequestContext(params, make_generator(params.seed, torch.device("cpu")), V)


def test_a_greedy_request_with_a_seed_reads_the_response_cache():
    p = SuffixProposer(SuffixSettings(max_cached_requests=10))
    p.cache.add([5, 6, 7, 8, 9, 10, 11, 12])
    p.cache.wait()
    p.add_request("greedy", _ctx(SamplingParams(temperature=0, seed=123)))
    p.add_request("sampled", _ctx(SamplingParams(temperature=0.8, seed=123)))
    p.add_request("unseeded", _ctx(SamplingParams(temperature=0.8)))
    assert p.draft("greedy", [1, 6, 7, 8], 3) == [9, 10, 11]
    assert p.draft("unseeded", [1, 6, 7, 8], 3) == [9, 10, 11]
    assert p.draft("sampled", [1, 6, 7, 8], 3) == []        # its output must not depend on other requests


def test_a_seeded_greedy_repeat_drafts_its_earlier_answer():
    llm = LLM(model=str(TOY_TARGET), speculative_config={"method": "suffix", "num_speculative_tokens": 4})
    params = SamplingParams(temperature=0, max_tokens=32, seed=123, ignore_eos=True)
    first = llm.generate(["def parse(text):\n"], params)[0]
    llm.engine.proposer.cache.wait()
    second = llm.generate(["def parse(text):\n"], params)[0]
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.stats.accepted_tokens > first.stats.accepted_tokens


# -- D5 ------------------------------------------------------------------------------------------

def test_max_spec_factor_caps_at_floor_of_factor_times_match_like_vllm():
    store = SuffixIndex.build([[10, 11, 12, 13, 14, 15]], 8)

    def drafts(factor, seq, k=4):
        return SuffixProposer(SuffixSettings(max_cached_requests=0, max_spec_factor=factor), datastore=store).draft(
            "a", seq, k)

    assert drafts(0.5, [1, 11]) == [] and drafts(0.0, [1, 11]) == []        # floor(0.5 x 1) = 0
    assert drafts(0.0, [1, 10, 11, 12, 13]) == []                            # factor 0: never
    assert drafts(0.5, [1, 10, 11]) == [12] and drafts(1.0, [1, 11]) == [12]
    assert drafts(0.7, [1, 10, 11, 12]) == [13, 14]                           # floor(2.1)
    assert drafts(math.inf, [1, 11], 3) == [12, 13, 14] and drafts(1e300, [1, 10, 11], 2) == [12, 13]
    # vLLM's bounds: depth >= 1 and factor >= 0, none above
    s = SuffixSettings.from_extra({"suffix_decoding_max_tree_depth": 100, "suffix_decoding_max_spec_factor": 100.0})
    assert s.max_tree_depth == 100 and s.max_spec_factor == 100.0
    big = SuffixProposer(SuffixSettings(max_tree_depth=10**6, max_cached_requests=4))
    assert big.cache.depth == 1024                                           # clamped inside (MAX_MATCH)
    big.cache.add(list(range(50, 60)))
    big.cache.wait()
    assert big.draft("a", np.arange(40, 55).tolist(), 3) == [55, 56, 57]
    for bad in ({"suffix_decoding_max_tree_depth": 0}, {"suffix_decoding_max_spec_factor": -0.1},
                {"suffix_decoding_max_spec_factor": float("nan")}):
        with pytest.raises(ValueError, match="suffix_decoding_max_"):
            SuffixSettings.from_extra(bad)
