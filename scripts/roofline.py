"""Plain decoding vs the roofline on a ~100M-parameter random bf16 model; Python overhead per step."""
import argparse
import time

import torch
from pathlib import Path
from specdec.model.config import ModelConfig
from specdec.model.llama import Transformer
from specdec.model import save_model
from specdec.train.tokenizer import copy_tokenizer
from specdec.bench.machine import memory_bandwidth, weight_bytes_per_step
from specdec import LLM, SamplingParams
ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--folder", default="/tmp/specdec-rand100m", help="where the random checkpoint is written once")
args = ap.parse_args()
torch.set_num_threads(args.threads)
d = Path(args.folder)
if not (d / "model.safetensors").exists():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=16384, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                      num_key_value_heads=4, head_dim=64, max_position_embeddings=1024, bos_token_id=0, eos_token_id=1)
    m = Transformer(cfg)
    for p in m.parameters(): torch.nn.init.normal_(p, std=0.02)
    save_model(m, d); copy_tokenizer(Path("models/target"), d)
bw = memory_bandwidth()
llm = LLM(model=d, num_speculative_tokens=0, dtype="bfloat16", enable_prefix_caching=False)
nb = weight_bytes_per_step(llm.target)
p = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
llm.generate(["def f(x):"], p)
o = llm.generate(["def f(x):"] * 3, p)
tps = sum(x.stats.output_tokens for x in o) / sum(x.stats.wall_time_s for x in o)
step = sum(x.stats.target_time_s for x in o) / sum(x.stats.target_forward_passes for x in o)
m, cache = llm.target, llm.target.new_cache()
with torch.inference_mode():
    m(torch.arange(2, 100)[None], cache)
    x = torch.tensor([[5]])
    for _ in range(5): m(x, cache, [98])
    t = time.perf_counter()
    for _ in range(50): m(x, cache, [98])
    fwd = (time.perf_counter() - t) / 50
print(f"weights read per token {nb/1e6:.1f} MB; copy bandwidth {bw/1e9:.1f} GB/s -> roofline {bw/nb:.1f} tokens/s")
print(f"plain decoding {tps:.1f} tokens/s = {tps/(bw/nb):.0%} of roofline ({(bw/nb)/tps:.2f}x from it)")
print(f"engine step {step*1e3:.2f} ms, bare forward {fwd*1e3:.2f} ms: Python overhead per step {(step-fwd)*1e3:.2f} ms")
