"""gpt-oss's decoding paths timed on a proxy of the architecture (no real checkpoint here: no model
hub): a random GptOssForCausalLM written by transformers, --layers layers of --hidden with
--experts experts (4 per token), as a bf16 folder and as OpenAI's MXFP4 folder. Greedy decoding of
--tokens tokens after a short prompt, per path: the PyTorch forward (kernels off), forward.c with
dense bf16 experts, forward.c with packed MXFP4 experts. Prints ms per token and the weights' bytes;
the CPU is named.

    PYTHONPATH=. python scripts/gpt_oss_proxy.py
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from specdec.bench.machine import cpu_model

ROOT = Path(__file__).resolve().parent.parent      # the timing children import scripts.proxy_timing from here


def build(root: Path, layers: int, hidden: int, experts: int) -> tuple[Path, Path]:
    import transformers
    from gguf import GGMLQuantizationType as T, quants
    from safetensors.torch import load_file, save_file

    from specdec.model.checkpoint import mxfp4_blocks

    cfg = transformers.GptOssConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=layers,
                                    num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256), head_dim=64,
                                    num_local_experts=experts, num_experts_per_tok=4, max_position_embeddings=4096,
                                    sliding_window=128, pad_token_id=None, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg).to(torch.bfloat16)
    dense = root / "bf16"
    model.save_pretrained(dense)
    mx = root / "mxfp4"
    mx.mkdir()
    for f in dense.glob("*.json"):
        (mx / f.name).write_bytes(f.read_bytes())
    sd = load_file(str(dense / "model.safetensors"))
    out = {}
    for name, v in sd.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name] = v
            continue
        w = v.float().numpy().transpose(0, 2, 1)                          # [E, rows, in]
        rows = quants.quantize(np.ascontiguousarray(w.reshape(-1, w.shape[-1])), T.MXFP4).reshape(*w.shape[:2], -1)
        out[name + "_blocks"], out[name + "_scales"] = mxfp4_blocks(torch.from_numpy(rows))
    save_file(out, str(mx / "model.safetensors"), metadata={"format": "pt"})
    c = json.loads((mx / "config.json").read_text())
    c["quantization_config"] = {"quant_method": "mxfp4"}
    (mx / "config.json").write_text(json.dumps(c))
    return dense, mx


RUN = r"""
import sys, torch
from specdec import LLM, kernels
from scripts.proxy_timing import best_ms_per_token
from specdec.defaults import BUNDLED_TARGET
folder, tokens, quant, kernels_on = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
if not kernels_on:
    kernels.load = lambda *a: None
torch.set_num_threads(1)
llm = LLM(folder, tokenizer=str(BUNDLED_TARGET), num_speculative_tokens=0, quantization=None if quant == "auto" else quant,
          max_model_len=512)
ms, out = best_ms_per_token(llm, tokens)
m = llm.target
from specdec.model.quant import QuantLinear
nbytes = sum(p.numel() * p.element_size() for p in m.parameters()) + sum(b.numel() * b.element_size() for b in m.buffers())
nbytes += sum(q.prepared.data.numel() for q in m.modules() if isinstance(q, QuantLinear) and q.prepared is not None)
print(f"{ms:.1f} {nbytes / 2**20:.0f} {m.c_view(m.new_cache(1, 8)) is not None}")
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dense, mx = build(Path(tmp), args.layers, args.hidden, args.experts)
        print(f"gpt-oss proxy: {args.layers} layers, hidden {args.hidden}, {args.experts} experts (4 per token); "
              f"one thread; {cpu_model()}; greedy, {args.tokens} tokens after 32, best of 3\n")
        print("| path | experts | ms / token | weights MiB | C forward |")
        print("|---|---|---|---|---|")
        for label, folder, quant, on in (("PyTorch (kernels off)", dense, "auto", "0"), ("forward.c", dense, "auto", "1"),
                                         ("forward.c", mx, "auto", "1")):
            r = subprocess.run([sys.executable, "-c", RUN, str(folder), str(args.tokens), quant, on], cwd=ROOT,
                               capture_output=True, text=True)
            if r.returncode != 0:
                sys.exit(f"{label}: " + (r.stderr.strip().splitlines() or ["failed"])[-1])
            out = r.stdout.split()
            kind = "MXFP4 packed" if folder == mx else "bf16"
            print(f"| {label} | {kind} | {out[0]} | {out[1]} | {out[2]} |")


if __name__ == "__main__":
    main()
