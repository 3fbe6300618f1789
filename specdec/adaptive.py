"""How many tokens each decoding request drafts in a step: a fixed K, or "auto".

"auto" is goodput-aware (goodput.py): per step and per request, from measured per-position
acceptance and the measured cost of a step as a function of what it feeds, the sizes that
maximise the whole batch's expected tokens per second, K = 0 (plain decoding) included.
vLLM's `disable_by_batch_size` also holds for either: from that many running requests on,
nobody drafts (and the proposer is not called).
"""

from __future__ import annotations

from collections.abc import Hashable

from .goodput import GoodputPolicy, Outcome, SeqInfo, StepCosts


def expected_tokens(alpha: float, k: float) -> float:
    """Tokens a step emits when each of k drafts is kept with probability alpha (i.i.d.)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


class SpeculationPolicy:
    """The engine asks once per step for all its decoding requests, reports each step's
    outcomes and costs back, and says when a request leaves."""

    def __init__(self, num_speculative_tokens: int | str, tree: bool = False, max_k: int = 8,
                 max_tree_size: int | None = None, disable_by_batch_size: int | None = None):
        self.disable_by_batch_size = disable_by_batch_size
        self.goodput = None
        self.fixed = 0
        if num_speculative_tokens == "auto":
            # no size beyond what the proposer can draft (EAGLE's chains: their depth)
            self.goodput = GoodputPolicy(min(max_k, max_tree_size or max_k), tree)
        else:
            self.fixed = int(num_speculative_tokens)

    def choose(self, seqs: list[SeqInfo], num_running: int, prompt_tokens: int = 0) -> list[int]:
        """The size each decoding request may draft (before any room limit); prompt_tokens:
        what the step is expected to prefill besides."""
        if self.disable_by_batch_size is not None and num_running >= self.disable_by_batch_size:
            if self.goodput is not None:
                self.goodput.bypass()      # not asked: these steps count against no request
            return [0] * len(seqs)
        if self.goodput is not None:
            return self.goodput.choose(seqs, prompt_tokens)
        return [self.fixed] * len(seqs)

    def observe(self, outcomes: list[Outcome], costs: StepCosts) -> None:
        if self.goodput is not None:
            self.goodput.observe(outcomes, costs)

    def forget(self, request_id: Hashable) -> None:
        if self.goodput is not None:
            self.goodput.forget(request_id)
