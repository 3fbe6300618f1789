"""Latent attention's decoding paths timed on proxies of DeepSeek-V2-Lite and of DeepSeek-V3 /
GLM-4.7-Flash (no real checkpoint here: no model hub): random folders written by transformers
with the real models' attention sizes (16 or 20 query heads; latent 512, rotary 64, nope 128 / 192,
v 128 / 256; V3's q_a / q_b at rank 768) and a mixture of 16 experts (6 per token, 2 shared) in
every layer after a dense first one, at --hidden, --layers deep, bf16 weights. Greedy decoding of
--tokens tokens after 32, per path:

  PyTorch (kernels off)         the model's PyTorch forward alone (SPECDEC_KERNELS=0)
  PyTorch + C kernels           the path latent attention took before forward.c ran it: PyTorch
                                ops per layer, skinny.c's products and forward.c's paged attention
  forward.c                     the whole forward in one C call

Prints ms per token (best of 3), whether the C forward ran, and the CPU.

    PYTHONPATH=. python scripts/mla_proxy.py
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from specdec.bench.machine import cpu_model

ROOT = Path(__file__).resolve().parent.parent      # the timing children import scripts.proxy_timing from here

ARCHS = {     # the real models' attention sizes
    "deepseek_v2_lite": dict(cls="DeepseekV2", heads=16, q_lora_rank=None, qk_nope_head_dim=128, v_head_dim=128,
                             extra={"topk_method": "greedy", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0}),
    "glm_4.7_flash": dict(cls="DeepseekV3", heads=20, q_lora_rank=768, qk_nope_head_dim=192, v_head_dim=256,
                          extra={"n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.8, "num_nextn_predict_layers": 0}),
}


def build(root: Path, arch: str, layers: int, hidden: int) -> Path:
    import transformers

    a = ARCHS[arch]
    cfg = getattr(transformers, a["cls"] + "Config")(
        vocab_size=32000, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=a["heads"], num_key_value_heads=a["heads"], kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=a["qk_nope_head_dim"], v_head_dim=a["v_head_dim"], q_lora_rank=a["q_lora_rank"],
        n_routed_experts=16, num_experts_per_tok=6, moe_intermediate_size=hidden // 2, n_shared_experts=2,
        first_k_dense_replace=1, max_position_embeddings=4096, pad_token_id=None, bos_token_id=0, eos_token_id=1,
        **a["extra"])
    torch.manual_seed(0)
    model = getattr(transformers, a["cls"] + "ForCausalLM")(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):      # zeros at init: every score would tie
                p.normal_(0, 0.5)
    model.save_pretrained(root / arch)
    return root / arch


RUN = r"""
import sys, torch
from specdec import LLM, kernels
from scripts.proxy_timing import best_ms_per_token
from specdec.defaults import BUNDLED_TARGET
from specdec.kernels import cforward
folder, tokens, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if path == "off":
    kernels.load = lambda *a: None
elif path == "torch+c":
    cforward.supported = lambda model, kv: False
torch.set_num_threads(1)
llm = LLM(folder, tokenizer=str(BUNDLED_TARGET), num_speculative_tokens=0, max_model_len=512)
ms, out = best_ms_per_token(llm, tokens)
m = llm.target
print(f"{ms:.1f} {m.c_view(m.new_cache(1, 8)) is not None} {hash(tuple(out[0].outputs[0].token_ids))}")
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    print(f"latent attention proxies: {args.layers} layers, hidden {args.hidden}, 16 experts (6 per token, 2 shared), "
          f"bf16 weights; one thread; {cpu_model()}; greedy, {args.tokens} tokens after 32, best of 3\n")
    print("| proxy | path | ms / token | C forward |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs.split(","):
            folder = build(Path(tmp), arch, args.layers, args.hidden)
            outputs = set()
            for label, path in (("PyTorch (kernels off)", "off"), ("PyTorch + C kernels (before)", "torch+c"),
                                ("forward.c", "c")):
                r = subprocess.run([sys.executable, "-c", RUN, str(folder), str(args.tokens), path], cwd=ROOT,
                                   capture_output=True, text=True)
                if r.returncode != 0:
                    sys.exit(f"{arch} {label}: " + (r.stderr.strip().splitlines() or ["failed"])[-1])
                ms, c, tokens = r.stdout.split()
                outputs.add(tokens)
                print(f"| {arch} | {label} | {ms} | {c} |", flush=True)
            if len(outputs) > 1:
                print(f"\n(the paths' greedy tokens differ on {arch}: float rounding on random weights)\n")


if __name__ == "__main__":
    main()
