"""Batched verification, exactly: per-row parameters, each row's output distribution
enumerated through the batch verifier, and every row drawing what it draws alone."""

from __future__ import annotations

import collections
import dataclasses
import itertools
from types import SimpleNamespace

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec import verify as verify_mod
from specdec.proposers import Draft
from specdec.sampling import process, process_rows
from specdec.verifier import target_probs, verify_batch
from specdec.verify import PLACEHOLDER, parse_output, verify_greedy, verify_greedy_batch, verify_greedy_host, verify_sampling

from test_engine import exact_first_two, total_variation
from test_tree import exact_tree_distribution
from test_verify import SETTINGS, V, _tables, exact_step_distribution

# other requests that share the batch with the row under test: other parameters, other K
NEIGHBOURS = [SamplingParams(temperature=0.9, top_k=2), SamplingParams(temperature=0),
              SamplingParams(temperature=1.2, top_p=0.7, min_p=0.1)]


def _req(params, seed=0):
    return SimpleNamespace(params=params, ctx=SimpleNamespace(generator=torch.Generator().manual_seed(seed), controls=None))


def batched_p_of(params, table):
    """p_of(prefix) as the batch verifier computes it: the row sits between requests with other
    parameters and other numbers of rows."""
    g = torch.Generator().manual_seed(99)

    def p_of(prefix):
        logits = torch.cat([torch.randn(3, V, generator=g), table("p", prefix)[None], torch.randn(3, V, generator=g)])
        reqs = [_req(NEIGHBOURS[0]), _req(params), _req(NEIGHBOURS[1]), _req(NEIGHBOURS[2])]
        probs = target_probs(reqs, [2, 0, 1, 0], logits, [0, 3, 4, 6])
        return probs[1][0]
    return p_of


def test_verify_greedy_batch_worked_example():
    a, b, c, d, e, x, y, z, w = range(9)
    out = verify_greedy_batch(torch.tensor([a, b, c, d, e]), [2, 0, 3], torch.tensor([a, x, y, z, c, d, e, w]))
    assert out.tolist() == [[a, x, PLACEHOLDER, PLACEHOLDER], [z] + [PLACEHOLDER] * 3, [c, d, e, w]]
    assert parse_output(out.tolist()) == [[a, x], [z], [c, d, e, w]]


def test_greedy_chains_on_the_host_equal_the_tensor_form():
    """The CPU's host-list form gives what the tensor form gives (the worked example, then random
    batches with K 0..4, full and partial acceptances)."""
    a, b, c, d, e, x, y, z, w = range(9)
    assert verify_greedy_host([[a, b], [], [c, d, e]], [a, x, y, z, c, d, e, w]) == [[a, x], [z], [c, d, e, w]]
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        ks = torch.randint(0, 5, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
        argmax = torch.randint(0, 3, (sum(ks) + len(ks),), generator=g)
        drafts = torch.randint(0, 3, (sum(ks),), generator=g)
        want = parse_output(verify_greedy_batch(drafts, ks, argmax).tolist())
        split = [t.tolist() for t in drafts.split(ks)]
        assert verify_greedy_host(split, argmax.tolist()) == want


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_rows_processed_together_equal_each_processed_alone(settings):
    g = torch.Generator().manual_seed(1)
    params = [SamplingParams(**settings), *NEIGHBOURS[::2], SamplingParams(**settings)]
    logits = torch.randn(9, 50, generator=g) * 3
    repeats = [3, 2, 1, 3]
    got = process_rows(logits, params, repeats).split(repeats)
    for rows, p, want_logits in zip(got, params, logits.split(repeats)):
        assert torch.equal(rows, process(want_logits, p))


@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("zero_q", [False, True], ids=["full-support", "disjoint-mass"])
def test_chain_distribution_through_the_batch_equals_target(K, settings, zero_q):
    params = SamplingParams(**settings)
    table = _tables(seed=K * 7 + len(settings), K=K, zero_q=zero_q)
    got = exact_step_distribution(K, params, table, p_of=batched_p_of(params, table))
    solo = lambda prefix: process(table("p", prefix)[None], params)[0]   # noqa: E731
    for a, b in itertools.product(range(V), repeat=2):
        assert abs(got.get((a, b), 0.0) - solo(())[a].item() * solo((a,))[b].item()) < 1e-6, (a, b)


@pytest.mark.parametrize("settings", SETTINGS[:3], ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("fixed", [False, True], ids=["sampled", "fixed-candidates"])
def test_tree_distribution_through_the_batch_equals_target(settings, fixed):
    params = SamplingParams(**settings)
    table = _tables(seed=3 + len(settings), K=3, zero_q=False)
    got = exact_tree_distribution(params, table, fixed, p_of=batched_p_of(params, table))
    solo = lambda prefix: process(table("p", prefix)[None], params)[0]   # noqa: E731
    for a, b in itertools.product(range(V), repeat=2):
        assert abs(got.get((a, b), 0.0) - solo(())[a].item() * solo((a,))[b].item()) < 1e-6, (a, b)


def _batch_case(seed: int):
    """Four requests: sampled chain with q, greedy chain, sampled K = 0, sampled n-gram chain."""
    g = torch.Generator().manual_seed(seed)
    params = [SamplingParams(temperature=0.8, top_k=4), SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, min_p=0.05), SamplingParams(temperature=1.1, top_p=0.9)]
    q = torch.softmax(torch.randn(2, V, generator=g), -1)
    drafts = [Draft(torch.tensor([1, 3]), q), Draft(torch.tensor([2, 2])), None, Draft(torch.tensor([0, 4, 1]))]
    logits = torch.randn(3 + 3 + 1 + 4, V, generator=g)
    offsets = [0, 3, 6, 7]
    for d, off in zip(drafts, offsets):      # the target likes the drafts: some get accepted
        if d is not None:
            logits[torch.arange(off, off + d.k), d.tokens] += 1.5
    return params, drafts, logits, offsets


def test_each_row_draws_what_it_draws_alone():
    """verify_batch's sampled rows equal verify_sampling on the row alone with the same
    generator state, for many seeds (so every acceptance pattern occurs)."""
    params, drafts, logits, offsets = _batch_case(0)
    patterns = set()
    for seed in range(300):
        reqs = [_req(p, seed * 10 + i) for i, p in enumerate(params)]
        got = verify_batch(reqs, drafts, logits, offsets, None)
        for i in (0, 2, 3):
            d = drafts[i]
            k = d.k if d is not None else 0
            tokens = d.tokens if d is not None else torch.empty(0, dtype=torch.long)
            p = process(logits[offsets[i]:offsets[i] + k + 1], params[i])
            emitted, n = verify_sampling(tokens, d.probs if d is not None else None, p,
                                         torch.Generator().manual_seed(seed * 10 + i))
            assert got[i].emitted == emitted[:n + 1].tolist() and got[i].accepted == n.item()
            patterns.add((i, n.item()))
        emitted, n = verify_greedy(drafts[1].tokens, logits[3:6])
        assert got[1].emitted == emitted[:n + 1].tolist()
    assert {(0, 0), (0, 2), (3, 0), (3, 1)} <= patterns


def test_monte_carlo_through_the_batch_verifier():
    """Seeded Monte Carlo of a batch row's first token against its processed target row."""
    params, drafts, logits, offsets = _batch_case(1)
    n = 6000
    counts = [collections.Counter() for _ in params]
    for seed in range(n):
        for i, v in enumerate(verify_batch([_req(p, seed * 10 + i) for i, p in enumerate(params)], drafts, logits,
                                           offsets, None)):
            counts[i][v.emitted[0]] += 1
    for i in (0, 2, 3):
        p = process(logits[offsets[i]:offsets[i] + 1], params[i])[0]
        if drafts[i] is not None and drafts[i].probs is not None:
            continue     # a q-drawn draft: only its average over drafts is p (enumerated above)
        tv = 0.5 * sum(abs(counts[i][t] / n - p[t].item()) for t in range(V))
        assert tv < 0.03, (i, tv)


def test_monte_carlo_through_the_batch_engine(tiny_pair, near_draft, monkeypatch):
    """1000 seeded requests sampled concurrently (64 at a time) follow the target's processed
    distribution over two tokens; a verifier that never rejects must fail the same threshold."""
    params = SamplingParams(temperature=1.0, top_k=2, max_tokens=2, ignore_eos=True)
    llm = LLM(model=tiny_pair[0], speculative_model=near_draft, num_speculative_tokens=2, dtype="float32",
              max_num_seqs=64)
    prompt, n = "def add(a, b):", 1000
    exact = exact_first_two(llm, prompt, params)

    def sample():
        outs = llm.generate([prompt] * n, [dataclasses.replace(params, seed=i) for i in range(n)])
        return collections.Counter(tuple(o.outputs[0].token_ids[:2]) for o in outs)

    assert total_variation(sample(), exact, n) < 0.05
    real_plan = verify_mod.rejection_plan
    monkeypatch.setattr(verify_mod, "rejection_plan",
                        lambda d, q, p: (torch.ones_like(real_plan(d, q, p)[0]), real_plan(d, q, p)[1]))
    assert total_variation(sample(), exact, n) > 0.05
