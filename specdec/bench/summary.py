"""From raw runs to the numbers in the table: tokens/s, speedups, c, the analytic prediction,
and the greedy comparison against specdec's plain decoding.

Glossary (per variant, over every timed run):
- alpha: acceptance rate, accepted / drafted tokens.
- K: mean tokens drafted per drafting step (the fixed K, or the mean for "auto" and n-gram).
- t_target: seconds per timed target forward (a verification of K + 1 tokens; plain: 1 token).
- t_draft: seconds of drafting per drafted token; c = t_draft / t_target.
- predicted speedup (Leviathan et al.): (1 - alpha^(K+1)) / ((1 - alpha)(K c + 1)); it assumes
  i.i.d. acceptance and that a verification costs what a plain decoding step costs.
"""

from __future__ import annotations

import statistics

from ..adaptive import expected_tokens
from ..metrics import RequestStats
from .variant import Run, Variant

REFERENCE, PEER_REFERENCE, LLAMACPP_REFERENCE = "plain", "hf_plain", "llamacpp_plain"
OWN_PLAIN = {"transformers": PEER_REFERENCE, "llama.cpp": LLAMACPP_REFERENCE}   # each peer family's plain decoding
MAX_LISTED_MISMATCHES = 5


def predicted_speedup(alpha: float, k: float, c: float) -> float:
    return expected_tokens(alpha, k) / (k * c + 1)


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "per_repeat": [round(v, 4) for v in values]}


def _tokens_per_second(runs: list[list[Run]]) -> list[float]:
    """Per repeat: all output tokens over all wall time of that repeat's prompts."""
    out = []
    for rep in runs:
        wall = sum(r.wall_s for r in rep)
        out.append(sum(len(r.token_ids) for r in rep) / wall if wall > 0 else 0.0)
    return out


def _decode_tokens_per_second(runs: list[list[Run]]) -> list[float] | None:
    """Per repeat: output tokens over wall time less the prefill (the decoding phase alone);
    None for runs that do not report their prefill (transformers' generate)."""
    out = []
    for rep in runs:
        if any(r.stats.prefill_time_s <= 0 for r in rep):
            return None
        wall = sum(r.wall_s - r.stats.prefill_time_s for r in rep)
        out.append(sum(len(r.token_ids) for r in rep) / wall if wall > 0 else 0.0)
    return out


def _decode_speedup(mine, reference) -> dict | None:
    tps = _decode_tokens_per_second(mine)
    ref = _decode_tokens_per_second(reference) if reference else None
    return _paired_speedup(tps, ref) if tps else None


def _paired_speedup(tps: list[float], ref_tps: list[float] | None) -> dict | None:
    """Ratios repeat by repeat (both measured within the same interleaved pass), then spread."""
    if not ref_tps:
        return None
    return _spread([a / b if b else 0.0 for a, b in zip(tps, ref_tps)])


def _merged(runs: list[list[Run]]) -> tuple[RequestStats, int]:
    total, timed = RequestStats(), 0
    for rep in runs:
        for r in rep:
            total.merge(r.stats)
            timed += r.timed_target_forwards
    return total, timed


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def greedy_comparison(runs: list[list[Run]], reference: list[list[Run]], prompt_ids: list[str]) -> dict:
    """Token for token against specdec plain's first repeat, in every repeat of this variant.

    One entry per mismatching prompt: where it first differs (in the first repeat that
    differs), the two tokens there, and in how many repeats it differed."""
    ref = [r.token_ids for r in reference[0]]
    mismatches = []
    for i, expected in enumerate(ref):
        outs = [rep[i].token_ids for rep in runs]
        bad = [out for out in outs if out != expected]
        if not bad:
            continue
        pos = _first_difference(bad[0], expected)
        mismatches.append({"prompt": prompt_ids[i], "prompt_index": i, "first_difference": pos,
                           "expected_token": expected[pos] if pos < len(expected) else None,
                           "got_token": bad[0][pos] if pos < len(bad[0]) else None,
                           "repeats_differing": len(bad), "repeats": len(outs),
                           "tokens": len(bad[0]), "reference_tokens": len(expected)})
    return {"identical": not mismatches, "mismatched_prompts": len(mismatches), "checked_prompts": len(ref),
            "mismatches": mismatches[:MAX_LISTED_MISMATCHES]}


def _timing(stats: RequestStats, timed: int) -> dict:
    t_target = stats.target_time_s / timed if timed else None
    t_draft = stats.draft_time_s / stats.draft_tokens if stats.draft_tokens else None
    c = t_draft / t_target if t_draft is not None and t_target else None
    k = stats.draft_tokens / stats.num_drafts if stats.num_drafts else 0.0
    predicted = predicted_speedup(stats.acceptance_rate, k, c) if c is not None else None
    ms = lambda s: None if s is None else round(s * 1e3, 4)  # noqa: E731
    return {"mean_k": round(k, 3), "target_forward_ms": ms(t_target), "draft_token_ms": ms(t_draft),
            "c": None if c is None else round(c, 4), "predicted_speedup": None if predicted is None else round(predicted, 4)}


def summarize_variant(v: Variant, runs: dict[str, list[list[Run]]], greedy: bool, prompt_ids: list[str],
                      decode_phase: bool = True) -> dict:
    mine = runs[v.name]
    tps = _tokens_per_second(mine)
    ref = lambda name: _tokens_per_second(runs[name]) if name in runs else None  # noqa: E731
    own = OWN_PLAIN.get(v.family)
    stats, timed = _merged(mine)
    return {
        "name": v.name, "family": v.family, "method": v.method, "k": v.k, "settings": v.settings,
        "tokens_per_second": _spread(tps),
        "speedup_vs_plain": _paired_speedup(tps, ref(REFERENCE)),
        "speedup_vs_hf_plain": _paired_speedup(tps, ref(PEER_REFERENCE)),
        "speedup_vs_llamacpp_plain": _paired_speedup(tps, ref(LLAMACPP_REFERENCE)),
        "decode_speedup_vs_plain": _decode_speedup(mine, runs.get(REFERENCE)) if decode_phase else None,
        "output_tokens": stats.output_tokens,
        "target_forward_passes": stats.target_forward_passes,
        "num_drafts": stats.num_drafts, "draft_tokens": stats.draft_tokens, "accepted_tokens": stats.accepted_tokens,
        "acceptance_rate": round(stats.acceptance_rate, 4) if stats.draft_tokens else None,
        "mean_accepted_length": round(stats.mean_accepted_length, 4),      # vLLM's: 1 + accepted / drafts
        "tokens_per_forward": round(stats.tokens_per_forward, 4),          # output / target forwards
        "per_position_acceptance": [round(x, 4) for x in stats.per_position_acceptance],
        **_timing(stats, timed),
        "greedy_match": greedy_comparison(mine, runs[REFERENCE], prompt_ids) if greedy and REFERENCE in runs else None,
        # a peer's speculation against its own plain decoding (llama.cpp's may differ from it)
        "greedy_match_own_plain": (greedy_comparison(mine, runs[own], prompt_ids)
                                   if greedy and own in runs and v.name != own else None),
    }


def summarize(variants: list[Variant], runs: dict[str, list[list[Run]]], scenario, max_tokens: int, repeats: int,
              decode_phase: bool = True) -> dict:
    prompt_ids = [p.id for p in scenario.prompts]
    return {
        "name": scenario.name, "prompt_set": scenario.prompt_set, "temperature": scenario.temperature,
        "num_prompts": len(scenario.prompts), "max_tokens": max_tokens, "repeats": repeats,
        "ignore_eos": scenario.ignore_eos,
        "prompt_tokens_mean": round(statistics.mean(len(p.ids) for p in scenario.prompts), 1),
        "methods": [summarize_variant(v, runs, scenario.greedy, prompt_ids, decode_phase) for v in variants],
    }
