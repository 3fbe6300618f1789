"""Why did a greedy output differ from plain decoding? Measure the target's logit gap there.

Greedy speculative decoding is exact in exact arithmetic, but a verification forward over K + 1
tokens runs different kernels (different blocking, accumulation order) than a one-token step,
so in bfloat16 two tokens whose logits are within rounding of each other can swap. A mismatch at
such a near-tie is numerics; one at a clear gap is a bug. The table reports both, never hides
either: this only labels them.
"""

from __future__ import annotations

import torch

# |gap| within this many epsilons of the dtype, relative to the largest |logit|, is a near-tie:
# a forward's rounding error grows with depth, so it is several ulps of the output, not one
NEAR_TIE_EPS = 4


@torch.inference_mode()
def logit_gap(model, prompt_ids: list[int], reference: list[int], pos: int, got: int) -> dict:
    """Target logits after prompt + reference[:pos] (one full-sequence forward): how far the
    token plain decoding chose (reference[pos]) is ahead of the one the variant emitted."""
    seq = torch.tensor([prompt_ids + reference[:pos]], device=model.device)
    logits = model(seq).logits[0, -1].float()                            # [V]
    gap = (logits[reference[pos]] - logits[got]).item()
    scale = logits.abs().max().item()
    return {"logit_gap": round(gap, 5), "max_abs_logit": round(scale, 3),
            "near_tie": abs(gap) <= NEAR_TIE_EPS * torch.finfo(model.dtype).eps * scale}


def label_mismatches(model, scenario, summary: dict, reference_runs) -> None:
    """Add logit_gap / near_tie to every listed greedy mismatch of a summarized scenario."""
    seen: dict[tuple[int, int, int], dict] = {}
    for m in summary["methods"]:
        g = m["greedy_match"]
        for mm in (g or {}).get("mismatches", []):
            if mm["expected_token"] is None or mm["got_token"] is None:
                continue                  # one output stopped earlier: nothing to compare there
            key = (mm["prompt_index"], mm["first_difference"], mm["got_token"])
            if key not in seen:
                i = mm["prompt_index"]
                seen[key] = logit_gap(model, scenario.prompts[i].ids, reference_runs[0][i].token_ids,
                                      mm["first_difference"], mm["got_token"])
            mm.update(seen[key])
        if g and g["mismatches"]:
            g["all_listed_near_ties"] = all(mm.get("near_tie") for mm in g["mismatches"])
