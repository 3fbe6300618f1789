"""Seeded sampling through the batch engine against each request run alone (#11: "seeded
sampling: identical"), on the bundled toy target, 14 prompts cut from the machine's Python
files, K = 3.

    python scripts/seeded_batch_vs_solo.py eagle auto 1.0       # holds (failed before 2026-12-06: 8 of 14)
    python scripts/seeded_batch_vs_solo.py eagle-tree auto 1.0  # holds
    python scripts/seeded_batch_vs_solo.py medusa auto 1.0      # holds
    python scripts/seeded_batch_vs_solo.py draft auto 1.0       # holds

Found by a stress probe on 2026-12-05: the bundled EAGLE head with dtype "auto" (bf16) drafted
differently in a batch than alone. Its fc read every request's prompt features in one matrix
product, and past 64 rows a CPU with native bf16 took oneDNN's GEMM, whose bf16 output for a
row depends on the number of rows; the head's fc now keeps to the row-exact kernel
(Linear.row_invariant).
"""
import glob
import random
import sys

from specdec import LLM, SamplingParams

T = "models/target"
method = sys.argv[1] if len(sys.argv) > 1 else "eagle"
dtype = sys.argv[2] if len(sys.argv) > 2 else "auto"
TEMP = float(sys.argv[3]) if len(sys.argv) > 3 else 1.0
spec = {"eagle": {"method": "eagle", "model": "models/eagle", "num_speculative_tokens": 3, "topk": 1},
        "eagle-tree": {"method": "eagle", "model": "models/eagle", "num_speculative_tokens": 6},
        "draft": {"method": "draft_model", "model": "models/draft", "num_speculative_tokens": 3},
        "ngram+draft": {"method": "ngram+draft_model", "model": "models/draft", "num_speculative_tokens": 3},
        "ngram+eagle": {"method": "ngram+eagle", "model": "models/eagle", "num_speculative_tokens": 3, "topk": 1},
        "medusa": {"method": "medusa", "model": "models/medusa", "num_speculative_tokens": 4}}[method]
rng = random.Random(0)
llm = LLM(T, speculative_config=spec, max_model_len=160, dtype=dtype, enable_prefix_caching=False)
tok = llm.tokenizer
files = sorted(glob.glob("/usr/lib/python3*/*.py"))[:200]
ids = tok.encode("".join(open(f, errors="ignore").read()[:4000] for f in rng.sample(files, 20)))
prompts = []
for i in range(14):
    s = rng.randrange(0, len(ids) - 60)
    prompts.append(ids[s:s + rng.randrange(10, 60)])
P = [SamplingParams(temperature=TEMP, seed=i, max_tokens=32, ignore_eos=True) for i in range(14)]
batch = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], P, use_tqdm=False)]
alone = [list(llm.generate([{"prompt_token_ids": p}], P[i], use_tqdm=False)[0].outputs[0].token_ids)
         for i, p in enumerate(prompts)]
print(method, dtype, f"T={TEMP}", "batch != alone for", [i for i in range(14) if batch[i] != alone[i]])
