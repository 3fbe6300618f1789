"""What admitting a structured request costs the engine's thread when the server has prepared it
(its spec frozen, each choice's matcher compiled ahead on the grammar threads), against a spec
that was not (the engine's add_request alone: the text made, validated and compiled at
admission), and LLM.generate's whole call (which compiles its choices ahead on every core).

    python scripts/grammar_admission.py --branches 3000 --choices 16

A JSON schema that is an anyOf of --branches objects (each with a pattern), as a large tool list
or a union type makes; the default model (SmolLM2-135M-Instruct GGUF); wall clock, one thread.
"""
from __future__ import annotations

import argparse
import time

import torch

from specdec import LLM, SamplingParams
from specdec.config import StructuredOutputsParams


def schema(branches: int) -> dict:
    return {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["kind", f"f{i}"],
                       "properties": {"kind": {"const": f"k{i}"}, f"f{i}": {"type": "integer"},
                                      "name": {"type": "string", "pattern": f"^n{i}[a-z]*$"}}}
                      for i in range(branches)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--branches", type=int, default=3000)
    ap.add_argument("--choices", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM()
    engine, prompt = llm.engine, llm.tokenizer.encode("JSON: ")
    grammars = engine.grammars
    rows = []
    for prepared in (True, False):
        spec = StructuredOutputsParams(json=schema(args.branches))
        params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=spec)
        ahead = 0.0
        if prepared:                       # what the server does before submitting (off the engine's thread)
            t = time.perf_counter()
            grammars.freeze(spec)
            grammars.prebuild(spec, args.choices)
            ahead = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(args.choices):
            engine.add_request(prompt, params)
        admit = time.perf_counter() - t
        for r in list(engine.scheduler.waiting):
            engine.abort(r.request_id)
        rows.append(("server (frozen, prebuilt)" if prepared else "offline (at admission)", ahead, admit))
    # offline: LLM.generate compiles every choice's matcher ahead, on all the cores together
    spec = StructuredOutputsParams(json=schema(args.branches))
    t = time.perf_counter()
    llm.generate(["JSON: "], SamplingParams(n=args.choices, temperature=0.7, seed=0, max_tokens=1,
                                            structured_outputs=spec))
    rows.append(("LLM.generate, whole call (n choices, 1 token)", time.perf_counter() - t, float("nan")))
    print(f"{args.choices} choices of a {args.branches}-branch anyOf, {args.threads} thread(s)")
    print("| path | prepared ahead (s) | engine thread at admission (s) |\n|---|---|---|")
    for name, ahead, admit in rows:
        print(f"| {name} | {ahead:.2f} | {admit:.3f} |")


if __name__ == "__main__":
    main()
