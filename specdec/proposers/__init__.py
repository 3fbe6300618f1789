"""Proposers, one file per method, and the registry that builds one from a SpeculativeConfig."""

from __future__ import annotations

from typing import Callable

from ..config import SpeculativeConfig
from .base import Draft, DraftSession, Proposer, RequestContext
from .draft_model import DraftModelProposer
from .layer_skip import LayerSkipProposer
from .ngram import NgramProposer


def _draft_model(spec: SpeculativeConfig, target, loader, max_len):
    return DraftModelProposer(loader(spec.model), max_len)


def _ngram(spec: SpeculativeConfig, target, loader, max_len):
    return NgramProposer(spec.prompt_lookup_max, spec.prompt_lookup_min)


def _layer_skip(spec: SpeculativeConfig, target, loader, max_len):
    n = spec.num_layers if spec.num_layers is not None else max(1, target.config.num_hidden_layers // 4)
    return LayerSkipProposer(target, n)


# method name -> builder(spec, target model, load_model(dir), max_len) -> Proposer
REGISTRY: dict[str, Callable] = {
    "draft_model": _draft_model,
    "ngram": _ngram,
    "layer_skip": _layer_skip,
}


def build_proposer(spec: SpeculativeConfig, target, loader, max_len) -> Proposer:
    if spec.method not in REGISTRY:
        raise ValueError(f"speculative method {spec.method!r} is not available "
                         f"(available: {', '.join(REGISTRY)})")
    return REGISTRY[spec.method](spec, target, loader, max_len)


__all__ = ["Draft", "DraftSession", "Proposer", "RequestContext", "REGISTRY", "build_proposer"]
