"""Contamination check: training prompts against an evaluation set (Spec-Bench's questions).

A prompt is dropped when, its text and the turns normalised alike (NFKC, case-folded, combining
marks such as accents removed: NFD text, "u" + U+0308, matches "ü") and cut into words,
- it equals an evaluation turn, or contains a short one (under 8 words) as a phrase, or contains
  a short turn's content (4 to 12 words after an instruction prefix of at most 6 words before a
  ":", such as "Translate German to English:"), so the benchmark's sentence under another
  wording of the instruction is dropped too;
- it shares any 13-word sequence with an evaluation turn (GPT-3's contamination rule);
- it is a near duplicate: at least half the 8-word sequences of the prompt, or of the
  evaluation turn, also occur in the other.
The report counts each rule's hits and how many prompts share any 8-gram at all.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections import defaultdict
from pathlib import Path

LONG_N, NEAR_N, NEAR_FRACTION = 13, 8, 0.5
PREFIX_WORDS, CONTENT_MIN = 6, 4      # an instruction prefix's most words; a checked content's fewest


def words(text: str) -> list[str]:
    """The text's words, compared alike however the text is encoded: NFKC, case-folded (ß is ss),
    and without combining marks (which are no word characters: NFD text would split at each)."""
    if not text.isascii():
        text = unicodedata.normalize("NFKD", text.casefold())
        text = unicodedata.normalize("NFKC", "".join(c for c in text if not unicodedata.category(c).startswith("M")))
    return re.findall(r"\w+", text.lower())


def turn_content(turn: str) -> list[str]:
    """The turn's words past an instruction prefix ("Translate German to English: S" -> S's), or []."""
    head, sep, rest = turn.partition(":")
    return words(rest) if sep and 0 < len(words(head)) <= PREFIX_WORDS else []


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
    # longer contents share a 13-gram with the prompt already
    short += [" ".join(c) for c in map(turn_content, evals) if CONTENT_MIN <= len(c) < LONG_N]
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
              "rules": f"exact / contains a short turn or a short turn's content; any shared {LONG_N}-gram; "
                       f">= {NEAR_FRACTION:.0%} of {NEAR_N}-grams shared either way"}
    return kept, report


def _max_below(prompts, kept, evals) -> float:
    """The largest 8-gram fraction among the kept prompts (recomputed on them alone)."""
    _, r = check_overlap(kept, evals) if len(kept) < len(prompts) else (None, {"max_8gram_fraction_kept": 0.0})
    return r["max_8gram_fraction_kept"]
