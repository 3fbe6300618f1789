"""Pretraining (cross-entropy) and draft distillation (KL to a frozen target), one loop for both.

Deterministic given the seed: batch i is drawn from `numpy.random.default_rng((seed, i))`, so a
run resumed from a checkpoint sees exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..model import ModelConfig, Transformer, load_model, save_model
from ..tokenizer import Tokenizer
from .data import cached_tokens
from .tokenizer import copy_tokenizer, train_tokenizer


@dataclass(frozen=True)
class TrainConfig:
    model: dict = field(default_factory=dict)   # ModelConfig fields (vocab comes from the tokenizer)
    seq_len: int = 512
    batch_size: int = 16
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 50
    max_steps: int = 1000
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 8
    save_every: int = 50
    seed: int = 0
    threads: int = 1
    vocab_size: int = 8192
    distill_temperature: float = 1.0
    precision: str = "auto"   # "bf16" autocast, "fp32", or "auto": bf16 where matmuls have native bf16
    corpus_limit_mb: float | None = None   # use only the first files of each split (smoke runs)

    def __post_init__(self):
        for name in ("seq_len", "batch_size", "max_steps", "eval_every", "eval_batches", "save_every", "threads"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: {v!r}, must be an integer >= 1")
        for name in ("lr", "distill_temperature"):     # 0 or nan: a model of nan weights saved as finished
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name}: {v!r}, must be a finite number > 0")
        if not isinstance(self.min_lr, (int, float)) or not math.isfinite(self.min_lr) or self.min_lr < 0:
            raise ValueError(f"min_lr: {self.min_lr!r}, must be a finite number >= 0")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps: {self.warmup_steps!r}, must be an integer >= 0")
    @classmethod
    def load(cls, path: str | os.PathLike, **overrides) -> "TrainConfig":
        try:
            raw = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: a training config is a JSON object, not {type(raw).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"{path}: unknown training option {sorted(unknown)[0]!r}")
        raw.update({k: v for k, v in overrides.items() if v is not None})
        try:
            cfg = cls(**raw)
            check_model(cfg.model)
            return cfg
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


def check_model(m: dict) -> None:
    """The config's `model` fields make a Llama architecture (a one-line error naming the field)."""
    need = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    if not isinstance(m, dict) or any(k not in m for k in need):
        raise ValueError(f"model: needs {', '.join(need)} (a Llama architecture; the vocabulary comes from "
                         "the tokenizer)")
    for k in (*need, "num_key_value_heads", "head_dim"):
        if k in m and (not isinstance(m[k], int) or isinstance(m[k], bool) or m[k] < 1):
            raise ValueError(f"model.{k}: {m[k]!r}, must be an integer >= 1")
    heads, kv = m["num_attention_heads"], m.get("num_key_value_heads", m["num_attention_heads"])
    if "head_dim" not in m and m["hidden_size"] % heads:
        raise ValueError(f"model.num_attention_heads: {heads} does not divide hidden_size {m['hidden_size']}")
    if heads % kv:
        raise ValueError(f"model.num_key_value_heads: {kv} does not divide num_attention_heads {heads}")


def use_bf16(precision: str, device: torch.device) -> bool:
    """bf16 autocast pays only with native bf16 matmuls; an AVX2-only CPU emulates them ~9x slower."""
    if precision not in ("auto", "bf16", "fp32"):
        raise ValueError(f"precision: {precision!r} is not auto, bf16 or fp32")
    if precision != "auto":
        return precision == "bf16"
    if device.type == "cuda":
        return True
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def device_name(device: torch.device) -> str:
    """Where a run trained, for its card: the GPU's name, or the CPU's model."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from ..bench.machine import cpu_model

    return f"{cpu_model()} CPU"


def optimizer_step(opt: torch.optim.Optimizer, loss: torch.Tensor, params, clip: float) -> None:
    """One update: gradients of loss, clipped to norm `clip` over params, applied."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()


def check_loss(loss: torch.Tensor, step: int, ckpt: Path) -> None:
    """A non-finite loss: the run diverged. Stopped before the update (and before any later
    checkpoint or output), so the work folder keeps the last finite checkpoint."""
    v = loss.item()
    if not math.isfinite(v):
        kept = f"the last checkpoint, {ckpt}, is kept" if ckpt.is_file() else "no checkpoint was written"
        raise ValueError(f"step {step + 1}: loss {v}: the run diverged (lower the learning rate); {kept}, "
                         "nothing is written as finished")


def save_checkpoint(obj: dict, path: Path) -> None:
    """torch.save through a temporary file, so an interrupted run leaves the last whole one (and
    no partial temporary file)."""
    tmp = path.with_suffix(".tmp")
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


RUNTIME_FIELDS = ("threads", "max_steps", "save_every", "eval_every", "eval_batches")   # a resume may change these


def run_record(cfg: TrainConfig, tok_dir: Path, teacher_dir: Path | None, init_dir: Path | None) -> dict:
    """What fixes a `train lm | draft` checkpoint's meaning: the teacher, the tokenizer, the
    initial checkpoint and the config (checked on resume, in this order)."""
    from .provenance import file_sample, target_fingerprint

    tok_file = Path(tok_dir) / "tokenizer.json"
    return {"teacher": target_fingerprint(teacher_dir) if teacher_dir else None,
            "tokenizer": file_sample(tok_file) if tok_file.is_file() else None,
            "init": target_fingerprint(init_dir) if init_dir else None,
            **{k: v for k, v in asdict(cfg).items() if k not in RUNTIME_FIELDS}}


def record_command(state: dict, command: str) -> None:
    """A run's commands, kept in its checkpoint's state: each invocation that differs from the one
    before (a resumed run's card lists them all, in order)."""
    cmds = state.setdefault("commands", [])
    if command and (not cmds or cmds[-1] != command):
        cmds.append(command)


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, frac)))


def batch_at(tokens: np.ndarray, step: int, cfg: TrainConfig, salt: int = 0) -> torch.Tensor:
    rng = np.random.default_rng((cfg.seed, salt, step))
    starts = rng.integers(0, len(tokens) - cfg.seq_len - 1, size=cfg.batch_size)
    return torch.from_numpy(np.stack([tokens[s:s + cfg.seq_len + 1] for s in starts]).astype(np.int64))


def eval_windows(tokens: np.ndarray, cfg: TrainConfig) -> list[torch.Tensor]:
    """Fixed, evenly spaced windows: the same every evaluation, so losses compare."""
    n = cfg.eval_batches * cfg.batch_size
    starts = np.linspace(0, len(tokens) - cfg.seq_len - 2, n).astype(np.int64)
    rows = np.stack([tokens[s:s + cfg.seq_len + 1] for s in starts]).astype(np.int64)
    return list(torch.from_numpy(rows).split(cfg.batch_size))


def _loss(student: Transformer, batch: torch.Tensor, teacher: Transformer | None, temp: float, bf16: bool):
    x, y = batch[:, :-1], batch[:, 1:]
    with torch.autocast(student.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = student(x).logits.float()
        if teacher is None:
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        with torch.no_grad():
            t_logits = teacher(x).logits.float()
    V = min(logits.shape[-1], t_logits.shape[-1])
    q_log = F.log_softmax(logits[..., :V] / temp, -1)
    p_log = F.log_softmax(t_logits[..., :V] / temp, -1)
    # forward KL(p || q): the draft must put mass wherever the target does
    return (p_log.exp() * (p_log - q_log)).sum(-1).mean() * temp * temp


@torch.no_grad()
def evaluate(model: Transformer, windows: list[torch.Tensor], bf16: bool = False) -> float:
    model.eval()
    total = 0.0
    for w in windows:
        w = w.to(model.device)
        with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(w[:, :-1]).logits.float()
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1)).item()
    model.train()
    return total / len(windows)


def build_model(cfg: TrainConfig, tok: Tokenizer, seed: int) -> Transformer:
    check_model(cfg.model)
    fields = dict(cfg.model)
    hidden, heads = fields["hidden_size"], fields["num_attention_heads"]
    mc = ModelConfig(
        vocab_size=len(tok), head_dim=fields.pop("head_dim", hidden // heads),
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, model_type="llama", **fields)
    torch.manual_seed(seed)
    model = Transformer(mc)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
            if name.endswith(("o_proj.weight", "down_proj.weight")):  # GPT-2's residual scaling
                p.data /= math.sqrt(2 * mc.num_hidden_layers)
        elif "norm" in name:
            torch.nn.init.ones_(p)
        else:
            torch.nn.init.zeros_(p)
    return model


def load_tokenizer(tokenizer_dir: Path | None, work: Path, cfg: TrainConfig) -> tuple[Tokenizer, Path]:
    """The run's tokenizer and a folder holding its tokenizer.json (copied into the output).
    None: trained on the train split into work/tokenizer (once: a resumed run reuses it). A given
    folder (--tokenizer, the target's) is an input, loaded as specdec loads a model's tokenizer and
    never written to (a missing or unreadable one is a TokenizerError, before work is made); one
    that is not a tokenizer.json (a GGUF's) is saved into work/tokenizer for the output's copy."""
    given = Tokenizer(tokenizer_dir) if tokenizer_dir is not None else None
    work.mkdir(parents=True, exist_ok=True)
    tok_dir = work / "tokenizer"
    if given is None:
        if not (tok_dir / "tokenizer.json").is_file():
            train_tokenizer(tok_dir, cfg.vocab_size, limit_mb=cfg.corpus_limit_mb)
        return Tokenizer(tok_dir), tok_dir
    if (Path(tokenizer_dir) / "tokenizer.json").is_file():
        return given, Path(tokenizer_dir)
    given.save_pretrained(tok_dir)
    return given, tok_dir


def train(cfg: TrainConfig, out: Path, work: Path, tokenizer_dir: Path | None = None,
          teacher_dir: Path | None = None, device: str = "cpu", command: str = "",
          stop_after: int | None = None, init_dir: Path | None = None) -> dict:
    """Train until cfg.max_steps (or `stop_after` steps in this call), checkpointing to `work`."""
    torch.set_num_threads(cfg.threads)
    tok, tok_dir = load_tokenizer(tokenizer_dir, work, cfg)
    data = {s: cached_tokens(tok, s, work / "tokens", cfg.corpus_limit_mb) for s in ("train", "validation", "test")}
    for split, tokens in data.items():
        if len(tokens) < cfg.seq_len + 2:
            raise ValueError(f"seq_len {cfg.seq_len}: longer than the {split} split ({len(tokens)} tokens)")
    bf16 = use_bf16(cfg.precision, torch.device(device))
    teacher = load_model(teacher_dir, "bfloat16" if bf16 else "float32", device) if teacher_dir else None

    model = build_model(cfg, tok, cfg.seed).to(device)
    if init_dir is not None:      # start from a pretrained checkpoint (e.g. a CE-pretrained draft)
        init = load_model(init_dir, "float32", device)
        if init.config != model.config:
            raise ValueError(f"--init {init_dir}: its architecture differs from the config's")
        model.load_state_dict(init.state_dict())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    state = {"step": 0, "tokens": 0, "elapsed_s": 0.0, "history": []}
    ckpt = work / "checkpoint.pt"
    record = run_record(cfg, tok_dir, teacher_dir, init_dir)
    if ckpt.is_file():
        from .provenance import check_run, check_state, load_optimizer

        saved = torch.load(ckpt, map_location=device, weights_only=False)
        where, advice = f"--work {work}", "use another --work, or the options it was made with to resume"
        flags = {"teacher": "--target", "tokenizer": "the tokenizer", "init": "--init",
                 **{k: f"the config's {k}" for k in asdict(cfg)}}
        check_run(saved.get("run"), record, where, flags, advice)
        check_state(model, saved["model"], where, advice)
        model.load_state_dict(saved["model"])
        load_optimizer(opt, saved["optimizer"], where, advice)
        state = saved["state"]
        print(f"resumed from {ckpt} at step {state['step']}", file=sys.stderr)
    record_command(state, command)

    val = eval_windows(data["validation"], cfg)
    model.train()
    start_step, t0, base_elapsed = state["step"], time.time(), state["elapsed_s"]
    end = cfg.max_steps if stop_after is None else min(cfg.max_steps, start_step + stop_after)
    bar = tqdm(range(start_step, end), initial=start_step, total=cfg.max_steps, desc="train", file=sys.stderr,
               dynamic_ncols=True, mininterval=30 if not sys.stderr.isatty() else 0.1)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        batch = batch_at(data["train"], step, cfg).to(device)
        loss = _loss(model, batch, teacher, cfg.distill_temperature, bf16)
        check_loss(loss, step, ckpt)
        optimizer_step(opt, loss, model.parameters(), cfg.grad_clip)
        state["step"] = step + 1
        state["tokens"] += batch.numel() - batch.shape[0]
        state["elapsed_s"] = base_elapsed + time.time() - t0
        done = (step + 1 - start_step) * cfg.batch_size * cfg.seq_len
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{done / max(1e-9, time.time() - t0):.0f}", refresh=False)
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.max_steps:
            v = evaluate(model, val, bf16)
            state["history"].append({"step": step + 1, "train_loss": loss.item(), "val_loss": v})
            print(f"step {step + 1}: train {loss.item():.4f}  val {v:.4f}", file=sys.stderr)
        if (step + 1) % cfg.save_every == 0 or step + 1 == end:
            save_checkpoint({"model": model.state_dict(), "optimizer": opt.state_dict(), "state": state, "run": record},
                            ckpt)
    bar.close()
    if state["step"] < cfg.max_steps:
        return {"finished": False, "step": state["step"]}
    return finish(model, cfg, state, data, tok_dir, out, teacher_dir, command, bf16, init_dir,
                  tokenizer_given=tokenizer_dir is not None,
                  teacher_vocab=teacher.config.vocab_size if teacher is not None else None)


def finish(model, cfg, state, data, tok_dir, out, teacher_dir, command, bf16, init_dir=None,
           tokenizer_given: bool = False, teacher_vocab: int | None = None) -> dict:
    model.eval()
    test = eval_windows(data["test"], cfg)
    val = eval_windows(data["validation"], cfg)
    result = {
        "steps": state["step"], "tokens_seen": state["tokens"], "wall_time_s": round(state["elapsed_s"], 1),
        "validation_loss": round(evaluate(model, val, bf16), 4),
        "test_loss": round(evaluate(model, test, bf16), 4),
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": model.config.vocab_size,      # the tokenizer's (cfg.vocab_size only sizes one trained here)
        "tokenizer": str(tok_dir) if tokenizer_given else "trained on the train split",
        "device": device_name(model.device),
    }
    target = target_record(teacher_dir, teacher_vocab) if teacher_dir else None
    save_model(model, out, torch.bfloat16, extra_config={"specdec_target": target} if target else None)
    copy_tokenizer(tok_dir, out)
    commands, init = state.get("commands") or [command], None
    if init_dir is not None and (Path(init_dir) / "training.json").is_file():
        init = json.loads((Path(init_dir) / "training.json").read_text())
        commands = init.get("commands", []) + commands
        result["initialised_from"] = {"folder": str(init_dir), **{k: init["result"][k] for k in
                                      ("steps", "tokens_seen", "wall_time_s", "validation_loss", "test_loss")}}
    (out / "training.json").write_text(json.dumps({"config": asdict(cfg), "result": result, "commands": commands,
                                                    "history": state["history"]}, indent=1) + "\n")
    (out / "README.md").write_text(model_card(out, cfg, result, teacher_dir, commands))
    return {"finished": True, **result}


def _tokenizer_source(r: dict, teacher_dir) -> str:
    if teacher_dir is not None:
        return f"the target's (`{teacher_dir}`)"
    t = r.get("tokenizer", "trained on the train split")
    return t if t.startswith("trained") else f"from `{t}`"


def target_record(target, vocab_size: int) -> dict:
    """What a trained drafter's config.json says it was trained for (`specdec_target`, as vLLM's
    speculators name their verifier; loaders ignore the key): the target's path and vocabulary size."""
    return {"path": str(target), "vocab_size": int(vocab_size)}


def _init_row(r: dict) -> str:
    i = r.get("initialised_from")
    if not i:
        return ""
    return (f"| initialised from | `{i['folder']}`: {i['steps']} steps, {i['tokens_seen']:,} tokens, "
            f"{i['wall_time_s'] / 3600:.2f} h of cross-entropy pretraining (validation loss {i['validation_loss']}) |\n")


def model_card(out: Path, cfg: TrainConfig, r: dict, teacher_dir, commands: list[str]) -> str:
    kind = f"draft distilled from `{teacher_dir}` (forward KL to its soft labels, DistillSpec-style)" \
        if teacher_dir else "target language model, pretrained from scratch"
    m = cfg.model
    return f"""# {out.name}

A Llama-architecture {kind}, trained by specdec on the Python standard library's source.

| | |
|---|---|
| parameters | {r['parameters']:,} |
| layers / hidden / MLP / heads / kv heads | {m['num_hidden_layers']} / {m['hidden_size']} / {m['intermediate_size']} / {m['num_attention_heads']} / {m.get('num_key_value_heads', m['num_attention_heads'])} |
| tokenizer | byte-level BPE, {r['vocab_size']} tokens, {_tokenizer_source(r, teacher_dir)} |
| data | CPython {platform.python_version()} stdlib `*.py`, split by file (`data/split.json`); test files never trained on |
| steps x batch x sequence | {r['steps']} x {cfg.batch_size} x {cfg.seq_len} |
| tokens seen | {r['tokens_seen']:,} |
| wall time | {r['wall_time_s'] / 3600:.2f} h on {r['device']}, {cfg.threads} thread(s), precision {cfg.precision} |
{_init_row(r)}| validation loss | {r['validation_loss']} |
| test loss | {r['test_loss']} |

Reproduce{" (in order: the initial checkpoint first)" if len(commands) > 1 else ""}:
```
{chr(10).join(commands)}
```
"""
