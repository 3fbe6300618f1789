"""Proposers, one file per method, and the registry that builds one from a SpeculativeConfig."""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

from ..config import MTP_METHODS, VLLM_SPEC_KEYS, SpeculativeConfig
from .base import Committed, Draft, ProposeItem, Proposer, ProposerBase, ProposerCaps, RequestContext
from .draft_model import DraftModelProposer
from .eagle import DEFAULT_DEPTH, EagleProposer
from .hybrid import HybridProposer, HybridSettings
from .layer_skip import LayerSkipProposer
from .medusa import MedusaProposer
from .ngram import NgramProposer
from .suffix import SuffixProposer, SuffixSettings, load_datastore

log = logging.getLogger("specdec.proposers")


def _draft_model(spec: SpeculativeConfig, target, loader, max_len):
    from ..model.vocab_draft import is_vocab_draft
    draft = loader(spec.model)
    # vLLM refuses any other size: a smaller one cannot embed the target's tokens past its end (a
    # padded, larger one is fine here: its logits are cut to the target's; a draft over its own
    # draft vocabulary maps onto the target's by design)
    if not is_vocab_draft(spec.model) and draft.config.vocab_size < target.config.vocab_size:
        raise ValueError(f"{spec.model}: the draft's vocab_size ({draft.config.vocab_size}) is smaller than the "
                         f"target's ({target.config.vocab_size}): target and draft model should have the same "
                         "vocabulary size (vLLM's rule)")
    limit = spec.extra.get("max_model_len")
    if limit is not None and limit > draft.config.max_position_embeddings:
        raise ValueError(f"speculative_config.max_model_len={limit} cannot be larger than the draft's context "
                         f"({draft.config.max_position_embeddings})")
    return DraftModelProposer(draft)


def _ngram(spec: SpeculativeConfig, target, loader, max_len):
    return NgramProposer(spec.prompt_lookup_max, spec.prompt_lookup_min)


def _suffix(spec: SpeculativeConfig, target, loader, max_len):
    """Own-context matches of at least max(2, prompt_lookup_min) tokens first (single-token
    matches lose to the datastore's longer ones), then the datastore (`model`) and the cache."""
    settings = SuffixSettings.from_extra(spec.extra)
    vocab = target.config.vocab_size if target is not None else None
    store = load_datastore(spec.model, vocab) if spec.model else None
    return SuffixProposer(settings, max(spec.prompt_lookup_max, 2), max(2, spec.prompt_lookup_min), store)


def _layer_skip(spec: SpeculativeConfig, target, loader, max_len):
    n = spec.num_layers if spec.num_layers is not None else max(1, target.config.num_hidden_layers // 4)
    return LayerSkipProposer(target, n)


def _load_heads(spec: SpeculativeConfig, target, kind: str):
    from ..model.heads import load_heads
    if not spec.model:
        raise ValueError(f"speculative_config.model is required for method {spec.method!r}: "
                         f"a heads folder written by `specdec train {spec.method}`")
    return load_heads(spec.model, target, kind)


def _medusa(spec: SpeculativeConfig, target, loader, max_len):
    """specdec's heads folder, or Medusa heads as vLLM or the Medusa authors ship them."""
    from ..model.heads import MEDUSA, is_released_medusa, load_medusa_released
    if spec.model and is_released_medusa(spec.model):
        return MedusaProposer(load_medusa_released(spec.model, target), target.config.vocab_size)
    heads = _load_heads(spec, target, MEDUSA)
    return MedusaProposer(heads, target.config.vocab_size, heads_config(spec.model).get("accuracy"))


def _tree_shape(spec: SpeculativeConfig, topk: int, depth: int | None) -> tuple[int, int | None]:
    """The EAGLE proposer's `topk` and `depth` (speculative_config's, else these defaults), checked.

    A chain (topk 1) drafts num_speculative_tokens tokens, as vLLM's EAGLE / EAGLE-3 / MTP chains
    do: its depth defaults to K ("auto": max_k when given, else DEFAULT_DEPTH, the ladder's top),
    and an explicit depth below K is an error (it would cap every draft below what K asks for).
    A tree (topk > 1) keeps its rules: depth in [1, 16], default DEFAULT_DEPTH, N nodes kept."""
    topk, depth = spec.extra.get("topk", topk), spec.extra.get("depth", depth)
    v = topk
    if not (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 16):
        raise ValueError(f"speculative_config.topk must be an integer in [1, 16], got {v!r}")
    top = 64 if topk == 1 else 16
    if depth is not None and not (isinstance(depth, int) and not isinstance(depth, bool) and 1 <= depth <= top):
        raise ValueError(f"speculative_config.depth must be an integer in [1, {top}], got {depth!r}")
    if topk == 1:
        k = spec.num_speculative_tokens
        if k == "auto":
            k = spec.max_k if "max_k" in spec.given else DEFAULT_DEPTH
        if depth is None:
            depth = k
        elif depth < k:
            raise ValueError(f"speculative_config.depth ({depth}) is below num_speculative_tokens ({k}): an "
                             f"{spec.method} chain (topk 1) drafts num_speculative_tokens tokens; leave depth out "
                             "or lower num_speculative_tokens")
    return topk, depth


def _eagle(spec: SpeculativeConfig, target, loader, max_len):
    """specdec's heads folder, or an EAGLE head as its authors ship it (vLLM's "eagle" heads:
    chains unless topk > 1 asks for EAGLE-2 trees, as vLLM drafts them)."""
    from ..model.heads import EAGLE, is_eagle_authors, load_eagle_authors
    if spec.model and is_eagle_authors(spec.model):
        topk, depth = _tree_shape(spec, 1, None)
        return EagleProposer(load_eagle_authors(spec.model, target), target, topk=topk, depth=depth)
    cfg = heads_config(spec.model) if spec.model else {}
    topk, depth = _tree_shape(spec, cfg.get("default_topk", 4), cfg.get("default_depth"))
    return EagleProposer(_load_heads(spec, target, EAGLE), target, topk=topk, depth=depth)


def _eagle3(spec: SpeculativeConfig, target, loader, max_len):
    """An EAGLE-3 head (vLLM's / the authors' folders: model/eagle3.py); chains unless topk > 1
    asks for EAGLE-2 trees (vLLM drafts EAGLE-3 chains by default)."""
    from ..model.eagle3 import load_eagle3
    if not spec.model:
        raise ValueError("speculative_config.model is required for method 'eagle3': an EAGLE-3 head's folder")
    topk, depth = _tree_shape(spec, 1, None)
    return EagleProposer(load_eagle3(spec.model, target), target, topk=topk, depth=depth)


def _mtp(spec: SpeculativeConfig, target, loader, max_len):
    """The MTP layers a target ships (model/mtp.py), in its own folder unless `model` names
    another; chains (vLLM's), or EAGLE-2 trees with topk > 1."""
    from ..model.mtp import load_mtp
    if not spec.model:
        raise ValueError(f"speculative_config.model is required for method {spec.method!r} here: the folder "
                         "whose checkpoint holds the MTP layers (LLM() fills in the target's)")
    topk, depth = _tree_shape(spec, 1, None)
    return EagleProposer(load_mtp(spec.model, target), target, topk=topk, depth=depth)


def _mlp_speculator(spec: SpeculativeConfig, target, loader, max_len):
    """IBM's MLP speculators (model/mlp_speculator.py): chains of at most n_predict tokens."""
    from ..model.mlp_speculator import load_mlp_speculator
    from .mlp_speculator import MLPSpeculatorProposer
    speculator = load_mlp_speculator(spec.model, target)
    k = spec.num_speculative_tokens
    if k != "auto" and k > speculator.n_predict:
        raise ValueError(f"num_speculative_tokens ({k}) exceeds the MLP speculator's n_predict "
                         f"({speculator.n_predict}): it drafts at most that many tokens a step")
    return MLPSpeculatorProposer(speculator, target.config.vocab_size)


HYBRID_KEYS = tuple(f.name for f in dataclasses.fields(HybridSettings) if f.name != "decay")


def _hybrid(learned_method: str) -> Callable:
    """"ngram+<learned_method>": lookup first, the learned proposer where it pays (hybrid.py)."""
    def build(spec: SpeculativeConfig, target, loader, max_len):
        settings = HybridSettings(**{k: spec.extra[k] for k in HYBRID_KEYS if k in spec.extra})
        extra = {k: v for k, v in spec.extra.items() if k not in HYBRID_KEYS}
        if learned_method in ("eagle", "mtp"):
            if extra.get("topk", 1) != 1:
                raise ValueError(f"speculative_config.topk must be 1 for {spec.method!r} (it drafts chains), "
                                 f"got {extra['topk']!r}")
            extra["topk"] = 1
        inner = dataclasses.replace(spec, method=learned_method, extra=extra)
        depth = extra.get("depth")
        if learned_method != "draft_model" and isinstance(depth, int) and not isinstance(depth, bool) and 1 <= depth <= 64:
            # the hybrid's learned chain may stop short of K (lookup drafts up to K either way)
            inner = dataclasses.replace(inner, num_speculative_tokens=depth)
        learned = _draft_context(REGISTRY[learned_method](inner, target, loader, max_len), inner)
        return HybridProposer(learned, spec.prompt_lookup_max, spec.prompt_lookup_min, settings)
    return build


def _draft_context(proposer: Proposer, spec: SpeculativeConfig) -> Proposer:
    """vLLM's speculative_config.max_model_len, the draft's context: its own lowered to it, so a
    request past it decodes plainly from there (draft_room), as vLLM skips speculation for it."""
    limit = spec.extra.get("max_model_len")
    if limit is not None:
        own = proposer.caps.max_len
        proposer.caps = dataclasses.replace(proposer.caps, max_len=limit if own is None else min(own, limit))
    return proposer


def heads_config(folder) -> dict:
    import json
    from pathlib import Path
    try:
        return json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


# method name -> builder(spec, target model, load_model(dir), max_len) -> Proposer
REGISTRY: dict[str, Callable] = {
    "draft_model": _draft_model,
    "ngram": _ngram,
    "suffix": _suffix,
    "layer_skip": _layer_skip,
    "medusa": _medusa,
    "eagle": _eagle,
    "eagle3": _eagle3,
    "mlp_speculator": _mlp_speculator,
    **{name: _mtp for name in MTP_METHODS if not name.startswith("ngram+")},
    "ngram+eagle": _hybrid("eagle"),
    "ngram+draft_model": _hybrid("draft_model"),
    "ngram+mtp": _hybrid("mtp"),
}


ACCEPTANCE_METHODS = ("rejection_sampler", "typical_acceptance_sampler")


# speculative_config keys beside SpeculativeConfig's fields: the ones specdec reads, and vLLM's
# other fields (config.VLLM_SPEC_KEYS: their values checked there, taken where they change nothing);
# any other key is an error, as it is in vLLM (a typo must not pass silently)
SUFFIX_KEYS = tuple(f"suffix_decoding_{f}" for f in SuffixSettings.__dataclass_fields__)
TYPICAL_KEYS = ("posterior_threshold", "posterior_alpha")
READ_KEYS = {"topk", "depth", "acceptance_method", *TYPICAL_KEYS, *HYBRID_KEYS, *SUFFIX_KEYS}
# what each method reads beside method, num_speculative_tokens, disable_by_batch_size and the
# acceptance keys (every method's); a key given to a method that does not read it is a warning
LOOKUP_FIELDS = ("prompt_lookup_min", "prompt_lookup_max")
# max_model_len: the context of a drafter that is a model (vLLM's draft_model_config); lookup has none
_MODEL = ("model", "max_model_len")
_EAGLE_READS = (*_MODEL, "topk", "depth")
METHOD_READS: dict[str, tuple[str, ...]] = {
    "draft_model": _MODEL, "ngram": LOOKUP_FIELDS, "suffix": ("model", *LOOKUP_FIELDS, *SUFFIX_KEYS),
    "layer_skip": ("num_layers", "max_model_len"), "medusa": _MODEL, "eagle": _EAGLE_READS, "eagle3": _EAGLE_READS,
    "mlp_speculator": _MODEL, **{m: _EAGLE_READS for m in MTP_METHODS if not m.startswith("ngram+")},
    "ngram+eagle": (*_EAGLE_READS, *LOOKUP_FIELDS, *HYBRID_KEYS),
    "ngram+mtp": (*_EAGLE_READS, *LOOKUP_FIELDS, *HYBRID_KEYS),
    "ngram+draft_model": (*_MODEL, *LOOKUP_FIELDS, *HYBRID_KEYS),
}
EVERY_METHOD_READS = {"method", "num_speculative_tokens", "disable_by_batch_size", "acceptance_method", *TYPICAL_KEYS,
                      "max_k", *(set(VLLM_SPEC_KEYS) - {"max_model_len"})}


def check_keys(spec: SpeculativeConfig) -> None:
    """One clear error for a speculative_config key specdec cannot honour, and a warning for
    each key the chosen method does not read (it would change nothing)."""
    for key in spec.extra:
        if key in READ_KEYS or key in VLLM_SPEC_KEYS:      # vLLM's: their values checked by SpeculativeConfig
            continue
        known = sorted({f for f in SpeculativeConfig.__dataclass_fields__ if f not in ("extra", "given")} | READ_KEYS)
        raise ValueError(f"speculative_config: unknown key {key!r} (specdec reads {', '.join(known)}, and vLLM's "
                         "other keys)")
    typical = spec.extra.get("acceptance_method") == "typical_acceptance_sampler"
    reads = set(METHOD_READS.get(spec.method, ())) | EVERY_METHOD_READS
    for key in sorted(spec.given):
        if key not in reads:
            log.warning("speculative_config: method %r does not read %r: it has no effect", spec.method, key)
        elif key in TYPICAL_KEYS and not typical:
            log.warning("speculative_config: %r is read only with acceptance_method 'typical_acceptance_sampler' "
                        "(method %r verifies by rejection sampling): it has no effect", key, spec.method)
        elif key == "max_k" and not spec.adaptive:
            log.warning("speculative_config: 'max_k' is read only with num_speculative_tokens \"auto\": it has no "
                        "effect on method %r at K = %s", spec.method, spec.num_speculative_tokens)
    if spec.extra.get("quantization") is not None:      # vLLM would quantize the draft online
        log.warning("speculative_config: 'quantization' (%r) is ignored: the draft loads as its folder stores it "
                    "(by its own quantization_config, if any)", spec.extra["quantization"])


def build_proposer(spec: SpeculativeConfig, target, loader, max_len) -> Proposer:
    if spec.method not in REGISTRY:
        raise ValueError(f"speculative method {spec.method!r} is not available "
                         f"(available: {', '.join(REGISTRY)})")
    check_keys(spec)
    typical_acceptance(spec)          # a bad acceptance setting fails before any weights load
    limit = spec.extra.get("max_model_len")       # vLLM's: at most the target's (and the draft's: _draft_model)
    if limit is not None and limit > max_len:
        raise ValueError(f"speculative_config.max_model_len={limit} cannot be larger than the target's "
                         f"max_model_len ({max_len})")
    proposer = REGISTRY[spec.method](spec, target, loader, max_len)
    if spec.method in ("ngram", "suffix") or isinstance(proposer, HybridProposer):   # a hybrid's learned one: _hybrid
        return proposer
    return _draft_context(proposer, spec)


def typical_acceptance(spec: SpeculativeConfig | None) -> tuple[float, float] | None:
    """(threshold, alpha) of Medusa's typical acceptance when the config asks for it (lossy:
    only ever explicit), else None; a verification setting of the engine, not of a proposer."""
    if spec is None:
        return None
    acceptance = spec.extra.get("acceptance_method", "rejection_sampler")
    if acceptance not in ACCEPTANCE_METHODS:
        raise ValueError(f"speculative_config.acceptance_method must be one of {', '.join(ACCEPTANCE_METHODS)}, "
                         f"got {acceptance!r}")
    threshold = spec.extra.get("posterior_threshold", 0.09)
    alpha = spec.extra.get("posterior_alpha", 0.3)
    for name, v in (("posterior_threshold", threshold), ("posterior_alpha", alpha)):     # checked even unread
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1):
            raise ValueError(f"speculative_config.{name} must be in (0, 1], got {v!r}")
    if acceptance != "typical_acceptance_sampler":
        return None
    return float(threshold), float(alpha)


__all__ = ["check_keys", "Committed", "Draft", "HybridProposer", "ProposeItem", "Proposer", "ProposerBase", "ProposerCaps",
           "RequestContext", "REGISTRY", "SuffixProposer", "build_proposer", "typical_acceptance"]
