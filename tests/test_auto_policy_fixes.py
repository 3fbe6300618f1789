"""The "auto" policy's fixes for a tester's five throughput defects, each driven with synthetic
data (the cost fit alone, or the policy against a machine whose costs and acceptance are known):
the fit's ridge per column, holding sizes against their outcomes, steps the policy was not asked
about, the hybrid's measured costs, and the prior of a draft position never tried."""

from __future__ import annotations

import random

import numpy as np
import pytest

from specdec.goodput import GoodputPolicy, Outcome, SeqInfo, StepCosts

TRUE = np.array([4.3, 1.0, 0.15, 0.25, 0.25, 1.0]) * 1e-3     # the target's costs, x as GoodputPolicy's


def features(k: int, prompt: int, context: int) -> np.ndarray:
    """x of a step feeding one request's token and k drafts at `context`, and a prompt chunk."""
    attended = (1 + k) * context + prompt * (prompt + 1) / 2
    drafted = k * context + k * (k + 1) / 2
    return np.array([1.0, 1 + k, prompt, (attended - drafted) / 1024, drafted / 1024, float(k > 0)])


@pytest.mark.parametrize("order", ["mixed", "prefill first", "decode first"])
@pytest.mark.parametrize("prompt", [512, 2048])
def test_cost_fit_recovers_the_costs_whatever_the_order_of_prompt_chunks(order, prompt):
    """Exact samples, K at random 0..8 and the context at random (every coefficient identified),
    prompt chunks on half the steps: as they come with the decoding steps, in a burst first, or
    after a decode-only start. One ridge for all columns, scaled by the prompt-token and attention
    columns, held the intercept and D > 0 at their start (zeros): 0.5 ms for 4.3, a plain step
    predicted 60-90% too cheap for good. Now each coefficient is within 2%."""
    rng, fit = random.Random(0), GoodputPolicy(8).target
    for s in range(600):
        chunk = {"mixed": rng.random() < 0.5, "prefill first": s < 300 and s % 2 == 0,
                 "decode first": s >= 300 and s % 2 == 0}[order]
        x = features(rng.randint(0, 8), prompt if chunk else 0, rng.randint(100, 2000))
        fit.update(x, float(TRUE @ x))
        fit.w                     # refitted as the policy reads it (every 8 samples)
    assert np.abs(fit.w / TRUE - 1).max() < 0.02
    for k in range(9):            # decoding steps, at a context the window holds
        x = features(k, 0, 1000)
        assert abs(fit.predict(x) / float(TRUE @ x) - 1) < 0.02


def test_decoding_sizes_ignore_prompt_chunks_beside_them():
    """A policy whose every other step carries a 512-token prompt chunk, alpha 0.8: the decoding-
    only steps play the best size's goodput (K = 4 here; the fit wrong by 60% and sizes chosen
    beside a chunk held for the steps after it played K = 7-8, 0.92x)."""
    ctx, alpha, rng, policy = 300, 0.8, random.Random(0), GoodputPolicy(8)

    def cost(k, p):
        x = features(k, p, ctx)
        return float(TRUE @ x), x

    def goodput(k):
        return (1 - alpha ** (k + 1)) / (1 - alpha) / cost(k, 0)[0]

    played = []
    for s in range(1500):
        p = 512 if rng.random() < 0.5 else 0
        k = policy.choose([SeqInfo(0, True, ctx, 8)], p)[0]
        probe = policy.probing
        kept = 0
        while kept < k and rng.random() < alpha:
            kept += 1
        t, x = cost(k, p)
        attended = x[3] * 1024 + x[4] * 1024
        policy.observe([Outcome(0, True, k, kept, None)],
                       StepCosts(1, k, p, attended, int(k > 0), k, 0.0, t * (1 + 0.02 * rng.gauss(0, 1)), x[4] * 1024))
        if s > 500 and not probe and not p:
            played.append(k)
    best = max(goodput(k) for k in range(9))
    assert np.mean([goodput(k) for k in played]) / best > 0.98


class Machine:
    """A step costs 4.3 ms + 1 ms per token fed + 1 ms if anything is drafted (x (1 + 2% noise)),
    drafting draft_s per drafted token; each draft position is kept with probability alpha."""

    def __init__(self, draft_s=0.0, seed=5):
        self.draft_s, self.rng = draft_s, random.Random(seed)

    def cost(self, B, D):
        return 4.3e-3 + 1e-3 * (B + D) + 1e-3 * (D > 0), self.draft_s * D

    def step(self, policy, ids, alpha, running=None, drafts=None):
        """alpha: per request; drafts: request -> the most its drafter has (None: whatever asked).
        Returns the sizes played and whether the step was a probe."""
        seqs = [SeqInfo(i, True, 300, 8) for i in ids]
        if hasattr(policy, "goodput"):        # a SpeculationPolicy
            ks = policy.choose(seqs, running or len(ids))
            probe = policy.goodput.probing
        else:
            ks = policy.choose(seqs)
            probe = policy.probing
        outcomes, fed = [], []
        for i, k in zip(ids, ks):
            d = k if drafts is None or drafts.get(i) is None else min(k, drafts[i])
            kept = 0
            while kept < d and self.rng.random() < alpha[i]:
                kept += 1
            outcomes.append(Outcome(i, True, d, kept, None))
            fed.append(d)
        B, D = len(ids), sum(fed)
        t, p = self.cost(B, D)
        policy.observe(outcomes, StepCosts(B, D, 0, (B + D) * 300, sum(k > 0 for k in fed), max(fed), p,
                                           t * (1 + 0.02 * self.rng.gauss(0, 1)), D * 300))
        return ks, probe


def test_a_position_never_tried_is_estimated_from_the_ones_before_it():
    """alpha 0.97 at every position, drafting 0.5 ms a token: the best fixed K is 8. Positions
    beyond the sizes played kept the prior 0.6, so "auto" settled on K = 5 for good (0.93x)."""
    machine, policy = Machine(draft_s=0.5e-3), GoodputPolicy(8)
    played = [machine.step(policy, [0], {0: 0.97})[0][0] for _ in range(1500)]
    assert np.mean(played[-500:]) >= 7.5
    policy._catch_up()
    assert (policy.acceptance[True]._alpha() > 0.9).all()


def test_steps_bypassed_by_disable_by_batch_size_count_against_no_request():
    """Three requests draft (alpha 0.7), a fourth joins and disable_by_batch_size=4 turns drafting
    off for 60 steps, then two remain: they draft again at once, as ones that never went through
    the bypassed steps do (these counted as asked and empty: the chance of drafting fell to 0.18
    and the two stayed plain ~50 steps)."""
    from specdec.adaptive import SpeculationPolicy

    machine, policy = Machine(seed=2), SpeculationPolicy("auto", disable_by_batch_size=4)
    alpha = {i: 0.7 for i in range(4)}
    for _ in range(200):
        machine.step(policy, [0, 1, 2], alpha)
    for _ in range(60):
        assert machine.step(policy, [0, 1, 2, 3], alpha)[0] == [0, 0, 0, 0]
    assert all(policy.goodput.seqs[i].available() > 0.9 for i in range(3))
    after = [machine.step(policy, [0, 1], alpha)[0] for _ in range(10)]
    assert all(k > 0 for ks in after for k in ks)


def test_a_held_size_is_dropped_when_its_outcomes_contradict_it():
    """A request's drafts are kept at 0.95 for 400 steps, then never: the size chosen on the
    first phase was held up to 64 steps whatever came back (K = 6-8 for ~40 steps). Now two or
    three drafts in a row with nothing kept, unlikely at the modelled acceptance, release it and
    discount the old evidence."""
    machine, policy = Machine(seed=7), GoodputPolicy(8)
    for _ in range(400):
        machine.step(policy, [0], {0: 0.95})
    after = [machine.step(policy, [0], {0: 0.0}) for _ in range(100)]
    assert sum(k[0] > 0 for k, probe in after if not probe) <= 28


def test_a_new_request_is_not_held_plain_by_another_requests_tail():
    """Request 0's drafts are never kept, and the policy went plain; request 1's are perfect. Its
    first step drafts, and it drafts from then on (before: 16 plain steps until a probe, then 16
    more, then K = 3)."""
    machine, policy = Machine(seed=7), GoodputPolicy(8)
    for _ in range(300):
        machine.step(policy, [0], {0: 0.0})
    while not machine.step(policy, [0], {0: 0.0})[1]:      # it leaves just after a probe
        pass
    policy.forget(0)
    steps = [machine.step(policy, [1], {1: 1.0})[0][0] for _ in range(40)]
    assert min(steps) > 0
    assert min(steps[10:]) >= 4


def test_the_hybrid_weighs_its_sources_by_the_costs_measured():
    """ngram+eagle under "auto": a learned token cost 0.75 of a plain step by the settings, ~0.31
    measured on SmolLM2 on one core, so at acceptance 0.45 the hybrid kept EAGLE idle where it
    paid (9-16 of 200 steps). The engine hands it the plain step's and a verified token's cost
    (its cost model) and what drafting took; it fits the learned drafter's cost per token."""
    from types import SimpleNamespace

    from specdec.proposers import ProposerCaps
    from specdec.proposers.hybrid import LEARNED, HybridProposer, HybridSettings, SourceRecords

    hybrid = HybridProposer(SimpleNamespace(name="eagle", caps=ProposerCaps()))
    assert hybrid.costs is None                     # the settings' constants until measured
    rng = random.Random(0)
    for step in range(40):
        m = rng.choice([0, 1, 2, 3])
        hybrid._step_learned = m                   # what propose() counts
        hybrid.measured(5e-3, 0.75e-3, 0.1e-3 + 0.8e-3 * m)
    verify, learned = hybrid.costs
    assert verify == pytest.approx(0.15) and learned == pytest.approx(0.16, rel=0.02)

    records = SourceRecords(8, HybridSettings())
    for _ in range(40):                             # the learned drafter's first token kept 45% of the time
        records.learned.observe(1, int(rng.random() < 0.45))
    assert records.choose(0, 0, 1).source is None                       # at the constants: plain
    assert records.choose(0, 0, 1, costs=hybrid.costs).source == LEARNED  # at the measured costs
