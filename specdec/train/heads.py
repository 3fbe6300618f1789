"""`specdec train medusa | eagle`: heads for a frozen target, trained on its own generations.

1. Self-distillation data, either (`data_kind`) the toy target's (selfdistill.py: prompts cut
   from the corpus split, continued by the target, trained at every position) or a chat
   model's (answers.py: chat prompts and the target's answers, trained on the answers), with
   the target's features at every position (headdata.py lays both out alike).
2. The draft vocabulary: the most frequent tokens of that data (model/heads.py says why).
3. Training, deterministic and resumable like `train lm`: batch i comes from
   default_rng((seed, i)); a checkpoint every `save_every` steps in the work folder.
   - Medusa: head i (1-based) at position t learns token t + 1 + i (cross-entropy, weight
     0.8^(i-1)), the target frozen.
   - EAGLE: from (feature t, embedding of token t + 1), predict feature t + 1 (smooth L1) and
     token t + 2 through the frozen LM-head rows (cross-entropy, weight 0.1), as in EAGLE;
     input features get uniform noise (EAGLE's augmentation against drafting on its own,
     imperfect features).
4. Evaluation on held-out generations (headreport.py): per-head top-r accuracy (Medusa: it also
   shapes the candidate tree) or top-1 accuracy of the drafted token (EAGLE), then speculative
   decoding on held-out prompts (function headers, or validation chat prompts) through the
   engine: mean accepted length, written into the card with the commands.
"""

from __future__ import annotations

import dataclasses
import json
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
from .eagle_unroll import unrolled
from .headdata import FlatData, chat_data
from .lm import check_loss, device_name, optimizer_step, record_command, save_checkpoint, target_record, use_bf16
from .provenance import (RunMismatch, check_run, check_state, data_fingerprint, folder_record, load_optimizer,
                         same_target, target_fingerprint, write_record)
from .headreport import card, eagle_accuracy, eagle_chain_accuracy, fitting_prompts, medusa_accuracy, speculation_report
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
    data_kind: str = "selfdistill"     # "selfdistill" (toy target, made here) | "chat" (answers.py shards)
    shards: int | None = None          # selfdistill: shards to make (None: 48); chat: answer shards to train on (None: all)
    val_shards: int = 4
    seed: int = 0
    save_every: int = 100
    threads: int = 1
    corpus_limit_mb: float | None = None   # prompts from the first files of each split only (smoke runs)
    default_topk: int = 1              # eagle: the tree's branching when speculative_config has no "topk";
                                       # chains measured fastest on the 2-core CPU (README, Methods)
    precision: str = "fp32"            # "bf16" autocast (or "auto": where matmuls have native bf16); fp32 master weights
    eval_every: int = 0                # log top-1 accuracy on a probe of greedy validation sequences (0: never)
    prompt_loss: bool = False          # chat data: also train on the prompt's positions (more data; the answer copies them)
    init_from_target: bool = False     # eagle: start the decoder layer from the target's last layer
    init: str | None = None            # start from these trained heads (a heads folder), their draft vocabulary kept
    soft_labels: bool = False          # token loss against the target's distribution (from its stored features)
    token_weight: float = 0.1          # eagle: weight of the token loss beside the feature regression
    unroll: int = 1                    # eagle: chain depths trained, the later ones on the head's own features
    freeze_lm_head: bool = False       # medusa: keep the shared LM head at the target's rows (EAGLE's always is):
                                       # trained, it drifts toward the far heads' guesses and head 1 loses accuracy

    def __post_init__(self):
        if self.kind not in ("medusa", "eagle"):
            raise ValueError(f"kind must be medusa or eagle, got {self.kind!r}")
        if self.data_kind not in ("selfdistill", "chat"):
            raise ValueError(f"data_kind must be selfdistill or chat, got {self.data_kind!r}")
        if self.init is not None and self.init_from_target:
            raise ValueError("--init and --init-from-target exclude each other")
        if self.unroll < 1:
            raise ValueError(f"unroll must be >= 1, got {self.unroll}")
        if self.steps < 1 and self.init is None:
            raise ValueError(f"--steps {self.steps} trains nothing: without --init the heads would be random; "
                             "give --steps >= 1 (or --init with trained heads to write them as they are)")
        if self.batch is None:
            object.__setattr__(self, "batch", 512 if self.kind == "medusa" else 8)


def draft_vocabulary(tokens: torch.Tensor, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent ids of `tokens` (ties to the lower id), sorted."""
    counts = torch.bincount(tokens.flatten().long(), minlength=vocab_size).double()
    counts -= torch.arange(vocab_size, dtype=torch.double) * 1e-9
    return counts.topk(min(size, vocab_size)).indices.sort().values


def lr_at(step: int, cfg) -> float:
    """Linear warm-up over cfg.warmup steps, then a cosine from cfg.lr down to a tenth of it at
    cfg.steps (heads and the vocabulary draft)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * min(1.0, t))))


def build_heads(cfg: HeadsConfig, target, vocab: torch.Tensor):
    torch.manual_seed(cfg.seed)
    if cfg.kind == "medusa":
        heads = MedusaHeads(target.config.hidden_size, cfg.num_heads, vocab)
        heads.lm_head.weight.data = target.lm_head.weight.data[vocab].float().clone()
        heads.lm_head.weight.requires_grad_(not cfg.freeze_lm_head)
    else:
        heads = EagleHead(target.config, vocab)
        for name, p in heads.named_parameters():
            if p.dim() == 2 and "embed_tokens" not in name:
                torch.nn.init.normal_(p, std=0.02)
        torch.nn.init.zeros_(heads.fc.bias)
        if cfg.init_from_target:    # the target's last decoder layer: a prior for "one more layer"
            last = f"model.layers.{target.config.num_hidden_layers - 1}."
            src = target.state_dict()
            heads.decoder.model.layers[0].load_state_dict(
                {k[len(last):]: v.float().clone() for k, v in src.items() if k.startswith(last)})
        # the target's final norm and LM-head rows: features live in the target's space
        heads.decoder.model.norm.weight.data = target.model.norm.weight.data.float().clone()
        heads.decoder.lm_head.weight.data = target.lm_head.weight.data[vocab].float().clone()
        heads.decoder.lm_head.weight.requires_grad_(False)
    return heads.float().train()


def _start_from(heads, trained, cfg: HeadsConfig) -> None:
    """Load `trained` (cfg.init's heads) into `heads`, built for them by build_heads; what stays
    frozen, the LM-head rows, and the (unused) embedding table stay the target's, as on a fresh start."""
    from ..model.checkpoint import CheckpointError

    own, sd = heads.state_dict(), trained.state_dict()
    for k in sorted(set(own) ^ set(sd)):
        raise CheckpointError(f"--init {cfg.init}: {k} is {'missing' if k in own else 'not in the heads'} "
                              f"(not the heads `train {cfg.kind}` builds with these options: --num-heads?)")
    for k, v in own.items():
        if sd[k].shape != v.shape:
            raise CheckpointError(f"--init {cfg.init}: {k} is {tuple(sd[k].shape)}, these options build "
                                  f"{tuple(v.shape)} (--num-heads / the target's shape)")
    frozen = {"decoder.lm_head.weight"} if cfg.kind == "eagle" else ({"lm_head.weight"} if cfg.freeze_lm_head else set())
    heads.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in sd.items()
                           if k not in frozen and not k.endswith("embed_tokens.weight")}, strict=False)


def _to_draft(vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """target id -> draft index, -100 (ignored by cross-entropy) off the draft vocabulary."""
    m = torch.full((vocab_size,), -100, dtype=torch.long)
    m[vocab] = torch.arange(vocab.numel())
    return m


def medusa_loss(heads: MedusaHeads, data: FlatData, t, seq, to_draft, soft: bool = False) -> torch.Tensor:
    """Feature positions t [N] of sequences seq [N]; head i learns token t + 2 + i of the same
    sequence (soft: the target's distribution there, from its feature at t + 1 + i)."""
    logits = heads(data.hidden[t].float())                              # [M, N, V']
    end = data.ends[seq]
    loss = 0.0
    for i in range(heads.num_heads):
        pos = t + 2 + i
        labels = to_draft[data.tokens[pos.clamp(max=len(data.tokens) - 1)].long()]
        labels = labels.masked_fill(pos >= end, -100)
        src = data.hidden[(pos - 1).clamp(max=len(data.tokens) - 1)] if soft else None
        loss = loss + 0.8 ** i * _token_loss(logits[i], labels, src, heads.lm_head.weight)
    return loss


def _token_loss(logits, labels, soft_from, head_rows) -> torch.Tensor:
    """Cross-entropy of logits [N, V'] with the hard labels [N] (-100: skip), or, given the
    target's features soft_from [N, D] at the label's previous position, with the target's own
    distribution over the draft vocabulary (softmax of its LM-head rows head_rows [V', D]):
    every position then teaches the whole distribution, not one sampled token."""
    keep = labels != -100
    if soft_from is None or not keep.any():
        return F.cross_entropy(logits, labels, ignore_index=-100)
    with torch.no_grad():
        p = torch.softmax(soft_from[keep].float() @ head_rows.float().T, -1)
    return -(p * F.log_softmax(logits[keep].float(), -1)).sum(-1).mean()


def eagle_loss(head: EagleHead, embed, data: FlatData, idx, mask, to_draft, noise, gen,
               soft: bool = False, token_weight: float = 0.1, unroll: int = 1):
    """Rows of pair positions idx [B, W] (feature t, token t + 1) -> feature t + 1, token t + 2;
    mask [B, W]: pairs whose token t + 2 is trained on. unroll > 1: also the chain's later
    depths, drafted from the head's own predicted features (eagle_unroll.py), each weighted as
    depth 0. Returns (loss, feature loss, token loss) summed over depths."""
    feats = data.hidden[idx].float()                                     # [B, W, D]
    if noise > 0:
        rms = feats.pow(2).mean().sqrt()
        feats = feats + (torch.rand(feats.shape, generator=gen, device=feats.device) * 2 - 1) * noise * rms
    embeds = embed(data.tokens[idx + 1].long()).float()
    if unroll > 1:
        depths = unrolled(head, feats, embeds, unroll)
    else:
        out = head(feats, embeds)
        depths = [(out.logits, out.hidden)]
    want = data.hidden[idx + 1].float()
    labels = to_draft[data.tokens[idx + 2].long()].masked_fill(~mask, -100)
    reg = ce = 0.0
    for s, (logits, pred) in enumerate(depths):
        keep = mask & (torch.arange(mask.shape[1], device=mask.device) >= s)[None]   # depth s: s committed rows before
        m = keep[..., None].float()
        reg = reg + (F.smooth_l1_loss(pred, want, reduction="none") * m).sum() / (m.sum() * pred.shape[-1]).clamp(min=1)
        ce = ce + _token_loss(logits.reshape(-1, logits.shape[-1]), labels.masked_fill(~keep, -100).reshape(-1),
                              want.reshape(-1, want.shape[-1]) if soft else None, head.decoder.lm_head.weight)
    return reg + token_weight * ce, reg, ce


# HeadsConfig fields a resume may change: they do not change what the heads are or learn
RUNTIME_FIELDS = ("steps", "save_every", "threads", "precision", "eval_every", "default_topk")
# self-distillation shards' fixed settings (selfdistill.make_shards' defaults), recorded with the data
SELFDISTILL = {"batch": 32, "prompt_len": 64, "gen_len": 192, "temperature": 0.8, "greedy_fraction": 0.5}


def check_answers_target(data_dir: Path, target: dict, flag: str = "--data") -> None:
    """An answers folder whose record names the target that answered: that target, or a RunMismatch."""
    rec = folder_record(data_dir) or {}
    if rec.get("target") and not same_target(rec["target"], target):
        raise RunMismatch(f"{flag} {data_dir}: its answers and features were made by --target {rec['target']['path']} "
                          f"(this run: --target {target['path']}); give that target, or answers made by this one "
                          "(`specdec train answers`)")


def _selfdistill_record(cfg: HeadsConfig, data_dir: Path, target: dict, log) -> None:
    """The self-distillation folder's record (selfdistill.json): the target whose generations and
    features it holds, and what was cut from the corpus; another target is refused. A folder filled
    before the record existed is taken as this target's (with a warning) and recorded."""
    now = {"target": target, "corpus_limit_mb": cfg.corpus_limit_mb, **SELFDISTILL}
    path = data_dir / "selfdistill.json"
    rec = folder_record(data_dir, "selfdistill.json")
    advice = "give another --data (an empty folder of its own for each target)"
    if rec is not None:
        check_run(rec, now, f"--data {data_dir}: its self-distillation data were", {"target": "--target"}, advice, sep=" ")
        return
    if any(data_dir.glob("*/shard_*.pt")):
        log(f"warning: --data {data_dir}: its shards were made before specdec recorded their target; taken as "
            f"--target {target['path']}'s and recorded so (if they are another's, {advice})")
    data_dir.mkdir(parents=True, exist_ok=True)
    write_record(path, now)


def load_data(cfg: HeadsConfig, target, target_dir: Path, data_dir: Path, state: dict, log,
              fingerprint: dict | None = None) -> tuple[FlatData, FlatData, str, list[Path]]:
    """(train, validation, a line for the card, the shard files read). Chat data: the train shard
    count is fixed at the first start (state["train_shards"]), so a resumed run trains on the same
    sequences. fingerprint: the target's (provenance.target_fingerprint), checked against the data
    folder's record."""
    fingerprint = fingerprint or target_fingerprint(target_dir)
    if cfg.data_kind == "chat":
        check_answers_target(data_dir, fingerprint)
        train, val, n = chat_data(data_dir, state.get("train_shards", cfg.shards), cfg.val_shards)
        state["train_shards"] = n
        paths = sorted(data_dir.glob("shard_*.pt"))[:cfg.val_shards + n]
        what = (f"chat self-distillation: {n} shards of the target's answers to chat prompts "
                f"({train.num_sequences} answers, {len(train.answer_tokens()):,} answer tokens trained on; "
                f"prompts as context only), from `{data_dir}`")
        return train, val, what, paths
    _selfdistill_record(cfg, data_dir, fingerprint, log)
    tok = Tokenizer(target_dir)
    shards = cfg.shards or 48
    rows, paths = {}, []
    for split, n, seed in (("train", shards, 0), ("validation", cfg.val_shards, 1)):
        stream = cached_tokens(tok, split, data_dir / "tokens", cfg.corpus_limit_mb)
        made = make_shards(target, stream, data_dir / split, n, seed=seed, log=lambda s: log(f"{split} {s}"))
        rows[split] = FlatData.from_rows(load_shards(made))
        paths += made
    greedy = rows["train"].greedy
    mix = ("all greedy" if greedy.all() else f"all at temperature {SELFDISTILL['temperature']}" if not greedy.any()
           else f"{int(greedy.sum())} greedy, {int((~greedy).sum())} at temperature {SELFDISTILL['temperature']}")
    what = (f"self-distillation: {shards} x 32 prompts of 64 tokens from the train split of the corpus, each "
            f"continued by the target for 192 tokens ({mix}), with the target's "
            f"features; {len(rows['train'].tokens):,} tokens, trained on at every position")
    return rows["train"], rows["validation"], what, paths


def run_record(cfg: HeadsConfig, target: dict, data_dir: Path, paths: list[Path], vocab: torch.Tensor) -> dict:
    """What fixes a heads checkpoint's meaning (checked on resume, in this order)."""
    return {"kind": cfg.kind, "target": target,
            **{k: v for k, v in asdict(cfg).items() if k not in RUNTIME_FIELDS and k != "kind"},
            "data": data_fingerprint(data_dir, paths), "draft_vocab_ids": vocab.tolist()}


RECORD_FLAGS = {"kind": "`specdec train`", "target": "--target", "data": "--data",
                "draft_vocab_ids": "a draft vocabulary of"}


def check_resume(saved: dict, record: dict, heads, work: Path, vocab: torch.Tensor, cfg: HeadsConfig) -> None:
    """A checkpoint resumed: its record (when it has one) equals this run's, its tensors fit the
    heads these options build, and its draft vocabulary is the one this run's data give."""
    where = f"--work {work}"
    advice = "use another --work, or the options it was made with to resume"
    flags = {**RECORD_FLAGS, **{k: "--" + k.replace("_", "-") for k in asdict(cfg) if k not in RECORD_FLAGS}}
    check_run(saved.get("run"), record, where, flags, advice)
    check_state(heads, saved["heads"], where, advice)
    if not torch.equal(saved["heads"]["draft_vocab"].cpu(), vocab):
        raise RunMismatch(f"{where}: its heads' draft vocabulary is not the one this run's data give (other --data, "
                          f"--shards or --val-shards than it was made with); {advice}")


def train_heads(cfg: HeadsConfig, target_dir: Path, out: Path, work: Path, data_dir: Path,
                command: str = "", stop_after: int | None = None, report_prompts: int = 20,
                log=lambda s: print(s, file=sys.stderr, flush=True), device: str = "cpu") -> dict:
    """device: where the heads train ("cuda": the training data is copied to the GPU whole; the
    batches are drawn on the host as on the CPU, so a run is the same schedule on either)."""
    torch.set_flush_denormal(True)   # tiny gradients otherwise turn CPU matmuls 10x slower
    try:
        return _train_heads(cfg, target_dir, out, work, data_dir, command, stop_after, report_prompts, log,
                            torch.device(device))
    finally:
        torch.set_flush_denormal(False)   # the process-wide default: inference numerics untouched


def _train_heads(cfg, target_dir, out, work, data_dir, command, stop_after, report_prompts, log, device) -> dict:
    torch.set_num_threads(cfg.threads)
    work.mkdir(parents=True, exist_ok=True)
    target = load_model(target_dir, "float32", quantization="none")     # a GGUF target dequantized
    V = target.config.vocab_size
    ckpt = work / "checkpoint.pt"
    saved = torch.load(ckpt, weights_only=False, map_location=device) if ckpt.is_file() else None
    state = saved["state"] if saved else {"step": 0, "elapsed_s": 0.0, "history": []}
    fingerprint = target_fingerprint(target_dir)
    if saved:       # another kind or target: refused before the data are read (or made)
        check_run(saved.get("run"), {"kind": cfg.kind, "target": fingerprint}, f"--work {work}",
                  RECORD_FLAGS, "use another --work, or the options it was made with to resume")
    train, val, what, paths = load_data(cfg, target, target_dir, data_dir, state, log, fingerprint)
    # chosen before training: a warning now, not an error after it, where they outgrow the context
    prompts, what_prompts = _report_prompts(cfg, val, report_prompts, target_dir, target.config.max_position_embeddings,
                                            log) if report_prompts else ([], "")
    trained = None
    if cfg.init:        # fine-tuning: the heads' weights and draft vocabulary are the start
        from ..model.heads import EAGLE, MEDUSA, load_heads
        trained = load_heads(cfg.init, target, kind=EAGLE if cfg.kind == "eagle" else MEDUSA)
    vocab = trained.draft_vocab.cpu() if trained is not None else draft_vocabulary(train.answer_tokens(), cfg.draft_vocab, V)
    if trained is not None:
        what += f"; started from the trained heads in `{cfg.init}` (their {vocab.numel()}-token draft vocabulary kept)"
        cfg = dataclasses.replace(cfg, draft_vocab=int(vocab.numel()))    # what the card and training.json record
    coverage = torch.isin(val.answer_tokens().long(), vocab).float().mean().item()
    if cfg.prompt_loss and cfg.data_kind == "chat":     # every position, the vocabulary still the answers'
        train = dataclasses.replace(train, answer_starts=train.starts.clone())
        what = what.replace("prompts as context only", "trained on the prompts' positions too")
    to_draft = _to_draft(vocab, V)
    heads = build_heads(cfg, target, vocab)
    record = run_record(cfg, fingerprint, data_dir, paths, vocab)
    if saved:
        check_resume(saved, record, heads, work, vocab, cfg)
    if trained is not None:
        _start_from(heads, trained, cfg)      # checked on a resume too; the checkpoint then replaces it
    heads = heads.to(device)
    embed = target.model.embed_tokens.to(device)
    data, to_draft_dev = train.to(device), to_draft.to(device)      # what the loss reads (the host's on CPU)
    params = [p for p in heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    if saved:
        heads.load_state_dict(saved["heads"])
        load_optimizer(opt, saved["optimizer"], f"--work {work}")
        log(f"resumed from {ckpt} at step {state['step']}")
    record_command(state, command)
    label_t, label_seq = train.label_positions(2)
    bf16 = use_bf16(cfg.precision, device)
    # a fixed probe of greedy validation sequences: top-1 accuracy during training shows overfitting
    val_probe = val.select(val.greedy & (torch.arange(val.num_sequences) < 4 * 24)).to(device) if cfg.eval_every else None
    start, t0, base = state["step"], time.time(), state["elapsed_s"]
    end = cfg.steps if stop_after is None else min(cfg.steps, start + stop_after)
    for step in range(start, end):
        rng = np.random.default_rng((cfg.seed, step))
        gen = torch.Generator(device=device).manual_seed(int(rng.integers(1 << 62)))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            if cfg.kind == "medusa":
                pick = torch.from_numpy(rng.integers(0, len(label_t), cfg.batch))
                loss, parts = medusa_loss(heads, data, label_t[pick].to(device), label_seq[pick].to(device),
                                          to_draft_dev, cfg.soft_labels), {}
            else:
                idx, valid, seq = train.windows(rng, label_t, label_seq, cfg.batch, cfg.window)
                mask = valid & train.trained_on(idx, seq, 2)
                loss, reg, ce = eagle_loss(heads, embed, data, idx.to(device), mask.to(device), to_draft_dev,
                                           cfg.noise, gen, cfg.soft_labels, cfg.token_weight, cfg.unroll)
                parts = {"feature_loss": round(reg.item(), 4), "token_loss": round(ce.item(), 4)}
        check_loss(loss, step, ckpt)
        optimizer_step(opt, loss, params, 1.0)
        state["step"] = step + 1
        state["elapsed_s"] = base + time.time() - t0
        if (step + 1) % 50 == 0 or step + 1 == cfg.steps:
            if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
                parts["val_top1"] = _val_top1(cfg, heads, embed, val_probe, to_draft_dev)
            state["history"].append({"step": step + 1, "loss": round(loss.item(), 4), **parts})
            log(f"step {step + 1}/{cfg.steps}: loss {loss.item():.4f} {parts or ''} "
                f"({(state['elapsed_s'] - base) / (step + 1 - start):.2f} s/step)")
        if (step + 1) % cfg.save_every == 0 or step + 1 == end:
            save_checkpoint({"heads": heads.state_dict(), "optimizer": opt.state_dict(), "state": state,
                             "run": record}, ckpt)
    if state["step"] < cfg.steps:
        return {"finished": False, "step": state["step"]}
    del data
    heads.eval()
    result = {"steps": state["step"], "wall_time_s": round(state["elapsed_s"], 1),
              "draft_vocab_coverage": round(coverage, 4), "data": what,
              "train_tokens": int(len(train.tokens)), "device": device_name(device),
              "trainable_parameters": sum(p.numel() for p in params)}
    extra = {"draft_vocab_coverage": result["draft_vocab_coverage"], "specdec_target": target_record(target_dir, V)}
    greedy_val, sampled_val = val.select(val.greedy).to(device), val.select(~val.greedy).to(device)
    if cfg.kind == "eagle":
        extra["default_topk"] = cfg.default_topk
        result["top1_accuracy"] = eagle_accuracy(heads, embed, greedy_val, to_draft_dev)
        result["sampled_top1_accuracy"] = eagle_accuracy(heads, embed, sampled_val, to_draft_dev)
        result["chain_top1_accuracy"] = eagle_chain_accuracy(heads, embed, greedy_val, to_draft_dev)
    else:
        greedy_acc = medusa_accuracy(heads, greedy_val, to_draft_dev)
        sampled_acc = medusa_accuracy(heads, sampled_val, to_draft_dev)
        result["top1_accuracy_per_head"] = [a[0] for a in greedy_acc]
        result["sampled_top1_accuracy_per_head"] = [a[0] for a in sampled_acc]
        # the candidate tree's shape: measured on greedy generations, else on sampled ones, else
        # left out (the proposer's default) -- never rows of "0.0" measured on nothing
        tree = next((acc for acc in (greedy_acc, sampled_acc) if all(row[0] is not None for row in acc)), None)
        if tree is not None:
            extra["accuracy"] = tree
    heads, embed = heads.cpu(), embed.cpu()
    save_heads(heads, out, torch.bfloat16, extra=extra)
    if prompts:
        result["speculation"] = speculation_report(target_dir, out, cfg.kind, prompts, what_prompts)
    commands = state.get("commands") or [command]
    (out / "training.json").write_text(json.dumps({"config": asdict(cfg), "result": result, "commands": commands,
                                                    "history": state["history"]}, indent=1) + "\n")
    (out / "README.md").write_text(card(out, target_dir, cfg, result, commands))
    return {"finished": True, **result}


def _val_top1(cfg: HeadsConfig, heads, embed, probe: FlatData, to_draft) -> float:
    heads.eval()
    acc = eagle_accuracy(heads, embed, probe, to_draft) if cfg.kind == "eagle" else \
        medusa_accuracy(heads, probe, to_draft, ranks=1)[0][0]
    heads.train()
    return acc


def _report_prompts(cfg: HeadsConfig, val: FlatData, n: int, target_dir: Path, context: int,
                    log) -> tuple[list[list[int]], str]:
    """Up to n held-out prompts as token ids, those that fit the context: validation chat
    prompts, or test-split function headers."""
    if cfg.data_kind == "chat":
        spans = zip(val.starts.tolist(), val.answer_starts.tolist())
        return (fitting_prompts((val.tokens[s:a].tolist() for s, a in spans), n, context, log),
                "validation chat prompts (chat template, first turn)")
    from .report import function_headers

    tok = Tokenizer(target_dir)
    # more than n to choose from (round robin: where the first n fit, they are the n taken before)
    headers = (tok.encode(h["prompt"]) for h in function_headers(max(100, 10 * n)))
    return fitting_prompts(headers, n, context, log), "test-split function headers"
