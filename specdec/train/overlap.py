"""Contamination check: training prompts against an evaluation set (Spec-Bench's questions).

A prompt is dropped when, after lower-casing and keeping only word characters,
- it equals an evaluation turn, or contains a short one (under 8 words) as a phrase;
- it shares any 13-word sequence with an evaluation turn (GPT-3's contamination rule);
- it is a near duplicate: at least half the 8-word sequences of the prompt, or of the
  evaluation turn, also occur in the other.
The report counts each rule's hits and how many prompts share any 8-gram at all.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

LONG_N, NEAR_N, NEAR_FRACTION = 13, 8, 0.5


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def ngrams(ws: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(ws[i:i + n]) for i in range(len(ws) - n + 1)}


def eval_texts(path: Path) -> list[str]:
    """Every turn of a Spec-Bench / MT-bench question file ({"turns": [...]} per line; a "turns"
    string is one turn). A file yielding no turn is refused: a check against nothing is none."""
    texts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
            turns = row.get("turns", []) if isinstance(row, dict) else []
            texts += [turns] if isinstance(turns, str) else [t for t in turns if isinstance(t, str)]
    if not any(words(t) for t in texts):
        raise ValueError(f'{path}: no evaluation turns (a Spec-Bench / MT-bench file has a "turns" list per line)')
    return texts


def check_overlap(prompts: list[dict], evals: list[str]) -> tuple[list[dict], dict]:
    """(prompts that pass, report). prompts: [{"id", "prompt", ...}]."""
    ev_words = [words(t) for t in evals]
    exact = {" ".join(w) for w in ev_words}
    short = [" ".join(w) for w in ev_words if 0 < len(w) < NEAR_N]
    long_index, near_index = defaultdict(set), defaultdict(set)
    near_sizes = []
    for i, w in enumerate(ev_words):
        for g in ngrams(w, LONG_N):
            long_index[g].add(i)
        grams = ngrams(w, NEAR_N)
        near_sizes.append(len(grams))
        for g in grams:
            near_index[g].add(i)
    hits = {"exact": [], "shared_13gram": [], "near_duplicate_8gram": []}
    any_8gram, max_fraction, kept = 0, 0.0, []
    for p in prompts:
        w = words(p["prompt"])
        joined = " ".join(w)
        rule = None
        if joined in exact or any(f" {s} " in f" {joined} " for s in short):
            rule = "exact"
        elif any(g in long_index for g in ngrams(w, LONG_N)):
            rule = "shared_13gram"
        else:
            grams = ngrams(w, NEAR_N)
            shared = defaultdict(int)
            for g in grams:
                for i in near_index.get(g, ()):
                    shared[i] += 1
            if shared:
                any_8gram += 1
                frac = max(max(n / len(grams), n / max(1, near_sizes[i])) for i, n in shared.items())
                max_fraction = max(max_fraction, frac)
                if frac >= NEAR_FRACTION:
                    rule = "near_duplicate_8gram"
        if rule:
            hits[rule].append(p.get("id"))
        else:
            kept.append(p)
    report = {"evaluation_turns": len(evals), "prompts_checked": len(prompts), "prompts_kept": len(kept),
              **{f"dropped_{k}": len(v) for k, v in hits.items()}, "dropped_ids": sum(hits.values(), []),
              "prompts_sharing_any_8gram_kept": any_8gram - len(hits["near_duplicate_8gram"]),
              "max_8gram_fraction_kept": round(max_fraction if not hits["near_duplicate_8gram"] else
                                               _max_below(prompts, kept, evals), 4),
              "rules": f"exact / contains a short turn; any shared {LONG_N}-gram; >= {NEAR_FRACTION:.0%} of "
                       f"{NEAR_N}-grams shared either way"}
    return kept, report


def _max_below(prompts, kept, evals) -> float:
    """The largest 8-gram fraction among the kept prompts (recomputed on them alone)."""
    _, r = check_overlap(kept, evals) if len(kept) < len(prompts) else (None, {"max_8gram_fraction_kept": 0.0})
    return r["max_8gram_fraction_kept"]
