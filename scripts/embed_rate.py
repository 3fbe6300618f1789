"""Embedding throughput: specdec's pooling runner against transformers (AutoModel, padded
batches, last-token pooling, as sentence-transformers runs a decoder embedding model), on the
default model used as an embedding model (`convert="embed"`), with the agreement of the vectors.

    PYTHONPATH=. python scripts/embed_rate.py --threads 2 --repeats 3 --out bench/embed/xeon-avx512vnni/embed-rate.json

Inputs: Spec-Bench's first turns (the first --limit of the 240). The dense folder is SmolLM2's GGUF
dequantized and written in bf16 (scripts/quant_folders.py does the same); specdec also runs the
GGUF itself, packed. SmolLM2 is no embedding model: these rows measure speed and agreement only.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from specdec import LLM  # noqa: E402
from specdec.bench.spec_bench import read_questions  # noqa: E402


def hf_embed(model, tok, texts: list[str], batch: int) -> list[torch.Tensor]:
    out = []
    for i in range(0, len(texts), batch):
        enc = tok(texts[i:i + batch], return_tensors="pt", padding=True)
        with torch.inference_mode():
            h = model(**enc).last_hidden_state
        last = enc["attention_mask"].sum(1) - 1                       # right padding: the last real token
        out += list(torch.nn.functional.normalize(h[torch.arange(h.shape[0]), last].float(), dim=-1))
    return out


def timed(fn, repeats: int):
    best, result = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t)
    return best, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--batch", type=int, default=16, help="transformers' batch size")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    from quant_folders import smollm2_dense
    from specdec import kernels

    gguf, _, dense = smollm2_dense(args.workdir, "embed-rate-")
    texts = [q["prompt"] for q in read_questions()][:args.limit]
    rows, vectors = [], {}
    for name, path, dtype in (("specdec, GGUF Q4_1 (packed)", str(gguf), "auto"),
                              ("specdec, HF folder bf16", str(dense), "bfloat16"),
                              ("specdec, HF folder fp32", str(dense), "float32")):
        llm = LLM(path, convert="embed", dtype=dtype, max_model_len=2048, enable_prefix_caching=False)
        seconds, outs = timed(lambda: llm.embed(texts), args.repeats)
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        vectors[name] = [torch.tensor(o.outputs.embedding) for o in outs]
        rows.append({"engine": name, "seconds": seconds, "texts_s": len(texts) / seconds, "tokens_s": tokens / seconds})
        print(json.dumps(rows[-1]), flush=True)
    tok = transformers.AutoTokenizer.from_pretrained(dense)
    tok.padding_side = "right"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    for dtype in (torch.bfloat16, torch.float32):
        model = transformers.AutoModel.from_pretrained(dense, dtype=dtype).eval()
        name = f"transformers AutoModel {str(dtype).replace('torch.', '')}, batch {args.batch}"
        seconds, outs = timed(lambda: hf_embed(model, tok, texts, args.batch), args.repeats)
        vectors[name] = outs
        tokens = sum(len(tok(t)["input_ids"]) for t in texts)
        rows.append({"engine": name, "seconds": seconds, "texts_s": len(texts) / seconds, "tokens_s": tokens / seconds})
        print(json.dumps(rows[-1]), flush=True)
    ref = vectors["transformers AutoModel float32, batch %d" % args.batch]
    for r in rows:
        cos = [torch.nn.functional.cosine_similarity(a, b, dim=0).item() for a, b in zip(vectors[r["engine"]], ref)]
        r["min_cosine_vs_transformers_fp32"] = min(cos)
    hf_rate = next(r["texts_s"] for r in rows if r["engine"].startswith("transformers AutoModel bfloat16"))
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor())
    print(f"\n# {cpu}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads, kernels {kernels.chosen() or 'none'}; "
          f"{len(texts)} Spec-Bench first turns, best of {args.repeats}\n")
    print("| engine | texts/s | tokens/s | vs transformers bf16 | min cosine vs transformers fp32 |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {r['texts_s']:.1f} | {r['tokens_s']:.0f} | {r['texts_s'] / hf_rate:.2f}x | "
              f"{r['min_cosine_vs_transformers_fp32']:.5f} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"cpu": cpu, "kernels": kernels.chosen(), "threads": torch.get_num_threads(),
                                              "args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
