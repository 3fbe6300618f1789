"""specdec's own variants: plain decoding and every registered proposer at each K, on one target.

Every engine shares the target already loaded by the LLM (and one loaded draft), so adding a
method or a K costs no memory and no load time; only the proposers differ.
"""

from __future__ import annotations

import dataclasses
import time

from ..config import MTP_METHODS, SchedulerConfig, SpeculativeConfig
from ..engine import Engine
from ..model import CheckpointError
from ..proposers import REGISTRY, build_proposer, typical_acceptance
from .variant import SPECDEC, Skipped, Variant, engine_runner

PLAIN = "plain"
# the harness runs one request at a time: a pool for one sequence per engine (many engines live at once)
ONE_AT_A_TIME = SchedulerConfig(max_num_seqs=1)


def registered_methods() -> list[str]:
    return list(REGISTRY)


def _cached_loader(llm):
    """Load each draft folder once, however many K values and methods use it."""
    loaded: dict[str, object] = {}

    def load(folder: str):
        if folder not in loaded:
            loaded[folder] = llm._load_draft(folder)
        return loaded[folder]
    return load


def plain_variant(llm, clock=time.perf_counter, graphs: tuple[int, ...] | None = None) -> Variant:
    """graphs: CUDA graph capture sizes for the engine's target forwards (config.cuda_graph_sizes), or None."""
    engine = Engine(llm.target, llm.tokenizer, None, 0, llm.engine.max_model_len, scheduler_config=ONE_AT_A_TIME,
                    clock=clock, cuda_graph_sizes=graphs)
    return Variant(PLAIN, SPECDEC, PLAIN, 0, engine_runner(engine, clock))


# `ngram`'s lookup sizes in specdec's benchmarks when --speculative-config gives neither (what every
# recorded `specdec bench` run measured; vLLM's own default, which speculative_config follows, is 5 and 5)
BENCH_NGRAM_LOOKUP = {"prompt_lookup_min": 1, "prompt_lookup_max": 4}


def _spec(method: str, k, draft_dir: str | None, overrides: dict) -> SpeculativeConfig:
    fields = dict(overrides)
    if method == "draft_model" and draft_dir is not None:
        fields.setdefault("model", draft_dir)
    if method == "ngram" and all(fields.get(key) is None for key in BENCH_NGRAM_LOOKUP):
        fields.update(BENCH_NGRAM_LOOKUP)
    return SpeculativeConfig.from_dict({**fields, "method": method, "num_speculative_tokens": k})


def _engine(llm, spec: SpeculativeConfig, load, clock=time.perf_counter, graphs: tuple[int, ...] | None = None) -> Engine:
    max_len = llm.engine.max_model_len
    proposer = build_proposer(spec, llm.target, load, max_len)
    return Engine(llm.target, llm.tokenizer, proposer, spec.num_speculative_tokens, max_len, max_k=spec.max_k,
                  scheduler_config=ONE_AT_A_TIME, typical=typical_acceptance(spec), clock=clock, cuda_graph_sizes=graphs)


def _settings(spec: SpeculativeConfig, proposer) -> dict:
    """What this proposer ran with: its own scalar settings (n-gram sizes, exit layer, ...),
    read generically so that a newly registered method is described without code here."""
    out = {"model": spec.model} if spec.model else {}
    out.update({k: v for k, v in vars(proposer).items()
                if not k.startswith("_") and isinstance(v, (int, float, str, bool))})
    if spec.adaptive:
        out["max_k"] = spec.max_k
    return {**out, **spec.extra}


def speculative_variants(llm, methods: list[str], ks: list, draft_dir: str | None,
                         overrides: dict[str, dict], clock=time.perf_counter,
                         graphs: tuple[int, ...] | None = None) -> tuple[list[Variant], list[Skipped]]:
    """One variant per (registered method, K). A method that cannot be built at a K (no draft
    model, no trained heads, K beyond what it supports) is skipped with its reason."""
    load = _cached_loader(llm)
    variants, skipped = [], []
    for method in methods:
        for k in ks:
            try:
                spec = _spec(method, k, draft_dir, overrides.get(method, {}))
                if method in MTP_METHODS and not spec.model:        # the target's own MTP layers
                    spec = dataclasses.replace(spec, model=llm.model_path)
                engine = _engine(llm, spec, load, clock, graphs)
            except (ValueError, CheckpointError, OSError, NotImplementedError) as e:
                skipped.append(Skipped(method, k, str(e).splitlines()[0] if str(e) else type(e).__name__))
                continue
            settings = _settings(spec, engine.proposer)
            variants.append(Variant(f"{method} K={k}", SPECDEC, method, k, engine_runner(engine, clock), settings))
    return variants, skipped
