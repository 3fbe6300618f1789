"""The sampling primitives every method shares: the nucleus (top-p) filter and the draw."""

from __future__ import annotations

import dataclasses

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


# ---- the CPU kernels (sampling.c) against the PyTorch ops they replace ----

from specdec import kernels  # noqa: E402
from specdec.sampling import sample_with  # noqa: E402
from specdec.verify import rejection_plan, rejection_plan_torch  # noqa: E402

needs_kernels = pytest.mark.skipif(kernels.load() is None, reason="CPU kernels off or not built")


@needs_kernels
@pytest.mark.parametrize("V", [49152, 5003])
def test_kernel_processing_equals_pytorch(V):
    """Every filter and their combinations, rows with masked (-inf) tokens, a vocabulary that is
    not a multiple of 8: the same support and the same probabilities as the PyTorch ops."""
    g = torch.Generator().manual_seed(V)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
              for t in (0.3, 0.7, 1.0, 1.7) for k in (0, 1, 40) for p in (1.0, 0.999, 0.95, 0.5, 0.1) for m in (0.0, 0.05)]
    logits = torch.randn(len(params), V, generator=g) * torch.linspace(0.5, 12.0, len(params))[:, None]
    logits[::3, : V // 2] = float("-inf")                  # a grammar's or bad words' mask
    got = process_rows(logits, params)
    torch.testing.assert_close(got.sum(-1).double(), torch.ones(len(params), dtype=torch.float64), rtol=0, atol=1e-5)
    unfiltered = [dataclasses.replace(p, top_p=1.0, min_p=0.0) for p in params]
    bare = process_rows(logits, unfiltered)                # temperature, top-k, softmax
    torch.testing.assert_close(bare, process_rows(logits, unfiltered, kernel=False), rtol=2e-5, atol=1e-9)
    # the filters exactly: the kernel's own unfiltered rows through the definitions above (a
    # nucleus that ends among many near-equal tokens may end a few tokens apart on the two
    # paths' softmax roundings, so the supports are compared on the kernel's probabilities)
    # vLLM's order: min-p, then top-p over what it kept, each renormalised
    top_p, min_p = torch.tensor([p.top_p for p in params]), torch.tensor([p.min_p for p in params])
    want = bare.masked_fill(bare < min_p[:, None] * bare.amax(-1, keepdim=True), 0.0)
    want = torch.where((min_p > 0.0)[:, None], want / want.sum(-1, keepdim=True), want)
    want = want.masked_fill(_sorted_definition(want, top_p), 0.0)
    want = torch.where((top_p < 1.0)[:, None], want / want.sum(-1, keepdim=True), want)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
    one = process(logits[7:8], params[7])                  # a row alone = the same row in a batch
    assert torch.equal(one, got[7:8])


@needs_kernels
def test_kernel_rows_shared_over_threads_equal_each_alone():
    """A batch of rows is shared out over the team (8 rows or more): each row's result is the
    one it gets alone."""
    import threading

    def body(out):
        torch.set_num_threads(2)
        kernels.set_threads(2)
        g = torch.Generator().manual_seed(5)
        x = torch.randn(24, 3001, generator=g) * 4
        ps = [SamplingParams(temperature=0.7, top_p=0.95, min_p=0.02 * (i % 3)) for i in range(24)]
        batch = process_rows(x, ps)
        out.append(all(torch.equal(batch[i:i + 1], process_rows(x[i:i + 1], [ps[i]])) for i in range(24)))

    out = []
    t = threading.Thread(target=body, args=(out,))      # its own team; the suite's thread keeps one
    t.start()
    t.join(60)
    torch.set_num_threads(1)
    assert out == [True]


@needs_kernels
def test_kernel_draws_follow_the_running_sum_and_never_take_a_zero():
    g = torch.Generator().manual_seed(3)
    probs = torch.rand(64, 3001, generator=g) ** 8
    probs[probs < 0.05] = 0.0                             # most tokens impossible
    probs[:, -50:] = 0.0                                  # ... including the row's end
    u = torch.rand(64, 1, generator=g, dtype=torch.float64)
    u[0] = 1.0 - 2 ** -53                                 # the very end of the CDF
    u[1] = 0.0
    got = kernels.draw(probs, u[:, 0])
    assert torch.equal(got, sample_with(probs, u))
    assert (probs.gather(1, got[:, None]) > 0).all()


@needs_kernels
@pytest.mark.parametrize("point_mass", [False, True])
def test_kernel_rejection_plan_equals_pytorch(point_mass):
    g = torch.Generator().manual_seed(int(point_mass))
    K, V = 5, 4099
    p = (torch.randn(K + 1, V, generator=g) * 3).softmax(-1)
    q = None if point_mass else (torch.randn(K, V, generator=g) * 3).softmax(-1)
    draft = torch.randint(0, V, (K,), generator=g)
    if q is not None:
        q[2] = p[2]                                       # p == q on a row: nothing to draw there
        q[3, draft[3]] = 0.0                              # q(x) = 0: rejected (x cannot come from q)
    accept, cand = rejection_plan(draft, q, p)
    ref_accept, ref_cand = rejection_plan_torch(draft, q, p)
    torch.testing.assert_close(accept, ref_accept, rtol=1e-6, atol=0)
    torch.testing.assert_close(cand, ref_cand, rtol=1e-5, atol=1e-9)
    assert torch.equal(cand > 0, ref_cand > 0)


@pytest.mark.parametrize("kernel", [True, False])
def test_min_p_runs_before_top_p_as_in_vllm(kernel):
    """vLLM's sampler applies min-p before top-k / top-p: top-p then keeps its mass of what min-p
    left. probs .40 / .24 / .21 / .15, min_p 0.5 (cut at .20), top_p 0.7: min-p keeps three
    (.47 / .28 / .25), of which top-p keeps two; transformers' order (top-p, then min-p) kept three."""
    if kernel and kernels.load() is None:
        pytest.skip("CPU kernels off or not built")
    logits = torch.tensor([[0.40, 0.24, 0.21, 0.15] + [1e-9] * 12]).log()
    got = process_rows(logits, [SamplingParams(temperature=1.0, top_p=0.7, min_p=0.5)], kernel=kernel)[0]
    assert (got > 0).nonzero().flatten().tolist() == [0, 1]
    torch.testing.assert_close(got[:2], torch.tensor([0.40, 0.24]) / 0.64, rtol=1e-5, atol=0)


def test_vllms_ranges_for_temperature_penalty_and_bias(caplog):
    """vLLM's rules: a positive temperature below 0.01 is raised to 0.01 and still samples (it went
    greedy below 1e-5); repetition_penalty is any finite number > 0 (it was capped at 2); offline a
    logit bias is any finite number, the server clamps it to [-100, 100] (it was a 400)."""
    import logging

    from specdec.server.fields import logit_bias
    from specdec.server.protocol import CompletionRequest

    with caplog.at_level(logging.WARNING, logger="specdec"):
        tiny = SamplingParams(temperature=1e-6)
    assert tiny.temperature == 0.01 and not tiny.greedy and "raised to 0.01" in caplog.text
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(repetition_penalty=3.5).repetition_penalty == 3.5
    # bounded where float32 logits would overflow (1e-40 made every penalised logit inf: the row
    # sampled the vocabulary's last token)
    for bad in (0, -1.0, float("inf"), 1e-40, 1e40):
        with pytest.raises(ValueError, match=r"repetition_penalty must be in \[0.01, 100\]"):
            SamplingParams(repetition_penalty=bad)
    assert SamplingParams(logit_bias={3: -1000.0, 4: 1e37, 5: float("-inf")}).logit_bias == {3: -100.0, 4: 100.0, 5: -100.0}
    with pytest.raises(ValueError, match="logit_bias values must be numbers"):
        SamplingParams(logit_bias={3: float("nan")})
    req = CompletionRequest(prompt="x", logit_bias={"3": -1000, "4": 150, "5": 7, "6": float("-inf")})
    assert logit_bias(req, 16) == {3: -100.0, 4: 100.0, 5: 7, 6: -100.0}


@pytest.mark.parametrize("kernel", [True, False])
def test_top_p_ends_a_run_of_ties_after_min_p_as_pytorch_does(kernel):
    """Four tied best tokens, min_p keeping them all, top_p 0.5: two are kept on both paths (the
    kernel's min-p renormalisation multiplied by a rounded reciprocal, each tie became 0.2499999
    and a third one fitted under the cut)."""
    if kernel and kernels.load() is None:
        pytest.skip("CPU kernels off or not built")
    logits = torch.tensor([[1.0, 2.0, 0.0, 2.0, 2.0, 1.0, 1.0, 2.0, 0.0]])
    got = process_rows(logits, [SamplingParams(temperature=0.3, top_p=0.5, min_p=0.5)], kernel=kernel)[0]
    assert (got > 0).sum().item() == 2 and torch.equal(got[got > 0], torch.tensor([0.5, 0.5]))
