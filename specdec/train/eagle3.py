"""`specdec train eagle3`: an EAGLE-3 head (model/eagle3.py) for a frozen target, trained with
EAGLE-3's "training-time test", saved in vLLM's / the authors' layout.

1. Documents: the target's own answers (a `specdec train suffix` datastore's corpus, or plain
   token lists), each after the chat template's opening of an empty user turn (the answers'
   own prompts are not stored there: the head sees the answer's context without the question).
2. Features, one pass of the target (the weights it is served with, kept packed): per position
   the residual streams entering the feature layers (fp16) and the final-norm feature (fp16,
   for soft labels), cached in the work folder.
3. Training, deterministic and resumable (batch i from default_rng((seed, i))): rows of
   `window` consecutive pairs (features of token t, embedding of token t + 1); depth 0 is
   teacher-forced, depths 1 .. unroll - 1 start from the head's own states of the depth before,
   attending as the serving chain does (train/eagle_unroll.py's mask); every depth predicts
   token t + 2 against the target's distribution over the draft vocabulary (softmax of its
   LM-head rows on the stored final-norm feature of token t + 1). No feature regression (EAGLE-3).
4. Evaluation: top-1 agreement with the target by chain depth on held-out documents.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..model import ForwardBatch, load_model
from ..model.config import ModelConfig
from ..model.eagle3 import Eagle3Head, save_eagle3
from .eagle_unroll import chain_mask
from .heads import draft_vocabulary, lr_at
from .lm import check_loss, optimizer_step, record_command, save_checkpoint, target_record, use_bf16
from .provenance import RunMismatch, check_run, check_state, data_fingerprint, load_optimizer, target_fingerprint

RUNTIME_FIELDS = ("steps", "save_every", "threads", "precision")     # a resume may change these


@dataclass(frozen=True)
class Eagle3Config:
    steps: int = 3000
    batch: int = 4                     # rows per step
    window: int = 256                  # pairs per row
    lr: float = 1e-3
    warmup: int = 100
    unroll: int = 3                    # chain depths trained (training-time test)
    draft_vocab: int = 8192
    max_tokens: int = 400_000          # feature positions taken from the documents
    val_docs: int = 48                 # the last documents, held out
    feature_layers: tuple[int, ...] | None = None   # None: vLLM's (2, L // 2, L - 3)
    intermediate_size: int | None = None            # None: the target's
    seed: int = 0
    save_every: int = 100
    threads: int = 1
    precision: str = "auto"

    def __post_init__(self):
        if self.unroll < 1 or self.window < 4 or self.batch < 1 or self.steps < 1:
            raise ValueError("unroll, batch and steps must be >= 1 and window >= 4")


def check_source(source: Path, val_docs: int) -> None:
    """Before anything is loaded or made: `source` is a datastore holding more documents than
    --val-docs holds out."""
    from ..proposers.suffix import INDEX_FILE

    if not (source / INDEX_FILE).is_file():
        raise ValueError(f"--data {source}: not a suffix datastore (no {INDEX_FILE}; `specdec train suffix` writes one)")
    n = len(documents(source))
    if n <= val_docs:
        raise ValueError(f"--data {source}: {n} documents, --val-docs {val_docs} held out leaves none to train on: "
                         f"lower --val-docs (below {n})")


def check_datastore_target(source: Path, target: dict, vocab_size: int) -> None:
    """The datastore's recorded target (`train suffix` keeps the one that answered, and its
    vocabulary size) is --target: documents of another tokenizer are other words to it."""
    from .provenance import folder_record, same_target

    rec = folder_record(source) or {}
    made_by = (rec.get("source") or {}).get("target")
    if rec.get("vocab_size") not in (None, vocab_size):
        raise RunMismatch(f"--data {source}: its documents are token ids of a {rec['vocab_size']}-token vocabulary"
                          f"{' (--target ' + made_by['path'] + ')' if made_by else ''}; --target {target['path']} has "
                          f"{vocab_size}: give the target that answered, or a datastore of this one's answers")
    if isinstance(made_by, dict) and made_by.get("fingerprint") and not same_target(made_by, target):
        raise RunMismatch(f"--data {source}: its documents were answered by --target {made_by['path']} (this run: "
                          f"--target {target['path']}); give that target, or a datastore of this one's answers")


def check_documents(docs: list[list[int]], vocab_size: int, source: Path) -> None:
    """Every id inside the target's embedding table (the C forward reads past it unchecked)."""
    for i, doc in enumerate(docs):
        bad = [t for t in doc if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"--data {source}: document {i} holds token id {bad[0]}, outside --target's vocabulary "
                             f"[0, {vocab_size}): a datastore made with another tokenizer")


def documents(source: Path) -> list[list[int]]:
    """Token documents: a suffix datastore folder's corpus (ids + 1, 0 between documents)."""
    from ..proposers.suffix import INDEX_FILE

    z = np.load(source / INDEX_FILE)
    corpus = z["forward"].astype(np.int64)
    cuts = np.flatnonzero(corpus == 0)
    docs, start = [], 0
    for c in [*cuts.tolist(), len(corpus)]:
        if c > start:
            docs.append((corpus[start:c] - 1).tolist())
        start = c + 1
    return docs


@dataclass
class Features:
    tokens: torch.Tensor       # [N] int64
    feats: torch.Tensor        # [N, len(layers) * D] float16
    final: torch.Tensor        # [N, D] float16: the final-norm feature
    starts: torch.Tensor       # [S] first position of each document
    ends: torch.Tensor         # [S] exclusive
    answer: torch.Tensor       # [S] first answer position (labels from there)


@torch.inference_mode()
def extract(target, docs: list[list[int]], prefix: list[int], header: int, layers: tuple[int, ...],
            max_tokens: int, log) -> Features:
    """One target pass per document (prefix + document), the paged C path where it applies, over the
    KV cache the engine keeps for this target (bf16 for a packed GGUF on the CPU): the features the
    head is fed when it serves."""
    from .answers import _new_cache, kv_cache_dtype_for

    kv_dtype = kv_cache_dtype_for(target, "auto")
    L = target.config.num_hidden_layers
    want = (*layers, L)
    toks, feats, final, starts, ends, answer = [], [], [], [], [], []
    n, t0 = 0, time.time()
    norm = target.model.norm
    for i, doc in enumerate(docs):
        ids = prefix + doc
        cache = _new_cache(target, 1, len(ids) + 1, kv_dtype)
        out = target(torch.tensor(ids), cache, ForwardBatch.build(cache, [0], [len(ids)], [0]), logits=False,
                     hidden=want)
        h = out.hidden.float()
        D = h.shape[1] // len(want)
        final_norm = norm(h[:, -D:]).half().cpu()
        h = h.cpu()
        starts.append(n)
        answer.append(n + len(prefix) + header)
        n += len(ids)
        ends.append(n)
        toks.append(torch.tensor(ids))
        feats.append(h[:, :-D].half())
        final.append(final_norm)
        if (i + 1) % 200 == 0:
            log(f"features: {i + 1} documents, {n:,} tokens ({n / (time.time() - t0):.0f} tokens/s)")
        if n >= max_tokens:
            break
    cat = lambda xs: torch.cat(xs)  # noqa: E731
    return Features(cat(toks), cat(feats), cat(final), torch.tensor(starts), torch.tensor(ends), torch.tensor(answer))


def build_head(cfg: Eagle3Config, target_cfg: ModelConfig, layers, vocab: torch.Tensor, lm_rows: torch.Tensor,
               norm_w: torch.Tensor) -> Eagle3Head:
    torch.manual_seed(cfg.seed)
    dcfg = target_cfg.replace(num_hidden_layers=1, intermediate_size=cfg.intermediate_size or target_cfg.intermediate_size)
    dcfg = ModelConfig.from_hf({**dcfg.to_hf(), "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                "tie_word_embeddings": False})
    head = Eagle3Head(dcfg, target_cfg.hidden_size, layers, vocab)
    for name, p in head.named_parameters():
        if p.dim() == 2 and p.numel():
            torch.nn.init.normal_(p, std=0.02)
    head.decoder.lm_head.weight.data = lm_rows.float().clone()     # the target's rows: a warm start, trained
    head.decoder.model.norm.weight.data = norm_w.float().clone()
    return head.float().train()


def unrolled(head: Eagle3Head, feats: torch.Tensor, embeds: torch.Tensor, depths: int) -> list[torch.Tensor]:
    """feats [B, W, F] the target's features of tokens t; embeds [B, W, D] of tokens t + 1.
    Returns the logits [B, W, V'] of each depth (token t + 2). Depth 0 equals head(feats,
    embeds); depth s row t starts from depth s - 1's state of row t - 1, at position t, seeing
    the committed rows <= t - s and the chain's earlier depths (eagle_unroll.chain_mask)."""
    dec = head.decoder
    layer = dec.model.layers[0]
    attn = layer.self_attn
    W = feats.shape[1]
    cos, sin = dec._rope(torch.arange(W, device=feats.device), feats.dtype)
    from ..model.llama import rotate_half

    e = layer.input_layernorm(embeds)
    h = head.fc(feats)
    keys, vals, out = [], [], []
    prev = None         # depth s > 0 reads depth s - 1's output
    for s in range(depths):
        if s > 0:
            h = torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], 1)
        normed = layer.hidden_norm(h)
        residual = normed if layer.norm_before_residual else h
        q, k, v = (t.transpose(1, 2) for t in attn.heads(torch.cat([e, normed], -1)))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        keys.append(k)
        vals.append(v)
        a = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(vals, 2), attn_mask=chain_mask(W, s, q.device),
                                           scale=attn.scale, enable_gqa=attn.n_kv != attn.n_heads)
        x = residual + attn.o_proj(a.transpose(1, 2).reshape(*h.shape[:2], -1))
        prev = x + layer.mlp(layer.post_attention_layernorm(x))
        out.append(dec.lm_head(dec.model.norm(prev)))
    return out


def _windows(data: Features, rng, batch: int, window: int, docs: torch.Tensor):
    """`batch` rows of `window` pair positions, each inside one document of `docs`, around a
    random answer position; valid [B, W]: token t + 2 is an answer token of that document."""
    s = docs[torch.from_numpy(rng.integers(0, len(docs), batch))]
    st, a, e = data.starts[s], data.answer[s], data.ends[s]
    lo = torch.maximum(st, a - 2 - window // 2)
    hi = torch.maximum(lo, e - 2 - window)
    begin = lo + (torch.from_numpy(rng.random(batch)) * (hi - lo + 1).double()).long()
    idx = begin[:, None] + torch.arange(window)[None]
    valid = (idx + 2 < e[:, None]) & (idx + 2 >= a[:, None])
    return idx.clamp(max=len(data.tokens) - 3), valid


def loss_of(head, embed, data: Features, idx, valid, lm_rows, depths: int):
    feats = data.feats[idx].float()
    embeds = embed(data.tokens[idx + 1]).float()
    with torch.no_grad():       # the target's distribution of token t + 2, over the draft vocabulary
        p = torch.softmax(data.final[idx + 1].float() @ lm_rows.T, -1)
    total, parts = 0.0, []
    for s, logits in enumerate(unrolled(head, feats, embeds, depths)):
        keep = valid & (torch.arange(idx.shape[1], device=idx.device) >= s)[None]
        lp = F.log_softmax(logits.float(), -1)
        ce = -(p * lp).sum(-1)[keep].mean()
        total = total + ce
        parts.append(round(ce.item(), 4))
    return total, parts


@torch.no_grad()
def chain_accuracy(head, embed, data: Features, docs: torch.Tensor, depths: int, lm_rows: torch.Tensor) -> list[float]:
    """Top-1 agreement with the target's argmax (over the whole vocabulary) at each chain depth,
    on every answer position of `docs` (windows of the documents whole)."""
    head.eval()
    hits, counts = [0] * depths, [0] * depths
    for s in docs.tolist():
        st, a, e = int(data.starts[s]), int(data.answer[s]), int(data.ends[s])
        if e - st < 4:
            continue
        idx = torch.arange(st, e - 2, device=data.tokens.device)[None]
        want = (data.final[idx + 1].float() @ lm_rows.T).argmax(-1)
        outs = unrolled(head, data.feats[idx].float(), embed(data.tokens[idx + 1]).float(), depths)
        for d, logits in enumerate(outs):
            got = head.draft_vocab[logits.argmax(-1)]
            keep = (idx + 2 >= a) & (torch.arange(idx.shape[1], device=idx.device) >= d)[None]
            hits[d] += int((got == want)[keep].sum())
            counts[d] += int(keep.sum())
    head.train()
    return [round(h / max(1, c), 4) for h, c in zip(hits, counts)]


def train_eagle3(cfg: Eagle3Config, target_path: str, source: Path, out: Path, work: Path, command: str = "",
                 stop_after: int | None = None, log=lambda s: print(s, file=sys.stderr, flush=True),
                 device: str = "cpu") -> dict:
    """device: where the target's pass and the training run ("cuda": the target dequantized on
    the GPU; the features are kept on the host between the two and copied to the GPU whole)."""
    torch.set_flush_denormal(True)
    try:
        return _train(cfg, target_path, source, out, work, command, stop_after, log, torch.device(device))
    finally:
        torch.set_flush_denormal(False)


def _train(cfg, target_path, source, out, work, command, stop_after, log, device) -> dict:
    torch.set_num_threads(cfg.threads)
    served = load_model(target_path, device=device)       # the weights as served (GGUF on the CPU: kept packed)
    tcfg = served.config
    layers = _feature_layers(cfg, tcfg.num_hidden_layers)
    dense = load_model(target_path, "float32", quantization="none")     # embeddings and LM-head rows
    work.mkdir(parents=True, exist_ok=True)
    embed = dense.model.embed_tokens.to(device)
    from ..proposers.suffix import INDEX_FILE

    fingerprint, store = target_fingerprint(target_path), data_fingerprint(source, [source / INDEX_FILE])
    check_datastore_target(source, fingerprint, tcfg.vocab_size)
    record = {"target": fingerprint, "data": store, "feature_layers": list(layers),
              **{k: v for k, v in asdict(cfg).items() if k not in RUNTIME_FIELDS and k != "feature_layers"}}
    where, advice = f"--work {work}", "use another --work, or the options it was made with to resume"
    flags = {"target": "--target", "data": "--data", "draft_vocab_ids": "a draft vocabulary of",
             **{k: "--" + k.replace("_", "-") for k in record if k not in ("target", "data")}}
    ckpt = work / "checkpoint.pt"
    saved = torch.load(ckpt, weights_only=False, map_location=device) if ckpt.is_file() else None
    if saved:       # before the features are read or made
        check_run(saved.get("run"), record, where, flags, advice)
    data = _features(served, target_path, source, work / "features.pt", layers,
                     cfg.max_tokens + 400 * cfg.val_docs, {"target": fingerprint, "data": store}, log)
    S = len(data.starts)
    if S <= cfg.val_docs:       # documents longer than --max-tokens' share: fewer taken than the datastore holds
        raise ValueError(f"--val-docs {cfg.val_docs}: {S} documents taken (--max-tokens {cfg.max_tokens}), none left "
                         "to train on: lower --val-docs or raise --max-tokens")
    train_docs, val_docs = torch.arange(S - cfg.val_docs), torch.arange(S - cfg.val_docs, S)
    answer_tokens = torch.cat([data.tokens[int(a):int(e)] for a, e in zip(data.answer[:S - cfg.val_docs],
                                                                         data.ends[:S - cfg.val_docs])])
    vocab = draft_vocabulary(answer_tokens, cfg.draft_vocab, tcfg.vocab_size)
    val_tokens = torch.cat([data.tokens[int(a):int(e)] for a, e in zip(data.answer[S - cfg.val_docs:], data.ends[S - cfg.val_docs:])])
    coverage = torch.isin(val_tokens, vocab).float().mean().item()
    lm_rows_full = dense.lm_head.weight.detach().float()
    lm_rows = lm_rows_full[vocab]
    head = build_head(cfg, tcfg, layers, vocab, lm_rows, dense.model.norm.weight.detach()).to(device)
    lm_rows, lm_rows_full, host = lm_rows.to(device), lm_rows_full.to(device), data
    data = Features(*(t.to(device) for t in (data.tokens, data.feats, data.final, data.starts, data.ends, data.answer)))
    params = [p for p in head.parameters() if p.requires_grad and p.numel()]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    state = {"step": 0, "elapsed_s": 0.0, "history": []}
    record["draft_vocab_ids"] = vocab.tolist()
    if saved:
        check_run(saved.get("run"), record, where, flags, advice)
        check_state(head, saved["head"], where, advice)
        if not torch.equal(saved["head"]["draft_vocab"].cpu(), vocab):
            raise RunMismatch(f"{where}: its head's draft vocabulary is not the one this run's features give (other "
                              f"--data, --max-tokens or --val-docs than it was made with); {advice}")
        head.load_state_dict(saved["head"])
        load_optimizer(opt, saved["optimizer"], where, advice)
        state = saved["state"]
        log(f"resumed from {ckpt} at step {state['step']}")
    record_command(state, command)
    bf16 = use_bf16(cfg.precision, device)
    start, t0, base = state["step"], time.time(), state["elapsed_s"]
    end = cfg.steps if stop_after is None else min(cfg.steps, start + stop_after)
    for step in range(start, end):
        rng = np.random.default_rng((cfg.seed, step))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        idx, valid = _windows(host, rng, cfg.batch, cfg.window, train_docs)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss, parts = loss_of(head, embed, data, idx.to(device), valid.to(device), lm_rows, cfg.unroll)
        check_loss(loss, step, ckpt)
        optimizer_step(opt, loss, params, 1.0)
        state["step"] = step + 1
        state["elapsed_s"] = base + time.time() - t0
        if (step + 1) % 50 == 0 or step + 1 == cfg.steps:
            state["history"].append({"step": step + 1, "loss": round(loss.item(), 4), "per_depth": parts})
            log(f"step {step + 1}/{cfg.steps}: loss {loss.item():.4f} per depth {parts} "
                f"({(state['elapsed_s'] - base) / (step + 1 - start):.2f} s/step)")
        if (step + 1) % cfg.save_every == 0 or step + 1 == end:
            save_checkpoint({"head": head.state_dict(), "optimizer": opt.state_dict(), "state": state, "run": record},
                            ckpt)
    if state["step"] < cfg.steps:
        return {"finished": False, "step": state["step"]}
    head.eval()
    acc = chain_accuracy(head, embed, data, val_docs, max(cfg.unroll, 4), lm_rows_full)
    result = {"steps": state["step"], "wall_time_s": round(state["elapsed_s"], 1), "feature_layers": list(layers),
              "train_tokens": int(data.ends[S - cfg.val_docs - 1]), "documents": S - cfg.val_docs,
              "draft_vocab_coverage": round(coverage, 4), "chain_top1_by_depth": acc}
    save_eagle3(head.cpu(), out, torch.bfloat16, extra={"vocab_size": tcfg.vocab_size, "max_position_embeddings":
                                                  tcfg.max_position_embeddings,
                                                  "specdec_target": target_record(target_path, tcfg.vocab_size)})
    commands = state.get("commands") or [command]
    (out / "training.json").write_text(json.dumps({"config": asdict(cfg), "result": result, "commands": commands,
                                                    "history": state["history"]}, indent=1) + "\n")
    (out / "README.md").write_text(card(out, target_path, source, cfg, result, commands))
    return {"finished": True, **result}


def card(out: Path, target, source: Path, cfg: Eagle3Config, r: dict, commands: list[str]) -> str:
    return f"""# {out.name}

An EAGLE-3 head (vLLM's layout) for `{target}`, trained by specdec on the target's own answers
(the documents of the suffix datastore `{source}`), with EAGLE-3's training-time test
({cfg.unroll} chain depths). Load it as `{{"method": "eagle3", "model": "{out}"}}`.

| | |
|---|---|
| feature layers | {', '.join(map(str, r['feature_layers']))} |
| draft vocabulary | {cfg.draft_vocab} tokens (coverage of held-out answer tokens {r['draft_vocab_coverage']}) |
| training | {r['steps']} steps x {cfg.batch} rows x {cfg.window} pairs, {r['documents']} documents, {r['train_tokens']:,} tokens |
| wall time | {r['wall_time_s'] / 3600:.2f} h |
| top-1 agreement with the target, by chain depth | {r['chain_top1_by_depth']} ({cfg.val_docs} held-out documents) |

Reproduce:
```
{chr(10).join(commands)}
```
"""


def _features(served, target_path, source: Path, path: Path, layers: tuple[int, ...], max_tokens: int,
              made_by: dict, log) -> Features:
    """The target's features of the datastore's documents, cached in `path` with what made them
    (target, datastore, layers, token budget, chat prefix); a cache made otherwise is remade. A
    cache from before that record is used when its width fits the layers (as before)."""
    from ..tokenizer import Tokenizer

    prefix = _prefix(Tokenizer(target_path))
    from .answers import kv_cache_dtype_for

    made_by = {**made_by, "layers": list(layers), "max_tokens": max_tokens, "prefix": prefix,
               "kv_cache_dtype": kv_cache_dtype_for(served, "auto")}
    if path.is_file():
        cached = torch.load(path)
        meta = cached.pop("meta", None)
        width = len(layers) * served.config.hidden_size
        if meta == made_by or (meta is None and cached["feats"].shape[1] == width):
            return Features(**cached)
        log(f"{path}: features made for other --target / --data / --feature-layers / --max-tokens; made again")
    docs = documents(source)
    check_documents(docs, served.config.vocab_size, source)
    data = extract(served, docs, prefix, 3, layers, max_tokens, log)
    tmp = path.with_suffix(".tmp")
    torch.save({**asdict(data), "meta": made_by}, tmp)
    os.replace(tmp, path)
    return data


def _feature_layers(cfg: Eagle3Config, num_layers: int) -> tuple[int, ...]:
    from ..model.eagle3 import feature_layers_of

    if cfg.feature_layers and max(cfg.feature_layers) >= num_layers:
        raise ValueError(f"--feature-layers {','.join(map(str, cfg.feature_layers))}: the target has {num_layers} "
                         f"layers (0 .. {num_layers - 1})")
    if cfg.feature_layers and len(set(cfg.feature_layers)) < len(cfg.feature_layers):
        raise ValueError(f"--feature-layers {','.join(map(str, cfg.feature_layers))}: a layer given twice (each "
                         "layer's features are read once at inference)")
    try:     # ascending: the order the loader (and vLLM) reads them in
        return tuple(sorted(cfg.feature_layers)) if cfg.feature_layers else feature_layers_of({}, num_layers)
    except ValueError as e:
        raise ValueError(f"{e}: set --feature-layers") from None


def _prefix(tok) -> list[int]:
    """The chat template's opening of an empty user turn, without its assistant header (each
    document starts with its own), or nothing for a tokenizer without a template."""
    try:
        text = tok.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=True, tokenize=False)
    except Exception:       # no chat template
        return []
    ids = tok.encode(text, add_special_tokens=False) if isinstance(text, str) else list(text)
    return ids[:-3]
