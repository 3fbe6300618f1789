"""How good trained heads are: accuracy on validation features, speculation through the engine,
and the model card (heads.py trains; this module measures and writes)."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

from ..model.heads import EagleHead, MedusaHeads
from .headdata import FlatData

REPORT_TOKENS = 64      # new tokens per held-out prompt in the cards' speculation numbers


def _sequences(data: FlatData):
    for st, a, e in zip(data.starts.tolist(), data.answer_starts.tolist(), data.ends.tolist()):
        if e - st >= 3:
            yield st, a, e


@torch.no_grad()
def medusa_accuracy(heads: MedusaHeads, data: FlatData, to_draft, ranks: int = 10) -> list[list[float]]:
    """acc[i][r]: how often head i's r-th ranked token is the right one (trained-on positions);
    None where head i has no position to measure on (no data)."""
    M = heads.num_heads
    dev = data.tokens.device
    hits, total = torch.zeros(M, ranks, device=dev), torch.zeros(M, device=dev)
    for st, a, e in _sequences(data):
        t = torch.arange(max(st, a - 2), e - 2, device=dev)              # head 0 predicts t + 2
        if len(t) == 0:
            continue
        top = heads(data.hidden[t].float()).topk(ranks, -1).indices       # [M, N, R]
        for i in range(M):
            ok = t + 2 + i < e
            labels = to_draft[data.tokens[(t + 2 + i).clamp(max=e - 1)].long()]
            hits[i] += ((top[i] == labels[:, None]) & ok[:, None]).float().sum(0)
            total[i] += ok.sum()
    return [[round(x, 4) if n > 0 else None for x in row]
            for row, n in zip((hits / total.clamp(min=1)[:, None]).tolist(), total.tolist())]


@torch.no_grad()
def eagle_accuracy(head: EagleHead, embed, data: FlatData, to_draft) -> float:
    """Top-1 accuracy of the token after next from true features, on trained-on positions (None:
    no position to measure on)."""
    hits = total = 0
    for st, a, e in _sequences(data):
        feats = data.hidden[st:e - 2].float()[None]
        logits = head(feats, embed(data.tokens[st + 1:e - 1].long()).float()[None]).logits
        labels = to_draft[data.tokens[st + 2:e].long()]
        mask = torch.arange(st + 2, e, device=labels.device) >= a
        hits += int(((logits[0].argmax(-1) == labels) & mask).sum())
        total += int(mask.sum())
    return round(hits / total, 4) if total else None


@torch.no_grad()
def eagle_chain_accuracy(head: EagleHead, embed, data: FlatData, to_draft, depths: int = 4) -> list[float]:
    """Per chain depth s: top-1 accuracy of the token drafted at position s + 1 from the head's
    own features of the s earlier drafts (true tokens: the accuracy given they were right, the
    engine's conditional acceptance), on trained-on positions. Depth 0 is eagle_accuracy."""
    from .eagle_unroll import unrolled

    dev = data.tokens.device
    hits, total = torch.zeros(depths, device=dev), torch.zeros(depths, device=dev)
    for st, a, e in _sequences(data):
        outs = unrolled(head, data.hidden[st:e - 2].float()[None], embed(data.tokens[st + 1:e - 1].long()).float()[None],
                        depths)
        labels = to_draft[data.tokens[st + 2:e].long()]
        rows = torch.arange(e - 2 - st, device=dev)
        for s, (logits, _) in enumerate(outs):
            keep = (rows + st + 2 >= a) & (rows >= s)
            hits[s] += ((logits[0].argmax(-1) == labels) & keep).sum()
            total[s] += keep.sum()
    return [round(x, 4) if n > 0 else None for x, n in zip((hits / total.clamp(min=1)).tolist(), total.tolist())]


def fitting_prompts(prompts, n: int, context: int, log, max_tokens: int = REPORT_TOKENS) -> list[list[int]]:
    """The first n prompts (token id lists) that leave room for max_tokens new tokens in the
    target's context; a warning naming --report-prompts where longer ones were passed over."""
    kept, too_long = [], 0
    for p in prompts:
        if len(kept) == n:
            break
        if len(p) + max_tokens <= context:
            kept.append(p)
        else:
            too_long += 1
    if too_long:
        log(f"warning: --report-prompts {n}: {too_long} held-out prompt(s) too long for {max_tokens} new tokens in the "
            f"target's {context}-token context, passed over; " +
            (f"the card's speculation numbers come from {len(kept)}" if kept else "the card has no speculation numbers"))
    return kept


def speculation_report(target_dir: Path, heads_dir: Path, kind: str, prompts: list[list[int]], what: str,
                       max_tokens: int = REPORT_TOKENS, sizes=(4, 8, 16), dtype: str = "bfloat16") -> dict:
    """Mean accepted length through the engine on held-out prompts (token ids), greedy and at
    temperature 1, for each tree size."""
    from ..config import SamplingParams
    from ..llm import LLM

    out = {"prompts": len(prompts), "what": what, "max_tokens": max_tokens}
    for size in sizes:
        llm = LLM(model=target_dir, dtype=dtype,
                  speculative_config={"method": kind, "model": str(heads_dir), "num_speculative_tokens": size})
        for temp in (0.0, 1.0):
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(temperature=temp, max_tokens=max_tokens, seed=0))
            emitted = sum(o.stats.output_tokens for o in outs)
            passes = sum(o.stats.target_forward_passes for o in outs)
            accepted = sum(o.stats.accepted_tokens for o in outs)
            out[f"tree{size}_{'greedy' if temp == 0 else 'temperature_1'}"] = {
                "mean_accepted_length": round(emitted / max(1, passes), 3),
                "accepted_per_step": round(accepted / max(1, passes), 3)}
    return out


def shown(v) -> str:
    """An accuracy (or a list of them) for a card: "–" where it was measured on nothing."""
    if isinstance(v, list):
        return "[" + ", ".join(map(shown, v)) + "]"
    return "–" if v is None else str(v)


def card(out: Path, target_dir: Path, cfg, r: dict, commands: list[str]) -> str:
    what = (f"{cfg.num_heads} Medusa heads (a residual block each, one shared LM head over the draft vocabulary)"
            if cfg.kind == "medusa" else "an EAGLE head (fc + one Llama decoder layer + the target's final norm and LM-head rows)")
    if cfg.kind == "medusa":
        acc = f"| top-1 accuracy per head, greedy / sampled generations | {shown(r['top1_accuracy_per_head'])} / {shown(r['sampled_top1_accuracy_per_head'])} |"
        steps = f"{r['steps']} x {cfg.batch} positions"
    else:
        acc = f"| top-1 accuracy of the drafted token, greedy / sampled generations | {shown(r['top1_accuracy'])} / {shown(r['sampled_top1_accuracy'])} |"
        if "chain_top1_accuracy" in r:
            acc += (f"\n| top-1 accuracy by chain position, from the head's own features (given the earlier drafts "
                    f"right), greedy generations | {' '.join(map(shown, r['chain_top1_accuracy']))} |")
        if cfg.unroll > 1:
            acc += f"\n| chain depths trained | {cfg.unroll} (the later ones on the head's own predicted features) |"
        steps = f"{r['steps']} x {cfg.batch} rows x {cfg.window} pairs"
    rows = ""
    for key, v in r.get("speculation", {}).items():
        if key.startswith("tree"):
            size, mode = key[4:].split("_", 1)
            # a chain drafts K = size tokens (its depth defaults to K, proposers._tree_shape); a tree keeps
            # `size` nodes of at most DEFAULT_DEPTH levels
            shape = ("" if cfg.kind != "eagle" else f" (topk 1: a chain, {size} deep)" if cfg.default_topk == 1
                     else f" (topk {cfg.default_topk}: an EAGLE-2 tree)")
            rows += f"| {size} nodes{shape}, {mode.replace('_', ' ')} | {v['mean_accepted_length']} |\n"
    s = r.get("speculation", {})
    return f"""# {out.name}

{what} for `{target_dir}`, trained by specdec with the target frozen
(`specdec train {cfg.kind}`; see specdec/train/heads.py).

Licence: Apache-2.0, as the rest of specdec; the base model's own licence applies to its weights.
Base model: `{target_dir}` (its final norm and LM-head rows are copied in).

| | |
|---|---|
| trainable parameters | {r['trainable_parameters']:,} |
| draft vocabulary | {cfg.draft_vocab} most frequent tokens of the training data; they cover {r['draft_vocab_coverage']:.1%} of the validation tokens trained on |
| data | {r['data']} |
| steps | {steps}, AdamW lr {cfg.lr}, cosine |
| wall time | {r['wall_time_s'] / 3600:.2f} h on {r.get('device') or platform.machine() + ' CPU'}, {cfg.threads} thread(s), {cfg.precision} matmuls (fp32 master weights) |
{acc}

## Speculation on held-out prompts

Tokens per target forward (training.json's mean accepted length; not vLLM's 1 + accepted / drafts) on
{s.get('prompts', 0)} {s.get('what', '')}, {s.get('max_tokens', 0)} new tokens, bfloat16:

| draft | tokens per target forward |
|---|---|
{rows}
Reproduce (writes this folder, card included):
```
{chr(10).join(commands)}
```
"""
