"""transformers' `generate` as peers, on the same checkpoints, prompt token ids and dtype.

- hf_plain: plain `generate`.
- hf_assisted K=k: assisted generation with the draft as `assistant_model`, K fixed (the
  "constant" schedule, the confidence early stop switched off).
- hf_assisted_default: assisted generation exactly as the installed transformers configures it
  (the settings it used are recorded; transformers 5.x: 20 tokens, "constant" schedule, a 0.4
  confidence early stop that adapts only when scikit-learn is installed).
- hf_assisted_heuristic: the classic "heuristic" schedule from 5 tokens (+2 after a full accept,
  -1 otherwise); opt-in through --methods.
- hf_prompt_lookup K=k: prompt-lookup decoding (`prompt_lookup_num_tokens=k`).

transformers reads the assistant's settings from `assistant_model.generation_config`, not from
`generate()`'s keyword arguments, and the "heuristic" schedule writes its K back there; so every
call starts from a fresh copy of the assistant's original config, and calls stay independent.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch

from ..config import SamplingParams
from ..metrics import RequestStats
from ..model.checkpoint import read_config, resolve_dtype
from .variant import TRANSFORMERS, Run, Skipped, Variant

PEERS = ("hf_plain", "hf_assisted", "hf_assisted_default", "hf_assisted_heuristic", "hf_prompt_lookup")
DEFAULT_PEERS = ("hf_plain", "hf_assisted", "hf_assisted_default", "hf_prompt_lookup")
NEEDS_ASSISTANT = ("hf_assisted", "hf_assisted_default", "hf_assisted_heuristic")
PER_K = ("hf_assisted", "hf_prompt_lookup")
HEURISTIC_START = 5


class Probe:
    """Times one `generate` call's target forwards and counts its speculative steps.

    Forward hooks on the target module time each forward; the candidate generator transformers
    builds for the call is wrapped (on that instance only) to time its drafting and record each
    step's (drafted, accepted). Everything is removed on exit."""

    def __init__(self, model):
        self.model = model

    def __enter__(self) -> "Probe":
        self.forward_s: list[float] = []
        self.steps: list[tuple[int, int]] = []
        self.draft_s, self._t0 = 0.0, 0.0
        self._hooks = [self.model.register_forward_pre_hook(self._pre),
                       self.model.register_forward_hook(self._post)]
        self._wrapped = hasattr(type(self.model), "_get_candidate_generator")
        if self._wrapped:
            self.model._get_candidate_generator = self._candidate_generator
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        if self._wrapped:
            del self.model._get_candidate_generator

    def _pre(self, module, args):
        self._t0 = time.perf_counter()

    def _post(self, module, args, output):
        self.forward_s.append(time.perf_counter() - self._t0)

    def _candidate_generator(self, *args, **kwargs):
        gen = type(self.model)._get_candidate_generator(self.model, *args, **kwargs)
        get, update = gen.get_candidates, gen.update_candidate_strategy

        def timed_get(*a, **kw):
            t0 = time.perf_counter()
            out = get(*a, **kw)
            self.draft_s += time.perf_counter() - t0
            return out

        def counted_update(input_ids, scores, num_matches):
            self.steps.append((scores.shape[1] - 1, int(num_matches)))   # scores: [1, K+1, V]
            return update(input_ids, scores, num_matches)

        gen.get_candidates, gen.update_candidate_strategy = timed_get, counted_update
        return gen

    def stats(self, output_tokens: int) -> tuple[RequestStats, int]:
        """RequestStats in specdec's meanings, and how many forwards target_time_s covers.

        The first forward holds the whole prompt (plain: the prefill; assisted: prefill and the
        first verification at once), so it is counted but left out of the per-forward time."""
        s = RequestStats()
        for k, n in self.steps:
            s.record_step(k, n, n + 1)
        if not self.steps:
            s.target_forward_passes = len(self.forward_s)
        s.output_tokens = output_tokens          # eos / max length may cut the last step short
        s.target_time_s, s.draft_time_s = sum(self.forward_s[1:]), self.draft_s
        return s, max(0, len(self.forward_s) - 1)


def _sampling_kwargs(params: SamplingParams, eos_ids: list[int]) -> dict:
    kw = {"max_new_tokens": params.max_tokens, "eos_token_id": None if params.ignore_eos else eos_ids or None,
          "pad_token_id": eos_ids[0] if eos_ids else None}
    if params.ignore_eos:
        kw["min_new_tokens"] = params.max_tokens
    if params.greedy:
        return {**kw, "do_sample": False}
    # specdec applies no top-k unless asked; transformers defaults to top_k=50
    return {**kw, "do_sample": True, "temperature": params.temperature, "top_k": 0, "top_p": params.top_p}


def _runner(model, eos_ids: list[int], extra: dict, prepare: Callable[[], None] | None = None, clock=time.perf_counter):
    def generate(prompt_ids: list[int], params: SamplingParams) -> Run:
        if prepare is not None:
            prepare()
        if not params.greedy:
            torch.manual_seed(params.seed if params.seed is not None else 0)
        ids = torch.tensor([prompt_ids], device=model.device)
        kwargs = {**_sampling_kwargs(params, eos_ids), **extra}
        with torch.inference_mode(), Probe(model) as probe:
            t0 = clock()
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
            wall = clock() - t0
        tokens = out[0, len(prompt_ids):].tolist()
        stats, timed = probe.stats(len(tokens))
        stats.prompt_tokens, stats.wall_time_s = len(prompt_ids), wall
        return Run(tokens, wall, stats, timed)
    return generate


def _load(folder: str, dtype: str, device: str):
    from transformers import AutoModelForCausalLM

    from ..model.gguf import find_gguf

    gguf = find_gguf(folder)
    if gguf is not None:      # transformers dequantizes a GGUF (as specdec's --quantization none)
        return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                    dtype=resolve_dtype(dtype, {"torch_dtype": "float32"})).to(device).eval()
    torch_dtype = resolve_dtype(dtype, read_config(folder))
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype).to(device).eval()


def _unloadable_assistant(draft_dir: str | None, dtype: str, device: str):
    """The draft as transformers' assistant model, or why it cannot be one (the assisted peers are
    then skipped with that reason, as any peer that cannot run)."""
    from ..model.vocab_draft import is_vocab_draft

    if draft_dir is None:
        return "no draft model (--speculative-model)"
    if is_vocab_draft(draft_dir):
        return (f"{draft_dir} is specdec's reduced-vocabulary draft (SpecdecVocabDraft), which transformers "
                "cannot load as an assistant model")
    try:
        return _load(draft_dir, dtype, device)
    except (OSError, ValueError) as e:           # a folder transformers does not know
        return f"transformers cannot load {draft_dir}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"


def _assistant_setup(assistant, base_cfg, **fields) -> Callable[[], None]:
    def prepare():
        cfg = copy.deepcopy(base_cfg)
        for name, value in fields.items():
            setattr(cfg, name, value)
        assistant.generation_config = cfg
    return prepare


def _default_settings(base_cfg) -> dict:
    """What transformers will use for an untouched assistant: its config, else the library default."""
    defaults = base_cfg._get_default_generation_params()
    names = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    out = {n: getattr(base_cfg, n, None) if getattr(base_cfg, n, None) is not None else defaults.get(n) for n in names}
    try:
        import sklearn  # noqa: F401
        out["confidence_threshold_adapts"] = True
    except ImportError:
        out["confidence_threshold_adapts"] = False     # transformers adapts it only with scikit-learn
    return out


def peer_variants(names: list[str], ks: list, target_dir: str, draft_dir: str | None, dtype: str,
                  device: str, eos_ids: list[int], clock=time.perf_counter) -> tuple[list[Variant], list[Skipped]]:
    """The requested peers, in PEERS order; a peer that cannot run is skipped with its reason."""
    try:
        import transformers
    except ImportError:
        return [], [Skipped(n, None, "transformers is not installed (pip install transformers, or specdec's [test] extra)") for n in names]
    transformers.logging.set_verbosity_error()     # per-call notices would bury the progress bar
    transformers.logging.disable_progress_bar()
    version = {"transformers": transformers.__version__}
    if not hasattr(transformers.GenerationMixin, "_get_candidate_generator"):
        # the probe counts drafts through this hook; without it acceptance would read as zero
        version["acceptance_counts"] = "unavailable: this transformers has no _get_candidate_generator"
    target = _load(target_dir, dtype, device)
    assistant, skipped = None, []
    if any(n in NEEDS_ASSISTANT for n in names):
        why = _unloadable_assistant(draft_dir, dtype, device)
        if isinstance(why, str):
            skipped += [Skipped(n, None, why) for n in names if n in NEEDS_ASSISTANT]
        else:
            assistant = why
    base_cfg = copy.deepcopy(assistant.generation_config) if assistant is not None else None
    int_ks = [k for k in ks if isinstance(k, int) and k > 0]
    variants = []
    for name in (n for n in PEERS if n in names):
        if name in NEEDS_ASSISTANT and assistant is None:
            continue
        if name == "hf_plain":
            variants.append(Variant(name, TRANSFORMERS, name, None, _runner(target, eos_ids, {}, None, clock), dict(version)))
        elif name == "hf_assisted_default":
            prep = _assistant_setup(assistant, base_cfg)
            variants.append(Variant(name, TRANSFORMERS, name, None,
                                    _runner(target, eos_ids, {"assistant_model": assistant}, prep, clock),
                                    {**version, **_default_settings(base_cfg)}))
        elif name == "hf_assisted_heuristic":
            fields = {"num_assistant_tokens": HEURISTIC_START, "num_assistant_tokens_schedule": "heuristic"}
            prep = _assistant_setup(assistant, base_cfg, **fields)
            variants.append(Variant(name, TRANSFORMERS, name, None,
                                    _runner(target, eos_ids, {"assistant_model": assistant}, prep, clock), {**version, **fields}))
        for k in int_ks if name in PER_K else []:
            variants.append(_per_k_variant(name, k, target, assistant, base_cfg, eos_ids, version, clock))
    if any(n in PER_K for n in names) and not int_ks:
        skipped.append(Skipped(",".join(n for n in names if n in PER_K), None, "no integer K in --num-speculative-tokens"))
    return variants, skipped


def _per_k_variant(name, k, target, assistant, base_cfg, eos_ids, version, clock) -> Variant:
    if name == "hf_prompt_lookup":
        extra = {"prompt_lookup_num_tokens": k}
        return Variant(f"{name} K={k}", TRANSFORMERS, name, k, _runner(target, eos_ids, extra, None, clock),
                       {**version, **extra, "max_matching_ngram_size": "default (2)"})
    # K fixed: the constant schedule, and no confidence early stop cutting drafts short
    fields = {"num_assistant_tokens": k, "num_assistant_tokens_schedule": "constant",
              "assistant_confidence_threshold": 0.0}
    prep = _assistant_setup(assistant, base_cfg, **fields)
    return Variant(f"{name} K={k}", TRANSFORMERS, name, k,
                   _runner(target, eos_ids, {"assistant_model": assistant}, prep, clock), {**version, **fields})
