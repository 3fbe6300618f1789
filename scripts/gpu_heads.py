"""Drafter training data and an EAGLE head for SmolLM2 on a GPU, inside one device lease.

The CPU here answers ~20K chat prompts in ~10 core-hours (~150 answer tokens/s a core) and trains a
head on them in many more; a GPU does both in minutes. This driver runs
specdec's own pipeline (`specdec train answers`, `specdec train eagle`, both with --device
cuda) under a wall-clock budget, and leaves under --out what a 16 MiB-per-file transfer can
carry back: the head (split in parts), its training.json and card, the answers' tokens (no
features) and the logs.

    python scripts/gpu_heads.py smoke --out OUT             # CUDA paths on random models; times a training step
    python scripts/gpu_heads.py full --gguf F --prompts P --out OUT [--budget S --gen-s S]
    python scripts/gpu_heads.py collect --src FILES_AT --out models/X [--answers-out runs/answers]   # here, after

`smoke` writes /tmp/specdec_calib.json (seconds per training step at the full run's shapes),
which `full` reads to size its training to what is left of the budget.

On this workplace's device machine (H200, 15 minutes a session, 64 MiB of tree a call): make the
prompts (`specdec train prompts --out runs/chat2 --count 24000 --target GGUF --self-instruct 240`,
3 minutes here; or only those not answered yet), pack the answers made here (`pack --src
runs/chat2/answers_ab --out runs/chat2/packed`: 2.2M tokens in 1.9 MB), commit, run
`bash scripts/gpu_tree.sh PROMPTS --init models/smollm2-eagle --tokens runs/chat2/packed`, then two
calls back to back (the machine stays warm 30 s; the first leaves the GGUF's first part in its /tmp):

    carry [".gpu/smol.00", ".whl"], timeout_s 240:
      mkdir -p /tmp/keep && cp .gpu/smol.00 /tmp/keep/ && python3 -m pip install -q --no-index --no-deps
      --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1;
      python3 scripts/gpu_heads.py smoke --out $OUT       (or `speed`: smoke passed on 2026-12-04)
    carry [".gpu/smol.01", ".gpu/head", ".whl"], timeout_s 560:
      export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1; cat /tmp/keep/smol.00 .gpu/smol.01 > /tmp/smol.gguf &&
      echo "$(cat gpudata/gguf.sha)  /tmp/smol.gguf" | sha256sum -c - && gunzip -c gpudata/prompts.jsonl.gz
      > /tmp/p.jsonl && python3 scripts/gpu_heads.py full --gguf /tmp/smol.gguf --prompts /tmp/p.jsonl --out $OUT
      --budget 480 --gen-s 250 --init .gpu/head --lr 3e-4 --tokens gpudata/tokens --max-steps 4000

then `give_back` and `bash scripts/gpu_tree.sh --restore`. What comes back (at most 8 files of
16 MiB, 64 MiB in all) is the EAGLE head and the answers' tokens (`collect --answers-out`, then
`specdec train features` here: ~300 tokens/s on one AMD EPYC Zen 3 core, prefill-bound; on the GPU, seconds); a
vocabulary draft (`specdec train vocab-draft --device cuda`, 37.8 MB) would need a lease of its own.
The first lease (bench/gpu-h200/2026-12-04) answered ~2,300 answer tokens/s with transformers at
512 rows and its 2048 training answers alone overfit a fine-tune of 5300 steps: hence `--tokens`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
CALIB = Path("/tmp/specdec_calib.json")
# the full run's EAGLE settings (the bundled head's, with 8x the rows per step)
EAGLE = dict(batch=32, window=256, draft_vocab=8192, unroll=3, lr=1e-3, token_weight=1.0, noise=0.1)


def sh(cmd: list[str], log: Path, timeout: float | None = None) -> int:
    """Run a specdec command, its output teed to `log`; returns the exit status (124: timed out)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", "PYTHONUNBUFFERED": "1"}
    print("$", " ".join(cmd), flush=True)
    with open(log, "a") as f:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
        timer = threading.Timer(timeout, p.terminate) if timeout is not None else None
        if timer:
            timer.start()
        try:
            for line in p.stdout:
                f.write(line)
                if "Warning" not in line:
                    print(line, end="", flush=True)
            rc = p.wait(timeout=30)
            return 124 if timer and not timer.is_alive() and rc != 0 else rc
        finally:
            if timer:
                timer.cancel()
            if p.poll() is None:
                p.kill()


def eagle_args(target: str, data: str, out: str, work: str, steps: int, device: str = "cuda", **over) -> list[str]:
    e = {**EAGLE, **over}
    return [sys.executable, "-m", "specdec", "train", "eagle", "--target", target, "--data", data, "--data-kind", "chat",
            "--val-shards", "1", "--draft-vocab", str(e["draft_vocab"]), "--window", str(e["window"]),
            "--batch", str(e["batch"]), "--lr", str(e["lr"]), "--soft-labels", "--prompt-loss",
            "--token-weight", str(e["token_weight"]), "--noise", str(e["noise"]), "--unroll", str(e["unroll"]),
            "--precision", "bf16", "--steps", str(steps), "--eval-every", str(max(50, steps // 10 // 50 * 50)),
            "--report-prompts", "0", "--out", out, "--work", work, "--device", device,
            *(["--init", e["init"]] if e.get("init") else [])]


def fake_shards(folder: Path, n_shards: int, rows: int, length: int, vocab: int, dim: int) -> None:
    """Answer shards of random tokens and features (answers.py's layout): a training step's cost
    depends on the shapes alone."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    for s in range(n_shards):
        tokens = torch.randint(0, vocab, (rows * length,), generator=g, dtype=torch.int32)
        torch.save({"ids": [f"{s}-{i}" for i in range(rows)], "tokens": tokens,
                    "offsets": torch.arange(rows + 1) * length, "prompt_lens": torch.full((rows,), length // 4),
                    "greedy": torch.arange(rows) % 2 == 0, "finished": torch.ones(rows, dtype=torch.bool),
                    "hidden": torch.randn(rows * length, dim, generator=g).half()}, folder / f"shard_{s:05d}.pt")


def random_llama(folder: Path, vocab: int, hidden: int, layers: int, heads: int, kv: int, inter: int) -> None:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                                   head_dim=hidden // heads, tie_word_embeddings=True, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)


def smoke(args) -> int:
    out, work = Path(args.out), Path("/tmp/smoke")
    quick = args.device == "cpu"          # a local check of this script: small shapes, few steps
    shutil.rmtree(work, ignore_errors=True)     # a head left there would be resumed, not timed
    work.mkdir(parents=True)
    print(torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU", flush=True)
    # 1. answers on CUDA: a random model with the toy pair's tokenizer (its chat template too)
    toy = work / "toy"
    random_llama(toy, 16384, 128, 2, 4, 2, 256)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (toy / f).write_bytes((ROOT / "models/target" / f).read_bytes())
    prompts = work / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": f"Question {i}: say something about {i * 7}."}) + "\n"
                               for i in range(24)))
    rc = sh([sys.executable, "-m", "specdec", "train", "answers", "--target", str(toy), "--prompts", str(prompts),
             "--out", str(work / "ans"), "--max-new-tokens", "16", "--batch", "12", "--per-shard", "12",
             "--dtype", "float32", "--device", args.device], out / "smoke.log")
    print("answers rc", rc, flush=True)
    engine = engine_check(toy, work, args.device)
    # 2. an EAGLE head at the full run's shapes (SmolLM2's layer, 8192 draft rows) on random data
    shaped = work / "shaped"
    random_llama(shaped, 49152, 576, 1, 9, 3, 1536)
    fake_shards(work / "fake", 3, 16 if quick else 256, 512, 49152, 576)
    steps = 4 if quick else 150
    t0 = time.time()
    cmd = eagle_args(str(shaped), str(work / "fake"), str(work / "head"), str(work / "hw"), steps, args.device,
                     **({"batch": 2} if quick else {}))
    rc2 = sh(cmd, out / "smoke.log")
    wall = time.time() - t0
    hist = json.loads((work / "head/training.json").read_text()) if rc2 == 0 else None
    per_step = None
    if hist:
        per_step = hist["result"]["wall_time_s"] / steps
        CALIB.write_text(json.dumps({"s_per_step": per_step, "wall_s": wall}))
    print(json.dumps({"answers_rc": rc, "eagle_rc": rc2, "s_per_step": per_step, "eagle_wall_s": round(wall, 1),
                      "engine": engine}), flush=True)
    return rc or rc2 or int(not engine.get("ok"))


def engine_check(target: Path, work: Path, device: str) -> dict:
    """The serving engine on `device`: greedy output of each speculative method equals plain
    decoding there (a one-layer random draft with the target's vocabulary)."""
    sys.path.insert(0, str(ROOT))
    from specdec import LLM, SamplingParams

    draft = work / "draft"
    random_llama(draft, 16384, 128, 1, 4, 2, 256)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (draft / f).write_bytes((target / f).read_bytes())
    prompts = [{"prompt_token_ids": [5 + i, 9, 17, 9, 17, 9, 300 + i]} for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    result = {}
    try:
        from specdec.model import load_model
        from specdec.model.heads import save_heads
        from specdec.train.heads import HeadsConfig, build_heads

        dense = load_model(target, "float32")
        vocab = torch.arange(0, dense.config.vocab_size, 4)      # random heads: drafts rarely accepted, still lossless
        for kind in ("eagle", "medusa"):
            save_heads(build_heads(HeadsConfig(kind=kind, num_heads=2), dense, vocab), work / kind)
        base = LLM(str(target), dtype="float32", device=device, enable_prefix_caching=False)
        plain = [o.outputs[0].token_ids for o in base.generate(prompts, greedy)]
        solo = [base.generate(p, greedy)[0].outputs[0].token_ids for p in prompts]
        sampled = SamplingParams(temperature=0.8, max_tokens=24, seed=7, ignore_eos=True)
        result["plain"] = {"batch_equals_solo": solo == plain,
                           "seeded_repeats": base.generate(prompts[0], sampled)[0].outputs[0].token_ids
                           == base.generate(prompts[0], sampled)[0].outputs[0].token_ids}
        for name, spec in (("ngram", {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}),
                           ("suffix", {"method": "suffix", "num_speculative_tokens": 3}),
                           ("draft_model", {"model": str(draft), "num_speculative_tokens": 3}),
                           ("eagle", {"method": "eagle", "model": str(work / "eagle"), "num_speculative_tokens": 3}),
                           ("eagle_tree", {"method": "eagle", "model": str(work / "eagle"), "num_speculative_tokens": 4,
                                           "topk": 2}),
                           ("medusa", {"method": "medusa", "model": str(work / "medusa"), "num_speculative_tokens": 3})):
            try:
                llm = LLM(str(target), dtype="float32", device=device, speculative_config=spec, enable_prefix_caching=False)
                outs = llm.generate(prompts, greedy)
                result[name] = {"identical": [o.outputs[0].token_ids for o in outs] == plain,
                                "draft_tokens": sum(o.stats.draft_tokens for o in outs)}
            except Exception as e:   # one method's failure is reported beside the others
                result[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        result["ok"] = all(v.get("identical", True) and "error" not in v for v in result.values()) and \
            all(result["plain"].values())
    except Exception as e:           # reported, so the lease's other checks still run
        import traceback

        traceback.print_exc()
        result["error"] = f"{type(e).__name__}: {e}"
    print("engine", json.dumps(result), flush=True)
    return result


def speed(args) -> int:
    """Answer tokens/s of `train answers`' two backends on a random model of SmolLM2-135M's shape
    (no GGUF needed: one call), by rows decoded together; and where transformers' step time goes."""
    sys.path.insert(0, str(ROOT))
    import transformers

    from specdec.model import load_model
    from specdec.train.answers import AnswerConfig, answer_batch, answer_batch_hf

    quick = args.device == "cpu"
    work = Path("/tmp/speed")
    shutil.rmtree(work, ignore_errors=True)
    shape = (512, 64, 2, 4, 2, 128) if quick else (49152, 576, 30, 9, 3, 1536)
    random_llama(work, *shape)
    dev = torch.device(args.device)
    hf = transformers.AutoModelForCausalLM.from_pretrained(work, dtype=torch.float32).to(dev).eval()
    ours = load_model(work, "float32", args.device)
    new = 8 if quick else 64
    cfg = AnswerConfig(max_new_tokens=new)
    rng = np.random.default_rng(0)
    results = []
    from specdec.model import batch as batch_module

    # specdec's attention on a GPU: padded (the default there), and token by token (the CPU's) at 64 rows
    for backend, rows in (("transformers", 64), ("transformers", 512), ("transformers", 2048), ("specdec", 64),
                          ("specdec", 512), ("specdec", 2048), ("specdec per-token", 64)):
        rows = rows // 32 if quick else rows
        batch_module.PADDED = None if backend == "specdec" else False
        prompts = [rng.integers(2, shape[0], int(n)).tolist() for n in rng.integers(50, 300, rows)]
        greedy = [i % 2 == 0 for i in range(rows)]
        run, model = (answer_batch_hf, hf) if backend == "transformers" else (answer_batch, ours)
        if backend == "specdec per-token" and dev.type == "cpu":
            continue
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            out = run(model, prompts, greedy, cfg, set(), torch.Generator(device=dev).manual_seed(0))
            if dev.type == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            tokens = sum(len(o["answer"]) for o in out)
            results.append({"backend": backend, "rows": rows, "answer_tokens": tokens, "s": round(wall, 2),
                            "tok_per_s": round(tokens / wall), "ms_per_step": round(1000 * wall / new, 1)})
        except Exception as e:      # one backend's failure is reported beside the others
            results.append({"backend": backend, "rows": rows, "error": f"{type(e).__name__}: {e}"[:300]})
        print(json.dumps(results[-1]), flush=True)
    rows = 16 if quick else 512
    prompts = [rng.integers(2, shape[0], int(n)).tolist() for n in rng.integers(50, 300, rows)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])) as prof:
        answer_batch_hf(hf, prompts, [True] * rows, AnswerConfig(max_new_tokens=16), set(),
                        torch.Generator(device=dev).manual_seed(0))
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    if dev.type == "cuda":
        table += "\n" + prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12)
    (Path(args.out) / "speed_profile.txt").write_text(table)
    print(table[-3000:], flush=True)
    (Path(args.out) / "speed.json").write_text(json.dumps({"device": torch.cuda.get_device_name(0) if dev.type == "cuda"
                                                           else "cpu", "max_new_tokens": new, "results": results},
                                                          indent=1) + "\n")
    return 0


def dump_tokens(ans: Path, out: Path) -> dict:
    """The answers' tokens without features (uint16: SmolLM2's 49152 ids fit), for the suffix datastore."""
    paths = sorted(ans.glob("shard_*.pt"))
    parts = [torch.load(p, mmap=True) for p in paths]        # mapped: the features are never read
    lens = torch.cat([p["offsets"].diff() for p in parts])
    d = {"ids": [i for p in parts for i in p["ids"]], "tokens": torch.cat([p["tokens"] for p in parts]),
         "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]),
         **{k: torch.cat([p[k] for p in parts]) for k in ("prompt_lens", "greedy", "finished")}}
    offs, n = d["offsets"].numpy(), len(d["ids"])
    for part, (a, b) in enumerate(((0, n // 2), (n // 2, n))):      # two files: each under the 16 MiB a file
        np.savez_compressed(out / f"answers_tokens{part}.npz",
                            tokens=d["tokens"][offs[a]:offs[b]].numpy().astype(np.uint16), offsets=offs[a:b + 1] - offs[a],
                            prompt_lens=d["prompt_lens"][a:b].numpy(), greedy=d["greedy"][a:b].numpy(),
                            finished=d["finished"][a:b].numpy(), ids=np.array(d["ids"][a:b]))
    return {"shards": len(paths), "answers": len(d["ids"]), "tokens": int(len(d["tokens"])),
            "answer_tokens": int(len(d["tokens"]) - d["prompt_lens"].sum())}


def full(args) -> int:
    t_start = time.time()
    out = Path(args.out)
    ans, head, work = Path(args.work_dir) / "ans", Path(args.work_dir) / "head", Path(args.work_dir) / "head_work"
    log = out / "full.log"
    # 1. the target's answers, until the generation budget runs out (shards are written whole)
    answers = [sys.executable, "-m", "specdec", "train", "answers", "--target", args.gguf, "--prompts", args.prompts,
               "--out", str(ans), "--max-new-tokens", "256", "--batch", str(args.rows), "--per-shard", str(args.rows),
               "--dtype", "float32", "--device", args.device]
    rc = sh(answers, log, timeout=args.gen_s)
    left = args.gen_s - (time.time() - t_start)
    if rc not in (0, 124) and left > 30:       # transformers failed there: specdec's own runtime instead
        print(f"answers through transformers failed (rc {rc}); --backend specdec for the {left:.0f} s left", flush=True)
        rc = sh([*answers, "--backend", "specdec"], log, timeout=left)
    for tmp in ans.glob("*.tmp"):
        tmp.unlink()
    shards = len(list(ans.glob("shard_*.pt")))
    if shards < 2:                             # a validation shard and at least one to train on
        info = {"shards": shards, "answers_rc": rc, "error": "too few answer shards to train on"}
        (out / "info.json").write_text(json.dumps(info, indent=1) + "\n")
        print(json.dumps(info), flush=True)
        return 1
    info = dump_tokens(ans, out)
    info["generation_s"] = round(time.time() - t_start, 1)
    if args.tokens:                            # answers made elsewhere: their features here, then trained on too
        extra = Path(args.work_dir) / "tokens"
        n = npz_to_shards(sorted(Path(args.tokens).glob("*.npz")), extra, first=90000)
        rc_f = sh([sys.executable, "-m", "specdec", "train", "features", "--target", args.gguf, "--data", str(extra),
                   "--out", str(ans), "--dtype", "float32", "--device", args.device], log)
        info.update(extra_shards=n, features_rc=rc_f, features_s=round(time.time() - t_start - info["generation_s"], 1))
    print(json.dumps(info), flush=True)
    # 2. the head: as many steps as the rest of the budget holds (data loading and evaluation kept aside)
    calib = json.loads(CALIB.read_text()) if CALIB.is_file() else {"s_per_step": 0.05}
    def steps_left() -> int:        # as many steps as the rest of the budget holds, in hundreds
        left = args.budget - (time.time() - t_start) - args.reserve_s
        return int(max(args.min_steps, min(args.max_steps, left / calib["s_per_step"] // 100 * 100)))

    steps = steps_left()
    info.update(steps=steps, s_per_step_calibrated=calib["s_per_step"])
    print(json.dumps(info), flush=True)
    over = {**({"batch": args.batch} if args.batch else {}), **({"lr": args.lr} if args.lr else {})}
    rc = sh(eagle_args(args.gguf, str(ans), str(head), str(work), steps, args.device, init=args.init, **over), log)
    if rc != 0 and args.init and args.budget - (time.time() - t_start) > 120:     # the fine-tune failed early: from scratch
        info["init_failed_rc"] = rc
        print(f"--init {args.init} failed (rc {rc}): a head from scratch instead", flush=True)
        steps = info["steps"] = steps_left()
        rc = sh(eagle_args(args.gguf, str(ans), str(head), str(work) + "_scratch", steps, args.device,
                           **({"batch": args.batch} if args.batch else {})), log)
    info["init"] = args.init if "init_failed_rc" not in info else None
    info["eagle_rc"], info["total_s"] = rc, round(time.time() - t_start, 1)
    if (head / "model.safetensors").is_file():
        blob = (head / "model.safetensors").read_bytes()
        half = len(blob) // 2 + 1
        (out / "head.safetensors.part0").write_bytes(blob[:half])
        (out / "head.safetensors.part1").write_bytes(blob[half:])
        (out / "head_training.json").write_bytes((head / "training.json").read_bytes())
        info["head_config"] = json.loads((head / "config.json").read_text())
    (out / "info.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps(info), flush=True)
    return rc


def collect(args) -> int:
    """Here, after a lease: the files that came back -> a head folder (model.safetensors, config.json,
    training.json, the card) and, with --answers-out, the answers' tokens as answer shards without
    features (what `specdec train suffix` indexes)."""
    sys.path.insert(0, str(ROOT))
    from specdec.train.headreport import card
    from specdec.train.heads import HeadsConfig

    src, out = Path(args.src), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = json.loads((src / "info.json").read_text())
    (out / "model.safetensors").write_bytes(b"".join((src / f"head.safetensors.part{i}").read_bytes() for i in (0, 1)))
    (out / "config.json").write_text(json.dumps(info["head_config"], indent=2) + "\n")
    training = json.loads((src / "head_training.json").read_text())
    (out / "training.json").write_text(json.dumps(training, indent=1) + "\n")
    cfg = HeadsConfig(**training["config"])
    (out / "README.md").write_text(card(out, Path(args.target_name), cfg, training["result"], training["commands"]))
    print(f"wrote {out}")
    if args.answers_out:
        n = npz_to_shards(sorted(src.glob("answers_tokens*.npz")), Path(args.answers_out))
        print(f"wrote {args.answers_out} ({n} shards, no features: `specdec train features` adds them)")
    return 0


def npz_to_shards(files: list[Path], out: Path, first: int = 0) -> int:
    """dump_tokens' files -> answer shards without features, shard_{first + i}.pt."""
    out.mkdir(parents=True, exist_ok=True)
    for i, f in enumerate(files):
        z = np.load(f)
        torch.save({"ids": [str(x) for x in z["ids"]], "tokens": torch.from_numpy(z["tokens"].astype(np.int32)),
                    "offsets": torch.from_numpy(z["offsets"].astype(np.int64)),
                    "prompt_lens": torch.from_numpy(z["prompt_lens"]), "greedy": torch.from_numpy(z["greedy"]),
                    "finished": torch.from_numpy(z["finished"])}, out / f"shard_{first + i:05d}.pt")
    return len(files)


def pack(args) -> int:
    """Here, before a lease: answer shards (with or without features) -> their tokens as .npz files
    (a few MB), for `full --tokens` to train on beside the answers made there."""
    info = dump_tokens(Path(args.src), Path(args.out))
    print(json.dumps(info))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("smoke", "full", "collect", "speed", "pack"))
    p.add_argument("--out", required=True)
    p.add_argument("--src", help="collect: the folder the lease's files came back to; pack: an answers folder")
    p.add_argument("--tokens", help="full: a folder of `pack`'s .npz files, answers made elsewhere to train on too")
    p.add_argument("--target-name", default="SmolLM2-135M-Instruct (Q4_1 GGUF)", help="collect: for the card")
    p.add_argument("--answers-out", help="collect: write the answers' tokens here as shards")
    p.add_argument("--gguf")
    p.add_argument("--prompts")
    p.add_argument("--rows", type=int, default=512, help="rows answered together (and prompts per shard)")
    p.add_argument("--gen-s", type=float, default=240, help="seconds of answering")
    p.add_argument("--budget", type=float, default=545, help="seconds for the whole run")
    p.add_argument("--reserve-s", type=float, default=75, help="seconds kept for loading data and evaluating")
    p.add_argument("--max-steps", type=int, default=30000)
    p.add_argument("--min-steps", type=int, default=500)
    p.add_argument("--work-dir", default="/tmp", help="full: where the answers, the head and its checkpoints go")
    p.add_argument("--batch", type=int, help=f"EAGLE rows per step (default {EAGLE['batch']})")
    p.add_argument("--init", help="full: fine-tune these trained heads (`train eagle --init`); from scratch if that fails")
    p.add_argument("--lr", type=float, help=f"full: the head's learning rate (default {EAGLE['lr']})")
    p.add_argument("--device", default="cuda", help="cpu: a quick local check of the script")
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    return {"smoke": smoke, "full": full, "collect": collect, "speed": speed, "pack": pack}[args.what](args)


if __name__ == "__main__":
    sys.exit(main())
