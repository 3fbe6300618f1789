"""OpenAI's Predicted Outputs (`prediction: {"type": "content", "content": ...}`): text the caller
expects most of the answer to repeat (a file being edited, a document being corrected) becomes a
draft source of its own request. While the output follows the prediction, each step drafts the
prediction's next tokens; where the output leaves it, the prediction is searched for the output's
last tokens to find where they rejoin (as prompt lookup searches the context); with no match the
request drafts with the engine's proposer as any other. The drafts are verified as every draft
is, so the output is exactly what the target would have written without them (greedy: identical;
sampling: the same distribution, a point-mass q as n-gram drafts have).

Counted as OpenAI defines them, once the reply is complete: accepted_prediction_tokens, the
prediction's tokens that appear in the reply, rejected_prediction_tokens, those that do not
(together the prediction's length); "appear" is an alignment in order, the longest common
subsequence of the two (bit-parallel: ~20 ms for a 300,000-token prediction against a
2,000-token reply, where difflib's matcher had taken 29 s on the engine's thread).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

N_MAX = 8        # the longest output tail looked up in the prediction
N_MIN = 2        # the shortest that counts as a rejoin (one token matches too often by chance)


def common_subsequence(a: list[int], b: list[int]) -> int:
    """The length of the longest common subsequence of a and b, bit-parallel over b (Hyyro's
    formulation of Allison and Dix): one pass over a, each step a few operations on a len(b)-bit
    integer (bit j of V set while b[j] is not yet matched in the current best alignment)."""
    if not a or not b:
        return 0
    masks: dict[int, int] = {}
    for j, c in enumerate(b):
        masks[c] = masks.get(c, 0) | (1 << j)
    full = (1 << len(b)) - 1
    v = full
    for c in a:
        u = v & masks.get(c, 0)
        v = ((v + u) | (v - u)) & full
    return len(b) - bin(v).count("1")


@dataclass
class Prediction:
    """One request's prediction and where its output stands in it."""
    ids: np.ndarray                  # the prediction's token ids
    cursor: int = 0                  # the last draft was ids[cursor:cursor + k] ...
    base: int = 0                    # ... proposed when the output held `base` tokens
    drafted: bool = False            # the step now being verified drafts from the prediction
    following: bool = True           # its last draft was kept whole: the next one may run longer than K
    peeked: np.ndarray | None = None  # this step's draft, taken when its length was chosen

    @classmethod
    def of(cls, ids) -> Prediction | None:
        ids = np.asarray(list(ids), dtype=np.int64)
        return cls(ids) if len(ids) else None

    def appearing_in(self, output: list[int]) -> int:
        """OpenAI's accepted_prediction_tokens: the prediction's tokens that appear in the output,
        aligned in order (their longest common subsequence), whether or not speculation drafted
        them; the rest of the prediction is rejected_prediction_tokens."""
        return common_subsequence(self.ids.tolist(), list(output))

    def draft(self, output: list[int], k: int) -> np.ndarray:
        """Up to k tokens the prediction says come next after `output` (empty: none)."""
        ids, n = self.ids, len(output)
        if n == 0:
            start = 0
        else:
            done = n - self.base           # tokens the output gained since the last draft
            if 0 < done and self.cursor + done <= len(ids) and \
                    np.array_equal(ids[self.cursor:self.cursor + done], output[self.base:]):
                start = self.cursor + done                 # still on the prediction
            else:
                start = self._rejoin(output)
                if start is None:
                    return ids[:0]
        self.cursor, self.base = start, n
        return ids[start:start + k]

    def _rejoin(self, output: list[int]) -> int | None:
        """Where the prediction continues after the output's last tokens: the end of the longest
        match (N_MIN..N_MAX tokens) of the output's tail in the prediction, the first such end at
        or after the last draft's start (edits keep the order), else the first; None: no match."""
        ids, tail = self.ids, np.asarray(output[-N_MAX:], dtype=np.int64)
        ends = np.flatnonzero(ids == tail[-1]) + 1          # a match of the last token ends here
        if not len(ends):
            return None
        length = 1
        while length < len(tail):
            longer = ends[ends - length - 1 >= 0]
            longer = longer[ids[longer - length - 1] == tail[-length - 1]]
            if not len(longer):
                break
            ends, length = longer, length + 1
        if length < min(N_MIN, len(output)):
            return None
        later = ends[ends >= self.cursor]
        return int(later[0] if len(later) else ends[0])
