"""llama.cpp as a peer, through llama-cpp-python, on the same GGUF file and prompt token ids.

- llamacpp_plain: `Llama.generate`, one token per forward.
- llamacpp_prompt_lookup K=k (each integer K asked for, and its default 10): llama-cpp-python's only built-in drafter,
  `LlamaPromptLookupDecoding(num_pred_tokens=k)` (n-grams of up to 2 tokens, its default); the
  binding then needs `logits_all=True` (every row's logits copied out of each forward). It
  verifies by sampling each drafted position and comparing: lossless in exact arithmetic, but
  llama.cpp's batched and single-row quantized products do not sum alike, so its output can
  differ from its own plain decoding (the report says, prompt by prompt).

Same thread count as specdec (`--threads`, else torch's), the same stop rule (EOS ends a
request and is kept, as specdec reports it) and max tokens. Sampling (temperature > 0) runs
llama.cpp's own chain with every filter off (top-k 0, top-p 1, min-p 0, no penalties), seeded
per prompt. The binding is optional (`pip install -e ".[peers]"`, README): without it the
methods are skipped with the reason.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..config import SamplingParams
from ..metrics import RequestStats
from .variant import LLAMACPP, Run, Skipped, Variant

PEERS = ("llamacpp_plain", "llamacpp_prompt_lookup")
PLAIN = "llamacpp_plain"
DEFAULT_K = 10          # LlamaPromptLookupDecoding's own num_pred_tokens


def available() -> str | None:
    """The installed llama-cpp-python version, or None."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return getattr(llama_cpp, "__version__", "unknown")


@dataclass
class _Recorder:
    """Wraps a draft model: remembers where each draft was proposed and what it was."""
    inner: object
    prompt_len: int = 0
    drafts: list[tuple[int, list[int]]] = field(default_factory=list)   # (tokens generated before it, draft)

    def __call__(self, input_ids, /, **kwargs):
        out = self.inner(input_ids, **kwargs)
        self.drafts.append((len(input_ids) - self.prompt_len, [int(t) for t in out]))
        return out

    def stats(self, tokens: list[int]) -> RequestStats:
        """Acceptance counted against what was generated: a draft made after n output tokens is
        accepted up to its first token that differs from tokens[n:]."""
        s = RequestStats()
        for n, draft in self.drafts:
            if n >= len(tokens):
                break
            accepted = next((i for i, t in enumerate(draft) if n + i >= len(tokens) or tokens[n + i] != t), len(draft))
            s.record_step(len(draft), accepted, min(accepted + 1, len(tokens) - n))
        s.output_tokens = len(tokens)
        return s


def _llama(path: str, threads: int, n_ctx: int, draft=None):
    from llama_cpp import Llama

    return Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                 logits_all=draft is not None, draft_model=draft, verbose=False, seed=0)


def _runner(llm, eos_ids: set[int], clock, recorder: _Recorder | None):
    def generate(prompt_ids: list[int], params: SamplingParams) -> Run:
        greedy = params.greedy
        llm.set_seed(params.seed if params.seed is not None else 0)
        if recorder is not None:
            recorder.prompt_len, recorder.drafts = len(prompt_ids), []
        tokens: list[int] = []
        t0 = clock()
        gen = llm.generate(prompt_ids, temp=0.0 if greedy else params.temperature, top_k=0, top_p=params.top_p, min_p=0.0,
                           typical_p=1.0, repeat_penalty=1.0, reset=True)
        for tok in gen:
            tokens.append(int(tok))
            if (tok in eos_ids and not params.ignore_eos) or len(tokens) >= params.max_tokens:
                break
        gen.close()
        wall = clock() - t0
        if recorder is not None:
            stats = recorder.stats(tokens)
        else:
            stats = RequestStats(output_tokens=len(tokens), target_forward_passes=len(tokens))
        stats.prompt_tokens, stats.wall_time_s = len(prompt_ids), wall
        return Run(tokens, wall, stats, 0)
    return generate


def llamacpp_variants(names: list[str], ks: list, gguf: str | None, threads: int, n_ctx: int,
                      eos_ids: list[int], clock=time.perf_counter) -> tuple[list[Variant], list[Skipped]]:
    """The requested llama.cpp methods; skipped (with the reason) without the binding or a GGUF."""
    version = available()
    if version is None:
        return [], [Skipped(n, None, "llama-cpp-python is not installed (pip install 'specdec[peers]', or -e '.[peers]' in a checkout)") for n in names]
    if gguf is None:
        return [], [Skipped(n, None, "llama.cpp runs GGUF files; the target is not one") for n in names]
    from llama_cpp import llama_print_system_info
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    info = {"llama_cpp_python": version, "threads": threads,
            "system_info": llama_print_system_info().decode(errors="replace").strip()}
    eos = set(eos_ids)
    variants = []
    if PLAIN in names:
        variants.append(Variant(PLAIN, LLAMACPP, PLAIN, None, _runner(_llama(gguf, threads, n_ctx), eos, clock, None),
                                dict(info)))
    if "llamacpp_prompt_lookup" in names:
        for k in sorted({*(k for k in ks if isinstance(k, int)), DEFAULT_K}):     # the K asked for, and its own default
            rec = _Recorder(LlamaPromptLookupDecoding(num_pred_tokens=k))
            llm = _llama(gguf, threads, n_ctx, rec)
            variants.append(Variant(f"llamacpp_prompt_lookup K={k}", LLAMACPP, "llamacpp_prompt_lookup", k,
                                    _runner(llm, eos, clock, rec),
                                    {**info, "num_pred_tokens": k, "max_ngram_size": rec.inner.max_ngram_size,
                                     "logits_all": True}))
    return variants, []
