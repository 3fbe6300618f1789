"""Goodput-aware speculation ("auto"): how many tokens each decoding request drafts this step.

Goodput here is what SmartSpec / TurboSpec maximise: expected emitted tokens per second for
the whole batch. For a step that gives request i a draft of size s_i,

    G(s) = sum_i E_i(s_i) / (T_target(x) + T_draft(z))

E_i(s): tokens request i emits when it drafts s (1 at s = 0), from measured acceptance:
    chains: e_j, the chance that a draft asked for j or more tokens has its first j kept, and
            l_j, the chance that it has a j-th token (lookups stop where their match gives
            out), E(s) = 1 + sum_{j<=s} e_j and the draft tokens fed sum_{j<=s} l_j, per kind
            (greedy / sampled: they differ systematically) and per method (one proposer per
            engine). A chain asked for s tokens is the first s of a longer ask's (a proposer's
            draft does not depend on its cap), so a step asked for K tells e_j and l_j for every
            j <= K at once. Where few asks reached j, e_j leans on e_{j-1} times the product
            model's step, l_j a_j / l_{j-1} (a_j: P(position j kept | positions < j kept));
            e_j is not the product l_j prod_{l<=j} a_l itself, because a lookup's long drafts
            are its confident ones: a_1 over all drafts undervalues them;
    trees:  the mean emitted tokens measured at each size of a ladder (greedy steps also tell
            every smaller, nested tree's outcome);
    per request, a multiplier (its accepted tokens over what the kind's model expected) and,
    for proposers that may come back empty (ngram: no match), the chance it drafts at all.
T_target: the step without drafting work, linear in x = [1, N, P, A - A_D, A_D, D > 0]: N = B + D
    tokens fed for B decoding requests and their D drafts (a draft token costs the forward's
    products what any fed token costs: one coefficient, which any change of B or K
    identifies), P prompt-chunk tokens, A slots attended (/1024), of which A_D by the drafted
    rows: a draft row attends the keys and values its request's first row has just read, so
    it pays for its scores and sums, not for reading them (on SmolLM2 about a third of the
    first row's rate); one coefficient for both charged drafts the first row's rate and cut K
    on long contexts; D > 0: a fixed cost of verifying at all (from one row per request to
    several the products leave their one-row kernels). While nobody drafts A_D and D > 0 are 0
    and their coefficients keep their last fit;
T_draft: z = [any drafting, requests drafting, D, longest draft, P].
Both are learned online by exponentially weighted recursive least squares, with outliers (a
step slowed by another process) clipped, so no offline profile is needed and the fit follows
the machine's load. Under load the per-token cost of a draft weighs against the goodput the
batch already has, so speculation switches off by itself; at low load it switches back on.

The step's sizes maximise G exactly for the model (Dinkelbach's iteration on the ratio: each
round picks, for every possible longest draft, each request's best size, in a few numpy
operations). No flapping: a request that is not drafting needs a clear gain to start
(its gains count (1 - h)), one that drafts keeps drafting while it nearly pays (1 + h); the
estimates move smoothly. While nobody drafts, one request drafts a few tokens every
`probe_every` steps, so acceptance and draft costs stay measured. K = 0 reserves nothing: the
scheduler allocates KV slots for the sizes chosen here, after this choice.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

LADDER = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
PRIOR_ALPHA = 0.6          # optimistic start: speculate first, let measurements say otherwise


@dataclass(frozen=True)
class SeqInfo:
    """A decoding request as the policy sees it."""
    request_id: Hashable
    greedy: bool
    context: int            # slots its tokens attend over (its sequence length)
    cap: int                # the most tokens (tree nodes) it may draft now


@dataclass(frozen=True)
class Outcome:
    request_id: Hashable
    greedy: bool
    drafted: int            # tokens (nodes) it drafted, 0 = none
    accepted: int
    path: list[int] | None  # a greedy tree step's accepted nodes


@dataclass(frozen=True)
class StepCosts:
    """What a step fed and what it cost."""
    decoding: int           # B: decoding requests
    draft_tokens: int       # D: drafts fed to the target
    prompt_tokens: int      # P: prompt-chunk tokens fed
    attention: float        # A: slots attended, summed over every fed token
    drafting: int           # requests that drafted
    depth: int              # the longest draft
    propose_s: float        # drafting: propose + the proposer's update
    rest_s: float           # the rest: target forward, verification, bookkeeping
    draft_attention: float = 0.0    # of A, the slots the drafted rows attend


class OnlineLinear:
    """y ~ w . x over the last `window` samples, recent ones weighing more (weights halve every
    `half_life` samples), refitted when asked after new samples.

    Every coefficient is a cost, so the fit is non-negative least squares: features that always
    move together (one request drafting K tokens: D = longest = K) share a cost between them
    instead of cancelling with opposite signs.
    Robust to a shared machine: a step now and then waits a scheduler quantum for another
    process, several times its own length. Slower-than-fitted samples are down-weighted as in
    Huber's estimator (beyond 1.345 robust standard deviations, from the residuals' median
    absolute deviation), a few reweighted rounds; faster ones keep their weight (nothing makes
    a step faster by accident). When the costs themselves change (another job starts or ends,
    a drafter slows down) the recent samples soon outweigh the old ones. The first `skip`
    samples are dropped: a code path's first run pays one-off costs."""

    def __init__(self, dim: int, window: int = 128, half_life: float = 48.0, skip: int = 2, rounds: int = 2,
                 refit_every: int = 4, apart: tuple[int, ...] = ()):
        self.skip, self.rounds, self.refit_every = skip, rounds, refit_every
        self.apart = np.zeros(dim, dtype=bool)       # columns of occasional large samples (below)
        self.apart[list(apart)] = True
        self.X, self.y = np.zeros((window, dim)), np.zeros(window)       # a ring of the last samples
        self.decay = 0.5 ** (1.0 / half_life)
        self.n = 0                   # samples seen (with x != 0)
        self.kept = 0                # samples in the ring
        self.fresh = 0               # samples since the last fit
        self._w = np.zeros(dim)

    @property
    def w(self) -> np.ndarray:
        """The coefficients, refitted once `refit_every` samples have come (or the first one)."""
        if self.fresh >= self.refit_every or (self.fresh and not self._w.any()):
            self.refit()
        return self._w

    def refit(self) -> None:
        """Fit now if any sample came since the last fit (a fit costs ~0.5 ms of Python)."""
        if self.fresh:
            self._w, self.fresh = self._fit(), 0

    def predict(self, x) -> float:
        return float(self.w @ np.asarray(x, dtype=float))

    def update(self, x, y: float) -> None:
        x = np.asarray(x, dtype=float)
        if not x.any() or not (np.isfinite(y) and np.isfinite(x).all()):
            return              # a NaN / inf timing (a caller's clock) would poison every later fit
        self.n += 1
        if self.n <= self.skip:
            return
        at = self.kept % len(self.y)
        self.X[at], self.y[at] = x, y
        self.kept += 1
        self.fresh += 1

    def _fit(self) -> np.ndarray:
        size = min(self.kept, len(self.y))
        X, y = self.X[:size], self.y[:size]
        age = (self.kept - 1 - np.arange(size)) % len(self.y)       # 0 = the newest
        # relative errors: a step's noise grows with its length (a prompt chunk's 2% is a decode
        # step's whole cost), so each sample weighs by 1 / y^2 (y kept off 0 by a tenth of the median)
        recency = self.decay ** age / np.maximum(y, 0.1 * float(np.median(y)) + 1e-12) ** 2
        weight = recency
        # a weak pull towards the last fit: what the window cannot tell (the per-token cost
        # while every step fed the same number of tokens) keeps its last measured value; where
        # columns move together the cost goes to the larger one. The pull is 1e-4 of the mean
        # square of a sample's features, taken over the samples without the `apart` columns
        # (prompt chunks: their tokens and attention run to thousands a sample, and a pull set by
        # them outweighed the intercept's and D > 0's data, which it held at the last fit, zeros
        # at the start: with prompt chunks from the first step a plain step was fitted 60-90% too
        # cheap, for good), plus 1e-4 of each column's own (so a column is never pulled harder
        # than its data allow)
        square = X * X * recency[:, None]
        own = square.sum(0)
        usual = ~(X[:, self.apart] != 0).any(1)
        shared = float(square[usual][:, ~self.apart].sum()) / max(1, int((~self.apart).sum()))
        prior = 1e-4 * (own + np.where(self.apart, 0.0, shared)) + 1e-12 * float(recency.sum())
        for _ in range(self.rounds + 1):
            Xw = X * weight[:, None]
            w = nonnegative_least_squares(Xw.T @ X + np.diag(prior), Xw.T @ y + prior * self._w)
            r = (y - X @ w) / np.maximum(y, 0.1 * float(np.median(y)) + 1e-12)
            scale = 1.4826 * float(np.median(np.abs(r))) + 1e-3     # no timing is closer than 0.1%
            weight = recency * np.minimum(1.0, 1.345 * scale / np.maximum(r, 1e-30))
        return w


def nonnegative_least_squares(G: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin over w >= 0 of w.G.w / 2 - b.w (G = X'X, b = X'y: least squares on the normal
    equations), by Lawson and Hanson's active-set method."""
    k = len(b)
    w = np.linalg.solve(G, b)
    if (w >= 0).all():             # the common case: the unconstrained optimum is feasible
        return w
    w, free = np.zeros(k), np.zeros(k, dtype=bool)
    for _ in range(3 * k):
        grad = b - G @ w
        grad[free] = 0.0
        j = int(np.argmax(grad))
        if grad[j] <= 1e-12 * (abs(b).max() + 1e-30):
            break
        free[j] = True
        for _ in range(3 * k):
            s = np.zeros(k)
            idx = np.flatnonzero(free)
            s[idx] = np.linalg.solve(G[np.ix_(idx, idx)], b[idx])
            if (s[idx] > 0).all():
                w = s
                break
            bad = idx[s[idx] <= 0]
            alpha = float(np.min(w[bad] / np.maximum(w[bad] - s[bad], 1e-300)))
            w = w + alpha * (s - w)
            free &= w > 1e-15
            w[~free] = 0.0
    return w


class ChainAcceptance:
    """Per-position conditional acceptance of chains, and how often a draft asked for j tokens
    has a j-th one (lookups stop where their match gives out: suffix decoding drafts at most
    spec_factor x its match length), counted with exponential forgetting."""

    def __init__(self, max_k: int, decay: float = 0.99, prior_n: float = 2.0):
        self.sizes = np.arange(max_k + 1)
        # counts in units of `_unit` (the decay since the last rescale): forgetting is one
        # multiply of _unit per step instead of four array operations; an event adds 1 / _unit
        self._tried, self._kept = np.zeros(max_k), np.zeros(max_k)
        self._offered, self._got = np.zeros(max_k), np.zeros(max_k)    # asks reaching position j, drafts reaching it
        self._emitted = np.zeros(max_k)                                 # ... and keeping it (and every earlier one)
        self._unit = 1.0
        self.decay, self.prior_n = decay, prior_n

    def _alpha(self) -> np.ndarray:
        """[K] a_j, each shrunk towards a_{j-1} (the first: PRIOR_ALPHA), so a position rarely
        tried is estimated from the positions before it (a fixed prior held K where its last
        tried position was: with a_j 0.97 measured up to 5, 0.6 beyond kept K at 5)."""
        n = self.prior_n / self._unit
        out, prior = [], PRIOR_ALPHA
        for kept, tried in zip(self._kept.tolist(), self._tried.tolist()):
            prior = (kept + prior * n) / (tried + n)
            out.append(prior)
        return np.array(out)

    def _length(self) -> np.ndarray:
        """[K] P(a non-empty draft asked for >= j tokens has a j-th), full length a priori."""
        n = self.prior_n / self._unit
        return (self._got + n) / (self._offered + n)

    def expected(self) -> np.ndarray:
        """[S] tokens emitted per size asked (the drafts a size gets are often shorter): e_j
        from the asks that reached j, shrunk towards e_{j-1} times the product model's step
        (the only estimate where no ask reached j), and never above e_{j-1}."""
        length = self._length()
        product = length * np.cumprod(self._alpha())        # the product model's e_j
        step = product / np.concatenate([[1.0], product[:-1]])
        n = self.prior_n / self._unit
        emitted, offered = self._emitted.tolist(), self._offered.tolist()
        e, prev = [], 1.0
        for j, r in enumerate(step.tolist()):
            prev = min(prev, (emitted[j] + n * prev * r) / (offered[j] + n))
            e.append(prev)
        return np.concatenate([[1.0], 1.0 + np.cumsum(e)])

    def drafted(self) -> np.ndarray:
        """[S] draft tokens fed per size asked (of a non-empty draft)."""
        return np.concatenate([[0.0], np.cumsum(self._length())])

    def observe(self, asked: int, drafted: int, accepted: int, path) -> None:
        one = 1.0 / self._unit
        reached = min(drafted, accepted + 1)        # positions tried: up to the first rejection
        self._tried[:reached] += one
        self._kept[:accepted] += one
        self._offered[:max(asked, drafted)] += one
        self._got[:drafted] += one
        self._emitted[:accepted] += one

    def discount(self, by: float) -> None:
        """What was counted so far weighs `by` of itself (the drafts have changed)."""
        self.forget_by(by)

    def forget(self) -> None:
        self.forget_by(self.decay)

    def forget_by(self, decay: float) -> None:
        self._unit *= decay
        if self._unit < 1e-100:                     # rescale long before 1 / _unit overflows
            for a in (self._tried, self._kept, self._offered, self._got, self._emitted):
                a *= self._unit
            self._unit = 1.0


class TreeAcceptance:
    """Mean emitted tokens per tree size of a ladder (trees are nested: the proposers list
    nodes best first, so a greedy step tells what every smaller tree would have kept)."""

    def __init__(self, max_size: int, decay: float = 0.99, prior_n: float = 1.0):
        self.sizes = np.array([s for s in LADDER if s <= max_size])
        depth = np.minimum(self.sizes, 1 + np.floor(np.log2(np.maximum(self.sizes, 1))))
        self.prior = (1 - PRIOR_ALPHA ** (depth + 1)) / (1 - PRIOR_ALPHA)
        self.tokens, self.count = np.zeros(len(self.sizes)), np.zeros(len(self.sizes))
        self.decay, self.prior_n = decay, prior_n

    def expected(self) -> np.ndarray:
        mean = (self.tokens + self.prior * self.prior_n) / (self.count + self.prior_n)
        mean[0] = 1.0
        return np.maximum.accumulate(np.minimum(mean, self.sizes + 1.0))

    def drafted(self) -> np.ndarray:
        return self.sizes.astype(float)

    def observe(self, asked: int, drafted: int, accepted: int, path) -> None:
        if asked <= 0:
            return
        if path is None:         # a sampled step: only the size played is observed
            i = int(np.searchsorted(self.sizes, asked))
            if i < len(self.sizes) and self.sizes[i] == asked:
                self.tokens[i] += accepted + 1
                self.count[i] += 1
            return
        for i, s in enumerate(self.sizes):
            if 0 < s <= asked:
                cut = next((j for j, node in enumerate(path) if node >= s), len(path))
                self.tokens[i] += cut + 1
                self.count[i] += 1

    def discount(self, by: float) -> None:
        self.tokens *= by
        self.count *= by

    def forget(self) -> None:
        self.discount(self.decay)


@dataclass
class _Seq:
    """What the policy remembers of one request."""
    asked: int = 0
    kept: float = 0.0       # accepted tokens (decayed)
    expect: float = 0.0     # what the kind's model expected for the same drafts (decayed)
    asks: float = 0.0       # steps it was asked to draft (decayed)
    drafts: float = 0.0     # ... and came back with a draft
    misses: int = 0         # drafts in a row of which nothing was kept
    hits: int = 0           # draft tokens in a row kept (in drafts kept whole)
    miss: float = 1.0       # the chance of that per draft, as modelled when its size was chosen

    def multiplier(self, strength: float = 8.0) -> float:
        return float(np.clip((self.kept + strength) / (self.expect + strength), 0.1, 4.0))

    def available(self, strength: float = 2.0) -> float:
        return (self.drafts + strength) / (self.asks + strength)


# the sizes played while the cost models have no data: varied, so that the fits can tell
# per-token from per-step costs
_WARM = (4, 0, 2, 0, 1, 3, 0, 4)


class GoodputPolicy:
    """Sizes per decoding request per step (see the module docstring).

    max_k: the largest chain (or tree) a request may draft; tree: drafts are token trees
    (sizes on LADDER); hysteresis h, probe_every and warmup as described above."""

    def __init__(self, max_k: int, tree: bool = False, hysteresis: float = 0.1, probe_every: int = 16,
                 probe_size: int = 2, warmup: int = len(_WARM), reuse: int = 64):
        self.tree = tree
        make = (lambda: TreeAcceptance(max_k)) if tree else (lambda: ChainAcceptance(max_k))
        self.acceptance = {True: make(), False: make()}
        self.sizes = self.acceptance[True].sizes
        self._size_list = [int(v) for v in self.sizes]
        # x = [1, B + D, P, (A - A_D) / 1024, A_D / 1024, D > 0] -> seconds, A_D the drafted rows'
        # part of A: a draft row attends the slots its request's first row has just read; the last,
        # what verifying costs at all (SmolLM2 on one request, Intel Xeon: one drafted token added
        # 1.6 ms to a 4.3 ms forward, a second 0.9: one row to two leaves the one-row kernels; a
        # per-token cost alone, fitted between them, took K = 1 and 2 for cheaper than they were)
        self.target = OnlineLinear(6, refit_every=8, apart=(2,))
        # z = [any, requests drafting, D, longest, P] -> seconds; drafting is observed only on
        # the steps that draft (rarely while speculation is off): it forgets per sample, faster,
        # and a probe's sample is fitted at once (observe)
        self.draft = OnlineLinear(5, window=16, half_life=4.0, refit_every=4)
        self.h, self.probe_every, self.warmup = hysteresis, probe_every, warmup
        self.probe_size = self._rung(probe_size)
        self.seqs: dict[Hashable, _Seq] = {}
        self.steps = 0                       # steps observed (with decoding requests)
        self.idle = 0                        # steps since anyone drafted
        self.probing = False                 # the last choice was a probe
        self._probe_turn = 0
        # an unchanged batch keeps its sizes for `reuse` steps once the policy has seen 4 x reuse
        # steps (fewer before: see choose) (`probe_every` while nobody
        # drafts, so that probes keep their pace): the optimisation and the fits cost ~1-2 ms of
        # Python, a fifth of a one-token step of a 135M model on one core (16: 0.1 ms a step
        # spread over them, against 8's 0.2), and sizes that follow every turn of the estimates
        # cost more than they find: on one client, Spec-Bench, the Zen 4, "auto" with its
        # sizes held 64 steps (about one re-optimisation per answer after its first) ran
        # 2.1% / 2.4% / 1.1% faster than with 16 in three runs, and 32 no faster than 16
        # (docs/serving-under-load.md)
        self.reuse = reuse
        self._last: tuple[tuple, list[int], int, bool] | None = None   # (request ids, sizes, age, beside a prompt chunk)
        self._pending: list = []             # observed steps not yet applied (observe)
        self._bypassed = False               # this step's sizes were set without the policy (bypass)

    def _rung(self, size: int) -> int:
        """The largest playable size <= size (a Python list: every step asks, numpy costs more)."""
        return self._size_list[bisect.bisect_right(self._size_list, size) - 1]

    def forget(self, request_id: Hashable) -> None:
        self.seqs.pop(request_id, None)

    def bypass(self) -> None:
        """This step nobody drafts, by a rule above the policy (disable_by_batch_size): its
        outcomes tell the cost models, but no request was asked, so none counts as having come
        back empty (that took a request's chance of drafting from 1 to 0.18 in 60 such steps, and
        it stayed plain for 50 steps after the batch shrank); each request's last ask stays for
        the hysteresis when the policy is asked again."""
        self._bypassed, self.probing = True, False

    def choose(self, seqs: list[SeqInfo], prompt_tokens: int = 0) -> list[int]:
        """seqs: the decoding requests; prompt_tokens: prompt-chunk tokens the step will also
        feed (a step that prefills is long anyway: drafts cost relatively less in it)."""
        self._bypassed = False
        if not seqs:
            return []
        self.probing = False
        ids = tuple(s.request_id for s in seqs)
        new = [s.request_id not in self.seqs for s in seqs]
        if self.steps < self.warmup:
            ks = [self._rung(min(s.cap, _WARM[self.steps % len(_WARM)])) for s in seqs]
        else:
            # while the policy is young its estimates are mostly prior (optimistic): sizes chosen on
            # them are held for a few steps, then for longer as measurements accumulate (a learned
            # drafter held at K = 8 for 64 steps on its prior alone ran at 0.67x plain)
            hold = (min(self.reuse, self.warmup + self.steps // 4) if self._last and any(self._last[1])
                    else min(self.reuse, self.probe_every))
            # sizes chosen beside a prompt chunk (drafts cost relatively less there) are not kept
            # for the decoding-only steps after it
            contradicted = not self.tree and self._contradicted(seqs)
            reused = (self._last and self._last[0] == ids and self._last[2] < hold and not prompt_tokens
                      and not self._last[3] and not contradicted)
            if reused:
                ks = [self._rung(min(s.cap, k)) for s, k in zip(seqs, self._last[1])]
                self._last = (ids, self._last[1], self._last[2] + 1, False)
            else:
                ks = self._optimise(seqs, prompt_tokens)
                self._last = (ids, ks, 1, bool(prompt_tokens))
            self.idle = 0 if any(ks) else self.idle + 1
            if not reused and self.idle >= self.probe_every:
                ks = self._probe(seqs, ks)
                self.probing = True
            # a request's first step drafts a few tokens where the estimates say plain: they are
            # the kind's, and may be another request's (one whose drafts turned bad just before)
            for i, s in enumerate(seqs):
                if new[i] and not ks[i] and s.cap >= 1:
                    ks[i], self.probing = self._rung(min(s.cap, self.probe_size)), True
        for s, k in zip(seqs, ks):
            self.seqs.setdefault(s.request_id, _Seq()).asked = k
        return ks

    def _contradicted(self, seqs: list[SeqInfo]) -> bool:
        """Whether a request's outcomes since its size was last chosen contradict the estimate it
        was chosen on, each way at under 0.1% as modelled: drafts in a row of which nothing was
        kept (three at a modelled 95% first-token acceptance, eight at 60%), or draft tokens in a
        row all kept (a probe's two at 3%); chains only (a tree keeps one path of its nodes). The
        evidence from before then counts a quarter, the request's, and its kind's where it is the
        kind's only request in the batch (others' evidence is theirs): the drafts have changed (a
        request that copied, then writes, or one whose drafts are good after another's were bad)."""
        hit = False
        for s in seqs:
            st = self.seqs.get(s.request_id)
            if st is None:
                continue
            if (st.misses >= 2 and st.miss ** st.misses < 1e-3) or (st.hits and (1 - st.miss) ** st.hits < 1e-3):
                st.kept, st.expect, st.misses, st.hits, hit = 0.25 * st.kept, 0.25 * st.expect, 0, 0, True
                if sum(o.greedy == s.greedy for o in seqs) == 1:   # the kind's model is its alone
                    self._catch_up()
                    self.acceptance[s.greedy].discount(0.25)
        return hit

    def unit_costs(self, contexts: list[int]) -> tuple[float, float] | None:
        """(a plain decoding step's cost per request, a verified draft token's) in seconds for
        decoding requests at these contexts, from the target's cost model; None while warming up."""
        if self.steps < self.warmup or not contexts:
            return None
        w, B, ctx = self.target.w, len(contexts), sum(contexts) / 1024
        plain = float(w @ np.array([1.0, B, 0.0, ctx, 0.0, 0.0])) / B
        return plain, max(float(w[1] + w[4] * ctx / B), 0.0)

    def _probe(self, seqs: list[SeqInfo], ks: list[int]) -> list[int]:
        """One request (in turn) drafts a few tokens, so that acceptance stays measured."""
        able = [i for i, s in enumerate(seqs) if s.cap >= 1]
        if able:
            i = able[self._probe_turn % len(able)]
            self._probe_turn += 1
            ks[i] = self._rung(min(seqs[i].cap, self.probe_size))
            self.idle = 0
        return ks

    def _expected(self, seqs: list[SeqInfo]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """([B, S] expected emitted tokens per size, [B, S] expected draft tokens fed per size,
        [B] each request's chance that its draft is not empty)."""
        base = {g: (a.expected(), a.drafted()) for g, a in self.acceptance.items()}
        state = [self.seqs.get(s.request_id) or _Seq() for s in seqs]
        mult = np.array([st.multiplier() for st in state])
        avail = np.array([st.available() for st in state])
        E = np.stack([base[s.greedy][0] for s in seqs])
        fed = avail[:, None] * np.stack([base[s.greedy][1] for s in seqs])
        E = 1.0 + (avail * mult)[:, None] * (E - 1.0)
        return np.minimum(E, 1.0 + fed), fed, avail

    def _optimise(self, seqs: list[SeqInfo], prompt_tokens: int = 0) -> list[int]:
        """Dinkelbach's iteration: for lam = the goodput so far, maximise E - lam * T (exactly:
        each request's best size for every possible longest draft), then lam = E / T of that
        choice, until it stops growing."""
        self._catch_up()
        B, sizes = len(seqs), self.sizes
        E, tokens, avail = self._expected(seqs)                                                # [B, S], [B, S], [B]
        ctx = np.array([s.context for s in seqs], dtype=float) / 1024
        wt, wd = self.target.w, self.draft.w
        T0 = wt @ np.array([1.0, B, float(prompt_tokens), ctx.sum(), 0.0, 0.0]) + max(wd[4], 0.0) * prompt_tokens
        if not T0 > 0:
            return [0] * B
        per_token = np.maximum(wt[1] + wt[4] * ctx, 0.02 * T0 / B) + max(wd[2], 0.0)        # [B]
        cost = tokens * per_token[:, None] + (sizes > 0)[None, :] * avail[:, None] * max(wd[1], 0.0)
        shared = max(wd[3], 0.0) * sizes + (max(wd[0], 0.0) + max(wt[5], 0.0)) * (sizes > 0)    # [S]
        drafting = np.array([(self.seqs.get(s.request_id) or _Seq()).asked > 0 for s in seqs])
        gain = 1.0 + (E - 1.0) * np.where(drafting, 1.0 + self.h, 1.0 - self.h)[:, None]
        allowed = sizes[None, :] <= np.array([s.cap for s in seqs])[:, None]
        # the ratio is taken on the hysteresis-weighted gains, so that "keep drafting while it
        # nearly pays" holds against plain decoding too
        rows, lam, choice = np.arange(B), B / T0, np.zeros(B, dtype=int)
        for _ in range(8):
            value = np.where(allowed, gain - lam * cost, -np.inf)                               # [B, S]
            total = np.maximum.accumulate(value, axis=1).sum(0) - lam * shared                 # [S]
            pick = value[:, :int(np.argmax(total)) + 1].argmax(1)
            ratio = gain[rows, pick].sum() / (T0 + cost[rows, pick].sum() + shared[pick.max()])
            if ratio <= lam * (1 + 1e-9):
                break
            choice, lam = pick, ratio
        for s, e in zip(seqs, E[:, 1]):               # E[:, 1]: 1 + the chance a first token is kept
            st = self.seqs.get(s.request_id)
            if st is not None:
                st.miss, st.misses, st.hits = float(np.clip(2.0 - e, 0.0, 1.0)), 0, 0
        return [int(sizes[c]) for c in choice]

    def observe(self, outcomes: list[Outcome], costs: StepCosts) -> None:
        """A step is over: its requests' acceptance and its costs update the models.

        Recorded now, applied (`_catch_up`) when the models are next read, i.e. when sizes are
        optimised again (every `reuse` steps while the batch is unchanged): the same updates in
        the same order, but run back to back instead of one per step between target forwards,
        which evict the Python code's and numpy's data from the caches (~0.15 ms a step there
        against ~0.03 ms in a loop, on SmolLM2 on one core)."""
        if not outcomes:
            return
        self.steps += 1
        # what each outcome's update reads of the request now (its ask may change by then)
        rows = []
        for o in outcomes:
            st = self.seqs.get(o.request_id)      # None: it finished this step (forgotten)
            if st is not None and o.drafted > 0:
                st.misses = st.misses + 1 if o.accepted == 0 else 0
                st.hits = st.hits + o.drafted if o.accepted >= o.drafted else 0
            rows.append((o, st, 0 if self._bypassed else st.asked if st is not None else o.drafted))
        self._pending.append((rows, costs, self.probing))
        if self.probing:
            self._last = None                    # what the probe measured counts next step
        if len(self._pending) >= 64:             # sizes reused for long (a fixed batch): bound the backlog
            self._catch_up()

    def _catch_up(self) -> None:
        """Apply the recorded steps' updates, oldest first."""
        pending, self._pending = self._pending, []
        for rows, costs, probing in pending:
            self._apply(rows, costs, probing)

    def _apply(self, rows: list, c: StepCosts, probing: bool) -> None:
        for acc in self.acceptance.values():
            acc.forget()
        given = {}                                # each kind's expected tokens per size asked, before this step's counts
        for o, st, asked in rows:
            if st is not None and asked > 0:
                st.asks = 0.9 * st.asks + 1
                st.drafts = 0.9 * st.drafts + (o.drafted > 0)
            if o.drafted > 0:
                if st is not None:
                    # measured against what the model expects of the size asked (the size a
                    # choice plays): E, through which the multiplier acts, is per size asked
                    if o.greedy not in given:
                        given[o.greedy] = self.acceptance[o.greedy].expected()
                    base = given[o.greedy]
                    rung = bisect.bisect_right(self._size_list, max(asked, o.drafted)) - 1
                    st.expect = 0.95 * st.expect + (base[rung] - 1.0)
                    st.kept = 0.95 * st.kept + o.accepted
                self.acceptance[o.greedy].observe(asked, o.drafted, o.accepted, o.path)
        self.target.update([1.0, c.decoding + c.draft_tokens, c.prompt_tokens, (c.attention - c.draft_attention) / 1024,
                            c.draft_attention / 1024, float(c.draft_tokens > 0)], c.rest_s)
        self.draft.update([float(c.drafting > 0), c.drafting, c.draft_tokens, c.depth, c.prompt_tokens], c.propose_s)
        if probing:
            self.draft.refit()                   # a probe's sample is fitted at once
