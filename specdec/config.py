"""Frozen, validated configuration: built once at the edge (Python API, CLI, server)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_STOP_STRINGS = 16
GREEDY_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """vLLM's sampling parameters. temperature 0 means greedy; top_k <= 0 and top_p 1 disable."""
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self):
        _check(isinstance(self.n, int) and not isinstance(self.n, bool) and 1 <= self.n <= 16, "n", "must be an integer in [1, 16]", self.n)
        _check(_real(self.temperature) and self.temperature >= 0, "temperature", "must be a finite number >= 0", self.temperature)
        _check(_real(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _check(isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and (self.top_k >= 1 or self.top_k in (0, -1)),
               "top_k", "must be -1 or 0 (disabled) or a positive integer", self.top_k)
        _check(_real(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        _check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)), "seed", "must be an integer", self.seed)
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool) and self.max_tokens >= 1),
               "max_tokens", "must be an integer >= 1", self.max_tokens)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        _check(all(isinstance(s, str) and s for s in stop), "stop", "must be non-empty strings", self.stop)
        _check(len(stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings", len(stop))
        object.__setattr__(self, "stop", stop)
        ids = list(self.stop_token_ids or [])
        _check(all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids), "stop_token_ids", "must be token ids >= 0", ids)
        object.__setattr__(self, "stop_token_ids", ids)
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20), "logprobs", "must be in [0, 20]", self.logprobs)

    @property
    def greedy(self) -> bool:
        # below 1e-5 the scaled logits overflow float32; vLLM treats such temperatures as 0 too
        return self.temperature < GREEDY_EPS


def _real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check(ok: bool, name: str, rule: str, value) -> None:
    if not ok:
        raise ValueError(f"{name} {rule}, got {value!r}")


METHODS = ("draft_model", "ngram", "layer_skip", "medusa", "eagle")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`. num_speculative_tokens: an int, or "auto" (adaptive K)."""
    method: str = "draft_model"
    model: str | None = None
    num_speculative_tokens: int | str = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    num_layers: int | None = None        # layer_skip: exit after this many layers
    max_k: int | None = None             # upper bound for "auto": K (default 8), tree size (32)
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        ok = k == "auto" or (isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= 64)
        _check(ok, "num_speculative_tokens", 'must be an integer in [0, 64] or "auto"', k)
        _check(1 <= self.prompt_lookup_min <= self.prompt_lookup_max, "prompt_lookup_min",
               "must be >= 1 and <= prompt_lookup_max", self.prompt_lookup_min)
        if self.max_k is None:
            object.__setattr__(self, "max_k", 32 if self.method in ("medusa", "eagle") else 8)
        _check(isinstance(self.max_k, int) and not isinstance(self.max_k, bool) and 1 <= self.max_k <= 64,
               "max_k", "must be an integer in [1, 64]", self.max_k)
        if self.method in ("draft_model", "medusa", "eagle") and not self.model:
            what = "a draft model folder" if self.method == "draft_model" else f"a heads folder (specdec train {self.method})"
            raise ValueError(f"speculative_config.model is required for method {self.method!r}: {what}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.model is required for method 'draft_model'")

    @property
    def adaptive(self) -> bool:
        return self.num_speculative_tokens == "auto"

    @classmethod
    def from_dict(cls, d: dict) -> "SpeculativeConfig":
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be an object, got {type(d).__name__}")
        d = dict(d)
        if "method" not in d:
            d["method"] = "draft_model" if d.get("model") else "ngram"
        known = set(cls.__dataclass_fields__) - {"extra"}
        extra = {k: d.pop(k) for k in list(d) if k not in known}
        return cls(**d, extra=extra)
