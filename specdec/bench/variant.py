"""What the harness runs (a Variant: one method at one K) and what one request yields (a Run)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from collections.abc import Callable

from ..config import SamplingParams
from ..metrics import RequestStats

SPECDEC, TRANSFORMERS, LLAMACPP = "specdec", "transformers", "llama.cpp"


@dataclass
class Run:
    """One request of one variant."""
    token_ids: list[int]
    wall_s: float                 # around the whole call, the same clock for every family
    stats: RequestStats           # acceptance counts; draft_time_s / target_time_s
    timed_target_forwards: int    # how many target forwards stats.target_time_s covers


@dataclass
class Variant:
    name: str                     # unique label, e.g. "draft_model K=4", "hf_assisted K=4"
    family: str                   # SPECDEC, TRANSFORMERS or LLAMACPP
    method: str                   # "plain", a registry name, or a peer: "hf_plain", "llamacpp_plain", ...
    k: int | str | None           # tokens drafted per step; "auto"; None (plain, or the peer decides)
    generate: Callable[[list[int], SamplingParams], Run]
    settings: dict = field(default_factory=dict)   # recorded in results.json as they ran


@dataclass(frozen=True)
class Skipped:
    """A method (at a K) that could not run, with the reason: reported, never silently dropped."""
    method: str
    k: int | str | None
    reason: str

    def to_dict(self) -> dict:
        return {"method": self.method, "k": self.k, "reason": self.reason}


def engine_runner(engine, clock=time.perf_counter) -> Callable[[list[int], SamplingParams], Run]:
    """A specdec Engine as a Variant.generate: stream to the end, time the whole stream."""
    def generate(prompt_ids: list[int], params: SamplingParams) -> Run:
        tokens, event = [], None
        t0 = clock()
        for event in engine.generate(prompt_ids, params):
            tokens += event.token_ids
        wall = clock() - t0
        # the engine times verification steps only; prefill is outside target_time_s
        return Run(tokens, wall, event.stats, event.stats.target_forward_passes)
    return generate
