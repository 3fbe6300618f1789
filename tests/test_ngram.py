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
