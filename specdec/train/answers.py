"""The target's own answers to the chat prompts, with its features: data for drafts and heads.

Each prompt goes through the target's chat template (one user turn) and the target answers it,
greedily or sampled (temperature 0.7, top-p 0.95), in batches of ragged rows on specdec's own
runtime (flat forwards over a KV cache, model/batch.py): the prompts are prefilled together,
then the rows decode together, each at its own position, and a row leaves the batch when it
ends. The final-norm features come out of the same forwards, over a KV cache of the dtype the
engine serving this target keeps (AnswerConfig.kv_cache_dtype, "auto": engine.kv_cache_dtype_of's
default, bf16 for a GGUF-packed target on the CPU), so they are the features the engine feeds a
proposer (tests/test_chat_train.py checks them against an engine's). The `transformers` backend
(answer_batch_hf) runs a transformers model, for a GGUF target its dequantized weights: its
answers and features are that model's, not those of the packed weights as served.

Shards of `per_shard` prompts (prompt i of the prompt file lives in shard i // per_shard):

    shard_00012.pt = {"ids": [n] str, "tokens": [N] int32 (prompt + answer, rows concatenated),
                      "offsets": [n + 1] int64, "prompt_lens": [n] int64, "greedy": [n] bool,
                      "finished": [n] bool (ended with an end-of-turn token),
                      "hidden": [N, D] float16 (row r's features at offsets[r] .. offsets[r + 1] - 1;
                                 the row's last token has none: zeros there)}

Written atomically one by one and skipped when present, so an interrupted run resumes. Whether
a prompt is answered greedily, and a sampled answer's draws (a generator per prompt, seeded
from seed and the prompt's index: ROW_SEEDS), are functions of (seed, prompt index), so a resumed
run, or one with another --batch, answers alike. A shard whose prompts are all longer than
max_prompt_tokens is not written; config.json records it under "skipped", and it counts as done.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..config import SamplingParams
from ..engine import KV_CACHE_DTYPES, kv_cache_dtype_of
from ..model import ForwardBatch, Transformer
from ..model.kv import KVCache
from ..sampling import make_generator, process


@dataclass(frozen=True)
class AnswerConfig:
    max_new_tokens: int = 256
    batch: int = 48                 # rows decoded together
    per_shard: int = 96
    greedy_fraction: float = 0.5
    temperature: float = 0.7        # sampled rows
    top_p: float = 0.95
    max_prompt_tokens: int = 900    # longer prompts are skipped (recorded in the shard log)
    seed: int = 0
    threads: int = 1
    # the KV cache the answers and features are computed over: "auto" = what the engine serving
    # the target keeps by default; write_shards records the dtype it resolves to
    kv_cache_dtype: str = "auto"

    def __post_init__(self):
        if not 0 <= self.greedy_fraction <= 1:
            raise ValueError(f"greedy_fraction must be in [0, 1], got {self.greedy_fraction}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.batch < 1 or self.per_shard < 1 or self.max_new_tokens < 1:
            raise ValueError("batch, per_shard and max_new_tokens must be >= 1")


def is_greedy(seed: int, index: int, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(f"{seed}:{index}".encode()).digest()[:8], "little")
    return h / 2**64 < fraction


# how write_shards seeds a prompt's generator (recorded in config.json)
ROW_SEEDS = "one generator per prompt, seeded seed * 1000003 + prompt index"


def _next_tokens(logits: torch.Tensor, greedy: list[bool], params: SamplingParams, gens: list) -> torch.Tensor:
    """logits [A, V] -> next token ids [A]; greedy rows take the argmax, the others sample, each
    from gens[row]: rows sharing one generator draw together, a row with its own draws what no
    other row changes."""
    out = logits.argmax(-1)
    sampled = [i for i, g in enumerate(greedy) if not g]
    if sampled:
        probs = process(logits[sampled], params)
        if all(gens[i] is gens[sampled[0]] for i in sampled):
            out[sampled] = torch.multinomial(probs, 1, generator=gens[sampled[0]]).squeeze(-1)
        else:
            for j, i in enumerate(sampled):
                out[i] = torch.multinomial(probs[j:j + 1], 1, generator=gens[i])[0, 0]
    return out


def _row_generators(gen, n: int) -> list:
    """One generator for the batch, or one per row (a list), as a list per row."""
    return list(gen) if isinstance(gen, (list, tuple)) else [gen] * n


def kv_cache_dtype_for(model, name: str) -> str:
    """The KV cache dtype `name` ("auto", "bfloat16", "float32", "int8") means for this answering
    model, by name: specdec's runtime keeps the one its engine would (engine.kv_cache_dtype_of:
    "auto" is bf16 for a GGUF-packed target on the CPU, else the model's dtype); a transformers
    model keeps its cache in its own dtype, so only that (or "auto") is accepted there."""
    if isinstance(model, Transformer):
        return str(kv_cache_dtype_of(model, name)).removeprefix("torch.")
    own = str(model.dtype).removeprefix("torch.")
    if name not in ("auto", own):
        raise ValueError(f"--kv-cache-dtype {name}: the transformers backend keeps its KV cache in the model's "
                         f"dtype ({own}); use --backend specdec for another")
    return own


def _new_cache(model: Transformer, batch: int, max_len: int, kv_dtype: str) -> KVCache:
    """model.new_cache's contiguous cache, in kv_dtype (a kv_cache_dtype_for name)."""
    dtype = getattr(torch, kv_dtype)
    if dtype == model.dtype:
        return model.new_cache(batch, max_len)
    cfg = model.local_config
    return KVCache.dense(batch, max_len, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, dtype,
                         model.device, values_are_keys=model.values_are_keys)


def _feed(model: Transformer, kv, seqs: list[int], tokens: list[list[int]], logits: bool = True):
    """One flat forward: sequence seqs[i] gets tokens[i] after what it holds. Returns
    (logits [len(seqs), V] at each sequence's last new token, features per sequence [T_i, D])."""
    counts = [len(t) for t in tokens]
    batch = ForwardBatch.build(kv, seqs, counts, logits=[1] * len(seqs) if logits else None)
    flat = torch.tensor([x for t in tokens for x in t], dtype=torch.long, device=model.device)
    out = model(flat, kv, batch, hidden=True)
    for s, n in zip(seqs, counts):
        kv.set_length(s, kv.length(s) + n)
    return out.logits, list(out.hidden.split(counts))


@torch.inference_mode()
def answer_batch(model: Transformer, prompts: list[list[int]], greedy: list[bool], cfg: AnswerConfig,
                 eos_ids: set[int], gen: torch.Generator | list[torch.Generator],
                 prefill_tokens: int = 4096) -> list[dict]:
    """Answer each prompt; returns per row {"answer": [ids], "hidden": [P + len(answer) - 1, D], "finished"}.
    gen: the batch's generator, or one per prompt (then a row's answer depends on no other row).

    Prompts are prefilled together in flat forwards of about `prefill_tokens` tokens; then every
    unfinished row decodes one token per forward, each at its own position (ForwardBatch), and
    a row that ends simply stops being fed. The KV cache: cfg.kv_cache_dtype (kv_cache_dtype_for)."""
    params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p)
    kv = _new_cache(model, len(prompts), max(map(len, prompts)) + cfg.max_new_tokens,
                    kv_cache_dtype_for(model, cfg.kv_cache_dtype))
    rows = [{"answer": [], "hidden": [], "finished": False} for _ in prompts]
    last = [None] * len(prompts)
    group: list[int] = []
    for r in range(len(prompts) + 1):
        if group and (r == len(prompts) or sum(len(prompts[i]) for i in group) + len(prompts[r]) > prefill_tokens):
            logits, feats = _feed(model, kv, group, [prompts[i] for i in group])
            for j, i in enumerate(group):
                rows[i]["hidden"].append(feats[j])
                last[i] = logits[j]
            group = []
        if r < len(prompts):
            group.append(r)
    gens = _row_generators(gen, len(prompts))
    live, logits = list(range(len(prompts))), torch.stack(last)      # logits [live, V]
    while live:
        nxt = _next_tokens(logits.float(), [greedy[r] for r in live], params, [gens[r] for r in live]).tolist()
        fed = []
        for r, t in zip(live, nxt):
            row = rows[r]
            row["answer"].append(t)
            if t in eos_ids or len(row["answer"]) == cfg.max_new_tokens:
                row["finished"] = t in eos_ids
            else:
                fed.append((r, t))
        live = [r for r, _ in fed]
        if not live:
            break
        logits, feats = _feed(model, kv, live, [[t] for _, t in fed])
        for r, f in zip(live, feats):
            rows[r]["hidden"].append(f)
    return [{"answer": x["answer"], "finished": x["finished"], "hidden": torch.cat(x["hidden"])} for x in rows]


@torch.inference_mode()
def answer_batch_hf(model, prompts: list[list[int]], greedy: list[bool], cfg: AnswerConfig, eos_ids: set[int],
                    gen: torch.Generator | list[torch.Generator], pad_id: int = 0) -> list[dict]:
    """answer_batch's contract on a transformers causal LM (the `transformers` backend).

    For a GPU (`--backend auto` picks it there). On the CPU specdec's own runtime is faster since
    forward.c runs whole batched forwards: 151 against 25 answer tokens/s for the Q4_1 SmolLM2 (32
    rows, one thread, AMD EPYC Zen 3), and its answers and features are those of the weights as
    served. A GGUF target runs here dequantized (model/export.py): for a quantized file that is
    another function than the packed weights specdec serves (int8-rounded activations), so greedy
    answers part from the served target's (4 of 8 prompts identical on the Q4_1 SmolLM2 at 48
    tokens) and the features differ (up to 1.6 on a scale of 53 on the same tokens).
    Prompts are left-padded; rows that end leave the batch (their cache rows are dropped)."""
    from transformers import DynamicCache

    dev = model.device
    B, P = len(prompts), max(map(len, prompts))
    ids = torch.full((B, P), pad_id, dtype=torch.long)
    mask = torch.zeros(B, P, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p)
        mask[i, P - len(p):] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p)
    cache = DynamicCache()
    cache_arg = {_cache_kwarg(model): cache}
    step = lambda ids, mask, pos: model.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,  # noqa: E731
                                              **cache_arg).last_hidden_state
    h = step(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0))             # [B, P, D] final-norm
    host = h.float().cpu()                                              # features gathered on the host
    rows = [{"answer": [], "hidden": [host[i, P - len(p):]], "finished": False} for i, p in enumerate(prompts)]
    gens = _row_generators(gen, B)
    live, logits = list(range(B)), model.lm_head(h[:, -1]).float()
    while live:
        nxt = _next_tokens(logits, [greedy[r] for r in live], params, [gens[r] for r in live]).tolist()
        keep = []
        for j, (r, t) in enumerate(zip(live, nxt)):
            rows[r]["answer"].append(t)
            if t in eos_ids or len(rows[r]["answer"]) == cfg.max_new_tokens:
                rows[r]["finished"] = t in eos_ids
            else:
                keep.append(j)
        if not keep:
            break
        if len(keep) < len(live):
            cache.batch_select_indices(torch.tensor(keep, device=dev))
            mask = mask[keep]
        live = [live[j] for j in keep]
        mask = torch.cat([mask, mask.new_ones(len(live), 1)], 1)
        h = step(torch.tensor([[nxt[j]] for j in keep], device=dev), mask, mask.sum(-1, keepdim=True) - 1)[:, -1]
        host = h.float().cpu()
        for j, r in enumerate(live):
            rows[r]["hidden"].append(host[j:j + 1])
        logits = model.lm_head(h).float()
    return [{"answer": x["answer"], "finished": x["finished"], "hidden": torch.cat(x["hidden"])} for x in rows]


def _cache_kwarg(model) -> str:
    """The cache argument's name: `cache` in recent transformers, `past_key_values` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """One user turn through the tokenizer's chat template, ready for the assistant's answer."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)      # the template writes its own BOS


def read_prompts(path: Path) -> list[dict]:
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f'{path}:{n}: each line must be an object with a "prompt" string')
        rows.append(row)
    return rows


# AnswerConfig fields that fix what a shard holds (batch and threads only change how fast it is made:
# each prompt samples from its own generator, ROW_SEEDS); kv_cache_dtype is compared once resolved
# (write_shards), "auto" before the model is loaded passes
MEANING_FIELDS = ("max_new_tokens", "per_shard", "greedy_fraction", "temperature", "top_p", "max_prompt_tokens", "seed",
                  "kv_cache_dtype")


def chunk_hash(chunk: list[dict]) -> str:
    """The prompts one shard answers (their ids and text, in order), hashed."""
    return hashlib.sha256(json.dumps([[p.get("id"), p["prompt"]] for p in chunk]).encode()).hexdigest()[:16]


def check_answers_folder(out: Path, prompts: list[dict], cfg: AnswerConfig, target: dict | None = None,
                         log=lambda s: print(s, file=sys.stderr, flush=True)) -> dict:
    """Before answering into `out`: the shards already there were made with these settings, by this
    target, for the prompts they stand for now (a RunMismatch naming what differs otherwise).
    Returns the folder's record as it is to be written (config.json: the settings, the target,
    how sampled rows are seeded, each shard's prompts hash, and those of the shards skipped as all
    too long). A folder from before the record: its settings are checked, its target and prompts
    taken as given (with a warning)."""
    from .provenance import RunMismatch, check_run

    rec = None
    if (out / "config.json").is_file():
        try:
            rec = json.loads((out / "config.json").read_text())
        except json.JSONDecodeError:
            rec = None
    present = sorted(out.glob("shard_*.pt")) if out.is_dir() else []
    advice = "use another --out, or the options it was made with to go on"
    now = {"target": target, "row_seeds": ROW_SEEDS, **{k: getattr(cfg, k) for k in MEANING_FIELDS
                                                        if k != "kv_cache_dtype" or cfg.kv_cache_dtype != "auto"}}
    hashes, skipped = {}, {}
    if rec is not None and (present or rec.get("skipped")):
        check_run({k: v for k, v in rec.items() if k in now and (k != "target" or v)}, now,
                  f"--out {out}: its shards were", {"target": "--target", "row_seeds": "sampled rows seeded by",
                                                    **{k: "--" + k.replace("_", "-") for k in MEANING_FIELDS}},
                  advice, sep=" ")
        hashes, skipped = dict(rec.get("shards") or {}), dict(rec.get("skipped") or {})
        for path in present:
            i = int(path.stem.split("_")[1])
            want = hashes.get(path.name)
            if want is not None and want != chunk_hash(prompts[i * cfg.per_shard:(i + 1) * cfg.per_shard]):
                raise RunMismatch(f"--out {out}: {path.name} was made for other prompts than its place in this "
                                  f"--prompts (another prompts file, order or --limit); {advice}")
        if target is not None and not rec.get("target"):
            log(f"warning: --out {out}: its shards were made before specdec recorded their target; taken as "
                f"--target {target['path']}'s and recorded so")
        if "row_seeds" not in rec and cfg.greedy_fraction < 1:
            log(f"warning: --out {out}: its shards were made before specdec seeded each prompt's sampling on its "
                f"own (their sampled answers then depended on --batch); new ones are seeded by {ROW_SEEDS}")
        if "kv_cache_dtype" not in rec and cfg.kv_cache_dtype != "auto":
            log(f"warning: --out {out}: its shards were made before specdec recorded their KV cache (then the "
                f"model's dtype); new ones are computed over a {cfg.kv_cache_dtype} cache")
    elif present:
        log(f"warning: --out {out}: no record of the settings its {len(present)} shards were made with; taken as these")
    return {**asdict(cfg), "target": target, "row_seeds": ROW_SEEDS, "shards": hashes, "skipped": skipped}


def write_shards(model, tokenizer, prompts: list[dict], out: Path, cfg: AnswerConfig,
                 stop_after: int | None = None, log=lambda s: print(s, file=sys.stderr, flush=True),
                 target: dict | None = None) -> list[Path]:
    """Answer `prompts` shard by shard under `out` (present shards are kept); returns the shard
    paths written so far, in order. `stop_after`: write at most that many new shards. A shard whose
    prompts are all too long is not written but recorded in out/config.json's "skipped" (with its
    prompts' hash): it is done, and a resume passes it (skipped_shards counts them).
    model: specdec's Transformer, or a transformers causal LM (answer_batch_hf). target: the
    target's provenance.target_fingerprint, recorded in out/config.json and checked on resume
    (check_answers_folder), as is the KV cache dtype cfg.kv_cache_dtype resolves to for `model`."""
    from dataclasses import replace

    from .provenance import write_record

    cfg = replace(cfg, kv_cache_dtype=kv_cache_dtype_for(model, cfg.kv_cache_dtype))
    record = check_answers_folder(out, prompts, cfg, target, log)
    out.mkdir(parents=True, exist_ok=True)
    write_record(out / "config.json", record)
    eos = set(tokenizer.eos_token_ids)
    paths, made = [], 0
    for s in range(0, len(prompts), cfg.per_shard):
        path = out / f"shard_{s // cfg.per_shard:05d}.pt"
        if path.is_file():
            paths.append(path)
            continue
        if record["skipped"].get(path.name) == chunk_hash(prompts[s:s + cfg.per_shard]):
            continue
        if stop_after is not None and made >= stop_after:
            break
        t0 = time.perf_counter()
        chunk = [(s + i, p) for i, p in enumerate(prompts[s:s + cfg.per_shard])]
        encoded = [(i, p, chat_ids(tokenizer, p["prompt"])) for i, p in chunk]
        kept = [(i, p, ids) for i, p, ids in encoded if len(ids) <= cfg.max_prompt_tokens]
        if not kept:                   # nothing to answer: no shard, recorded as done
            record["skipped"][path.name] = chunk_hash(prompts[s:s + cfg.per_shard])
            write_record(out / "config.json", record)
            log(f"{path.name}: all {len(chunk)} prompts too long (> {cfg.max_prompt_tokens} tokens), skipped")
            continue
        # batches of similar prompt lengths: a padded batch costs its longest prompt per row
        order = sorted(range(len(kept)), key=lambda j: len(kept[j][2]))
        results = [None] * len(kept)
        for b in range(0, len(order), cfg.batch):
            part = [kept[j] for j in order[b:b + cfg.batch]]
            greedy = [is_greedy(cfg.seed, i, cfg.greedy_fraction) for i, _, _ in part]
            gens = [make_generator(cfg.seed * 1_000_003 + i, model.device) for i, _, _ in part]     # ROW_SEEDS
            run = answer_batch if isinstance(model, Transformer) else answer_batch_hf
            for j, r in zip(order[b:b + cfg.batch], run(model, [ids for _, _, ids in part], greedy, cfg, eos, gens)):
                results[j] = r
        _save_shard(path, kept, results, cfg)
        record["shards"][path.name] = chunk_hash(prompts[s:s + cfg.per_shard])
        record["skipped"].pop(path.name, None)          # skipped for other prompts once
        write_record(out / "config.json", record)
        paths.append(path)
        made += 1
        n_new = sum(len(r["answer"]) for r in results)
        log(f"{path.name}: {len(kept)} prompts ({len(chunk) - len(kept)} too long), {n_new} answer tokens "
            f"in {time.perf_counter() - t0:.0f}s")
    skipped = skipped_shards(out, prompts, cfg.per_shard)
    if skipped:
        n = sum(len(prompts[i * cfg.per_shard:(i + 1) * cfg.per_shard]) for i in skipped.values())
        log(f"{len(skipped)} shards skipped, their {n} prompts all over {cfg.max_prompt_tokens} tokens (recorded in "
            f"{out / 'config.json'})")
    return paths


def skipped_shards(out: Path, prompts: list[dict], per_shard: int) -> dict[str, int]:
    """{name: shard index} of the shards of `out` that write_shards skipped, their prompts all too
    long, for these very prompts: done, though not on disk."""
    rec = json.loads((out / "config.json").read_text()) if (out / "config.json").is_file() else {}
    index = {name: int(Path(name).stem.split("_")[1]) for name in rec.get("skipped") or {}}
    return {name: i for name, i in index.items()
            if rec["skipped"][name] == chunk_hash(prompts[i * per_shard:(i + 1) * per_shard])}


def _save_shard(path: Path, kept: list, results: list[dict], cfg: AnswerConfig) -> None:
    tokens = [torch.tensor(ids + r["answer"], dtype=torch.int32) for (_, _, ids), r in zip(kept, results)]
    hidden = []
    for t, r in zip(tokens, results):
        h = r["hidden"].to(torch.float16)
        hidden += [h, torch.zeros(len(t) - len(h), h.shape[1], dtype=torch.float16)]
    lens = torch.tensor([len(t) for t in tokens])
    shard = {"ids": [p.get("id", str(i)) for i, p, _ in kept],
             "tokens": torch.cat(tokens), "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]),
             "prompt_lens": torch.tensor([len(ids) for _, _, ids in kept]),
             "greedy": torch.tensor([is_greedy(cfg.seed, i, cfg.greedy_fraction) for i, _, _ in kept]),
             "finished": torch.tensor([r["finished"] for r in results]),
             "hidden": torch.cat(hidden)}
    tmp = path.with_suffix(".tmp")
    torch.save(shard, tmp)
    os.replace(tmp, path)


@torch.inference_mode()
def sequence_features(model, seqs: list[list[int]], prefill_tokens: int = 4096,
                      kv_cache_dtype: str = "auto") -> list[torch.Tensor]:
    """The final-norm features [len(s) - 1, D] of every token of each sequence but its last, fed
    teacher-forced: what `answer_batch` recorded while answering (specdec's runtime, over a KV
    cache of kv_cache_dtype (kv_cache_dtype_for), its C forward giving the same bits however a
    sequence is chunked), or a transformers causal LM's (right-padded batches of about
    `prefill_tokens` tokens)."""
    kv_dtype = kv_cache_dtype_for(model, kv_cache_dtype)
    out: list[torch.Tensor | None] = [None] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    groups, group, size = [], [], 0
    for i in order:
        n = len(seqs[i]) - 1
        if group and (size + n > prefill_tokens if isinstance(model, Transformer) else (len(group) + 1) * n > prefill_tokens):
            groups.append(group)
            group, size = [], 0
        group.append(i)
        size += n
    groups += [group] if group else []
    for group in groups:
        fed = [seqs[i][:-1] for i in group]
        if isinstance(model, Transformer):
            kv = _new_cache(model, len(group), max(map(len, fed)), kv_dtype)
            _, feats = _feed(model, kv, list(range(len(group))), fed, logits=False)
        else:
            L = max(map(len, fed))
            ids = torch.zeros(len(group), L, dtype=torch.long)
            mask = torch.zeros(len(group), L, dtype=torch.long)
            for j, f in enumerate(fed):
                ids[j, :len(f)], mask[j, :len(f)] = torch.tensor(f), 1
            h = model.model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                            use_cache=False).last_hidden_state
            feats = [h[j, :len(f)] for j, f in enumerate(fed)]
        for i, f in zip(group, feats):
            out[i] = f.float().cpu()
    return out


def check_features_folder(out: Path, paths: list[Path], target: dict | None, dtype: str,
                          log=lambda s: print(s, file=sys.stderr, flush=True), kv_cache_dtype: str = "auto") -> dict:
    """Before `train features` writes into `out`: the shards already there hold this target's
    features (at this dtype, over a KV cache of kv_cache_dtype: a resolved name, kv_cache_dtype_for;
    "auto", before the model is loaded, is not compared) of these very token shards (a RunMismatch
    naming what differs otherwise). Returns out/config.json's record as it is to be written: the
    answers folder's own record (its settings, the target that answered, kept as `answers_target`),
    with `target` the target whose features the shards now hold (what `train eagle / medusa`
    check), `features_dtype`, `features_kv_cache_dtype` and each shard's source
    (provenance.file_sample of the token shard)."""
    from .provenance import RunMismatch, check_run, file_sample, folder_record, same_target

    src_dir = paths[0].parent if paths else out
    src = folder_record(src_dir) or {}
    rec = folder_record(out)
    present = sorted(out.glob("shard_*.pt")) if out.is_dir() else []
    advice = "use another --out, or the --target / --dtype / --kv-cache-dtype / --data it was made with to go on"
    sources = {}
    now = {"target": target, "features_dtype": dtype,
           **({} if kv_cache_dtype == "auto" else {"features_kv_cache_dtype": kv_cache_dtype})}
    if present and rec is not None:
        check_run({k: v for k, v in rec.items() if k in now and v}, now, f"--out {out}: its features were",
                  {"target": "--target", "features_dtype": "--dtype", "features_kv_cache_dtype": "--kv-cache-dtype"},
                  advice, sep=" ")
        sources = dict(rec.get("sources") or {})
        if "features_kv_cache_dtype" not in rec and kv_cache_dtype != "auto":
            log(f"warning: --out {out}: its features were made before specdec recorded their KV cache (then the "
                f"model's dtype); new ones are computed over a {kv_cache_dtype} cache")
        for path in paths:
            want = sources.get(path.name)
            if want is not None and (out / path.name).is_file() and want != file_sample(path):
                raise RunMismatch(f"--out {out}: {path.name} holds the features of another {path.name} than "
                                  f"--data {src_dir}'s; {advice}")
    elif present:
        log(f"warning: --out {out}: no record of what its {len(present)} shards were made from; taken as this "
            "--target's features of --data's shards")
    answered_by = src.get("answers_target", src.get("target"))
    if target is not None and answered_by and not same_target(answered_by, target):
        log(f"warning: --data {src_dir}: answered by --target {answered_by['path']}; the features are "
            f"--target {target['path']}'s (heads learn the first's answers from the second's features)")
    return {**{k: v for k, v in src.items() if k not in ("target", "sources")}, "answers_target": answered_by or None,
            "target": target, "features_dtype": dtype, "features_kv_cache_dtype": kv_cache_dtype, "sources": sources}


def add_features(model, paths: list[Path], out: Path,
                 log=lambda s: print(s, file=sys.stderr, flush=True), target: dict | None = None,
                 dtype: str | None = None, kv_cache_dtype: str = "auto") -> list[Path]:
    """Answer shards without features (`scripts/gpu_heads.py collect` brings back tokens only)
    -> the same shards with the target's features (over a KV cache of kv_cache_dtype, as
    sequence_features), under `out` with the same names; present ones are kept (resumable).
    target: its provenance.target_fingerprint, recorded with dtype and the resolved KV cache
    dtype in out/config.json and checked on resume (check_features_folder)."""
    from .provenance import file_sample, write_record

    kv_cache_dtype = kv_cache_dtype_for(model, kv_cache_dtype)
    record = check_features_folder(out, paths, target, dtype, log, kv_cache_dtype)
    out.mkdir(parents=True, exist_ok=True)
    write_record(out / "config.json", record)
    written = []
    for path in paths:
        dst = out / path.name
        if not dst.is_file():
            t0 = time.perf_counter()
            shard = torch.load(path)
            offs = shard["offsets"].tolist()
            tokens = shard["tokens"]
            check_token_ids(tokens, model.config.vocab_size, path)
            seqs = [tokens[a:b].tolist() for a, b in zip(offs, offs[1:])]
            if min(map(len, seqs)) < 2:
                raise ValueError(f"{path}: a row with fewer than 2 tokens")
            hidden = []
            for f in sequence_features(model, seqs, kv_cache_dtype=kv_cache_dtype):
                hidden += [f.to(torch.float16), torch.zeros(1, f.shape[1], dtype=torch.float16)]
            shard["hidden"] = torch.cat(hidden)
            tmp = dst.with_suffix(".tmp")
            torch.save(shard, tmp)
            os.replace(tmp, dst)
            record["sources"][path.name] = file_sample(path)
            write_record(out / "config.json", record)
            log(f"{dst.name}: features of {len(seqs)} rows ({len(tokens)} tokens) in {time.perf_counter() - t0:.0f}s")
        written.append(dst)
    return written


def check_token_ids(tokens: torch.Tensor, vocab_size: int, where) -> None:
    """Every id inside the target's embedding table: the C forward reads past it unchecked (garbage
    features, or a segfault), as the engine's prompt check refuses."""
    bad = ((tokens < 0) | (tokens >= vocab_size)).nonzero()
    if len(bad):
        raise ValueError(f"{where}: token id {int(tokens[bad[0, 0]])} is outside --target's vocabulary [0, "
                         f"{vocab_size}): shards of another tokenizer's ids")


def load_answer_shards(paths: list[Path], hidden: bool = True) -> dict:
    """Concatenate shards: offsets become global, features are kept only if asked."""
    parts = [torch.load(p) for p in paths]
    out = {"ids": [i for p in parts for i in p["ids"]], "tokens": torch.cat([p["tokens"] for p in parts])}
    base, offs = 0, [torch.zeros(1, dtype=torch.long)]
    for p in parts:
        offs.append(p["offsets"][1:] + base)
        base += int(p["offsets"][-1])
    out["offsets"] = torch.cat(offs)
    for key in ("prompt_lens", "greedy", "finished"):
        out[key] = torch.cat([p[key] for p in parts])
    if hidden:
        out["hidden"] = torch.cat([p["hidden"] for p in parts])
    return out
