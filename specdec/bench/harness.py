"""The measurement loop: one warm-up per variant, then repeats interleaved across variants.

Within a repeat every prompt is run by every variant back to back, and the order of variants
rotates from one (repeat, prompt) to the next, so slow drift of the machine (thermal, a
neighbour process) lands on all variants alike instead of on whichever ran last.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import SamplingParams
from .prompts import Prompt
from .variant import Run, Variant


@dataclass(frozen=True)
class Scenario:
    prompt_set: str               # "code", "repeat", or a file's stem
    temperature: float
    prompts: list[Prompt]
    top_p: float = 1.0            # nucleus sampling of sampled runs (every method, peers included)
    ignore_eos: bool = False      # every request runs to its max tokens (every method, peers included)

    @property
    def name(self) -> str:
        return f"{self.prompt_set}_t{self.temperature:g}"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sampling_params(scenario: Scenario, seed: int) -> list[SamplingParams]:
    """One per prompt; sampled runs get a seed per prompt, the same in every repeat and variant."""
    return [SamplingParams(temperature=scenario.temperature, max_tokens=p.max_tokens,
                           top_p=1.0 if scenario.greedy else scenario.top_p, seed=None if scenario.greedy else seed + i,
                           ignore_eos=scenario.ignore_eos)
            for i, p in enumerate(scenario.prompts)]


def rotated(variants: list[Variant], shift: int) -> list[Variant]:
    shift %= len(variants)
    return variants[shift:] + variants[:shift]


def measure(variants: list[Variant], scenario: Scenario, repeats: int, seed: int = 0,
            progress=None) -> dict[str, list[list[Run]]]:
    """runs[variant name][repeat][prompt index]."""
    params = sampling_params(scenario, seed)
    prompts = scenario.prompts

    def step(v: Variant, i: int) -> Run:
        if progress is not None:
            progress.set_postfix_str(f"{scenario.name} {v.name}", refresh=False)
        run = v.generate(prompts[i].ids, params[i])
        if progress is not None:
            progress.update()
        return run

    for v in variants:                       # warm-up: allocations, caches, lazy imports
        step(v, 0)
    runs = {v.name: [[None] * len(prompts) for _ in range(repeats)] for v in variants}
    for r in range(repeats):
        for i in range(len(prompts)):
            for v in rotated(variants, r * len(prompts) + i):
                runs[v.name][r][i] = step(v, i)
    return runs


def num_steps(num_variants: int, num_prompts: int, repeats: int) -> int:
    """Calls `measure` makes, for the progress bar."""
    return num_variants * (1 + num_prompts * repeats)
