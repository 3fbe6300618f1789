"""Tree verification, exactly: enumerated output distributions over every draft tree and every
acceptance pattern, with candidates drawn without replacement and branches sharing prefixes."""

from __future__ import annotations

import itertools

import pytest
import torch

from specdec.config import SamplingParams
from specdec.sampling import process
from specdec.verify import sibling_plan, tree_children, verify_tree_greedy, verify_tree_sampling

from test_verify import SETTINGS, _tables

V = 5
# root -> nodes 0, 1; node 0 -> nodes 2, 3; node 1 -> node 4; node 2 -> node 5:
# two branches share the prefix [node 0], and depths differ
SHAPE = [-1, -1, 0, 0, 1, 2]


def test_children_and_topological_order():
    assert tree_children(SHAPE) == [[0, 1], [2, 3], [4], [5], [], [], []]
    with pytest.raises(ValueError, match="parents must come before"):
        tree_children([-1, 2, 0])


@pytest.mark.parametrize("argmax,path,emitted", [
    ([7, 7, 7, 7, 7, 7, 7], [], [7]),              # root's choice is no candidate
    ([2, 9, 6, 7, 7, 7, 7], [1], [2, 6]),          # second branch, then its child misses
    ([1, 4, 3, 3, 7, 5, 9], [0, 2, 5], [1, 4, 3, 9]),  # deepest branch, all accepted + bonus
    ([1, 8, 3, 3, 7, 5, 7], [0, 3], [1, 8, 7]),    # shared prefix, the other branch
])
def test_greedy_tree_follows_the_target_argmax(argmax, path, emitted):
    tokens = [1, 2, 4, 8, 3, 3]
    assert verify_tree_greedy(tokens, SHAPE, argmax) == (path, emitted)


def draws_without_replacement(q: torch.Tensor, m: int):
    """Every ordered draw of up to m distinct tokens from q, with its probability (fewer when
    q's support is smaller: a proposer cannot draw what has no mass)."""
    support = [t for t in range(V) if q[t] > 0]
    m = min(m, len(support))
    for seq in itertools.permutations(support, m):
        w, left = 1.0, 1.0
        for t in seq:
            w *= q[t].item() / left
            left -= q[t].item()
        yield list(seq), w


def exact_tree_distribution(params: SamplingParams, table, fixed: bool, p_of=None, q_of=None) -> dict:
    """P(first two output tokens) of one tree step (plus the next step's first token when the
    step emits one), enumerating every tree the proposer can draw and every acceptance pattern
    with the probabilities `sibling_plan` gives. p_of, q_of as in
    test_verify.exact_step_distribution."""
    p_of = p_of or (lambda prefix: process(table("p", prefix)[None], params)[0])   # noqa: E731
    q_of = q_of or (lambda prefix: process(table("q", prefix)[None], params)[0])   # noqa: E731
    children = tree_children(SHAPE)
    out: dict[tuple, float] = {}

    def add(key, w):
        out[key] = out.get(key, 0.0) + w

    def expand(row, prefix, w):
        """The distribution of what the walk emits from node `row` (0 = root) on."""
        kids = children[row]
        if fixed:   # deterministic candidates: the top tokens of q, a point mass each
            q = q_of(prefix)
            order = [t for t in q.argsort(descending=True).tolist() if q[t] > 0][:len(kids)]
            options = [(order, 1.0)]
        else:
            options = list(draws_without_replacement(q_of(prefix), len(kids))) if kids else [([], 1.0)]
        for cand, wc in options:
            accept, final = sibling_plan(p_of(prefix), None if fixed else q_of(prefix), cand)
            reject_all = wc * w
            for i, x in enumerate(cand):
                if len(prefix) >= 1:   # second token decided: stop here
                    add((prefix[0], x), reject_all * accept[i])
                else:
                    expand(kids[i] + 1, prefix + (x,), reject_all * accept[i])
                reject_all *= 1 - accept[i]
            for y in range(V):
                wy = reject_all * final[y].item()
                if wy == 0:
                    continue
                if prefix:
                    add((prefix[0], y), wy)
                else:   # one token emitted: the next step starts from p(.|y)
                    nxt = p_of((y,))
                    for b in range(V):
                        add((y, b), wy * nxt[b].item())

    expand(0, (), 1.0)
    return out


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("zero_q", [False, True], ids=["full-support", "disjoint-mass"])
@pytest.mark.parametrize("fixed", [False, True], ids=["sampled", "fixed-candidates"])
def test_tree_distribution_equals_processed_target(settings, zero_q, fixed):
    params = SamplingParams(**settings)
    table = _tables(seed=len(settings) + 3, K=3, zero_q=zero_q)
    got = exact_tree_distribution(params, table, fixed)
    p1 = process(table("p", ())[None], params)[0]
    assert sum(got.values()) == pytest.approx(1.0, abs=1e-6)
    for a, b in itertools.product(range(V), repeat=2):
        want = p1[a].item() * process(table("p", (a,))[None], params)[0][b].item()
        assert abs(got.get((a, b), 0.0) - want) < 1e-6, (a, b)


def _naive_sibling_plan(p, q, candidates):
    """A plausible-looking but wrong rule: q is not renormalised after each draw."""
    accept = []
    for x in candidates:
        accept.append(min(1.0, p[x].item() / q[x].item()))
        r = (p - q).clamp_min(0)
        p = r / r.sum()
    return accept, p


def test_without_replacement_renormalisation_matters(monkeypatch):
    """The exact test catches a verifier that forgets q changes between draws."""
    import test_tree as me
    monkeypatch.setattr(me, "sibling_plan", _naive_sibling_plan)
    params = SamplingParams(temperature=1.0)
    table = _tables(seed=4, K=3, zero_q=False)
    got = exact_tree_distribution(params, table, fixed=False)
    p1 = process(table("p", ())[None], params)[0]
    p2 = process(table("p", (0,))[None], params)[0]
    errors = [abs(got.get((0, b), 0.0) - p1[0].item() * p2[b].item()) for b in range(V)]
    assert max(errors) > 1e-3


def test_tree_sampler_draws_what_the_plan_says():
    """verify_tree_sampling against sibling_plan, seeded Monte Carlo over the first emitted
    token and the accepted path."""
    g = torch.Generator().manual_seed(0)
    N = len(SHAPE)
    p = torch.softmax(torch.randn(N + 1, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(N, V, generator=g) * 2, -1)
    q[1] = q[0]                        # siblings share the distribution they were drawn from
    q[3] = q[2]
    tokens = [3, 1, 0, 4, 2, 2]
    accept, final = sibling_plan(p[0], q[0], [3, 1])
    want_first = torch.zeros(V)
    want_first[3] += accept[0]
    want_first[1] += (1 - accept[0]) * accept[1]
    want_first += (1 - accept[0]) * (1 - accept[1]) * final
    n_trials, first, deep = 20000, torch.zeros(V), 0
    for _ in range(n_trials):
        path, emitted = verify_tree_sampling(tokens, SHAPE, p, q, g)
        first[emitted[0]] += 1
        deep += path[:1] == [0] and len(path) >= 2
        assert len(emitted) == len(path) + 1
    assert (first / n_trials - want_first).abs().max() < 0.015
    a2, _ = sibling_plan(p[1], q[2], [0, 4])
    want_deep = accept[0] * (a2[0] + (1 - a2[0]) * a2[1])
    assert abs(deep / n_trials - want_deep) < 0.015


def test_tree_sampler_joint_of_two_levels_is_the_targets():
    """The first two tokens a sampled tree step emits follow the target, p(a) p(b | a), when the
    second level is drafted from a context-dependent q: each node's children are checked against
    the distribution they were drawn from (q of their parent's context), not their parent's own.
    A mutation tester found the earlier tests could not tell these apart (the deep candidate was
    accepted with probability 1 either way). Seeded Monte Carlo, 40,000 steps."""
    V, g = 4, torch.Generator().manual_seed(1)
    p_root, q_root = torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([0.4, 0.3, 0.2, 0.1])
    p_next = torch.softmax(torch.randn(V, V, generator=g) * 2, -1)      # p(. | a), row a
    q_next = torch.softmax(torch.randn(V, V, generator=g) * 2, -1)      # q(. | a)
    parents = [-1, 0, 0]                     # root -> node 0 -> {node 1, node 2}
    trials, counts = 40000, torch.zeros(V, V)
    for _ in range(trials):
        a0 = torch.multinomial(q_root, 1, generator=g).item()
        kids = torch.multinomial(q_next[a0], 2, replacement=False, generator=g).tolist()
        p = torch.stack([p_root, p_next[a0], p_next[a0], p_next[a0]])   # scored after root, node 0, 1, 2
        q = torch.stack([q_root, q_next[a0], q_next[a0]])               # what node i was drawn from
        path, emitted = verify_tree_sampling([a0, *kids], parents, p, q, g)
        a = emitted[0]
        b = emitted[1] if len(emitted) > 1 else torch.multinomial(p_next[a], 1, generator=g).item()
        counts[a, b] += 1
    want = p_root[:, None] * p_next
    assert (counts / trials - want).abs().max() < 0.01      # noise ~0.0025; the parent's q: 0.077 off
