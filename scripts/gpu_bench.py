"""specdec on a GPU, inside one device lease: the CUDA paths' checks, plain decoding's scaling with
the batch, and speculation on the real model (SmolLM2-135M-Instruct's Q4_1 GGUF, dequantized there).

    python scripts/gpu_bench.py check --out OUT [--budget S]      # no GGUF: random models
    python scripts/gpu_bench.py real --gguf F --eagle HEAD --out OUT [--budget S]

`check` (one call, the GGUF's first part only on the machine):
  1. the serving engine's greedy output of each speculative method equals plain decoding there, a
     batch equals its rows alone, seeded sampling repeats (gpu_heads.engine_check, random models);
  2. plain decoding by concurrency (1 .. 256 greedy streams, ignore_eos) on a random model of
     SmolLM2-135M's shape: output tokens/s of the batch engine, padded attention (the GPU's default),
     the same with CUDA graphs (`compilation_config` FULL_DECODE_ONLY: captures counted, outputs
     compared with the eager ones) and token by token; transformers' generate at batch 1 and 64 on
     the same weights beside it.
`real` (the next call, the whole GGUF): Spec-Bench through `specdec bench` (greedy, one question a
category, plain / suffix / ngram / EAGLE chain and tree / transformers' generate and prompt lookup,
greedy output compared with plain's), then the batch engine on Spec-Bench prompts at concurrency
1, 16 and 64: plain against speculative ("auto" K), each with and without CUDA graphs of the
target's forwards, output tokens/s and each request's greedy output against plain's.

Everything is float32 (TF32 off, PyTorch's default): the greedy comparisons then test the method,
not bf16 rounding. What comes back: $OUT/all.tar.gz (every file and log) beside the main JSON and
results.md files (a device call returns at most 8 files); a table last on stdout.

One lease (15 minutes; 64 MiB of tree a call, so the GGUF travels in two parts, one a call, the
machine kept warm between them): `bash scripts/gpu_tree.sh - --init models/smollm2-eagle`, then

    carry [".gpu/smol.00", ".whl"], timeout_s 300:
      mkdir -p /tmp/keep && cp .gpu/smol.00 /tmp/keep/ && python3 -m pip install -q --no-index --no-deps
      --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1;
      python3 scripts/gpu_bench.py check --out $OUT --budget 150
    carry [".gpu/smol.01", ".gpu/head", ".whl"], timeout_s 480:
      export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1; cat /tmp/keep/smol.00 .gpu/smol.01 > /tmp/smol.gguf &&
      echo "$(cat gpudata/gguf.sha)  /tmp/smol.gguf" | sha256sum -c - && python3 scripts/gpu_bench.py real
      --gguf /tmp/smol.gguf --eagle .gpu/head --out $OUT --budget 380 --bench-s 220

The second call must start within 30 s of the first's end (the machine goes back when idle, and
with it /tmp/keep: on 2026-12-05 a third call found a fresh machine). `real` ends with
scripts/gpu_profile.py (a batch-1 step by part) in what is left of --budget + --profile-s.
Then `give_back` and `bash scripts/gpu_tree.sh --restore`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


# the target's decoding forwards as CUDA graphs (specdec/model/graphs.py; off by default)
GRAPHS = {"cudagraph_mode": "FULL_DECODE_ONLY"}


def failed(variant: str, e: Exception) -> dict:
    """A variant's row when it raised: the error, printed, and its traceback kept for the JSON."""
    import traceback

    row = {"variant": variant, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
    return row


def table(rows: list[dict], columns: dict[str, str]) -> None:
    """A markdown table of rows (header -> key); a failed variant's row shows its error."""
    print("\n| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
    for r in rows:
        cells = [r["variant"], f"error: {r['error'][:120]}"] + [""] * (len(columns) - 2) if "error" in r else \
            [str(r[k]) for k in columns.values()]
        print("| " + " | ".join(cells) + " |")


def device_info() -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1))
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def plain_scaling(args, out: Path, deadline: float) -> list[dict]:
    """Output tokens/s of plain greedy decoding by concurrency on a random SmolLM2-shaped model:
    specdec's batch engine (padded attention, and token by token) and transformers' generate."""
    import transformers
    from gpu_heads import random_llama

    from specdec import LLM, SamplingParams
    from specdec.model import batch as batch_module

    quick = args.device == "cpu"
    work = Path("/tmp/gpu_bench_shape")
    shape = (2048, 64, 2, 4, 2, 128) if quick else (49152, 576, 30, 9, 3, 1536)
    random_llama(work, *shape)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if not (work / f).exists() and (ROOT / "models/target" / f).exists():
            (work / f).write_bytes((ROOT / "models/target" / f).read_bytes())
    new = 16 if quick else 128
    rng = random.Random(0)
    prompts = [[rng.randrange(2, shape[0]) for _ in range(rng.randrange(128, 256))] for _ in range(256)]
    rows, eager = [], {}
    concurrencies = (1, 4) if quick else (1, 4, 16, 64, 256)
    for attention in ("padded", "graphs", "per-token"):
        try:
            batch_module.PADDED = False if attention == "per-token" else None
            llm = LLM(str(work), dtype="float32", device=args.device, max_num_seqs=max(concurrencies),
                      max_num_batched_tokens=8192, num_speculative_tokens=0,
                      compilation_config=GRAPHS if attention == "graphs" else None, enable_prefix_caching=False)
            greedy = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
            llm.generate([{"prompt_token_ids": prompts[0][:32]}], SamplingParams(temperature=0, max_tokens=4))   # warm-up
            for c in concurrencies:
                if time.time() > deadline or (attention == "per-token" and c > 16):
                    continue
                batch = [{"prompt_token_ids": p} for p in prompts[:c]]
                sync(args.device)
                t0 = time.perf_counter()
                outs = llm.generate(batch, greedy)
                sync(args.device)
                wall = time.perf_counter() - t0
                toks = sum(len(o.outputs[0].token_ids) for o in outs)
                ttft = max(o.stats.time_to_first_token_s for o in outs)
                ids = [list(o.outputs[0].token_ids) for o in outs]
                if attention == "padded":
                    eager[c] = ids
                row = {"engine": f"specdec ({attention})", "concurrency": c, "output_tokens": toks, "s": round(wall, 3),
                       "tok_per_s": round(toks / wall, 1),
                       "decode_tok_per_s": round((toks - c) / max(wall - ttft, 1e-9), 1),
                       "ms_per_step": round(1000 * (wall - ttft) / (new - 1), 2)}
                if attention == "graphs":       # captures happen inside the timed run (a bucket's first use)
                    row["graphs"] = dict(llm.engine.graphs.stats)
                    row["identical_to_eager"] = f"{sum(a == b for a, b in zip(ids, eager.get(c, [])))}/{c}"
                rows.append(row)
                print(json.dumps(row), flush=True)
            del llm
        except Exception as e:      # one variant failing (a first run of CUDA graphs) must not lose the rest
            rows.append(failed(attention, e))
    batch_module.PADDED = None
    dev = torch.device(args.device)
    hf = transformers.AutoModelForCausalLM.from_pretrained(work, dtype=torch.float32).to(dev).eval()
    for c in (1, 64) if not quick else (1, 4):
        if time.time() > deadline:
            break
        ids = [torch.tensor(p[:128]) for p in prompts[:c]]      # equal lengths (all >= 128): no padding to mask
        x = torch.stack(ids).to(dev)
        hf.generate(x[:, :16], attention_mask=torch.ones_like(x[:, :16]), max_new_tokens=4, do_sample=False)        # warm-up
        sync(args.device)
        t0 = time.perf_counter()
        y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new, do_sample=False)
        sync(args.device)
        wall = time.perf_counter() - t0
        toks = (y.shape[1] - x.shape[1]) * c
        row = {"engine": "transformers generate", "concurrency": c, "output_tokens": toks, "s": round(wall, 3),
               "tok_per_s": round(toks / wall, 1), "ms_per_step": round(1000 * wall / new, 2)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    (out / "plain_scaling.json").write_text(json.dumps({"device": device_info(), "max_new_tokens": new,
                                                        "rows": rows}, indent=1) + "\n")
    return rows


def check(args) -> int:
    from gpu_heads import engine_check

    out = Path(args.out)
    t0 = time.time()
    print(json.dumps(device_info()), flush=True)
    work = Path("/tmp/gpu_bench_check")
    work.mkdir(parents=True, exist_ok=True)
    from gpu_heads import random_llama

    toy = work / "toy"
    random_llama(toy, 16384, 128, 2, 4, 2, 256)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (toy / f).write_bytes((ROOT / "models/target" / f).read_bytes())
    engine = engine_check(toy, work, args.device)
    (out / "engine_check.json").write_text(json.dumps(engine, indent=1) + "\n")
    rows = plain_scaling(args, out, t0 + args.budget)
    table(rows, {"engine": "engine", "concurrency": "concurrency", "output tok/s": "tok_per_s", "ms a step": "ms_per_step"})
    print(f"engine check ok: {engine.get('ok')}  ({time.time() - t0:.0f} s)")
    return 0 if engine.get("ok") else 1


def spec_bench(args, out: Path, name: str, methods: str, ks: str, timeout: float) -> int:
    """`specdec bench` on Spec-Bench, one question a category, greedy (a subprocess, time-limited)."""
    cmd = [sys.executable, "-m", "specdec", "bench", "--model", args.gguf, "--device", args.device,
           "--dtype", "float32", "--methods", methods, "--num-speculative-tokens", ks, "--temperature", "0",
           "--prompts", "spec-bench", "--limit-per-category", str(args.per_category), "--max-tokens", "128",
           "--repeats", "1", "--seed", "0", "--speculative-config", json.dumps({"eagle": {"model": args.eagle, "topk": 4}}),
           "--out", str(out / name)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", "PYTHONUNBUFFERED": "1"}
    print("$", " ".join(cmd), flush=True)
    with open(out / f"{name}.log", "w") as log:
        try:
            return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return 124


def batch_spec(args, out: Path, deadline: float) -> list[dict]:
    """The batch engine on Spec-Bench prompts: plain against speculative methods by concurrency,
    output tokens/s, acceptance, and each request's greedy output against plain's."""
    from specdec import LLM, SamplingParams
    from specdec.bench.spec_bench import chat_prompt, read_questions

    quick = args.device == "cpu"
    suffix = {"method": "suffix", "num_speculative_tokens": "auto"}
    eagle = {"method": "eagle", "model": args.eagle, "num_speculative_tokens": "auto"}
    methods = {"plain": None, "plain graphs": None, "suffix auto graphs": suffix, "eagle auto graphs": eagle,
               "eagle 2 graphs": {**eagle, "num_speculative_tokens": 2},
               "suffix auto": suffix, "eagle auto": eagle,
               "eagle tree 8": {"method": "eagle", "model": args.eagle, "num_speculative_tokens": 8, "topk": 4}}
    concurrencies = (1, 4) if quick else (1, 16, 64)
    new = 16 if quick else 128
    rows, reference = [], {}
    for name, spec in methods.items():
        try:
            if time.time() > deadline:
                break
            llm = LLM(args.gguf, dtype="float32", device=args.device, max_num_seqs=max(concurrencies),
                      speculative_config=spec, num_speculative_tokens=0 if spec is None else None,
                      compilation_config=GRAPHS if name.endswith("graphs") else None, enable_prefix_caching=False)
            qs = read_questions()
            random.Random(0).shuffle(qs)
            prompts = [p for p in (chat_prompt(llm.tokenizer, q["prompt"]) for q in qs) if len(p) <= 1024]
            greedy = SamplingParams(temperature=0, max_tokens=new)
            llm.generate([{"prompt_token_ids": prompts[-1]}], SamplingParams(temperature=0, max_tokens=8))   # warm-up
            for c in concurrencies:
                if time.time() > deadline:
                    break
                n = 4 if c == 1 else c
                batch = prompts[:n]
                sync(args.device)
                t0 = time.perf_counter()
                outs = closed_loop(llm, batch, greedy, c)
                sync(args.device)
                wall = time.perf_counter() - t0
                toks = [list(o) for o in outs["tokens"]]
                key = (c, n)
                if name == "plain":
                    reference[key] = toks
                same = sum(a == b for a, b in zip(toks, reference.get(key, [])))
                row = {"method": name, "concurrency": c, "requests": n, "output_tokens": sum(map(len, toks)),
                       "s": round(wall, 3), "tok_per_s": round(sum(map(len, toks)) / wall, 1),
                       "identical_to_plain": f"{same}/{n}" if key in reference else None,
                       "draft_tokens": outs["draft"], "accepted_tokens": outs["accepted"],
                       "tau": round(sum(map(len, toks)) / max(outs["passes"], 1), 3)}
                if llm.engine.graphs is not None:
                    row["graphs"] = dict(llm.engine.graphs.stats)
                rows.append(row)
                print(json.dumps(row), flush=True)
            del llm
        except Exception as e:      # one variant failing (a first run of CUDA graphs) must not lose the rest
            rows.append(failed(name, e))
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    (out / "batch_spec.json").write_text(json.dumps({"device": device_info(), "max_tokens": new, "rows": rows},
                                                    indent=1) + "\n")
    return rows


def closed_loop(llm, prompts: list[list[int]], params, concurrency: int) -> dict:
    """At most `concurrency` requests in the engine at once (a closed loop, as `bench serve
    --max-concurrency`); returns each request's tokens in order, the speculation counters and
    the wall time (scripts/auto_concurrency.py uses it too)."""
    engine = llm.engine
    pending, running, done = list(enumerate(prompts)), {}, {}
    draft = accepted = passes = 0
    t0 = time.perf_counter()
    while pending or running:
        while pending and len(running) < concurrency:
            i, p = pending.pop(0)
            running[i] = engine.add_request(p, params)
        engine.step()
        for i, r in list(running.items()):
            if r.finished:
                done[i] = list(r.out)
                draft, accepted = draft + r.stats.draft_tokens, accepted + r.stats.accepted_tokens
                passes += r.stats.target_forward_passes
                del running[i]
    return {"tokens": [done[i] for i in range(len(prompts))], "draft": draft, "accepted": accepted, "passes": passes,
            "wall_s": time.perf_counter() - t0}


def real(args) -> int:
    out = Path(args.out)
    t0 = time.time()
    print(json.dumps(device_info()), flush=True)
    # specdec's methods first (an EAGLE tree of 4 and 8 nodes: "topk": 4), then transformers' generate
    # (on 2026-12-05's H100 the first, with K = 4 and 8, did not finish in 133 s: speculative runs took ~2 s a prompt)
    runs = (("spec_bench", "plain,suffix,eagle", "4", 0.6), ("spec_bench_hf", "plain,hf_plain,hf_prompt_lookup", "4", 0.4))
    rcs = {}
    for name, methods, ks, share in runs:
        rcs[name] = spec_bench(args, out, name, methods, ks, timeout=share * args.bench_s)
        print(f"{name} rc {rcs[name]} ({time.time() - t0:.0f} s)", flush=True)
    rows = batch_spec(args, out, t0 + args.budget)
    left = args.budget + args.profile_s - (time.time() - t0)
    if left > 30:               # where a batch-1 step's time goes (scripts/gpu_profile.py), in what is left
        env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", "PYTHONUNBUFFERED": "1"}
        with open(out / "profile.log", "w") as log:
            try:
                subprocess.run([sys.executable, str(ROOT / "scripts/gpu_profile.py"), args.gguf, args.eagle, str(out),
                                args.device], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, timeout=left)
            except subprocess.TimeoutExpired:
                pass
        prof = out / "profile.json"
        if prof.is_file():
            print(prof.read_text())
    for name, *_ in runs:
        log = out / f"{name}.log"
        if rcs[name] != 0 and log.is_file():
            print(log.read_text()[-2000:])
        elif log.is_file():     # the console summary: one line a method
            print("\n".join(ln for ln in log.read_text().splitlines() if "tok/s" in ln and "roofline" not in ln[:9]))
    rc = max(rcs.values())
    table(rows, {"method": "method", "concurrency": "concurrency", "output tok/s": "tok_per_s",
                 "identical to plain": "identical_to_plain", "tau": "tau"})
    print(f"({time.time() - t0:.0f} s)")
    return rc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("check", "real"))
    p.add_argument("--out", required=True)
    p.add_argument("--gguf")
    p.add_argument("--eagle", help="real: the EAGLE head folder (models/smollm2-eagle)")
    p.add_argument("--budget", type=float, default=150, help="seconds for the whole run (parts past it are skipped)")
    p.add_argument("--bench-s", type=float, default=240, help="real: seconds for the Spec-Bench run")
    p.add_argument("--per-category", type=int, default=1, help="real: Spec-Bench questions a category")
    p.add_argument("--profile-s", type=float, default=60, help="real: seconds past --budget for gpu_profile.py")
    p.add_argument("--device", default="cuda", help="cpu: a quick local check of the script")
    args = p.parse_args()
    if args.device == "cpu":        # the local rehearsal: graphs emulated (a CPU refuses real ones)
        from specdec.model import graphs as graphs_module
        graphs_module.EMULATE = True
    Path(args.out).mkdir(parents=True, exist_ok=True)
    try:
        return {"check": check, "real": real}[args.what](args)
    finally:
        pack(Path(args.out))


# what a device call brings back: at most 8 files (16 MiB each), two folders down
KEEP = ("engine_check.json", "plain_scaling.json", "batch_spec.json", "profile.json", "spec_bench/results.md",
        "spec_bench_hf/results.md")


def pack(out: Path) -> None:
    """Everything under out in one out/all.tar.gz, beside the few files read first (KEEP, flattened:
    spec_bench/results.md -> spec_bench_results.md): a device call returns 8 files at most."""
    import shutil
    import tarfile

    files = [f for f in out.rglob("*") if f.is_file()]
    if not files:
        return
    archive = Path("/tmp") / f"gpu_bench_{os.getpid()}.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for f in files:
            tar.add(f, arcname=str(f.relative_to(out)))
    kept = {name: (out / name).read_bytes() for name in KEEP if (out / name).is_file()}
    for child in out.iterdir():
        shutil.rmtree(child) if child.is_dir() else child.unlink()
    shutil.move(str(archive), out / "all.tar.gz")
    for name, data in kept.items():
        (out / name.replace("/", "_")).write_bytes(data)


if __name__ == "__main__":
    sys.exit(main())
