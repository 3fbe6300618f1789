"""How many tokens to draft: a fixed K, or "auto" chosen each step to maximise tokens/second.

With acceptance rate a (i.i.d. per position), a step that drafts K tokens emits
(1 - a^(K+1)) / (1 - a) tokens on average and costs K * t_draft + t_verify(K). The policy
keeps running estimates of a, t_draft and t_verify(K) (a + b*K) and picks the K with the best
ratio, K = 0 (plain decoding) included. While K = 0 wins it still drafts one token every few
steps, so that it notices when the text becomes predictable again.
"""

from __future__ import annotations


def expected_tokens(alpha: float, k: int) -> float:
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


class FixedK:
    def __init__(self, k: int):
        self.k = k

    def choose(self) -> int:
        return self.k

    def update(self, k: int, accepted: int, draft_s: float, verify_s: float, path=None) -> None:
        pass


class AdaptiveK:
    def __init__(self, max_k: int = 8, probe_every: int = 8, decay: float = 0.9):
        self.max_k, self.probe_every, self.decay = max_k, probe_every, decay
        self.alpha = 0.6            # optimistic start: try speculating first
        self.t_draft = None         # seconds per drafted token
        self.t_verify = {}          # k -> EMA seconds of a target forward over k + 1 tokens
        self.steps_since_draft = 0

    def _verify_time(self, k: int) -> float | None:
        if k in self.t_verify:
            return self.t_verify[k]
        known = sorted(self.t_verify)
        if not known:
            return None
        if len(known) == 1:
            return self.t_verify[known[0]]
        # linear fit through the two measured sizes nearest to k
        a, b = min(known, key=lambda x: abs(x - k)), None
        b = min((x for x in known if x != a), key=lambda x: abs(x - k))
        slope = (self.t_verify[b] - self.t_verify[a]) / (b - a)
        return max(1e-9, self.t_verify[a] + slope * (k - a))

    def choose(self) -> int:
        t0 = self._verify_time(0)
        if self.t_draft is None or t0 is None:
            return min(4, self.max_k) if self.t_draft is None else 0
        best_k, best_rate = 0, 1.0 / t0
        for k in range(1, self.max_k + 1):
            tv = self._verify_time(k)
            rate = expected_tokens(self.alpha, k) / (k * self.t_draft + tv)
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_k == 0:
            self.steps_since_draft += 1
            if self.steps_since_draft >= self.probe_every:
                self.steps_since_draft = 0
                return 1
        return best_k

    def update(self, k: int, accepted: int, draft_s: float, verify_s: float, path=None) -> None:
        d = self.decay
        prev = self.t_verify.get(k)
        self.t_verify[k] = verify_s if prev is None else d * prev + (1 - d) * verify_s
        if k == 0:
            return
        self.steps_since_draft = 0
        per_tok = draft_s / k
        self.t_draft = per_tok if self.t_draft is None else d * self.t_draft + (1 - d) * per_tok
        # the accepted count of a step is a truncated geometric sample: estimate a by
        # accepted / (accepted + [a rejection happened]) smoothed over steps
        trials = accepted + (1 if accepted < k else 0)
        if trials:
            self.alpha = d * self.alpha + (1 - d) * (accepted / trials)


class AdaptiveSize:
    """"auto" for token trees, whose acceptance is not one geometric rate: estimate, for each
    size in a ladder (0 = plain decoding), the tokens a step emits and what the step costs
    (draft + verify), and play the size with the best tokens/second.

    Trees are nested: the proposers list nodes best first, so the tree of size s is the first
    s nodes of any larger one. A greedy step that verified a tree of size k therefore also
    tells what every smaller size would have accepted (the accepted path cut at the first node
    beyond s), and all those estimates move every step. Costs are measured per size played;
    every `probe_every` steps the policy plays the next size up (to see whether a bigger tree
    would now pay) or down (to refresh its cost), alternately.
    """

    LADDER = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)

    def __init__(self, max_size: int = 32, warmup: int = 2, probe_every: int = 16, decay: float = 0.9):
        self.sizes = [s for s in self.LADDER if s <= max_size]
        self.warmup, self.probe_every, self.decay = warmup, probe_every, decay
        self.tokens: dict[int, float] = {}
        self.seconds: dict[int, float] = {}
        self.played: dict[int, int] = {}      # steps played per size (its cost observations)
        self.observed: dict[int, int] = {}    # token observations per size (counterfactual included)
        self.steps = 0
        self.chosen = 0                       # the size last asked for: the arm a step's outcome belongs to
        self.incumbent: int | None = None     # the size played between probes
        self.switch_margin = 1.05

    def rate(self, size: int) -> float:
        if size not in self.tokens or size not in self.seconds:
            return 0.0
        return self.tokens[size] / max(self.seconds[size], 1e-9)

    def choose(self) -> int:
        self.chosen = self._choose()
        return self.chosen

    def _choose(self) -> int:
        # warm up in increasing size, but never more than two rungs above the best so far:
        # trees far past the point where acceptance saturates only cost (32 nodes: 4x a step)
        warmed = [s for s in self.sizes if self.played.get(s, 0) >= self.warmup]
        top = self.sizes.index(max(warmed, key=self.rate)) + 2 if warmed else 0
        fresh = [s for s in self.sizes[:top + 1] if self.played.get(s, 0) < self.warmup]
        if fresh:
            return fresh[0]
        self.steps += 1
        # switch only for a clear gain: estimates of rarely played sizes are noisy
        best = max(self.sizes, key=self.rate)
        if self.incumbent is not None and self.rate(best) < self.switch_margin * self.rate(self.incumbent):
            best = self.incumbent
        self.incumbent = best
        if self.steps % self.probe_every == 0:
            i = self.sizes.index(best)
            up = (self.steps // self.probe_every) % 2
            return self.sizes[min(len(self.sizes) - 1, i + 1) if up else max(0, i - 1)]
        return best

    def _observe(self, table: dict, counts: dict, size: int, value: float) -> None:
        n = counts[size] = counts.get(size, 0) + 1
        d = min(self.decay, (n - 1) / n)      # a plain mean over the first observations
        table[size] = value if n == 1 else d * table[size] + (1 - d) * value

    def update(self, k: int, accepted: int, draft_s: float, verify_s: float, path: list[int] | None = None) -> None:
        # the outcome belongs to the size asked for, even when the proposer drafted fewer nodes
        # (a depth limit, a draft distribution with little support, the end of the request)
        size = self.chosen if k > 0 else 0
        self._observe(self.seconds, self.played, size, draft_s + verify_s)
        if path is None:          # sampling: only the size played is observed
            self._observe(self.tokens, self.observed, size, accepted + 1.0)
            return
        for s in self.sizes:
            if s > size:
                break
            cut = next((i for i, node in enumerate(path) if node >= s), len(path))
            self._observe(self.tokens, self.observed, s, cut + 1.0)


class SpeculationPolicy:
    """K (or tree size) for each decoding request of a step, and what the step taught.

    The engine asks once per step for all its decoding requests and reports back once; this is
    the hook where a batch-aware (goodput) policy chooses K from the batch size and the
    measured cost of a forward over n tokens. This default keeps what runs at batch 1: one
    policy per kind of request (greedy, sampled: their acceptance differs systematically),
    shared across requests because acceptance and costs belong to the method and the machine.
    Every request of a kind gets that kind's choice in a step; costs are the whole step's
    (what each of its requests waited for).
    """

    def __init__(self, num_speculative_tokens: int | str, tree: bool = False, max_k: int = 8,
                 max_tree_size: int | None = None):
        if num_speculative_tokens == "auto":
            # no ladder rung beyond what the proposer can draft (EAGLE's chains: their depth)
            make = (lambda: AdaptiveSize(min(max_k, max_tree_size or max_k))) if tree else (lambda: AdaptiveK(max_k))
            self.by_kind = {greedy: make() for greedy in (True, False)}
        else:
            self.by_kind = {greedy: FixedK(int(num_speculative_tokens)) for greedy in (True, False)}

    def choose(self, greedy: list[bool]) -> list[int]:
        """greedy: one flag per decoding request -> the K each may draft (before any room limit)."""
        ks = {g: self.by_kind[g].choose() for g in set(greedy)}
        return [ks[g] for g in greedy]

    def observe(self, outcomes: list[tuple[bool, int, int, list[int] | None]], draft_s: float, verify_s: float,
                num_tokens: int = 0) -> None:
        """outcomes: per decoding request (greedy, drafted k, accepted, accepted tree path of a
        greedy step or None); draft_s / verify_s: the step's drafting and verification time;
        num_tokens: what the target forward fed (decoding and prompt tokens), for a policy that
        models the forward's cost as a function of it."""
        for greedy, k, accepted, path in outcomes:
            self.by_kind[greedy].update(k, accepted, draft_s, verify_s, path=path)
