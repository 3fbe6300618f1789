"""Prompt lookup: which earlier match the n-gram proposer copies from."""

import numpy as np
import pytest

from specdec.proposers.ngram import lookup


@pytest.mark.parametrize("seq,k,want", [
    ([1, 2, 3, 9, 1, 2, 3], 3, [9, 1, 2]),            # the longest n that matches
    ([1, 2, 7, 7, 1, 2, 8, 1, 2], 2, [8, 1]),         # the latest match with k tokens after it
    ([4, 1, 2, 5, 6, 0, 1, 2, 3, 1, 2], 3, [3, 1, 2]),
    ([4, 1, 2, 5, 6, 0, 1, 2, 3, 1, 2], 4, [5, 6, 0, 1]),   # none newer has 4 after it: the earliest
    ([5, 5, 5, 5, 5, 5], 3, [5, 5]),                  # a loop: not the tail's own neighbour (1 token)
    ([1, 2, 3], 2, []),                               # no earlier occurrence
])
def test_lookup_prefers_recent_matches_with_a_full_continuation(seq, k, want):
    assert lookup(np.asarray(seq), k, 4, 1).tolist() == want


def _reference(seq, k, n_max, n_min):
    """The definition, by brute force: for the longest n with an earlier occurrence of the tail,
    the latest occurrence with k tokens after it, else the earliest."""
    L = len(seq)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        starts = [s for s in range(0, L - n) if list(seq[s:s + n]) == list(seq[L - n:])]
        if starts:
            full = [s for s in starts if L - (s + n) >= k]
            start = (full[-1] if full else starts[0]) + n
            return list(seq[start:start + k]), n
    return [], 0


@pytest.mark.parametrize("kernel", [True, False], ids=["C", "numpy"])
def test_match_agrees_with_the_definition_on_random_sequences(kernel):
    from specdec.proposers.ngram import match
    rng = np.random.default_rng(0)
    for _ in range(400):
        seq = rng.integers(0, rng.integers(2, 6), size=rng.integers(1, 40))
        k, n_max = int(rng.integers(1, 6)), int(rng.integers(1, 6))
        n_min = int(rng.integers(1, n_max + 1))
        tokens, n = match(seq, k, n_max, n_min, kernel=kernel)
        assert (tokens.tolist(), n) == _reference(seq, k, n_max, n_min), (seq.tolist(), k, n_max, n_min)


def test_the_proposer_copies_what_the_context_repeats():
    """End to end: a greedy reply that repeats itself (the toy target's loop) is drafted from its
    own earlier tokens and the drafts are accepted; a proposer that drafted garbage would still be
    lossless, and only this shows it (a mutation tester's finding)."""
    from specdec import LLM, SamplingParams

    llm = LLM("models/target", speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                   "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    out = llm.generate(["def add(a, b):\n    return a + b\n\ndef add(a, b):\n"],
                       SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))[0]
    assert out.stats.num_drafts > 0 and out.stats.acceptance_rate > 0.8
