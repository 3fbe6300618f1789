"""llguidance, xgrammar and outlines-core on one tokenizer: the comparison behind specdec's choice.

    pip install -c constraints.txt xgrammar outlines-core   # llguidance is a dependency already
    python scripts/grammar_engines.py [--model X.gguf] [--repeats 10]

For each engine that imports: time to prepare the tokenizer, to compile a JSON schema, the
time per token mask while walking valid JSON outputs token by token (first walk, then warm
walks), whether consumed tokens roll back, and whether a harder schema ($ref recursion,
pattern, enum, anyOf, format) compiles. One thread, timed with its CPU clock (a shared machine
slows the wall clock, not this).
"""
import argparse
import json
import time

import torch

from specdec.bench.machine import cpu_model
from specdec.defaults import smollm2_gguf
from specdec.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0},
          "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}, "ok": {"type": "boolean"}},
          "required": ["name", "age", "tags", "ok"], "additionalProperties": False}
HARD = {"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"},
                                                           "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                           "required": ["v"]}},
        "type": "object", "properties": {"root": {"$ref": "#/$defs/node"},
                                         "id": {"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"},
                                         "kind": {"enum": ["a", "b"]}, "when": {"type": "string", "format": "date"},
                                         "x": {"anyOf": [{"type": "number"}, {"type": "null"}]}},
        "required": ["root", "id"]}
VALUES = [("Alice Smith", 42, ["a", "bc", "def"], True), ("Bob", 7, [], False), ("Zoë Ñ", 100, ["x y z"], True),
          ("q" * 20, 0, ["1", "2", "3"], False)]


def walks(tok: Tokenizer) -> list[list[int]]:
    texts = [json.dumps(dict(zip(("name", "age", "tags", "ok"), v)), separators=(",", ":"), ensure_ascii=False)
             for v in VALUES]
    return [tok.encode(t, add_special_tokens=False) + [tok.eos_token_ids[0]] for t in texts]


def timed(f):
    t = time.thread_time()
    out = f()
    return time.thread_time() - t, out


def llguidance_engine(tok, V):
    import llguidance

    prep, ll = timed(lambda: llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=V, eos_token=tok.eos_token_ids))
    words = (V + 31) // 32

    def compile_(schema):
        g = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        m = llguidance.LLMatcher(ll, g, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return g

    def matcher(g):
        m = llguidance.LLMatcher(ll, g, log_level=0)
        buf = torch.empty(words, dtype=torch.int32)
        return (lambda: m.unsafe_compute_mask_ptr(buf.data_ptr(), words * 4)), m.consume_token, m.rollback
    return prep, compile_, matcher


def xgrammar_engine(tok, V):
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    prep, info = timed(lambda: xgr.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_object=tok.backend, eos_token=tok.eos_token), vocab_size=V,
        stop_token_ids=tok.eos_token_ids))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile_(schema):
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    def matcher(g):
        m = xgr.GrammarMatcher(g)
        buf = xgr.allocate_token_bitmask(1, V)
        return (lambda: m.fill_next_token_bitmask(buf)), m.accept_token, m.rollback
    return prep, compile_, matcher


def outlines_engine(tok, V):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    def vocabulary():
        words = {}
        for i in range(V):
            s = tok.backend.id_to_token(i)
            if s is not None and i not in tok.eos_token_ids:
                words.setdefault(s, []).append(i)
        return Vocabulary(tok.eos_token_ids[0], words)
    prep, vocab = timed(vocabulary)

    def compile_(schema):
        return Index(build_regex_from_schema(json.dumps(schema)), vocab)

    def matcher(index):
        g = Guide(index)
        mask = torch.zeros(V, dtype=torch.bool)

        def fill():        # a list of allowed ids; a mask is what sampling needs
            mask.zero_()
            mask[torch.tensor(g.get_tokens())] = True

        def rollback(n):
            g.rollback_state(n)

        def advance(t):     # EOS is not a transition here: it is allowed where the guide is finished
            return g.is_finished() if t in tok.eos_token_ids else g.advance(t)
        return fill, advance, rollback
    return prep, compile_, matcher


ENGINES = {"llguidance": llguidance_engine, "xgrammar": xgrammar_engine, "outlines-core": outlines_engine}


def measure(name, make, tok, V, seqs, repeats) -> dict:
    try:
        prep, compile_, matcher = make(tok, V)
    except ImportError as e:
        return {"engine": name, "skipped": f"not installed ({e.name})"}
    compile_s, grammar = timed(lambda: compile_(SCHEMA))
    per_walk = []
    for _ in range(1 + repeats):
        times = []
        for ids in seqs:
            fill, consume, _ = matcher(grammar)
            for t in ids:
                t0 = time.thread_time()
                fill()
                times.append(time.thread_time() - t0)
                consume(t)
        per_walk.append(times)
    warm = sorted(t for w in per_walk[1:] for t in w)
    fill, consume, rollback = matcher(grammar)
    for t in seqs[0][:6]:
        consume(t)
    try:
        rollback(3)
        rolled = all(consume(t) is not False for t in seqs[0][3:6])
    except Exception as e:              # noqa: BLE001 - an engine without rollback
        rolled = f"no ({type(e).__name__})"
    try:
        compile_(HARD)
        hard = "compiles"
    except Exception as e:              # noqa: BLE001
        hard = f"fails: {str(e).splitlines()[0][:80]}"
    return {"engine": name, "tokenizer_prep_ms": round(prep * 1e3, 1), "schema_compile_ms": round(compile_s * 1e3, 2),
            "first_walk_mask_ms_mean": round(1e3 * sum(per_walk[0]) / len(per_walk[0]), 4),
            "warm_mask_ms_mean": round(1e3 * sum(warm) / len(warm), 4),
            "warm_mask_ms_median": round(1e3 * warm[len(warm) // 2], 4),
            "warm_mask_ms_p99": round(1e3 * warm[int(len(warm) * 0.99)], 4), "rollback": rolled,
            "recursive_schema": hard, "masks_timed": len(warm)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = Tokenizer(args.model or str(smollm2_gguf()))
    V = len(tok)
    print(json.dumps({"cpu": cpu_model(), "vocab": V}))
    for name, make in ENGINES.items():
        print(json.dumps(measure(name, make, tok, V, walks(tok), args.repeats)), flush=True)


if __name__ == "__main__":
    main()
