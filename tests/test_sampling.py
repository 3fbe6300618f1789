"""The sampling primitives every method shares: the nucleus (top-p) filter and the draw."""

from __future__ import annotations

import pytest
import torch

from specdec.config import SamplingParams
from specdec.sampling import make_generator, nucleus_drop, process, process_rows, sample


def _sorted_definition(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p by a full descending sort: drop a token when its more likely tokens hold top_p."""
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    before = sorted_p.double().cumsum(-1) - sorted_p
    drop = (before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    drop[:, 0] = False
    return torch.empty_like(drop).scatter_(-1, idx, drop)


@pytest.mark.parametrize("scale", [0.3, 1.0, 3.0, 8.0, 20.0])
def test_nucleus_equals_the_full_sort(scale):
    """Narrow nuclei end in the first tier, flat rows fall through to 4096 tokens or a whole sort:
    every row gets the sort's answer, rows with top_p 1 lose nothing."""
    g = torch.Generator().manual_seed(int(scale * 10))
    V = 49152
    probs = (torch.randn(16, V, generator=g) * scale).softmax(-1)
    top_p = torch.tensor([0.1, 0.5, 0.9, 0.95, 0.999, 1.0, 0.7, 1.0] * 2)
    got = nucleus_drop(probs, top_p)
    assert torch.equal(got, _sorted_definition(probs, top_p))
    assert not got[top_p == 1.0].any()
    assert (~got).sum(-1).min() >= 1                   # the most likely token always stays


def test_process_rows_keeps_each_rows_own_top_p():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5000, generator=g) * 4
    params = [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.5, top_p=0.5)]
    rows = process_rows(logits, params)
    for r, p in enumerate(params):
        assert torch.equal(rows[r:r + 1], process(logits[r:r + 1], p))
    assert (rows[1] > 0).all() and (rows[0] == 0).any()


def test_sample_follows_the_distribution_and_skips_zeros():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.2, 0.3, 0.0]])
    gen = make_generator(7)
    draws = torch.cat([sample(probs, gen) for _ in range(20000)])
    counts = torch.bincount(draws, minlength=6).double() / len(draws)
    assert counts[[0, 2, 5]].sum() == 0
    sigma = (probs[0] * (1 - probs[0]) / len(draws)).sqrt().double()
    assert ((counts - probs[0].double()).abs() <= 5 * sigma + 1e-12).all()


def test_sample_is_reproducible_and_takes_unnormalised_rows():
    probs = torch.rand(4, 1000)
    a = sample(probs, make_generator(3))
    b = sample(probs * 7.0, make_generator(3))        # the scale of a row does not matter
    assert torch.equal(a, b)
    assert ((a >= 0) & (a < 1000)).all()
