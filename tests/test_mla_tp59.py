"""Latent attention (DeepSeek-V2 / V3) at TP=2 (tester report 59, item 3): the absorbed per-head
products (W_UK^T q, W_UV o) take the row-invariant kernel as the shard's Linears do, so a row's
logprobs do not depend on its batch and greedy / seeded outputs equal TP=1's.

Each test starts a TP worker process (a few seconds on 2 cores)."""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams

from conftest import make_checkpoint

# > kernels.MAX_ROWS (64) prompt rows in one step (hidden 256: MKL's blocking then differs from a
# lone row's, and einsum's per-head products did too)
PROMPTS = ["def add(a, b):" + " x" * i for i in range(8)] + ["import os\n" * 6] * 4


def _logprobs(out):
    return [[v.logprob for v in step.values()] for step in out.outputs[0].logprobs]


@pytest.mark.tp
@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])      # q_proj; q_a -> q_b
def test_mla_tp2_rows_do_not_depend_on_their_batch_and_match_tp1(arch, tmp_path):
    ck = make_checkpoint(tmp_path / arch, arch=arch, seed=0, layers=2, hidden=256)
    kw = dict(model=str(ck), dtype="float32", num_speculative_tokens=0, enable_prefix_caching=False)
    greedy = SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, n=2, seed=5, max_tokens=6, ignore_eos=True)

    def tokens(outs):
        return [[c.token_ids for c in o.outputs] for o in outs]

    tp1 = LLM(**kw)
    want_greedy = tokens(tp1.generate(PROMPTS, greedy, use_tqdm=False))
    want_sampled = tokens(tp1.generate(PROMPTS, sampled, use_tqdm=False))
    del tp1
    tp2 = LLM(**kw, tensor_parallel_size=2)
    try:
        batched = tp2.generate(PROMPTS, greedy, use_tqdm=False)
        assert sum(len(o.prompt_token_ids) for o in batched) > 64
        for i in (0, 5, 8):
            assert _logprobs(tp2.generate(PROMPTS[i:i + 1], greedy, use_tqdm=False)[0]) == _logprobs(batched[i]), i
        assert tokens(batched) == want_greedy
        assert tokens(tp2.generate(PROMPTS, sampled, use_tqdm=False)) == want_sampled
    finally:
        tp2.shutdown()
