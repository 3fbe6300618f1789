"""`specdec train vocab-draft`: a draft for a chat target, distilled from the target's answers.

The draft (model/vocab_draft.py) is the target's first `layers` decoder layers and final norm,
an LM head over the draft vocabulary (initialised from the target's LM-head rows) and the
target's own embedding table (shared at inference, never stored). It learns, on the target's
answers (answers.py), the target's next-token distribution restricted to the draft vocabulary:
forward KL(p || q) on every answer position (DistillSpec), where p = softmax of the target's
LM-head rows applied to its stored feature, so the target never runs during training.

Batches: each row is the last `window` tokens of one conversation (the end of the prompt as
context, then the answer), rows padded on the right (causal attention never sees the padding);
row i of step s comes from default_rng((seed, s)), so a resumed run equals a straight one.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..model import load_model
from ..model.vocab_draft import VocabDraft, save_vocab_draft
from .headdata import FlatData, chat_data
from .headreport import fitting_prompts
from .heads import draft_vocabulary, lr_at      # the same warm-up and cosine schedule (lr, warmup, steps)
from .lm import check_loss, device_name, optimizer_step, record_command, save_checkpoint, target_record, use_bf16
from .provenance import check_run, check_state, data_fingerprint, load_optimizer, target_fingerprint


@dataclass(frozen=True)
class VocabDraftConfig:
    layers: int = 4
    draft_vocab: int = 8192
    steps: int = 2000
    batch: int = 8                 # conversations per step
    window: int = 320              # tokens per conversation: the tail of the prompt, then the answer
    lr: float = 3e-4
    warmup: int = 50
    hard_weight: float = 0.0       # + weight * cross-entropy on the answer's own token
    shards: int | None = None      # answer shards to train on (None: all present at the first start)
    val_shards: int = 1
    seed: int = 0
    save_every: int = 50
    threads: int = 1
    precision: str = "auto"        # bf16 autocast where matmuls have native bf16 (lm.use_bf16)
    init: str | None = None        # start from this trained draft folder (its layers and draft vocabulary kept)

    def __post_init__(self):
        if self.steps < 1 and self.init is None:
            raise ValueError(f"--steps {self.steps} trains nothing: without --init the draft would be the target's "
                             "first layers untrained; give --steps >= 1 (or --init with a trained draft)")


RUNTIME_FIELDS = ("steps", "save_every", "threads", "precision")     # a resume may change these


def _check_layers(cfg: VocabDraftConfig, num_layers: int) -> None:
    if not 1 <= cfg.layers <= num_layers:
        raise ValueError(f"--layers must be in [1, {num_layers}] (the target's layers), got {cfg.layers}")


def init_draft(cfg: VocabDraftConfig, target, vocab: torch.Tensor) -> VocabDraft:
    """The target's first layers and final norm, LM-head rows of the draft vocabulary."""
    tcfg = target.config
    _check_layers(cfg, tcfg.num_hidden_layers)
    draft = VocabDraft(tcfg.replace(num_hidden_layers=cfg.layers), vocab, target.model.embed_tokens, tcfg.vocab_size)
    src = target.state_dict()
    own = draft.decoder.state_dict()
    for name in own:
        if name.startswith("model.layers.") or name == "model.norm.weight":
            own[name] = src[name].float().clone()
    own["lm_head.weight"] = target.lm_head.weight.data[vocab].float().clone()
    draft.decoder.load_state_dict({k: v for k, v in own.items() if not k.endswith("embed_tokens.weight")}, strict=False)
    return draft.float().train()


def batch_rows(data: FlatData, seqs: list[int], window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [B, W] right-padded, positions [B, W] flat index of each token, loss mask [B, W]:
    the token at t + 1 is an answer token of the same conversation)."""
    W = min(window, max(int(data.ends[s] - data.starts[s]) for s in seqs))
    pos = torch.zeros(len(seqs), W, dtype=torch.long)
    mask = torch.zeros(len(seqs), W, dtype=torch.bool)
    for i, s in enumerate(seqs):
        st, a, e = int(data.starts[s]), int(data.answer_starts[s]), int(data.ends[s])
        b = max(st, e - W)
        n = e - b
        pos[i, :n] = torch.arange(b, e)
        pos[i, n:] = e - 1
        t = torch.arange(b, e)
        mask[i, :n] = (t + 1 >= a) & (t + 1 < e)
    return data.tokens[pos].long(), pos, mask


def distill_loss(draft: VocabDraft, head_rows: torch.Tensor, data: FlatData, tokens, pos, mask, to_draft,
                 hard_weight: float, bf16: bool) -> tuple[torch.Tensor, float]:
    """KL(p || q) over the draft vocabulary at masked positions; returns (loss, top-1 agreement)."""
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=bf16):
        q_logits = draft.draft_logits(tokens).float()[mask]                  # [N, V']
    with torch.no_grad():
        p_logits = data.hidden[pos[mask]].float() @ head_rows.T               # [N, V']
        p_log = F.log_softmax(p_logits, -1)
    q_log = F.log_softmax(q_logits, -1)
    loss = (p_log.exp() * (p_log - q_log)).sum(-1).mean()
    if hard_weight:
        labels = to_draft[data.tokens[pos[mask] + 1].long()]
        loss = loss + hard_weight * F.cross_entropy(q_logits, labels, ignore_index=-100)
    agree = (q_logits.argmax(-1) == p_logits.argmax(-1)).float().mean().item()
    return loss, agree


@torch.no_grad()
def agreement(draft: VocabDraft, data: FlatData, max_seqs: int = 200) -> float:
    """How often the draft's argmax is the token the target actually wrote next (greedy answers:
    the target's own argmax), teacher-forced, over answer positions, each conversation read whole
    from its start as at inference (not the training windows cut from its end)."""
    hits = total = 0
    draft.eval()
    seqs = [s for s in range(data.num_sequences) if data.greedy[s]][:max_seqs]
    for s in seqs:
        tokens, pos, mask = batch_rows(data, [s], int(data.ends[s] - data.starts[s]))
        pred = draft.draft_vocab[draft.draft_logits(tokens).argmax(-1)]
        nxt = data.tokens[(pos + 1).clamp(max=len(data.tokens) - 1)]
        hits += int(((pred == nxt) & mask).sum())
        total += int(mask.sum())
    draft.train()
    return round(hits / total, 4) if total else None     # None: no greedy answer to measure on


def train_vocab_draft(cfg: VocabDraftConfig, target_dir: Path, answers: Path, out: Path, work: Path,
                      command: str = "", stop_after: int | None = None, report_prompts: int = 20,
                      log=lambda s: print(s, file=sys.stderr, flush=True), device: str = "cpu") -> dict:
    """device: where the draft trains ("cuda": the data is copied to the GPU whole; batches are
    drawn on the host as on the CPU)."""
    device = torch.device(device)
    torch.set_num_threads(cfg.threads)
    target = load_model(target_dir, "float32", quantization="none")     # a GGUF target dequantized
    if cfg.init is None:        # (--init: its own layer count)
        _check_layers(cfg, target.config.num_hidden_layers)
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "checkpoint.pt"
    saved = torch.load(ckpt, weights_only=False, map_location=device) if ckpt.is_file() else None
    state = saved["state"] if saved else {"step": 0, "elapsed_s": 0.0, "history": []}
    from .heads import check_answers_target

    fingerprint = target_fingerprint(target_dir)
    where, advice = f"--work {work}", "use another --work, or the options it was made with to resume"
    flags = {"target": "--target", "data": "--data", "draft_vocab_ids": "a draft vocabulary of",
             **{k: "--" + k.replace("_", "-") for k in asdict(cfg)}}
    if saved:
        check_run(saved.get("run"), {"target": fingerprint}, where, flags, advice)
    check_answers_target(answers, fingerprint)
    train, val, n = chat_data(answers, state.get("train_shards", cfg.shards), cfg.val_shards)
    state["train_shards"] = n
    paths = sorted(answers.glob("shard_*.pt"))[:cfg.val_shards + n]
    # chosen before training: a warning now, not an error after it, where they outgrow the context
    prompts = fitting_prompts((val.tokens[s:a].tolist() for s, a in zip(val.starts.tolist(), val.answer_starts.tolist())),
                              report_prompts, target.config.max_position_embeddings, log) if report_prompts else []
    V = target.config.vocab_size
    start = None
    if cfg.init:        # fine-tuning: the draft's weights, layer count and vocabulary are the start
        from ..model.vocab_draft import load_vocab_draft
        start = load_vocab_draft(cfg.init, target, dtype=torch.float32)
        cfg = dataclasses.replace(cfg, layers=start.decoder.config.num_hidden_layers,
                                  draft_vocab=int(start.draft_vocab.numel()))
        vocab = start.draft_vocab.cpu()
    else:
        vocab = draft_vocabulary(train.answer_tokens(), cfg.draft_vocab, V)
    to_draft = torch.full((V,), -100, dtype=torch.long)
    to_draft[vocab] = torch.arange(vocab.numel())
    head_rows = target.lm_head.weight.data[vocab].float().to(device)
    draft = init_draft(cfg, target, vocab)
    record = {"target": fingerprint, **{k: v for k, v in asdict(cfg).items() if k not in RUNTIME_FIELDS},
              "data": data_fingerprint(answers, paths), "draft_vocab_ids": vocab.tolist()}
    if saved:
        check_run(saved.get("run"), record, where, flags, advice)
        check_state(draft.decoder, saved["decoder"], where, advice)
    if start is not None and not saved:
        draft.decoder.load_state_dict({k: v for k, v in start.decoder.state_dict().items()
                                       if not k.endswith("embed_tokens.weight")}, strict=False)
    draft = draft.to(device)
    target.model.embed_tokens.to(device)        # the draft reads the target's table (not one of its modules)
    data, to_draft_dev = train.to(device), to_draft.to(device)
    params = [p for n_, p in draft.decoder.named_parameters() if not n_.endswith("embed_tokens.weight")]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    if saved:
        draft.decoder.load_state_dict(saved["decoder"])
        load_optimizer(opt, saved["optimizer"], where, advice)
        log(f"resumed from {ckpt} at step {state['step']}")
    record_command(state, command)
    bf16 = use_bf16(cfg.precision, device)
    weights = (train.ends - train.answer_starts).double()               # conversations by answer length
    weights /= weights.sum()
    start, t0, base = state["step"], time.time(), state["elapsed_s"]
    end = cfg.steps if stop_after is None else min(cfg.steps, start + stop_after)
    for step in range(start, end):
        rng = np.random.default_rng((cfg.seed, step))
        seqs = rng.choice(train.num_sequences, size=cfg.batch, p=weights.numpy()).tolist()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        tokens, pos, mask = (t.to(device) for t in batch_rows(train, seqs, cfg.window))
        loss, agree = distill_loss(draft, head_rows, data, tokens, pos, mask, to_draft_dev, cfg.hard_weight, bf16)
        check_loss(loss, step, ckpt)
        optimizer_step(opt, loss, params, 1.0)
        state["step"] = step + 1
        state["elapsed_s"] = base + time.time() - t0
        if (step + 1) % 25 == 0 or step + 1 == cfg.steps:
            state["history"].append({"step": step + 1, "kl": round(loss.item(), 4), "top1_agreement": round(agree, 4)})
            log(f"step {step + 1}/{cfg.steps}: KL {loss.item():.4f}, top-1 agreement {agree:.3f} "
                f"({(state['elapsed_s'] - base) / (step + 1 - start):.2f} s/step)")
        if (step + 1) % cfg.save_every == 0 or step + 1 == end:
            save_checkpoint({"decoder": draft.decoder.state_dict(), "optimizer": opt.state_dict(), "state": state,
                             "run": record}, ckpt)
    if state["step"] < cfg.steps:
        return {"finished": False, "step": state["step"]}
    del data
    return _finish(cfg, draft, target_dir, train, val, state, out, command, prompts, vocab, V)


def _finish(cfg, draft, target_dir, train, val, state, out, command, prompts, vocab, vocab_size: int) -> dict:
    from .headreport import speculation_report

    where = device_name(draft.device)
    draft = draft.cpu().eval()
    draft.target_embed[0].cpu()
    coverage = torch.isin(val.answer_tokens().long(), vocab).float().mean().item()
    result = {"steps": state["step"], "wall_time_s": round(state["elapsed_s"], 1),
              "train_shards": state["train_shards"], "train_answers": train.num_sequences,
              "train_answer_tokens": int(len(train.answer_tokens())),
              "draft_vocab_coverage": round(coverage, 4),
              "parameters": sum(p.numel() for n_, p in draft.decoder.named_parameters() if not n_.endswith("embed_tokens.weight")),
              "greedy_top1_agreement": agreement(draft, val), "device": where}
    save_vocab_draft(draft, out, torch.bfloat16, extra={"draft_vocab_coverage": result["draft_vocab_coverage"],
                                                        "specdec_target": target_record(target_dir, vocab_size)})
    if prompts:
        result["speculation"] = speculation_report(target_dir, out, "draft_model", prompts,
                                                   "validation chat prompts (chat template, first turn)", sizes=(4,))
    commands = state.get("commands") or [command]
    (out / "training.json").write_text(json.dumps({"config": asdict(cfg), "result": result, "commands": commands,
                                                    "history": state["history"]}, indent=1) + "\n")
    (out / "README.md").write_text(card(out, target_dir, cfg, result, "\n".join(commands)))
    return {"finished": True, **result}


def card(out: Path, target_dir: Path, cfg: VocabDraftConfig, r: dict, command: str) -> str:
    spec = "\n".join(f"| K = {k[4:].split('_')[0]}, {k.split('_', 1)[1].replace('_', ' ')} | {v['mean_accepted_length']} |"
                     for k, v in r.get("speculation", {}).items() if k.startswith("tree"))
    return f"""# {out.name}

A draft model for `{target_dir}` (specdec/model/vocab_draft.py): the target's first {cfg.layers} decoder
layers and final norm, then an LM head over a {cfg.draft_vocab}-token draft vocabulary, reading the
target's own token embeddings (shared at run time, not stored here). Distilled by specdec
(`specdec train vocab-draft`, specdec/train/vocab_draft.py) from the target's answers to chat prompts:
forward KL to the target's distribution restricted to the draft vocabulary, on answer tokens only.

| | |
|---|---|
| parameters stored | {r['parameters']:,} |
| draft vocabulary | the {cfg.draft_vocab} most frequent answer tokens; they cover {r['draft_vocab_coverage']:.1%} of the validation answers |
| data | {r['train_answers']} answers ({r['train_answer_tokens']:,} answer tokens, {r['train_shards']} shards) |
| steps | {r['steps']} x {cfg.batch} conversations x up to {cfg.window} tokens, AdamW lr {cfg.lr}, cosine |
| wall time | {r['wall_time_s'] / 3600:.2f} h on {r.get('device') or platform.machine() + ' CPU'}, {cfg.threads} thread(s), precision {cfg.precision} |
| greedy top-1 agreement with the target (teacher-forced, validation, each answer with its whole context) | {"–" if r['greedy_top1_agreement'] is None else r['greedy_top1_agreement']} |

Mean accepted length through the engine on held-out prompts (bfloat16):

| K | mean accepted length |
|---|---|
{spec}

Reproduce:
```
{command}
```
"""
