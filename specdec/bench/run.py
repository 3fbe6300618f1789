"""One benchmark run: load the checkpoints once, build every variant on them, measure, report."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import METHODS
from ..defaults import is_bundled
from ..llm import DEFAULT_DRAFT, LLM, MODELS_DIR
from . import machine, report
from .diagnose import label_mismatches
from .harness import Scenario, measure, num_steps
from .methods import PLAIN, plain_variant, registered_methods, speculative_variants
from .peers import DEFAULT_PEERS, PEERS, peer_variants
from .prompts import load_prompts
from .spec_bench import category_summaries
from .summary import summarize
from .variant import Skipped


def select_methods(requested: list[str] | None, peers: bool) -> tuple[list[str], list[str], list[Skipped]]:
    """(specdec methods, peer names, skipped). Plain decoding always runs: it is the baseline,
    and so does hf_plain whenever a peer runs."""
    registry = registered_methods()
    if requested is None:
        spec, hf, skipped = registry, list(DEFAULT_PEERS), []
    else:
        known = {PLAIN, *registry, *METHODS, *PEERS}
        unknown = [m for m in requested if m not in known]
        if unknown:
            raise ValueError(f"--methods: unknown {', '.join(unknown)} (known: {', '.join([PLAIN, *registry, *PEERS])})")
        spec = [m for m in requested if m in registry]
        hf = [m for m in requested if m in PEERS]
        skipped = [Skipped(m, None, "not registered in this build of specdec") for m in requested
                   if m in METHODS and m not in registry]
    if not peers:
        hf = []
    if hf and "hf_plain" not in hf:
        hf.insert(0, "hf_plain")
    return spec, hf, skipped


def _draft_dir(args, llm: LLM) -> str | None:
    if args.speculative_model and args.speculative_model not in ("[ngram]", "ngram"):
        return args.speculative_model
    if is_bundled(llm.model_path) and DEFAULT_DRAFT.is_dir():
        return str(DEFAULT_DRAFT)        # the bundled pair
    return None


def build_variants(args, llm: LLM, draft_dir: str | None):
    spec_methods, peer_names, skipped = select_methods(args.methods, args.peers)
    overrides = {m: dict(v) for m, v in (args.speculative_config or {}).items()}
    bad = [m for m in overrides if m not in registered_methods()]
    if bad:
        raise ValueError(f"--speculative-config: not a registered method: {', '.join(bad)}")
    if is_bundled(llm.model_path):    # the bundled target: its bundled heads
        for method in ("medusa", "eagle"):
            if (MODELS_DIR / method).is_dir():
                overrides.setdefault(method, {}).setdefault("model", str(MODELS_DIR / method))
    variants = [plain_variant(llm)]
    spec_vs, spec_skipped = speculative_variants(llm, spec_methods, args.num_speculative_tokens, draft_dir, overrides)
    peer_vs, peer_skipped = peer_variants(peer_names, args.num_speculative_tokens, llm.model_path, draft_dir,
                                          args.dtype, args.device, llm.tokenizer.eos_token_ids) if peer_names else ([], [])
    return variants + spec_vs + peer_vs, skipped + spec_skipped + peer_skipped


def _config(args, llm: LLM, draft_dir: str | None) -> dict:
    return {"model": llm.model_path, "draft_model": draft_dir, "dtype": machine.weights_kind(llm.target),
            "device": args.device, "num_speculative_tokens": args.num_speculative_tokens,
            "temperatures": args.temperature, "prompts": args.prompts, "max_tokens": args.max_tokens,
            "repeats": args.repeats, "seed": args.seed, "peers": args.peers,
            "speculative_config": args.speculative_config or {}}


def run_benchmark(args, command: str) -> tuple[dict, list[Path]]:
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(model=args.model, num_speculative_tokens=0, dtype=args.dtype, device=args.device, max_num_seqs=1,
              max_model_len=args.max_model_len)
    draft_dir = _draft_dir(args, llm)
    variants, skipped = build_variants(args, llm, draft_dir)
    max_len = llm.engine.max_model_len
    sets = [load_prompts(p, llm.tokenizer, args.max_tokens, max_len, args.limit_prompts, args.limit_per_category)
            for p in args.prompts]
    scenarios = [Scenario(name, t, prompts) for name, prompts in sets for t in args.temperature]
    results = {"command": command, "machine": machine.machine_info(), "config": _config(args, llm, draft_dir),
               "roofline": machine.roofline(llm.target, machine.memory_bandwidth()) if args.device == "cpu" else None,
               "scenarios": [], "skipped": [s.to_dict() for s in skipped]}
    if machine.busy(results["machine"]):
        print(f"specdec bench: warning: the machine is busy (load average {results['machine']['load_average']} "
              f"on {results['machine']['cores']} cores); timings will not be representative", file=sys.stderr)
    total = sum(num_steps(len(variants), len(s.prompts), args.repeats) for s in scenarios)
    with tqdm(total=total, desc="bench", unit="run", file=sys.stderr, dynamic_ncols=True) as bar:
        for s in scenarios:
            runs = measure(variants, s, args.repeats, args.seed, bar)
            summary = summarize(variants, runs, s, args.max_tokens, args.repeats)
            if any(p.category for p in s.prompts):
                summary["categories"] = category_summaries(variants, runs, s.prompts, s.greedy)
            if s.greedy:
                label_mismatches(llm.target, s, summary, runs[PLAIN])
            results["scenarios"].append(summary)
    results["machine"]["load_average_end"] = machine.machine_info()["load_average"]
    return results, report.write_all(results, args.out)
