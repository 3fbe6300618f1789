"""One benchmark run: load the checkpoints once, build every variant on them, measure, report."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from .. import kernels
from ..config import METHODS, cuda_graph_sizes
from ..defaults import bundled_drafters
from ..proposers.suffix import CACHE_KEY
from ..llm import LLM
from ..model.gguf import find_gguf
from . import machine, report
from .diagnose import label_mismatches
from .harness import Scenario, measure, num_steps
from .methods import PLAIN, plain_variant, registered_methods, speculative_variants
from . import llamacpp
from .peers import DEFAULT_PEERS, PEERS, peer_variants
from .prompts import load_prompts
from .spec_bench import category_summaries
from .summary import summarize
from .variant import Skipped


def select_methods(requested: list[str] | None, peers: list[str]) -> tuple[list[str], list[str], list[str], list[Skipped]]:
    """(specdec methods, transformers peers, llama.cpp peers, skipped). Plain decoding always
    runs: it is the baseline; so does each peer family's own plain decoding when it runs."""
    registry = registered_methods()
    if requested is None:
        spec, hf, lc, skipped = registry, list(DEFAULT_PEERS), list(llamacpp.PEERS), []
    else:
        known = {PLAIN, *registry, *METHODS, *PEERS, *llamacpp.PEERS}
        unknown = [m for m in requested if m not in known]
        if unknown:
            raise ValueError(f"--methods: unknown {', '.join(unknown)} "
                             f"(known: {', '.join([PLAIN, *registry, *PEERS, *llamacpp.PEERS])})")
        spec = [m for m in requested if m in registry]
        hf = [m for m in requested if m in PEERS]
        lc = [m for m in requested if m in llamacpp.PEERS]
        skipped = [Skipped(m, None, "not registered in this build of specdec") for m in requested
                   if m in METHODS and m not in registry]
    hf = hf if "transformers" in peers else []
    lc = lc if "llamacpp" in peers else []
    if hf and "hf_plain" not in hf:
        hf.insert(0, "hf_plain")
    if lc and llamacpp.PLAIN not in lc:
        lc.insert(0, llamacpp.PLAIN)
    return spec, hf, lc, skipped


def _draft_dir(args, llm: LLM) -> str | None:
    if args.speculative_model and args.speculative_model not in ("[ngram]", "ngram"):
        return args.speculative_model
    return bundled_drafters(llm.model_path).get("draft_model")      # the toy pair's or SmolLM2's


def build_variants(args, llm: LLM, draft_dir: str | None, clock=time.perf_counter):
    spec_methods, peer_names, lc_names, skipped = select_methods(args.methods, args.peers)
    overrides = {m: dict(v) for m, v in (args.speculative_config or {}).items()}
    bad = [m for m in overrides if m not in registered_methods()]
    if bad:
        raise ValueError(f"--speculative-config: not a registered method: {', '.join(bad)}")
    # a path that is not there is the user's typo, not a method to skip with a note in the table
    missing = [f"{m}'s model {v['model']!r}" for m, v in overrides.items()
               if isinstance(v.get("model"), str) and not v["model"].startswith("[") and not Path(v["model"]).exists()]
    if missing:
        raise ValueError(f"--speculative-config: no such path: {', '.join(missing)}")
    for method, folder in bundled_drafters(llm.model_path).items():     # heads bundled for this target
        if method != "draft_model":
            overrides.setdefault(method, {}).setdefault("model", folder)
    # suffix decoding's cache of finished requests' outputs would let a prompt run again (the
    # warm-up, each repeat) draft its own earlier answer: off unless asked for
    overrides.setdefault("suffix", {}).setdefault(CACHE_KEY, 0)
    graphs = cuda_graph_sizes(args.compilation_config, False, 1)     # one request at a time: batch size 1
    variants = [plain_variant(llm, clock, graphs)]
    spec_vs, spec_skipped = speculative_variants(llm, spec_methods, args.num_speculative_tokens, draft_dir, overrides,
                                                 clock, graphs)
    peer_vs, peer_skipped = peer_variants(peer_names, args.num_speculative_tokens, llm.model_path, draft_dir,
                                          args.dtype, args.device, llm.tokenizer.eos_token_ids,
                                          clock) if peer_names else ([], [])
    gguf = find_gguf(llm.model_path)
    lc_vs, lc_skipped = llamacpp.llamacpp_variants(
        lc_names, args.num_speculative_tokens, None if gguf is None else str(gguf), args.threads or torch.get_num_threads(),
        llm.engine.max_model_len, llm.tokenizer.eos_token_ids, clock) if lc_names else ([], [])
    return (variants + spec_vs + peer_vs + lc_vs, skipped + spec_skipped + peer_skipped + lc_skipped)


def _config(args, llm: LLM, draft_dir: str | None) -> dict:
    return {"model": llm.model_path, "draft_model": draft_dir, "dtype": machine.weights_kind(llm.target),
            "device": args.device, "num_speculative_tokens": args.num_speculative_tokens,
            "temperatures": args.temperature, "top_p": args.top_p, "ignore_eos": args.ignore_eos, "prompts": args.prompts, "max_tokens": args.max_tokens,
            "repeats": args.repeats, "seed": args.seed, "peers": args.peers, "clock": args.clock,
            "threads": args.threads or torch.get_num_threads(),
            "speculative_config": args.speculative_config or {}, "hf_config_path": args.hf_config_path,
            "cuda_graphs": cuda_graph_sizes(args.compilation_config, False, 1) is not None}


def run_benchmark(args, command: str) -> tuple[dict, list[Path]]:
    if args.threads:
        torch.set_num_threads(args.threads)
        kernels.set_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if getattr(args, "runner", "auto") == "pooling" or getattr(args, "convert", "auto") not in ("auto", "none") \
            or getattr(args, "task", None) not in (None, "generate") or getattr(args, "pooler_config", None):
        raise ValueError("specdec bench measures generation: --runner pooling / --convert / --task embed / "
                         "--pooler-config do not apply")
    llm = LLM(model=args.model, num_speculative_tokens=0, dtype=args.dtype, device=args.device, max_num_seqs=1,
              max_model_len=args.max_model_len, hf_overrides=args.hf_overrides, hf_config_path=args.hf_config_path,
              disable_sliding_window=args.disable_sliding_window, tokenizer=args.tokenizer,
              generation_config=args.generation_config,
              override_generation_config=getattr(args, "override_generation_config", None),
              quantization=None if args.quantization == "auto" else args.quantization)
    draft_dir = _draft_dir(args, llm)
    variants, skipped = build_variants(args, llm, draft_dir, clock)
    max_len = llm.engine.max_model_len
    sets = [load_prompts(p, llm.tokenizer, args.max_tokens, max_len, args.limit_prompts, args.limit_per_category,
                         args.categories)
            for p in args.prompts]
    scenarios = [Scenario(name, t, prompts, args.top_p, args.ignore_eos) for name, prompts in sets for t in args.temperature]
    results = {"command": command, "machine": machine.machine_info(), "config": _config(args, llm, draft_dir),
               "roofline": machine.roofline(llm.target, machine.memory_bandwidth(clock=clock)) if args.device == "cpu" else None,
               "scenarios": [], "skipped": [s.to_dict() for s in skipped]}
    print(machine.describe(results["machine"], results["roofline"]), file=sys.stderr)
    if machine.busy(results["machine"]):
        print(f"specdec bench: warning: the machine is busy (load average {results['machine']['load_average']} "
              f"on {results['machine']['cores']} cores); timings will not be representative", file=sys.stderr)
    total = sum(num_steps(len(variants), len(s.prompts), args.repeats) for s in scenarios)
    with tqdm(total=total, desc="bench", unit="run", file=sys.stderr, dynamic_ncols=True) as bar:
        for s in scenarios:
            runs = measure(variants, s, args.repeats, args.seed, bar)
            summary = summarize(variants, runs, s, args.max_tokens, args.repeats)
            machine.add_roofline_fractions(summary, results["roofline"])
            if any(p.category for p in s.prompts):
                summary["categories"] = category_summaries(variants, runs, s.prompts, s.greedy)
            if s.greedy:
                label_mismatches(llm.target, s, summary, runs[PLAIN])
            results["scenarios"].append(summary)
    results["machine"]["load_average_end"] = machine.machine_info()["load_average"]
    return results, report.write_all(results, args.out)
