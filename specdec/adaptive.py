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

    def update(self, k: int, accepted: int, draft_s: float, verify_s: float) -> None:
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

    def update(self, k: int, accepted: int, draft_s: float, verify_s: float) -> None:
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
    """"auto" for token trees, where acceptance is not one geometric rate: measure each tree
    size directly. For every size in a ladder (0 = plain decoding) keep running means of the
    tokens a step emits and of what the step costs (draft + verify); play the size with the best
    tokens/second, after trying each a few times. Every `probe_every` steps it plays a neighbour
    of the best size instead, so the estimates follow the text as it changes.
    """

    LADDER = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)

    def __init__(self, max_size: int = 32, warmup: int = 3, probe_every: int = 10, decay: float = 0.9):
        self.sizes = [s for s in self.LADDER if s <= max_size]
        self.warmup, self.probe_every, self.decay = warmup, probe_every, decay
        self.tokens: dict[int, float] = {}
        self.seconds: dict[int, float] = {}
        self.count: dict[int, int] = {}
        self.steps = 0

    def rate(self, size: int) -> float:
        return self.tokens[size] / max(self.seconds[size], 1e-9)

    def choose(self) -> int:
        fresh = [s for s in self.sizes if self.count.get(s, 0) < self.warmup]
        if fresh:
            return fresh[0]
        self.steps += 1
        best = max(self.sizes, key=self.rate)
        if self.steps % self.probe_every == 0:
            i = self.sizes.index(best)
            side = (self.steps // self.probe_every) % 2
            j = min(len(self.sizes) - 1, i + 1) if side else max(0, i - 1)
            return self.sizes[j]
        return best

    def update(self, k: int, accepted: int, draft_s: float, verify_s: float) -> None:
        size = min(self.sizes, key=lambda s: abs(s - k))   # a step may draft fewer than asked
        n, cost = accepted + 1.0, draft_s + verify_s
        if size not in self.count:
            self.tokens[size], self.seconds[size], self.count[size] = n, cost, 1
            return
        d = self.decay if self.count[size] >= self.warmup else (self.count[size] / (self.count[size] + 1))
        self.tokens[size] = d * self.tokens[size] + (1 - d) * n
        self.seconds[size] = d * self.seconds[size] + (1 - d) * cost
        self.count[size] += 1
