"""bad_words and logit_bias at scale: a step's cost does not grow with the number of words or
entries, the words are tokenized where a request is prepared (not on the engine thread), and
the outputs are those of the old per-word loop (vLLM's rule, word by word), token for token.

A tester's request with 50,000 bad words slowed another user's stream ~14x: the engine thread
tokenized every word when the request joined and looped in Python over all of them for every
row of every step."""

from __future__ import annotations

import random

import pytest
import torch

import specdec.engine
from specdec import LLM, SamplingParams
from specdec.config import MAX_STOP_STRINGS
from specdec.defaults import BUNDLED_DRAFT, BUNDLED_TARGET
from specdec.sampling import BadWords, Controls, Row, adjust_rows, bad_words_of

V = 64


# -- the old implementation, the reference ------------------------------------------------------

def old_tokenize(tokenizer, words: list[str]) -> list[list[int]]:
    """Engine.controls' loop before this change (vLLM's rule)."""
    out = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out += [w for w in (plain, spaced) if w]
        if spaced and plain and (spaced[0] == plain[0] or len(spaced) != len(plain)):
            out.pop()
    return out


def old_ends_with(output: list[int], path: list[int], prefix: list[int]) -> bool:
    n = len(prefix)
    if n <= len(path):
        return path[len(path) - n:] == prefix
    k = n - len(path)
    return len(output) >= k and output[len(output) - k:] == prefix[:k] and path == prefix[k:]


class OldBadWords(BadWords):
    """Every word checked against every row, as adjust_rows did (no mask, no trie)."""

    def single_mask(self, vocab, device):
        return None

    def after(self, output, path):
        return [w[-1] for w in self.words if len(w) == 1 or old_ends_with(output, path, w[:-1])]


def old_adjust_bans(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """adjust_rows' bans and logit_bias before this change, with the same rows (no grammar, no
    penalties in these tests)."""
    logits = logits.float().clone()
    bans_r, bans_t, bias_r, bias_t, bias_v = [], [], [], [], []
    for r, (c, output, path) in enumerate(rows):
        p = c.params
        banned = list(c.stop_ids) if len(output) + len(path) < p.min_tokens else []
        banned += [w[-1] for w in c.bad_words.words if len(w) == 1 or old_ends_with(output, path, w[:-1])]
        bans_r += [r] * len(banned)
        bans_t += banned
        if p.logit_bias:
            bias_r += [r] * len(p.logit_bias)
            bias_t += list(p.logit_bias)
            bias_v += list(p.logit_bias.values())
    if bans_t:
        keep = [i for i, t in enumerate(bans_t) if t < logits.shape[-1]]
        banned = logits.clone()
        banned[torch.tensor([bans_r[i] for i in keep], dtype=torch.long),
               torch.tensor([bans_t[i] for i in keep], dtype=torch.long)] = float("-inf")
        alive = (banned > float("-inf")).any(-1, keepdim=True)
        logits = torch.where(alive, banned, logits)
    if bias_t:
        logits.index_put_((torch.tensor(bias_r), torch.tensor(bias_t)), torch.tensor(bias_v), accumulate=True)
    return logits


def random_words(rng: random.Random, n: int, vocab: int, max_len: int = 4) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.choice([1, 1, 2, 2, 2, 3, max_len]))] for _ in range(n)]


# -- the index against the loop -----------------------------------------------------------------

@pytest.mark.parametrize("seed", range(5))
def test_index_bans_what_the_loop_bans(seed):
    """Random words over a small vocabulary (so prefixes match often, ids past V included),
    random outputs and paths: the same tokens banned, and adjust_rows equal to the old code."""
    rng = random.Random(seed)
    words = random_words(rng, 300, V + 3, max_len=5)
    params = SamplingParams(min_tokens=rng.choice([0, 4]), logit_bias={rng.randrange(V): rng.uniform(-5, 5)
                                                                       for _ in range(7)})
    controls = Controls(params, [1, 2], words, [V - 1])
    other = Controls(SamplingParams(bad_words=["x"]), [3], [[5], [6, 7, 8]], [V - 1])
    rows = []
    for _ in range(40):
        c = controls if rng.random() < 0.8 else other
        output = [rng.randrange(8) for _ in range(rng.randrange(7))]
        rows += [Row(c, output, [rng.randrange(8) for _ in range(k)]) for k in range(rng.randrange(1, 4))]
    for c, output, path in rows:
        want = {w[-1] for w in c.bad_words.words if len(w) == 1 or old_ends_with(output, path, w[:-1])}
        got = set(c.bad_words.after(output, path)) | set(c.bad_words.single.tolist())
        assert got == want, (output, path)
    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(seed)) * 3
    assert torch.equal(adjust_rows(logits, rows), old_adjust_bans(logits, rows))


def test_a_ban_of_every_token_is_lifted_as_before():
    """One-token words covering the vocabulary (through the mask) plus min_tokens: lifted for
    the row, as the old single index assignment was."""
    params = SamplingParams(min_tokens=5)
    controls = Controls(params, [1], [[t] for t in range(V - 1)], [V - 1])
    rows = [Row(controls, [], []), Row(controls, [0] * 6, [])]
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(1))
    got = adjust_rows(logits, rows)
    assert torch.equal(got, old_adjust_bans(logits, rows))
    assert torch.equal(got[0], logits[0]) and got[1].argmax() == V - 1


# -- the cost of a step -------------------------------------------------------------------------

def _step_work(controls: Controls, rows_per_request: int = 4) -> tuple[int, int]:
    """What one step of adjust_rows does, counted rather than timed (a test never asserts a
    timing): the tensor operations it dispatches and the Python and C functions it calls."""
    import sys

    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Ops.n += 1
            return func(*args, **(kwargs or {}))

    out = list(range(100))
    rows = [Row(controls, out, out[:k]) for k in range(rows_per_request)]
    logits = torch.randn(len(rows), 16384)
    adjust_rows(logits, rows)                 # first use: whatever is built once per request
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        calls += event in ("call", "c_call")

    with Ops():
        sys.setprofile(profile)
        try:
            adjust_rows(logits, rows)
        finally:
            sys.setprofile(None)
    return Ops.n, calls


def test_a_step_costs_the_same_with_100000_words_as_with_2():
    """100,000 token sequences (what 50,000 words tokenize to) and a whole-vocabulary
    logit_bias against two words and one bias: the old loop took ~100 ms a step for these
    4 rows (an operation per word), now it is the same handful of tensor operations and calls."""
    rng = random.Random(0)
    many = Controls(SamplingParams(logit_bias={t: 1.0 for t in range(16384)}), [1], random_words(rng, 100_000, 16384), [])
    few = Controls(SamplingParams(logit_bias={3: 1.0}), [1], [[5], [6, 7]], [])
    _step_work(few)                            # the first use of a dispatch mode imports what it needs
    (ops_few, calls_few), (ops_many, calls_many) = _step_work(few), _step_work(many)
    assert ops_many <= ops_few + 8 and calls_many <= calls_few + 200, (ops_few, ops_many, calls_few, calls_many)


def test_logit_bias_has_no_cap_and_stop_names_its_count_and_limit():
    """vLLM takes any number of logit_bias entries (they are applied by one tensor operation);
    the error for too many stop strings names the count and the limit."""
    bias = {t: -1.0 for t in range(16384)}
    assert SamplingParams(logit_bias=bias).logit_bias == bias
    with pytest.raises(ValueError, match=f"stop must hold at most {MAX_STOP_STRINGS} strings .*got 60000"):
        SamplingParams(stop=[f"s{i}" for i in range(60000)])
    with pytest.raises(ValueError, match="logit_bias must map token ids to biases, got 'list'"):
        SamplingParams(logit_bias=[1, 2])


# -- through the engine -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain():
    return LLM(model=BUNDLED_TARGET, num_speculative_tokens=0)


def _words(tokenizer, seed: int, n: int) -> list[str]:
    """Words from the vocabulary's own pieces: one token, two and three (and with a space)."""
    rng = random.Random(seed)
    vocab = tokenizer.vocab_size
    words = []
    while len(words) < n:
        text = tokenizer.decode([rng.randrange(vocab) for _ in range(rng.choice([1, 1, 2, 3]))]).strip()
        if text and text.isprintable():
            words.append(text)
    return words


def test_words_are_tokenized_when_the_request_is_prepared(plain, monkeypatch):
    """check_prompt (what the server runs while preparing a request) tokenizes them; the
    engine thread's add_request (clone, check_prompt, controls) calls the tokenizer no more."""
    engine = plain.engine
    calls = []
    encode = engine.tokenizer.encode
    monkeypatch.setattr(engine.tokenizer, "encode", lambda *a, **k: calls.append(1) or encode(*a, **k))
    params = SamplingParams(max_tokens=4, bad_words=_words(engine.tokenizer, 0, 2000))
    prompt = encode("def f(x):")
    engine.check_prompt(prompt, params)
    assert len(calls) == 4000
    calls.clear()
    own = params.clone()
    engine.check_prompt(prompt, own)
    controls = engine.controls(prompt, own)
    assert calls == [] and controls.bad_words is bad_words_of(params, engine.tokenizer)
    assert controls.bad_words.words == old_tokenize(engine.tokenizer, params.bad_words)
    own.bad_words = ["other"]                      # changed words are tokenized again
    assert bad_words_of(own, engine.tokenizer).words == old_tokenize(engine.tokenizer, ["other"])


PROMPTS = ["def parse(data):\n    return ", "class Point:\n    def __init__(self, x, y):\n", "import os\n",
           "The quick brown fox"]
SPECULATIVE = {
    "draft_model": {"method": "draft_model", "model": str(BUNDLED_DRAFT), "num_speculative_tokens": 3},
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4},
}


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_outputs_equal_the_old_implementation(plain, monkeypatch, seed):
    """A random set of words (one-, two- and three-token, a few of them the model's likely
    tokens so that bans act), greedy, plain and speculative: the same tokens as the old
    tokenization and per-word loop, and not those without the words."""
    tok = plain.tokenizer
    base = plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    likely = {tok.decode([t]).strip() for o in base for t in o.outputs[0].token_ids[:8]} - {""}
    words = _words(tok, seed, 3000) + sorted(likely)[seed::2] + ["return x", "self.x"]
    random.Random(seed).shuffle(words)
    params = SamplingParams(temperature=0, max_tokens=24, bad_words=words)
    assert any(len(w) == 1 for w in BadWords.tokenize(tok, words)) and any(len(w) > 2 for w in BadWords.tokenize(tok, words))

    def run(llm):
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]

    llms = {"plain": plain, **{name: LLM(model=BUNDLED_TARGET, speculative_config=cfg) for name, cfg in SPECULATIVE.items()}}
    new = {name: run(llm) for name, llm in llms.items()}
    monkeypatch.setattr(specdec.engine, "bad_words_of",
                        lambda p, tokenizer: OldBadWords(old_tokenize(tokenizer, p.bad_words or [])))
    old = {name: run(llm) for name, llm in llms.items()}
    assert new == old
    assert all(got == new["plain"] for got in new.values())
    assert new["plain"] != [o.outputs[0].token_ids for o in base]


def test_indexing_from_many_threads_leaves_the_collector_on():
    """A server prepares several requests at once: BadWords' collector pause must not leave Python's
    cyclic garbage collector off for good (a plain disable / enable per thread did, a tester's race)."""
    import gc
    import sys
    import threading

    from specdec.sampling import BadWords

    words = [[i, i + 1] for i in range(200)] + [[5]]     # long enough an index for threads to overlap
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(150):
            barrier = threading.Barrier(4)

            def build():
                barrier.wait()
                for _ in range(200):
                    BadWords(words)

            threads = [threading.Thread(target=build) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert gc.isenabled()
    finally:
        sys.setswitchinterval(old)
        gc.enable()
