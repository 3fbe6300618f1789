"""Verification rules, exactly: hand-built logits and enumerated output distributions."""

from __future__ import annotations

import itertools

import pytest
import torch

from specdec.config import SamplingParams
from specdec.sampling import process
from specdec.verify import rejection_plan, verify_greedy, verify_sampling

V = 5


def one_hot_logits(tokens: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.full((len(tokens), vocab), -5.0)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


@pytest.mark.parametrize("draft,argmax,want,n", [
    ([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4], 3),   # all accepted + bonus
    ([1, 2, 3], [1, 2, 7, 4], [1, 2, 7], 2),      # third rejected, target's token recovered
    ([1, 2, 3], [6, 2, 3, 4], [6], 0),            # none accepted
    ([], [5], [5], 0),                            # K = 0: plain decoding
])
def test_greedy_keeps_longest_matching_prefix(draft, argmax, want, n):
    emitted, num = verify_greedy(torch.tensor(draft, dtype=torch.long), one_hot_logits(argmax))
    assert num.item() == n
    assert emitted[:n + 1].tolist() == want


SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=3),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=1.0, min_p=0.2),
    dict(temperature=0.5, top_k=4, top_p=0.9, min_p=0.05),
]


def _tables(seed: int, K: int, zero_q: bool):
    """Context-dependent logits: p_t(.|prefix), q_t(.|prefix) for prefixes up to K + 1 tokens."""
    g = torch.Generator().manual_seed(seed)
    cache = {}

    def table(kind, prefix):
        key = (kind, tuple(prefix))
        if key not in cache:
            logits = torch.randn(V, generator=g) * 2
            if zero_q and kind == "q":
                logits[0] = float("-inf")        # the draft never proposes 0 where p has mass
            if zero_q and kind == "p":
                logits[V - 1] = float("-inf")    # the target has no mass where the draft does
            cache[key] = logits
        return cache[key]
    return table


def exact_step_distribution(K: int, params: SamplingParams, table, p_of=None, q_of=None) -> dict:
    """P(first two output tokens) under one speculative step (plus the next step's first token
    when the step emits only one), computed by enumerating every draft and every acceptance
    pattern with the probabilities `rejection_plan` returns. p_of(prefix) / q_of(prefix): the
    processed target / draft distributions after prefix (default: process() on the table's
    logits)."""
    p_of = p_of or (lambda prefix: process(table("p", prefix)[None], params)[0])   # noqa: E731
    q_of = q_of or (lambda prefix: process(table("q", prefix)[None], params)[0])   # noqa: E731
    out: dict[tuple, float] = {}
    for draft in itertools.product(range(V), repeat=K):
        q_rows = [q_of(draft[:i]) for i in range(K)]
        w_draft = torch.prod(torch.stack([q_rows[i][draft[i]] for i in range(K)])).item()
        if w_draft == 0:
            continue
        p = torch.stack([p_of(draft[:i]) for i in range(K + 1)])
        acc, cand = rejection_plan(torch.tensor(draft), torch.stack(q_rows), p)
        for n in range(K + 1):   # exactly n accepted
            w = w_draft * torch.prod(acc[:n]).item() * ((1 - acc[n].item()) if n < K else 1.0)
            if w == 0:
                continue
            for y in range(V):
                emitted = list(draft[:n]) + [y]
                wy = w * cand[n, y].item()
                if wy == 0:
                    continue
                if len(emitted) >= 2:
                    key = tuple(emitted[:2])
                    out[key] = out.get(key, 0.0) + wy
                else:   # the next step starts with a first token distributed as p(.|y)
                    nxt = p_of((y,))
                    for b in range(V):
                        out[(y, b)] = out.get((y, b), 0.0) + wy * nxt[b].item()
    return out


@pytest.mark.parametrize("K", [1, 2, 3])
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("zero_q", [False, True], ids=["full-support", "disjoint-mass"])
def test_enumerated_distribution_equals_processed_target(K, settings, zero_q):
    params = SamplingParams(**settings)
    table = _tables(seed=K * 10 + len(settings), K=K, zero_q=zero_q)
    got = exact_step_distribution(K, params, table)
    p1 = process(table("p", ())[None], params)[0]
    for a, b in itertools.product(range(V), repeat=2):
        want = p1[a].item() * process(table("p", (a,))[None], params)[0][b].item()
        assert abs(got.get((a, b), 0.0) - want) < 1e-6, (a, b)


def test_deterministic_draft_is_a_point_mass():
    """q = None (n-gram): accept with probability p(x); on rejection draw from p without x."""
    p = torch.tensor([[0.1, 0.6, 0.3], [0.2, 0.2, 0.6]])
    acc, cand = rejection_plan(torch.tensor([1]), None, p)
    assert acc.tolist() == pytest.approx([0.6])
    assert cand[0].tolist() == pytest.approx([0.25, 0.0, 0.75])
    assert cand[1].tolist() == pytest.approx([0.2, 0.2, 0.6])


def test_sampling_verifier_matches_plan_statistically():
    """verify_sampling draws what rejection_plan describes (seeded Monte Carlo)."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, V, generator=g), -1)
    q = torch.softmax(torch.randn(2, V, generator=g), -1)
    draft = torch.tensor([2, 4])
    acc, cand = rejection_plan(draft, q, p)
    counts = torch.zeros(3)
    first = torch.zeros(V)
    n_trials = 20000
    for _ in range(n_trials):
        emitted, n = verify_sampling(draft, q, p, g)
        counts[n] += 1
        first[emitted[0]] += 1
    want_n = torch.tensor([1 - acc[0], acc[0] * (1 - acc[1]), acc[0] * acc[1]])
    assert (counts / n_trials - want_n).abs().max() < 0.015
    want_first = acc[0] * torch.nn.functional.one_hot(draft[0], V) + (1 - acc[0]) * cand[0]
    assert (first / n_trials - want_first).abs().max() < 0.015


def test_greedy_tokens_equals_torch_argmax():
    """The CPU fast path (numpy) picks torch's index: first maximum, NaN as the maximum, ties,
    all -inf rows, strided views; other dtypes go through torch itself."""
    from specdec.verify import greedy_tokens

    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 49152, generator=g)
    x[1, 10] = x[1, 20] = x[1].max() + 1                  # a tie: the first wins
    x[2, 300] = float("nan")
    x[2, 5] = float("nan")
    x[3] = float("-inf")
    x[4, 7] = float("inf")
    x[4, 9] = float("inf")
    x[5] = 0.0
    x[5, 3] = -0.0
    for t in (x, x[::2], x[:, 1000:], x.T.contiguous().T, x.to(torch.bfloat16), x[0]):
        got = greedy_tokens(t)
        assert got.dtype == torch.int64 and torch.equal(got, t.argmax(-1)), t.shape
