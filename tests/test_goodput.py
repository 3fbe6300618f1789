"""Goodput-aware speculation: the policy against synthetic machines (costs linear in what a step
feeds, with noise and outliers; i.i.d. acceptance), then in a real engine whose drafter turns
slow and fast again."""

from __future__ import annotations

import random

import numpy as np
import pytest

from specdec import LLM, SamplingParams
from specdec.adaptive import SpeculationPolicy
from specdec.goodput import GoodputPolicy, OnlineLinear, Outcome, SeqInfo, StepCosts
from specdec.proposers import NgramProposer


class Machine:
    """A step costs fixed + per_token * tokens fed (x (1 + noise), and now and then 4x: another
    process took the core); each draft position is kept with probability alpha[request]."""

    def __init__(self, fixed=4.3e-3, per_token=2.5e-3, noise=0.1, seed=0, drafting=0.0):
        self.fixed, self.per_token, self.noise = fixed, per_token, noise
        self.drafting = drafting          # seconds a step that drafts spends in the drafter
        self.rng = random.Random(seed)

    def step(self, policy: GoodputPolicy, ids: list, alpha: dict, greedy=True, context=300, longest=None):
        """longest: the most tokens the drafter ever has (a lookup whose matches give out)."""
        ks = policy.choose([SeqInfo(i, greedy, context, 8) for i in ids])
        probe = policy.probing
        outcomes, fed = [], []
        for i, k in zip(ids, ks):
            d = k if longest is None else min(k, longest)
            kept = 0
            while kept < d and self.rng.random() < alpha[i]:
                kept += 1
            outcomes.append(Outcome(i, greedy, d, kept, None))
            fed.append(d)
        ks = fed
        D, B = sum(ks), len(ids)
        t = (self.fixed + self.per_token * (B + D)) * max(0.2, 1 + self.noise * self.rng.gauss(0, 1))
        if self.rng.random() < 0.02:
            t *= 4
        propose = self.drafting * (1 + 0.1 * self.rng.random()) if any(ks) else 0.0
        policy.observe(outcomes, StepCosts(B, D, 0, (B + D) * context, sum(k > 0 for k in ks), max(ks), propose, t))
        return ks, probe

    def run(self, policy, ids, alpha, steps):
        """The sizes of the steps that were not probes."""
        out = []
        for _ in range(steps):
            ks, probe = self.step(policy, ids, alpha, )
            if not probe:
                out.append(ks)
        return out


def drafting(history) -> float:
    return float(np.mean([[k > 0 for k in ks] for ks in history]))


def test_speculation_switches_off_under_load_and_back_on():
    """With these costs a 0.6-acceptance draft pays at 1 request (K = 1-2: +15%) and costs
    from 3 on: the policy finds both, and returns to drafting when the load goes."""
    machine, policy = Machine(), GoodputPolicy(8)
    alpha = {i: 0.6 for i in range(32)}
    alone = machine.run(policy, [0], alpha, 300)[-150:]
    assert drafting(alone) > 0.9 and 1 <= np.mean([k[0] for k in alone]) <= 3
    loaded = machine.run(policy, list(range(32)), alpha, 300)[-150:]
    assert drafting(loaded) < 0.02
    again = machine.run(policy, [0], alpha, 300)[-150:]
    assert drafting(again) > 0.9


def test_no_flapping_when_the_batch_size_straddles_the_break_even_point():
    """The batch alternates between 2 and 3 requests every step, where drafting is within a few
    percent of break-even: vLLM's batch-size rule flips every step; with hysteresis the
    requests keep their state, and without it they do flip (the test can fail)."""
    def switches(h):
        machine, policy = Machine(seed=1), GoodputPolicy(8, hysteresis=h)
        alpha = {i: 0.6 for i in range(3)}
        history = []
        for t in range(1500):
            ks, probe = machine.step(policy, [0, 1, 2][:2 + t % 2], alpha)
            if not probe:
                history.append([k > 0 for k in ks[:2]])
        history = history[100:]
        return sum(a != b for prev, cur in zip(history, history[1:]) for a, b in zip(prev, cur)) / len(history)

    assert switches(0.1) < 0.08 < switches(0.0)


def test_chain_model_counts_what_a_short_drafter_actually_drafts():
    """A lookup asked for 4 tokens that has only 2 (suffix decoding drafts at most spec_factor x
    its match): the positions it never reaches add neither emitted nor fed tokens, instead of
    being valued at their prior; a drafter that fills its asks keeps full-length estimates."""
    from specdec.goodput import ChainAcceptance

    short, full = ChainAcceptance(8), ChainAcceptance(8)
    rng = random.Random(0)
    for _ in range(300):
        for model, drafted in ((short, 2), (full, 4)):
            kept = 0
            while kept < drafted and rng.random() < 0.9:
                kept += 1
            model.forget()
            model.observe(4, drafted, kept, None)
    e, fed = short.expected(), short.drafted()
    assert abs(e[4] - e[2]) < 0.03 and abs(fed[4] - 2.0) < 0.06          # the prior (2 pseudo-asks) fading
    assert e[2] == pytest.approx(1 + 0.9 + 0.81, abs=0.06)
    e, fed = full.expected(), full.drafted()
    assert fed[4] == pytest.approx(4.0, abs=1e-9) and e[4] == pytest.approx(1 + 0.9 + 0.81 + 0.729 + 0.656, abs=0.25)


def test_chain_model_values_a_lookups_confident_long_drafts():
    """Half the drafts are one token kept 40% of the time, half four tokens kept 95% each (a
    lookup drafts long where its match is long, and a long match is a good one). Asked for 4,
    the steps tell what 1, 2 and 3 would have emitted; the product of per-position acceptances
    (position 1's 0.675 over all drafts times position 2's 0.95) would value the second token at
    0.32 instead of 0.45."""
    from specdec.goodput import ChainAcceptance

    model, rng, seen = ChainAcceptance(8), random.Random(0), []
    for i in range(3000):
        if i >= 1000:         # the estimates forget (~100 steps): their mean over time
            seen.append((model.expected()[:5], model.drafted()[:5]))
        long = rng.random() < 0.5
        drafted, p = (4, 0.95) if long else (1, 0.4)
        kept = 0
        while kept < drafted and rng.random() < p:
            kept += 1
        model.forget()
        model.observe(4, drafted, kept, None)
    truth = np.cumsum([1.0, 0.5 * 0.4 + 0.5 * 0.95] + [0.5 * 0.95 ** j for j in (2, 3, 4)])
    emitted, fed = np.mean(seen, axis=0)
    assert emitted == pytest.approx(truth, abs=0.03)
    assert fed == pytest.approx([0, 1, 1.5, 2, 2.5], abs=0.03)


def test_per_request_k_follows_each_requests_acceptance():
    """Eight requests, four whose drafts are nearly always right and four nearly always wrong:
    only the first four draft."""
    machine, policy = Machine(per_token=1e-3), GoodputPolicy(8)
    alpha = {i: (0.95 if i < 4 else 0.05) for i in range(8)}
    history = machine.run(policy, list(range(8)), alpha, 400)[-100:]
    good = np.mean([[k > 0 for k in ks[:4]] for ks in history])
    bad = np.mean([[k > 0 for k in ks[4:]] for ks in history])
    assert good > 0.9 and bad < 0.1


def test_a_draft_row_is_priced_at_its_own_attention_cost():
    """One request whose context wanders between 64 and 2048 slots; a step costs 3 ms + 0.1 ms
    per fed token + 4 ms per 1024 slots the first row attends + 0.4 ms per 1024 slots each draft
    row attends (its keys and values were just read for the first row: only its own scores and
    sums cost). At 2048 slots a plain step takes 11.1 ms and a draft token 0.9 ms, so a draft kept
    a quarter of the time pays (1.25 tokens in 12 ms against 1 in 11.1). One attention
    coefficient for every row charged a draft token the first row's rate there, and drafted on
    under half of those steps; the fit tells the two rates apart."""
    for seed in range(3):
        policy, rng = GoodputPolicy(8), random.Random(seed)
        long_steps = []
        for i in range(1200):
            context = 2048 if i % 4 == 0 else rng.randint(64, 2048)
            (k,) = policy.choose([SeqInfo(0, True, context, 8)])
            probe = policy.probing
            kept = 0
            while kept < k and rng.random() < 0.25:
                kept += 1
            first, drafted = context + 1, k * context + (k + 1) * (k + 2) // 2 - 1
            t = (3e-3 + 1e-4 * (1 + k) + 4e-3 * first / 1024 + 4e-4 * drafted / 1024) * (1 + 0.05 * rng.gauss(0, 1))
            policy.observe([Outcome(0, True, k, kept, None)],
                           StepCosts(1, k, 0, first + drafted, int(k > 0), k, 0.0, t, drafted))
            if i >= 600 and context == 2048 and not probe:
                long_steps.append(k)
        assert np.mean([k > 0 for k in long_steps]) > 0.9
        w = policy.target.w
        assert w[3] == pytest.approx(4e-3, rel=0.15) and w[4] == pytest.approx(4e-4, rel=0.5)


def test_tree_sizes_find_the_best_size_and_fall_back_to_plain():
    def run(kept_of, per_node):
        policy, played = GoodputPolicy(32, tree=True), []
        for _ in range(300):
            (k,) = policy.choose([SeqInfo(0, True, 100, 32)])
            n = kept_of(k)
            policy.observe([Outcome(0, True, k, n, list(range(n)))],
                           StepCosts(1, k, 0, (k + 1) * 100, int(k > 0), k, 0.0, 1e-3 * (1 + per_node * k)))
            played.append(k)
        return played[-100:]

    # every step keeps the first 4 nodes of a best-first tree: 4 nodes is the best size
    played = run(lambda k: min(k, 4), 0.3)
    assert max(set(played), key=played.count) == 4
    # nothing is ever kept: plain decoding (bar probes)
    played = run(lambda k: 0, 0.3)
    assert played.count(0) > 85


def test_cost_fit_ignores_outliers():
    """Steps cost 4 ms + 2 ms per token + 1 ms per 1024 attended slots (5% noise), and one in
    twenty takes 10x: the fit stays within a few percent, where plain least squares does not."""
    def mean_error(fit, seed=0):
        rng, errors = np.random.default_rng(seed), []
        for i in range(1500):
            x = np.array([1.0, rng.integers(1, 33), rng.integers(0, 65)])
            y = x @ [4e-3, 2e-3, 1e-3] * (1 + 0.05 * rng.standard_normal())
            fit.update(x, y * (10 if rng.random() < 0.05 else 1))
            if i >= 500:      # inside the data (its corners are noisier)
                errors += [fit.predict(q) / np.dot(q, [4e-3, 2e-3, 1e-3]) - 1 for q in ([1, 16, 0], [1, 16, 64])]
        return float(np.mean(np.abs(errors)))

    class LeastSquares:            # plain least squares over the same window
        def __init__(self):
            self.X, self.y = [], []

        def update(self, x, y):
            self.X, self.y = (self.X + [x])[-128:], (self.y + [y])[-128:]

        def predict(self, q):
            return float(np.linalg.lstsq(np.array(self.X), np.array(self.y), rcond=None)[0] @ q)

    assert mean_error(OnlineLinear(3)) < 0.05
    assert mean_error(LeastSquares()) > 0.2


def test_disable_by_batch_size_and_fixed_k():
    seqs = [SeqInfo(i, True, 10, 8) for i in range(4)]
    policy = SpeculationPolicy(3, disable_by_batch_size=4)
    assert policy.choose(seqs[:3], num_running=3) == [3, 3, 3]
    assert policy.choose(seqs, num_running=4) == [0, 0, 0, 0]
    auto = SpeculationPolicy("auto", disable_by_batch_size=2)
    assert auto.choose(seqs, num_running=4) == [0, 0, 0, 0]


def test_a_drafter_that_turns_slow_is_dropped_and_taken_back_when_fast_again():
    """One request with good drafts (alpha 0.8): drafting pays while the drafter is cheap, stops
    when it costs 20 steps, and the probes bring it back once it is cheap again."""
    machine, policy = Machine(drafting=1e-4), GoodputPolicy(8)
    assert drafting(machine.run(policy, [0], {0: 0.8}, 150)[-100:]) > 0.9
    machine.drafting = 0.1
    assert drafting(machine.run(policy, [0], {0: 0.8}, 200)[-100:]) < 0.05
    machine.drafting = 1e-4
    assert drafting(machine.run(policy, [0], {0: 0.8}, 250)[-100:]) > 0.9


class VirtualClock:
    """The engine's clock (Engine(clock=)) advanced by what the work would cost, not read from
    the machine: the policy sees the same step times on a loaded 2-core VM as on an idle one."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SlowNgram(NgramProposer):
    """Prompt lookup whose drafting costs `delay` seconds of the virtual clock per step: a
    drafter that costs more than it saves while slow."""

    def __init__(self, clock: VirtualClock):
        super().__init__(4, 1)
        self.delay, self.clock = 0.0, clock

    def propose(self, items):
        self.clock.now += self.delay
        return super().propose(items)


def test_engine_turns_speculation_off_when_drafting_is_slow(tiny_pair):
    """The goodput policy inside the engine, on a virtual clock: a target forward costs 1 ms plus
    0.05 ms a token (a memory-bound forward: verifying drafts is cheap), drafting nothing or 20 ms."""
    from specdec.engine import Engine

    target = LLM(tiny_pair[0], num_speculative_tokens=0, dtype="float32")
    clock = VirtualClock()
    proposer = SlowNgram(clock)
    engine = Engine(target.target, target.tokenizer, proposer, "auto", 256, clock=clock)
    forward = engine._forward

    def timed_forward(plan, drafts, host):
        out = forward(plan, drafts, host)
        clock.now += 1e-3 + 5e-5 * out[2]            # out[2]: the tokens the forward fed
        return out

    engine._forward = timed_forward
    prompt = target.tokenizer.encode("x = 1\n" * 12)         # repetitive: lookups are mostly right
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)

    def drafted_fraction():
        """Of one request's steps, those that verified a draft (a lookup may find nothing)."""
        req, steps = engine.add_request(prompt, params), []
        while not req.finished:
            engine.step()
            steps.append(engine.last_step_drafting)
        return np.mean(steps)

    assert drafted_fraction() > 0.5                 # cheap drafting of good drafts: on
    proposer.delay = 0.02                           # 20x a step of this model: off, bar probes
    drafted_fraction()                              # (a request to notice it)
    assert drafted_fraction() < 0.15
    proposer.delay = 0.0                            # cheap again: the probes bring it back
    drafted_fraction()
    assert drafted_fraction() > 0.5
    plain = target.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    req = engine.add_request(prompt, params)
    while not req.finished:
        engine.step()
    assert req.out == plain                          # lossless whatever it chose


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_disable_by_batch_size_is_validated(bad):
    from specdec.config import SpeculativeConfig

    with pytest.raises(ValueError, match="disable_by_batch_size"):
        SpeculativeConfig(method="ngram", disable_by_batch_size=bad)


def test_a_young_policy_revisits_its_sizes_soon():
    """While a policy is young its sizes are held a few steps, not `reuse` (64): a size that a
    probe's luck or the optimistic prior made look good is revisited once measurements say
    otherwise. Here drafting never pays (each position kept with probability 0.35, a drafting step
    costing 1.6 ms more plus 1.4 ms a token on a 4.3 ms step); held 64 steps, K = 1 ran 96 and 66
    of 112 steps for two of four seeds."""
    drafted = 0
    for seed in range(4):
        rng, policy = random.Random(seed), GoodputPolicy(8)
        for i in range(120):
            (k,) = policy.choose([SeqInfo(0, True, 300, 8)])
            kept = 0
            while kept < k and rng.random() < 0.35:
                kept += 1
            t = (4.3e-3 + 0.9e-3 * k + (1.2e-3 if k else 0)) * (1 + 0.05 * rng.gauss(0, 1))
            policy.observe([Outcome(0, True, k, kept, None)],
                           StepCosts(1, k, 0, 300 * (1 + k), int(k > 0), k, 0.5e-3 * k + (0.4e-3 if k else 0), t))
            drafted += i >= 8 and k > 0
    assert drafted < 100, drafted


def test_a_non_finite_timing_is_skipped_not_fitted():
    """One NaN reading of a caller's clock under "auto" K: the sample is dropped; it had poisoned
    every later fit (an empty-array minimum) and failed every later step."""
    import time
    llm = LLM(model="models/target", speculative_config={"method": "draft_model", "model": "models/draft",
                                                         "num_speculative_tokens": "auto"})
    n = [0]

    def clock():
        n[0] += 1
        return float("nan") if n[0] % 50 == 0 else time.perf_counter()

    llm.engine.clock = clock
    sp = SamplingParams(temperature=0, max_tokens=40)
    plain = LLM(model="models/target").generate(["def fibonacci(n):"], sp, use_tqdm=False)[0].outputs[0].token_ids
    for _ in range(3):
        out = llm.generate(["def fibonacci(n):"], sp, use_tqdm=False)[0].outputs[0].token_ids
        assert out == plain
    fit = OnlineLinear(2)
    fit.update([1.0, 2.0], float("inf"))
    fit.update([float("nan"), 1.0], 1.0)
    assert fit.kept == 0
