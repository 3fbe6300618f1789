"""Shared by the proxy scripts' timing children (gpt_oss_proxy.py, mla_proxy.py): greedy decoding
of a fixed 32-token prompt, warmed up once, best of 3."""
from __future__ import annotations

import time

PROMPT = {"prompt_token_ids": list(range(2, 34))}


def best_ms_per_token(llm, tokens: int):
    """(ms per generated token, best of 3 runs after a warm-up, the last run's outputs)."""
    from specdec import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    best, out = 1e9, None
    for _ in range(3):
        t0 = time.perf_counter()
        out = llm.generate(PROMPT, params)
        best = min(best, time.perf_counter() - t0)
    return 1000 * best / tokens, out
