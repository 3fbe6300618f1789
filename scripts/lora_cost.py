"""What serving a LoRA adapter costs: decode-phase tokens per second of the same greedy requests
without an adapter and with one (a random PEFT adapter of the given rank on every projection,
made here from the model itself), at several concurrencies, interleaved in one process (best of
--repeats), plus speculative decoding under the adapter against plain decoding under it.

    python scripts/lora_cost.py --ranks 8,16 --batch 1,4 --repeats 3 --threads 2
    python scripts/lora_cost.py --ranks 8,16 --write-adapters runs/lora    # only write them (r8/, r16/)
    python scripts/lora_cost.py --ranks 8 --batch 1 --speculative '{"method": "suffix", "num_speculative_tokens": 2}'

The model defaults to the bundled default (SmolLM2-135M-Instruct Q4_1 GGUF); the adapter is
written from transformers' loading of that GGUF (dequantized) with `peft` (pip install peft).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from specdec import LLM, SamplingParams
from specdec.lora import LoRARequest

PROMPTS = [f"Question {i}: explain in a few sentences how a {w} works." for i, w in
           enumerate(["bicycle", "compiler", "refrigerator", "database index", "transistor", "violin", "tide", "vaccine"] * 4)]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model_path: str, folder: Path, rank: int) -> Path:
    import peft
    import transformers

    p = Path(model_path)
    kw = {"gguf_file": p.name} if p.suffix == ".gguf" else {}
    hf = transformers.AutoModelForCausalLM.from_pretrained(p.parent if kw else p, dtype=torch.float32, **kw)
    torch.manual_seed(rank)
    model = peft.get_peft_model(hf, peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=ALL,
                                                    init_lora_weights=False))
    with torch.no_grad():       # small B: an adapter that nudges the model, as a fine-tune does
        for name, t in model.named_parameters():
            if "lora_B" in name:
                t.mul_(0.05)
    model.save_pretrained(folder)
    return folder


def decode_rate(llm, n: int, max_tokens: int, lora) -> tuple[float, list]:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    reqs = [engine.add_request(llm.chat_prompt([{"role": "user", "content": p}])["prompt_token_ids"], params,
                               lora_request=lora) for p in PROMPTS[:n]]
    while not all(r.out for r in reqs):
        engine.step()
    t, start = time.perf_counter(), sum(len(r.out) for r in reqs)
    while engine.has_unfinished():
        engine.step()
    return (sum(len(r.out) for r in reqs) - start) / (time.perf_counter() - t), [r.out for r in reqs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="target (default: the bundled default model)")
    ap.add_argument("--ranks", default="8,16")
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--speculative", default=None, help="a speculative_config (JSON) to time under the adapter too")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--write-adapters", default=None, metavar="DIR", help="only write the adapters, to DIR/r<rank>")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from specdec.defaults import default_model
    model = args.model or str(default_model()[0])
    ranks = [int(r) for r in args.ranks.split(",")]
    batches = [int(b) for b in args.batch.split(",")]
    tmp = Path(args.write_adapters or tempfile.mkdtemp(prefix="lora-cost-"))
    adapters = {r: LoRARequest(f"r{r}", i + 1, str(make_adapter(model, tmp / f"r{r}", r))) for i, r in enumerate(ranks)}
    if args.write_adapters:
        print("\n".join(a.lora_path for a in adapters.values()))
        return
    llms = {"plain": LLM(model, num_speculative_tokens=0, enable_lora=True, max_lora_rank=max(ranks), max_loras=1, enable_prefix_caching=False)}
    if args.speculative:
        llms["spec"] = LLM(model, speculative_config=json.loads(args.speculative), enable_lora=True,
                           max_lora_rank=max(ranks), max_loras=1, enable_prefix_caching=False)
    cells = [(name, b, r) for b in batches for name in llms for r in [None, *ranks]]
    best, outs = {}, {}
    for _ in range(args.repeats):
        for name, b, r in cells:
            rate, out = decode_rate(llms[name], b, args.max_tokens, adapters.get(r))
            best[(name, b, r)] = max(best.get((name, b, r), 0.0), rate)
            outs[(name, b, r)] = out
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor())
    print(f"# {model}\n# {cpu}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads; decode-phase tokens/s, "
          f"best of {args.repeats}, {args.max_tokens} tokens per request\n")
    print("| engine | sequences | no adapter | " + " | ".join(f"rank {r}" for r in ranks) + " |")
    print("|---|---|---|" + "---|" * len(ranks))
    rows = []
    for name, b in [(n, b) for b in batches for n in llms]:
        base = best[(name, b, None)]
        cells_txt = [f"{best[(name, b, r)]:.1f} ({best[(name, b, r)] / base:.2f}x)" for r in ranks]
        print(f"| {name} | {b} | {base:.1f} | " + " | ".join(cells_txt) + " |")
        rows.append({"engine": name, "batch": b, "base": base, **{f"rank{r}": best[(name, b, r)] for r in ranks}})
    if "spec" in llms:
        for b in batches:
            for r in ranks:
                same = outs[("spec", b, r)] == outs[("plain", b, r)]
                print(f"spec / plain under rank {r}, {b} sequences: {best[('spec', b, r)] / best[('plain', b, r)]:.2f}x, "
                      f"greedy outputs identical: {same}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"model": model, "cpu": cpu, "threads": torch.get_num_threads(),
                                              "args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
