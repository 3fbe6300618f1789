"""Training sequences for heads and drafts, laid end to end with the target's features.

Two sources, one layout:
- the toy target's self-distillation rows (selfdistill.py): equal-length rows, trained on at
  every position (corpus prompt and continuation alike);
- the chat answers (answers.py): a prompt through the chat template, then the target's answer;
  trained on the answer only (the prompt is context: it is what the proposer sees at inference,
  but it never drafts it).

Positions are flat: sequence s occupies [starts[s], ends[s]); its loss positions are
[answer_starts[s], ends[s]). hidden[t] is the target's final-norm feature after token t.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor


@dataclass
class FlatData:
    tokens: Tensor            # [N] int
    hidden: Tensor | None     # [N, D] float16
    starts: Tensor            # [S] int64
    ends: Tensor              # [S] int64, exclusive
    answer_starts: Tensor     # [S] int64: the first position trained on
    greedy: Tensor            # [S] bool: the answer was greedy (else sampled)

    @classmethod
    def from_rows(cls, rows: dict) -> "FlatData":
        """selfdistill rows {"tokens": [B, L], "hidden": [B, L, D], "greedy": [B]}."""
        B, L = rows["tokens"].shape
        starts = torch.arange(B, dtype=torch.long) * L
        return cls(rows["tokens"].reshape(-1), rows["hidden"].reshape(B * L, -1), starts, starts + L,
                   starts.clone(), rows["greedy"].clone())

    @classmethod
    def from_answers(cls, data: dict) -> "FlatData":
        """answers.load_answer_shards(...) output."""
        offs = data["offsets"]
        return cls(data["tokens"], data.get("hidden"), offs[:-1].clone(), offs[1:].clone(),
                   offs[:-1] + data["prompt_lens"], data["greedy"].clone())

    def to(self, device) -> "FlatData":
        """The same data on `device` (itself when already there)."""
        move = lambda t: t.to(device) if t is not None else None  # noqa: E731
        return FlatData(*(move(getattr(self, f)) for f in ("tokens", "hidden", "starts", "ends", "answer_starts",
                                                           "greedy")))

    @property
    def num_sequences(self) -> int:
        return len(self.starts)

    def answer_tokens(self) -> Tensor:
        """Every token trained on (for the draft vocabulary and its coverage)."""
        return torch.cat([self.tokens[a:e] for a, e in zip(self.answer_starts.tolist(), self.ends.tolist())])

    def select(self, keep: Tensor) -> "FlatData":
        """The sequences where keep [S] is true, re-laid end to end."""
        idx = keep.nonzero().flatten().tolist()
        spans = [(int(self.starts[i]), int(self.ends[i])) for i in idx]
        lens = torch.tensor([e - s for s, e in spans], dtype=torch.long)
        starts = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)[:-1]]) if spans else lens
        cat = lambda t: torch.cat([t[s:e] for s, e in spans]) if spans else t[:0]  # noqa: E731
        return FlatData(cat(self.tokens), cat(self.hidden) if self.hidden is not None else None, starts,
                        starts + lens, starts + (self.answer_starts[idx] - self.starts[idx]), self.greedy[idx])

    def label_positions(self, ahead: int) -> tuple[Tensor, Tensor]:
        """(t [P], sequence [P]) for every feature position t whose token t + ahead is trained on."""
        ts, seqs = [], []
        for s, (st, a, e) in enumerate(zip(self.starts.tolist(), self.answer_starts.tolist(), self.ends.tolist())):
            lo, hi = max(st, a - ahead), e - ahead          # t in [lo, hi): t + ahead in [answer, end)
            if hi > lo:
                ts.append(torch.arange(lo, hi))
                seqs.append(torch.full((hi - lo,), s))
        return torch.cat(ts), torch.cat(seqs)

    def windows(self, rng: np.random.Generator, label_t: Tensor, label_seq: Tensor, batch: int,
                window: int) -> tuple[Tensor, Tensor]:
        """EAGLE rows: `batch` windows of `window` pair positions t (feature t, token t + 1 ->
        feature t + 1, token t + 2), each around a random trained-on position.
        Returns (idx [B, W] positions, valid [B, W]: t + 2 < the sequence's end, seq [B])."""
        pick = torch.from_numpy(rng.integers(0, len(label_t), batch))
        t, s = label_t[pick], label_seq[pick]
        st, e = self.starts[s], self.ends[s]
        begin = t - torch.from_numpy(rng.integers(0, window, batch))
        begin = torch.maximum(st, torch.minimum(begin, e - 2 - window))   # full windows where the sequence allows
        idx = begin[:, None] + torch.arange(window)[None]
        valid = idx + 2 < e[:, None]
        return idx.clamp(max=len(self.tokens) - 3), valid, s

    def trained_on(self, idx: Tensor, seq_of: Tensor, ahead: int) -> Tensor:
        """[B, W] bool: token idx + ahead is a trained-on (answer) token of its sequence."""
        return idx + ahead >= self.answer_starts[seq_of][:, None]

    def sequence_of(self, positions: Tensor) -> Tensor:
        """The sequence holding each position."""
        return torch.searchsorted(self.starts, positions, right=True) - 1


def chat_data(answers_dir: Path, train_shards: int | None, val_shards: int) -> tuple[FlatData, FlatData, int]:
    """(train, validation, train shard count) from an answers folder: validation is the first
    `val_shards` shards (written first, so fixed while more are being made), train the first
    `train_shards` of the rest (None: all present)."""
    from .answers import load_answer_shards

    paths = sorted(answers_dir.glob("shard_*.pt"))
    if len(paths) <= val_shards:
        raise ValueError(f"{answers_dir}: {len(paths)} answer shards, need more than --val-shards {val_shards}")
    val_paths, rest = paths[:val_shards], paths[val_shards:]
    n = len(rest) if train_shards is None else min(train_shards, len(rest))
    return (FlatData.from_answers(load_answer_shards(rest[:n])), FlatData.from_answers(load_answer_shards(val_paths)), n)
