"""PyTorch ops per engine step by phase, on the PyTorch path (the GPU's: C kernels off, padded
attention), for plain and speculative decoding of the real model at one request.

On a GPU every op is a kernel launch or more, and specdec's path there is host-bound
(bench/gpu-h100/2026-12-05: a 30-layer SmolLM2 forward took 10.4 ms at batch 1, ~1,000 launches):
a step's op count is its cost there. This counts the aten ops each phase of `Engine.step`
dispatches (a TorchDispatchMode), per target forward, on this CPU.

    PYTHONPATH=. python scripts/step_ops.py [--methods plain,suffix2,eagle2] [--tokens 48] [--batch 1]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

os.environ["SPECDEC_KERNELS"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from specdec import LLM, SamplingParams, engine as engine_module  # noqa: E402
from specdec.bench.spec_bench import chat_prompt, read_questions  # noqa: E402
from specdec.defaults import smollm2_gguf  # noqa: E402
from specdec.model import batch as batch_module  # noqa: E402

PHASE = ["other"]


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.by_op = collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[PHASE[0]] += 1
        self.by_op[PHASE[0]][str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def phased(obj, name: str, label: str) -> None:
    fn = getattr(obj, name)

    def wrapped(*a, **k):
        before, PHASE[0] = PHASE[0], label
        try:
            return fn(*a, **k)
        finally:
            PHASE[0] = before

    setattr(obj, name, wrapped)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--methods", default="plain,suffix2,eagle2")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--top", type=int, default=8, help="the most frequent ops of each phase")
    p.add_argument("--batch", type=int, default=1, help="requests decoding together (Spec-Bench questions)")
    args = p.parse_args()
    batch_module.PADDED = True
    model = args.model or str(smollm2_gguf())
    specs = {"plain": None}
    for k in (1, 2, 4):
        specs[f"suffix{k}"] = {"method": "suffix", "num_speculative_tokens": k}
        specs[f"eagle{k}"] = {"method": "eagle", "num_speculative_tokens": k}
        specs[f"eagle_tree{k}"] = {"method": "eagle", "num_speculative_tokens": k, "topk": 2}
    for name in args.methods.split(","):
        llm = LLM(model, dtype="float32", speculative_config=specs[name],
                  num_speculative_tokens=0 if specs[name] is None else None, max_num_seqs=args.batch, enable_prefix_caching=False)
        eng = llm.engine
        qs = read_questions(limit_per_category=2)
        prompts = [chat_prompt(llm.tokenizer, qs[(3 + i) % len(qs)]["prompt"]) for i in range(args.batch)]
        phased(eng, "_propose", "propose")
        phased(eng, "_forward", "target forward")
        phased(eng, "_commit", "commit")
        phased(eng, "_finish_step", "finish")
        phased(eng, "_logprobs", "logprobs")
        phased(eng, "_observe", "observe")
        phased(eng, "_choose_k", "choose")
        saved = {fn: getattr(engine_module, fn) for fn in ("verify_batch", "controlled_logits")}
        phased(engine_module, "verify_batch", "verify")         # module functions the engine calls by name
        phased(engine_module, "controlled_logits", "controls")
        if eng.proposer is not None:
            phased(eng.proposer, "update", "proposer update")
        greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        reqs = [eng.add_request(p, greedy) for p in prompts]
        while not all(r.out for r in reqs):    # the prompts' prefill, not counted
            eng.step()
        start = sum(len(r.out) for r in reqs)
        steps = 0
        with Count() as c:
            while eng.has_unfinished():
                eng.step()
                steps += 1
        toks = sum(len(r.out) for r in reqs) - start
        for fn, orig in saved.items():          # undo the module patches
            setattr(engine_module, fn, orig)
        total = sum(c.ops.values())
        row = {"method": name, "steps": steps, "tokens": toks, "ops_per_step": round(total / steps),
               "ops_per_token": round(total / toks), "by_phase_per_step": {k: round(v / steps, 1) for k, v in c.ops.most_common()}}
        print(json.dumps(row), flush=True)
        for phase, ops in c.by_op.items():
            top = ", ".join(f"{k} {v / steps:.1f}" for k, v in ops.most_common(args.top))
            print(f"   {phase}: {top}")
        del llm


if __name__ == "__main__":
    main()
