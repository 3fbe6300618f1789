"""Method "suffix": the suffix index against brute force, the datastore folder, the proposer's
sources, and losslessness through the engine (greedy identical, seeded sampling unaffected by
what other requests left in the response cache)."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from specdec import LLM, SamplingParams
from specdec.config import SpeculativeConfig
from specdec.proposers import build_proposer
from specdec.proposers.suffix import SuffixProposer, SuffixSettings, load_datastore, save_datastore
from specdec.proposers.suffix_index import SuffixIndex

from specdec.defaults import BUNDLED_TARGET as TOY_TARGET


def brute_match(docs, tail, depth):
    """Longest m (<= depth) with tail[-m:] inside one document; the end positions (doc, i) of its occurrences."""
    best = (0, [])
    for m in range(1, min(len(tail), depth) + 1):
        pat = list(tail[-m:])
        occ = [(d, i + m - 1) for d, doc in enumerate(docs) for i in range(len(doc) - m + 1) if list(doc[i:i + m]) == pat]
        if not occ:
            break
        best = (m, occ)
    return best


@pytest.mark.parametrize("kernel", [True, False], ids=["C", "numpy"])
@pytest.mark.parametrize("seed", range(6))
def test_match_and_continuation_agree_with_brute_force(seed, kernel):
    rng = np.random.default_rng(seed)
    vocab = 3 + seed                       # small vocabularies: many repeats, long matches
    docs = [rng.integers(0, vocab, rng.integers(1, 40)).tolist() for _ in range(rng.integers(1, 8))]
    depth = 6
    ix = SuffixIndex.build(docs, depth)
    assert ix.num_tokens == sum(map(len, docs))
    for _ in range(40):
        tail = rng.integers(0, vocab + 1, rng.integers(1, 10))      # vocab itself occurs nowhere
        lo, hi, m = ix.match(tail, kernel=kernel)
        bm, occ = brute_match(docs, tail, depth)
        assert m == bm and hi - lo == len(occ)
        if not m:
            continue
        # every occurrence found, as forward end positions
        ends = sorted((ix.n - 1 - int(s)) for s in ix.sa[lo:hi])
        flat = []
        for d, doc in enumerate(docs):
            flat += [None] + [(d, i) for i in range(len(doc))]
        assert sorted(flat[e] for e in ends) == sorted(occ)
        # the chain: the most frequent next token among occurrences agreeing so far (ties: smaller id)
        toks, probs = ix.continue_chain(lo, hi, m, 4, 0.0, kernel=kernel)
        live = occ
        for j, (t, p) in enumerate(zip(toks, probs)):
            nxt = Counter(docs[d][i + 1 + j] for d, i in live if i + 1 + j < len(docs[d]))
            top = max(nxt.values())
            assert t == min(k for k, v in nxt.items() if v == top) and p == pytest.approx(top / len(occ))
            live = [(d, i) for d, i in live if i + 1 + j < len(docs[d]) and docs[d][i + 1 + j] == t]
        assert len(toks) == 4 or not any(i + 1 + len(toks) < len(docs[d]) for d, i in live)


def test_kernel_lookup_equals_numpy_with_a_spread_of_occurrences():
    """lookup.c against the NumPy forms where the occurrences are thinned to max_occurrences
    (NumPy's linspace picks them) and where min_token_prob cuts the chain."""
    rng = np.random.default_rng(11)
    docs = [rng.integers(0, 4, rng.integers(20, 200)).tolist() for _ in range(30)]
    ix = SuffixIndex.build(docs, 8)
    for _ in range(60):
        tail = rng.integers(0, 4, rng.integers(1, 6))
        found = ix.match(tail)
        assert found == ix.match(tail, kernel=False)
        lo, hi, m = found
        for occ, prob in ((7, 0.0), (64, 0.2), (4096, 0.05)):
            assert ix.continue_chain(lo, hi, m, 6, prob, max_occurrences=occ) == \
                ix.continue_chain(lo, hi, m, 6, prob, max_occurrences=occ, kernel=False)


def test_min_token_prob_and_save_load(tmp_path):
    docs = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 5], [1, 2, 9]]
    ix = SuffixIndex.build(docs, 8)
    lo, hi, m = ix.match(np.array([7, 1, 2]))
    assert m == 2 and hi - lo == 4
    assert ix.continue_chain(lo, hi, m, 3, 0.0) == ([3, 5], [0.75, 0.5])
    assert ix.continue_chain(lo, hi, m, 3, 0.6)[0] == [3]                   # 5 holds half the paths
    save_datastore(ix, tmp_path / "store", {"note": "test"})
    back = load_datastore(tmp_path / "store")
    assert back.fwd.dtype == np.int32 and np.array_equal(back.sa, ix.sa) and back.depth == 8
    assert back.continue_chain(*back.match(np.array([1, 2])), 3, 0.0) == ([3, 5], [0.75, 0.5])
    assert json.loads((tmp_path / "store" / "config.json").read_text())["num_tokens"] == 15
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(ValueError, match="not a suffix datastore"):
        load_datastore(tmp_path / "bad")
    with pytest.raises(ValueError, match="no readable config.json"):
        load_datastore(tmp_path / "nothing")


def test_proposer_sources_and_spec_factor():
    store = SuffixIndex.build([[10, 11, 12, 13, 14, 15]], 8)
    p = SuffixProposer(SuffixSettings(max_cached_requests=0, max_spec_factor=1.0), datastore=store)
    assert p.draft("a", [1, 2, 3, 4, 2, 3], 3) == [4, 2, 3]          # own context: a 2-token match wins
    assert p.draft("a", [1, 10, 11], 4) == [12, 13]                  # datastore: match 2, factor 1 -> 2 tokens
    assert p.draft("a", [1, 11], 4) == [12]
    assert p.draft("a", [1, 99], 4) == []
    p0 = SuffixProposer(SuffixSettings(max_cached_requests=0, max_spec_factor=0.5), datastore=store)
    assert p0.draft("a", [1, 10, 11, 12, 13], 4) == [14, 15]          # match 4 x 0.5
    with pytest.raises(ValueError, match="suffix_decoding_min_token_prob"):
        SuffixSettings(min_token_prob=2)
    with pytest.raises(ValueError, match="suffix_decoding_max_tree_depth"):
        SuffixSettings.from_extra({"suffix_decoding_max_tree_depth": 0})


def test_response_cache_learns_finished_outputs():
    llm = LLM(model=str(TOY_TARGET), speculative_config={"method": "suffix", "num_speculative_tokens": 4})
    proposer = llm.engine.proposer
    assert isinstance(proposer, SuffixProposer) and proposer.datastore is None
    prompt = "def fibonacci(n):\n"
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    first = llm.generate([prompt], greedy)[0]
    proposer.cache.wait()
    assert proposer.cache.index is not None and proposer.cache.indexed == 1
    second = llm.generate([prompt], greedy)[0]
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    # the repeated prompt drafts its earlier answer: nearly every draft is kept
    assert second.stats.accepted_tokens > first.stats.accepted_tokens
    assert second.stats.accepted_tokens >= 0.8 * second.stats.draft_tokens


def test_greedy_identical_with_a_datastore_and_batched(tmp_path):
    plain = LLM(model=str(TOY_TARGET), num_speculative_tokens=0)
    prompts = ["def add(a, b):\n", "import os\n\ndef list_files(path):\n", "class Stack:\n", "for i in range(10):\n"]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy)]
    # a datastore of the target's own answers to other prompts
    others = plain.generate(["def mul(a, b):\n", "def read(path):\n", "class Queue:\n"], greedy)
    save_datastore(SuffixIndex.build([o.prompt_token_ids[-3:] + list(o.outputs[0].token_ids) for o in others], 16),
                   tmp_path / "store")
    spec = LLM(model=str(TOY_TARGET), max_num_seqs=4, speculative_config={
        "method": "suffix", "model": str(tmp_path / "store"), "num_speculative_tokens": 3})
    outs = spec.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert sum(o.stats.accepted_tokens for o in outs) > 0
    auto = LLM(model=str(TOY_TARGET), speculative_config={
        "method": "suffix", "model": str(tmp_path / "store"), "num_speculative_tokens": "auto"})
    assert [o.outputs[0].token_ids for o in auto.generate(prompts, greedy)] == ref


def test_seeded_sampling_ignores_the_response_cache():
    cfg = {"method": "suffix", "num_speculative_tokens": 3}
    sampled = SamplingParams(temperature=0.8, max_tokens=32, seed=5, ignore_eos=True)
    fresh = LLM(model=str(TOY_TARGET), speculative_config=cfg)
    alone = fresh.generate(["def parse(text):\n"], sampled)[0].outputs[0].token_ids
    busy = LLM(model=str(TOY_TARGET), speculative_config=cfg)
    busy.generate(["def parse(text):\n", "def parse(line):\n"], SamplingParams(temperature=0, max_tokens=32))
    busy.engine.proposer.cache.wait()
    assert busy.engine.proposer.cache.index is not None
    assert busy.generate(["def parse(text):\n"], sampled)[0].outputs[0].token_ids == alone


def test_registered_and_configured_like_vllm():
    spec = SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 8,
                                        "suffix_decoding_max_tree_depth": 16, "suffix_decoding_min_token_prob": 0.2,
                                        "suffix_decoding_max_spec_factor": 2.0, "suffix_decoding_max_cached_requests": 7})
    p = build_proposer(spec, None, None, 256)
    assert p.settings == SuffixSettings(16, 7, 2.0, 0.2) and p.cache.max_requests == 7
    with pytest.raises(ValueError, match="suffix_decoding_max_spec_factor"):
        build_proposer(SpeculativeConfig.from_dict({"method": "suffix", "suffix_decoding_max_spec_factor": -1}),
                       None, None, 256)
