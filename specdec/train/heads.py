"""`specdec train medusa | eagle`: heads for a frozen target, trained on its own generations.

1. Self-distillation data (selfdistill.py): prompts cut from the corpus split, continued by the
   target (half greedy, half sampled), with the target's features at every position.
2. The draft vocabulary: the most frequent tokens of that data (model/heads.py says why).
3. Training, deterministic and resumable like `train lm`: batch i comes from
   default_rng((seed, i)); a checkpoint every `save_every` steps in the work folder.
   - Medusa: head i (1-based) at position t learns token t + 1 + i (cross-entropy, weight
     0.8^(i-1)), the target frozen.
   - EAGLE: from (feature t, embedding of token t + 1), predict feature t + 1 (smooth L1) and
     token t + 2 through the frozen LM-head rows (cross-entropy, weight 0.1), as in EAGLE;
     input features get uniform noise (EAGLE's augmentation against drafting on its own,
     imperfect features).
4. Evaluation on the validation split's generations: per-head top-r accuracy (Medusa: it also
   shapes the candidate tree) or top-1 accuracy of the drafted token (EAGLE), then speculative
   decoding on held-out function headers through the engine: acceptance rate and mean
   accepted length, written into the card with the commands.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..model import load_model
from ..model.heads import EagleHead, MedusaHeads, save_heads
from ..tokenizer import Tokenizer
from .data import cached_tokens
from .selfdistill import load_shards, make_shards


@dataclass(frozen=True)
class HeadsConfig:
    kind: str = "medusa"               # "medusa" | "eagle"
    num_heads: int = 4                 # medusa
    draft_vocab: int = 2048
    steps: int = 1500
    batch: int | None = None           # medusa: positions per step (512); eagle: rows of `window` pairs (8)
    window: int = 128                  # eagle: pairs per row
    lr: float = 1e-3
    warmup: int = 50
    noise: float = 0.1                 # eagle: input feature noise, uniform in +-noise * rms
    shards: int = 48                   # self-distillation shards (32 x 256 tokens each)
    val_shards: int = 4
    seed: int = 0
    save_every: int = 100
    threads: int = 1
    corpus_limit_mb: float | None = None   # prompts from the first files of each split only (smoke runs)
    default_topk: int = 1              # eagle: the tree's branching when speculative_config has no "topk";
                                       # chains measured fastest on the 2-core CPU (README, Methods)

    def __post_init__(self):
        if self.kind not in ("medusa", "eagle"):
            raise ValueError(f"kind must be medusa or eagle, got {self.kind!r}")
        if self.batch is None:
            object.__setattr__(self, "batch", 512 if self.kind == "medusa" else 8)


def draft_vocabulary(tokens: torch.Tensor, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent ids of `tokens` (ties to the lower id), sorted."""
    counts = torch.bincount(tokens.flatten().long(), minlength=vocab_size).double()
    counts -= torch.arange(vocab_size, dtype=torch.double) * 1e-9
    return counts.topk(min(size, vocab_size)).indices.sort().values


def lr_at(step: int, cfg: HeadsConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * min(1.0, t))))


def build_heads(cfg: HeadsConfig, target, vocab: torch.Tensor):
    torch.manual_seed(cfg.seed)
    if cfg.kind == "medusa":
        heads = MedusaHeads(target.config.hidden_size, cfg.num_heads, vocab)
        heads.lm_head.weight.data = target.lm_head.weight.data[vocab].float().clone()
    else:
        heads = EagleHead(target.config, vocab)
        for name, p in heads.named_parameters():
            if p.dim() == 2 and "embed_tokens" not in name:
                torch.nn.init.normal_(p, std=0.02)
        torch.nn.init.zeros_(heads.fc.bias)
        # the target's final norm and LM-head rows: features live in the target's space
        heads.decoder.model.norm.weight.data = target.model.norm.weight.data.float().clone()
        heads.decoder.lm_head.weight.data = target.lm_head.weight.data[vocab].float().clone()
        heads.decoder.lm_head.weight.requires_grad_(False)
    return heads.float().train()


def _to_draft(vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """target id -> draft index, -100 (ignored by cross-entropy) off the draft vocabulary."""
    m = torch.full((vocab_size,), -100, dtype=torch.long)
    m[vocab] = torch.arange(vocab.numel())
    return m


def medusa_loss(heads: MedusaHeads, hidden, tokens, rows, cols, to_draft) -> torch.Tensor:
    """hidden [B, L, D], tokens [B, L]; positions (rows, cols) with cols + 1 + M < L."""
    h = hidden[rows, cols].float()                                     # [N, D]
    logits = heads(h)                                                  # [M, N, V']
    loss = 0.0
    for i in range(heads.num_heads):
        labels = to_draft[tokens[rows, cols + 2 + i].long()]
        loss = loss + 0.8 ** i * F.cross_entropy(logits[i], labels, ignore_index=-100)
    return loss


def eagle_loss(head: EagleHead, embed, hidden, tokens, rows, starts, window, to_draft, noise, gen):
    """Rows of `window` consecutive pairs (feature t, token t + 1) -> feature t + 1, token t + 2."""
    idx = starts[:, None] + torch.arange(window)[None]                   # [B, W]
    feats = hidden[rows[:, None], idx].float()                           # [B, W, D]
    if noise > 0:
        rms = feats.pow(2).mean().sqrt()
        feats = feats + (torch.rand(feats.shape, generator=gen) * 2 - 1) * noise * rms
    nxt = tokens[rows[:, None], idx + 1].long()
    out = head(feats, embed(nxt).float())
    logits, pred = out.logits, out.hidden
    want = hidden[rows[:, None], idx + 1].float()
    labels = to_draft[tokens[rows[:, None], idx + 2].long()]
    reg = F.smooth_l1_loss(pred, want)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
    return reg + 0.1 * ce, reg, ce


@torch.no_grad()
def medusa_accuracy(heads: MedusaHeads, data: dict, to_draft, ranks: int = 10) -> list[list[float]]:
    """acc[i][r]: how often head i's r-th ranked token is the right one (validation data)."""
    hidden, tokens = data["hidden"], data["tokens"]
    B, L = tokens.shape
    M = heads.num_heads
    cols = torch.arange(0, L - 2 - M)
    hits = torch.zeros(M, ranks)
    total = 0
    for b in range(B):
        logits = heads(hidden[b, cols].float())                           # [M, N, V']
        top = logits.topk(ranks, -1).indices                              # [M, N, R]
        for i in range(M):
            labels = to_draft[tokens[b, cols + 2 + i].long()]
            hits[i] += (top[i] == labels[:, None]).float().sum(0)
        total += len(cols)
    return [[round(x, 4) for x in row] for row in (hits / total).tolist()]


@torch.no_grad()
def eagle_accuracy(head: EagleHead, embed, data: dict, to_draft) -> float:
    """Top-1 accuracy of the token after next from true features (validation data)."""
    hidden, tokens = data["hidden"], data["tokens"]
    B, L = tokens.shape
    logits = head(hidden[:, :L - 2].float(), embed(tokens[:, 1:L - 1].long()).float()).logits
    labels = to_draft[tokens[:, 2:].long()]
    return round((logits.argmax(-1) == labels).float().mean().item(), 4)


def train_heads(cfg: HeadsConfig, target_dir: Path, out: Path, work: Path, data_dir: Path,
                command: str = "", stop_after: int | None = None, report_prompts: int = 20,
                log=lambda s: print(s, file=sys.stderr, flush=True)) -> dict:
    torch.set_flush_denormal(True)   # tiny gradients otherwise turn CPU matmuls 10x slower
    try:
        return _train_heads(cfg, target_dir, out, work, data_dir, command, stop_after, report_prompts, log)
    finally:
        torch.set_flush_denormal(False)   # the process-wide default: inference numerics untouched


def _train_heads(cfg, target_dir, out, work, data_dir, command, stop_after, report_prompts, log) -> dict:
    torch.set_num_threads(cfg.threads)
    work.mkdir(parents=True, exist_ok=True)
    target = load_model(target_dir, "float32")
    tok = Tokenizer(target_dir)
    V = target.config.vocab_size
    data = {}
    for split, n, seed in (("train", cfg.shards, 0), ("validation", cfg.val_shards, 1)):
        stream = cached_tokens(tok, split, data_dir / "tokens", cfg.corpus_limit_mb)
        paths = make_shards(target, stream, data_dir / split, n, seed=seed, log=lambda s: log(f"{split} {s}"))
        data[split] = load_shards(paths)
    train, val = data["train"], data["validation"]
    vocab = draft_vocabulary(train["tokens"], cfg.draft_vocab, V)
    coverage = torch.isin(val["tokens"][:, 64:].long(), vocab).float().mean().item()
    to_draft = _to_draft(vocab, V)
    heads = build_heads(cfg, target, vocab)
    embed = target.model.embed_tokens
    params = [p for p in heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    state = {"step": 0, "elapsed_s": 0.0, "history": []}
    ckpt = work / "checkpoint.pt"
    if ckpt.is_file():
        saved = torch.load(ckpt, weights_only=False)
        heads.load_state_dict(saved["heads"])
        opt.load_state_dict(saved["optimizer"])
        state = saved["state"]
        log(f"resumed from {ckpt} at step {state['step']}")
    B, L = train["tokens"].shape
    start, t0, base = state["step"], time.time(), state["elapsed_s"]
    end = cfg.steps if stop_after is None else min(cfg.steps, start + stop_after)
    for step in range(start, end):
        rng = np.random.default_rng((cfg.seed, step))
        gen = torch.Generator().manual_seed(int(rng.integers(1 << 62)))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        if cfg.kind == "medusa":
            rows = torch.from_numpy(rng.integers(0, B, cfg.batch))
            cols = torch.from_numpy(rng.integers(0, L - 2 - cfg.num_heads, cfg.batch))
            loss = medusa_loss(heads, train["hidden"], train["tokens"], rows, cols, to_draft)
            parts = {}
        else:
            rows = torch.from_numpy(rng.integers(0, B, cfg.batch))
            starts = torch.from_numpy(rng.integers(0, L - 2 - cfg.window + 1, cfg.batch))
            loss, reg, ce = eagle_loss(heads, embed, train["hidden"], train["tokens"], rows, starts,
                                       cfg.window, to_draft, cfg.noise, gen)
            parts = {"feature_loss": round(reg.item(), 4), "token_loss": round(ce.item(), 4)}
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        state["step"] = step + 1
        state["elapsed_s"] = base + time.time() - t0
        if (step + 1) % 50 == 0 or step + 1 == cfg.steps:
            state["history"].append({"step": step + 1, "loss": round(loss.item(), 4), **parts})
            log(f"step {step + 1}/{cfg.steps}: loss {loss.item():.4f} {parts or ''} "
                f"({state['elapsed_s'] / (step + 1):.2f} s/step)")
        if (step + 1) % cfg.save_every == 0 or step + 1 == end:
            torch.save({"heads": heads.state_dict(), "optimizer": opt.state_dict(), "state": state}, ckpt.with_suffix(".tmp"))
            os.replace(ckpt.with_suffix(".tmp"), ckpt)
    if state["step"] < cfg.steps:
        return {"finished": False, "step": state["step"]}
    heads.eval()
    result = {"steps": state["step"], "wall_time_s": round(state["elapsed_s"], 1),
              "draft_vocab_coverage": round(coverage, 4),
              "train_tokens": int(train["tokens"].numel()),
              "trainable_parameters": sum(p.numel() for p in params)}
    extra = {"draft_vocab_coverage": result["draft_vocab_coverage"]}
    if cfg.kind == "eagle":
        extra["default_topk"] = cfg.default_topk
    if cfg.kind == "medusa":
        greedy_val = {k: v[val["greedy"]] for k, v in val.items()}
        extra["accuracy"] = medusa_accuracy(heads, greedy_val, to_draft)
        result["top1_accuracy_per_head"] = [a[0] for a in extra["accuracy"]]
        result["sampled_top1_accuracy_per_head"] = [a[0] for a in medusa_accuracy(
            heads, {k: v[~val["greedy"]] for k, v in val.items()}, to_draft)]
    else:
        result["top1_accuracy"] = eagle_accuracy(heads, embed, {k: v[val["greedy"]] for k, v in val.items()}, to_draft)
        result["sampled_top1_accuracy"] = eagle_accuracy(heads, embed, {k: v[~val["greedy"]] for k, v in val.items()}, to_draft)
    save_heads(heads, out, torch.bfloat16, extra=extra)
    if report_prompts:
        result["speculation"] = speculation_report(target_dir, out, cfg.kind, report_prompts)
    commands = [command]
    (out / "training.json").write_text(json.dumps({"config": asdict(cfg), "result": result, "commands": commands,
                                                    "history": state["history"]}, indent=1) + "\n")
    (out / "README.md").write_text(card(out, target_dir, cfg, result, commands))
    return {"finished": True, **result}


def speculation_report(target_dir: Path, heads_dir: Path, kind: str, n: int, max_tokens: int = 64,
                       sizes=(4, 8, 16)) -> dict:
    """Acceptance on held-out function headers (test split), through the engine, bf16."""
    from ..config import SamplingParams
    from ..llm import LLM
    from .report import function_headers

    prompts = [p["prompt"] for p in function_headers(n)]
    out = {"functions": len(prompts), "max_tokens": max_tokens}
    for size in sizes:
        llm = LLM(model=target_dir, dtype="bfloat16",
                  speculative_config={"method": kind, "model": str(heads_dir), "num_speculative_tokens": size})
        for temp in (0.0, 1.0):
            outs = llm.generate(prompts, SamplingParams(temperature=temp, max_tokens=max_tokens, seed=0))
            emitted = sum(o.stats.output_tokens for o in outs)
            passes = sum(o.stats.target_forward_passes for o in outs)
            accepted = sum(o.stats.accepted_tokens for o in outs)
            out[f"tree{size}_{'greedy' if temp == 0 else 'temperature_1'}"] = {
                "mean_accepted_length": round(emitted / max(1, passes), 3),
                "accepted_per_step": round(accepted / max(1, passes), 3)}
    return out


def card(out: Path, target_dir: Path, cfg: HeadsConfig, r: dict, commands: list[str]) -> str:
    what = (f"{cfg.num_heads} Medusa heads (a residual block each, one shared LM head over the draft vocabulary)"
            if cfg.kind == "medusa" else "an EAGLE head (fc + one Llama decoder layer + the target's final norm and LM-head rows)")
    if cfg.kind == "medusa":
        acc = f"| top-1 accuracy per head, greedy / sampled generations | {r['top1_accuracy_per_head']} / {r['sampled_top1_accuracy_per_head']} |"
        steps = f"{r['steps']} x {cfg.batch} positions"
    else:
        acc = f"| top-1 accuracy of the drafted token, greedy / sampled generations | {r['top1_accuracy']} / {r['sampled_top1_accuracy']} |"
        steps = f"{r['steps']} x {cfg.batch} rows x {cfg.window} pairs"
    rows = ""
    shape = f" (topk {cfg.default_topk}: {'a chain, at most 8 deep' if cfg.default_topk == 1 else 'an EAGLE-2 tree'})" if cfg.kind == "eagle" else ""
    for key, v in r.get("speculation", {}).items():
        if key.startswith("tree"):
            size, mode = key[4:].split("_", 1)
            rows += f"| {size} nodes{shape}, {mode.replace('_', ' ')} | {v['mean_accepted_length']} |\n"
    s = r.get("speculation", {})
    return f"""# {out.name}

{what} for `{target_dir}`, trained by specdec with the target frozen
(`specdec train {cfg.kind}`; see specdec/train/heads.py).

| | |
|---|---|
| trainable parameters | {r['trainable_parameters']:,} |
| draft vocabulary | {cfg.draft_vocab} most frequent tokens of the training data; they cover {r['draft_vocab_coverage']:.1%} of the validation generations |
| data | self-distillation: {cfg.shards} x 32 prompts of 64 tokens from the train split of the corpus, each continued by the target for 192 tokens (half greedy, half at temperature 0.8), with the target's features; {r['train_tokens']:,} tokens, trained on at every position (corpus prompt and the target's own continuation) |
| steps | {steps}, AdamW lr {cfg.lr}, cosine |
| wall time | {r['wall_time_s'] / 3600:.2f} h on {platform.machine()} CPU, {cfg.threads} thread(s), fp32 |
{acc}

## Speculation on held-out functions

Mean accepted length (tokens per target forward) on {s.get('functions', 0)} test-split function headers,
{s.get('max_tokens', 0)} new tokens, bfloat16:

| draft | mean accepted length |
|---|---|
{rows}
Reproduce (writes this folder, card included):
```
{chr(10).join(commands)}
```
"""
