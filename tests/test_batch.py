"""Continuous batching: a request's output is the same in a batch as alone, with every method.

Greedy outputs equal plain decoding's whatever runs beside them (prompts of different lengths,
requests joining mid-way, prompts prefilled in chunks, requests preempted and recomputed);
seeded sampling equals its solo run with a fixed K; the KV pool admits, preempts and rolls
back per sequence; the C forward gives bit-identical rows whatever the batch, and the
PyTorch path agrees with it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specdec import LLM, SamplingParams, kernels
from specdec.engine import Engine

from test_engine import PROMPTS
from test_heads import _heads_dirs

LONG = "".join(PROMPTS[:6])          # 163 tokens: prefilled in chunks of the step budget
MIXED = [LONG] + PROMPTS[:9]


def _params(greedy: bool, seed: int = 0) -> list[SamplingParams]:
    """Different lengths, so that requests finish (and others join) at different steps."""
    return [SamplingParams(temperature=0 if greedy else 1.0, top_k=0 if greedy else 8, max_tokens=6 + 3 * (i % 5),
                           seed=None if greedy else seed + i, ignore_eos=True) for i in range(len(MIXED))]


@pytest.fixture(scope="module")
def setup(tiny_pair, near_draft, tmp_path_factory):
    target, draft = tiny_pair[0], near_draft         # a draft that agrees often, not always
    heads = _heads_dirs(target, tmp_path_factory.mktemp("batch-heads"))
    solo = LLM(model=target, dtype="float32", num_speculative_tokens=0, max_num_seqs=1)
    plain = [o.outputs[0].token_ids for o in solo.generate(MIXED, _params(True))]
    return {"target": target, "draft": draft, "plain": plain, **heads}


METHODS = {
    "draft_model": lambda s, k: {"method": "draft_model", "model": str(s["draft"]), "num_speculative_tokens": k},
    "ngram": lambda s, k: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 4},
    "layer_skip": lambda s, k: {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": k},
    "medusa": lambda s, k: {"method": "medusa", "model": str(s["medusa"]), "num_speculative_tokens": k},
    "eagle-tree": lambda s, k: {"method": "eagle", "model": str(s["eagle"]), "num_speculative_tokens": k},
    "eagle-chain": lambda s, k: {"method": "eagle", "model": str(s["eagle"]), "num_speculative_tokens": k, "topk": 1},
}


def _llm(setup, method, k, **kw):
    kw = {"max_num_seqs": 4, "max_num_batched_tokens": 16, **kw}
    return LLM(model=setup["target"], dtype="float32", speculative_config=METHODS[method](setup, k), **kw)


@pytest.mark.parametrize("k", [3, "auto"])
@pytest.mark.parametrize("method", list(METHODS))
def test_batch_greedy_equals_solo_plain_for_every_method(setup, method, k):
    """Up to 4 at once from a queue of 10 (they join as others finish), prompts of 28 to 163
    tokens prefilled in chunks: at most 16 tokens per step, decoding tokens first."""
    llm = _llm(setup, method, k)
    outs = llm.generate(MIXED, _params(True))
    assert [o.outputs[0].token_ids for o in outs] == setup["plain"], f"{method} K={k}"
    if k != "auto":        # "auto" may rightly settle on plain decoding with these untrained heads
        assert sum(o.stats.accepted_tokens for o in outs) > 0


@pytest.mark.parametrize("method", ["draft_model", "eagle-tree", "medusa"])
def test_requests_joining_mid_way_through_the_engine_api(setup, method):
    engine = _llm(setup, method, 4, max_num_seqs=8, max_num_batched_tokens=64).engine
    ids = [engine.tokenizer.encode(p) for p in MIXED]
    params = _params(True)
    reqs = [engine.add_request(ids[i], params[i]) for i in range(3)]
    while not all(r.out for r in reqs):      # the long prompt takes three steps of prefill
        engine.step()
    assert engine.num_running == 3 and not any(r.finished for r in reqs)
    reqs += [engine.add_request(ids[i], params[i]) for i in range(3, len(ids))]
    while engine.has_unfinished():
        engine.step()
    assert [r.out for r in reqs] == setup["plain"]


@pytest.mark.parametrize("method", list(METHODS))
def test_seeded_sampling_in_a_batch_equals_its_solo_run(setup, method):
    batch = _llm(setup, method, 3).generate(MIXED, _params(False, seed=7))
    solo_llm = _llm(setup, method, 3, max_num_seqs=1)
    solo = [solo_llm.generate([p], [sp])[0] for p, sp in zip(MIXED, _params(False, seed=7))]
    assert [o.outputs[0].token_ids for o in batch] == [o.outputs[0].token_ids for o in solo], method
    assert sum(o.stats.accepted_tokens for o in batch) > 0


@pytest.mark.parametrize("method", ["draft_model", "eagle-chain", "layer_skip"])
def test_greedy_and_sampled_requests_in_one_batch_equal_their_solo_runs(setup, method):
    """Greedy and seeded sampled requests side by side (the chains' greedy rows are drawn by one
    argmax, the others one by one): each request's tokens are those it gets alone, greedy ones
    plain decoding's."""
    params = [g if i % 2 else s for i, (g, s) in enumerate(zip(_params(True), _params(False, seed=11)))]
    batch = _llm(setup, method, 3).generate(MIXED, params)
    solo_llm = _llm(setup, method, 3, max_num_seqs=1)
    solo = [solo_llm.generate([p], [sp])[0] for p, sp in zip(MIXED, params)]
    assert [o.outputs[0].token_ids for o in batch] == [o.outputs[0].token_ids for o in solo], method
    assert [o.outputs[0].token_ids for o in solo][1::2] == setup["plain"][1::2]
    # the drafts too (a wrong draft is only rejected, not seen in the tokens): the same acceptance
    assert [o.stats.accepted_tokens for o in batch] == [o.stats.accepted_tokens for o in solo], method


def test_streams_interleave_and_a_closed_stream_frees_its_blocks(setup):
    """Engine.generate iterators advance the whole batch; each sees only its own tokens."""
    llm = _llm(setup, "draft_model", 3)
    engine, params = llm.engine, _params(True)
    ids = [engine.tokenizer.encode(p) for p in MIXED[:3]]
    streams = [engine.generate(i, p) for i, p in zip(ids, params)]
    got = [[] for _ in streams]
    live = list(range(len(streams)))
    while live:
        for j in list(live):
            event = next(streams[j])
            got[j] += event.token_ids
            if event.finished:
                live.remove(j)
    assert got == setup["plain"][:3]
    free = engine.blocks.num_free_blocks
    stream = engine.generate(ids[0], dataclasses.replace(params[0], max_tokens=30))
    next(stream)
    assert engine.num_running == 1 and engine.blocks.num_free_blocks < free
    stream.close()                                   # the client left
    assert engine.num_running == 0 and engine.blocks.num_free_blocks == free


def _tiny_pool(setup, method, blocks: int, **kw):
    """A pool of `blocks` blocks of 16 slots (target + draft bytes), max_model_len 64."""
    probe = _llm(setup, method, 3, max_model_len=64)
    per_slot = probe.target.kv_bytes_per_slot() + probe.engine.proposer.kv_bytes_per_slot()
    return _llm(setup, method, 3, max_model_len=64, kv_cache_memory=blocks * 16 * per_slot, **kw)


def test_admission_waits_for_blocks(setup):
    # identical prompts: no prefix caching, which would share their blocks (the point is the pool)
    llm = _tiny_pool(setup, "draft_model", 6, max_num_seqs=8, max_num_batched_tokens=256, enable_prefix_caching=False)
    engine = llm.engine
    assert engine.blocks.num_blocks == 6
    ids = [engine.tokenizer.encode(LONG)[:40] for _ in range(4)]          # 3 blocks each
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    reqs = [engine.add_request(i, params) for i in ids]
    engine.step()
    assert engine.num_running == 2 and engine.num_waiting == 2           # two prompts' blocks fit
    running_max = 0
    while engine.has_unfinished():
        engine.step()
        running_max = max(running_max, engine.num_running)
    assert running_max <= 2 and all(r.out == reqs[0].out for r in reqs)


@pytest.mark.parametrize("method", ["draft_model", "eagle-chain"])
def test_preemption_recomputes_and_keeps_greedy_output(setup, method):
    """A pool too small for four growing sequences: the newest are preempted (freed), requeued
    and prefilled again from prompt + output; every output still equals plain decoding's."""
    llm = _tiny_pool(setup, method, 6, max_num_seqs=4, max_num_batched_tokens=256)
    engine = llm.engine
    ids = [engine.tokenizer.encode(p) for p in PROMPTS[:4]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reqs = [engine.add_request(i, params) for i in ids]
    while engine.has_unfinished():
        engine.step()
    assert sum(r.num_preemptions for r in reqs) > 0
    solo = LLM(model=setup["target"], dtype="float32", num_speculative_tokens=0, max_num_seqs=1, max_model_len=64)
    want = [o.outputs[0].token_ids for o in solo.generate(PROMPTS[:4], params)]
    assert [r.out for r in reqs] == want
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks      # everything returned


def test_kv_budget_below_one_sequence_is_a_clear_error(setup):
    with pytest.raises(ValueError, match="kv_cache_memory of 1000 bytes"):
        LLM(model=setup["target"], dtype="float32", num_speculative_tokens=0, kv_cache_memory=1000)
    with pytest.raises(ValueError, match="kv_cache_memory must be a number of bytes"):
        LLM(model=setup["target"], dtype="float32", num_speculative_tokens=0, kv_cache_memory="lots")
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(model=setup["target"], dtype="float32", num_speculative_tokens=0, max_num_seqs=0)
    llm = LLM(model=setup["target"], dtype="float32", num_speculative_tokens=0, kv_cache_memory="1M", max_model_len=64)
    assert llm.engine.blocks.num_blocks * 16 * llm.target.kv_bytes_per_slot() <= 1 << 20


def test_plain_engine_runs_many_sequences_without_a_proposer(setup):
    """K = 0 everywhere: the batch is one token per running sequence."""
    engine = Engine(*_plain(setup), num_speculative_tokens=0, max_model_len=None)
    reqs = [engine.add_request(engine.tokenizer.encode(p), sp) for p, sp in zip(MIXED, _params(True))]
    while engine.has_unfinished():
        engine.step()
    assert [r.out for r in reqs] == setup["plain"]


def _plain(setup):
    llm = LLM(model=setup["target"], dtype="float32", num_speculative_tokens=0)
    return llm.target, llm.tokenizer


def test_bf16_batch_equals_solo(setup):
    """bf16 weights: the C forward (CPUs without native bf16) or the PyTorch path with bf16
    activations and forward.c's bf16 attention (native bf16): a batch decodes what solo runs
    do. (Up to 64 rows per step here, the row-exact kernel's range: README.)"""
    kw = dict(model=setup["target"], dtype="bfloat16",
              speculative_config=METHODS["draft_model"](setup, 3), max_num_batched_tokens=16)
    prompts, params = MIXED[1:7], _params(True)[1:7]
    batch = LLM(max_num_seqs=4, **kw).generate(prompts, params)
    solo_llm = LLM(max_num_seqs=1, **kw)
    solo = [solo_llm.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    assert [o.outputs[0].token_ids for o in batch] == [o.outputs[0].token_ids for o in solo]


@pytest.mark.skipif(kernels.load() is None, reason="bf16 rows are exact across batches through the C kernels only "
                                                   "(SPECDEC_KERNELS=0: PyTorch's GEMMs round with the row count)")
@pytest.mark.parametrize("method", ["eagle-chain", "eagle-tree", "medusa"])
def test_bf16_heads_seeded_batch_equals_solo_with_prompts_prefilled_together(method):
    """The bundled pair in bf16 (dtype auto), 14 prompts prefilled in one step (476 rows): a
    head's input matrix (EAGLE's fc) reads them all at once, and on a CPU with native bf16
    oneDNN's GEMM rounds a row's output differently with the number of rows: the head drafted
    other q rows in a batch than alone, and seeded samples differed (4 of these 14). Its fc
    keeps to the row-exact kernel. (CPUs without native bf16 never take oneDNN's path.)"""
    from specdec.defaults import BUNDLED_TARGET, MODELS_DIR

    spec = {"eagle-chain": {"method": "eagle", "model": str(MODELS_DIR / "eagle"), "topk": 1},
            "eagle-tree": {"method": "eagle", "model": str(MODELS_DIR / "eagle")},
            "medusa": {"method": "medusa", "model": str(MODELS_DIR / "medusa")}}[method]
    llm = LLM(model=str(BUNDLED_TARGET), speculative_config={**spec, "num_speculative_tokens": 3}, max_model_len=160)
    prompts = [p * 3 for p in PROMPTS[:14]]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=16, ignore_eos=True) for i in range(len(prompts))]
    batch = llm.generate(prompts, params)
    solo = [llm.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    assert [o.outputs[0].token_ids for o in batch] == [o.outputs[0].token_ids for o in solo]
    assert sum(o.stats.accepted_tokens for o in batch) > 0


@pytest.mark.parametrize("method", ["draft_model", "ngram", "eagle-tree"])
def test_bf16_kv_cache_batch_equals_solo_and_plain(setup, method):
    """fp32 activations over a bf16 KV cache (--kv-cache-dtype bfloat16: forward.c rounds keys
    and values when it writes them): greedy speculation in a batch decodes what plain decoding
    over the same cache decodes alone."""
    prompts, params = MIXED[:7], _params(True)[:7]
    solo = LLM(model=setup["target"], dtype="float32", num_speculative_tokens=0, max_num_seqs=1,
               kv_cache_dtype="bfloat16")
    assert solo.engine.kv.k[0].dtype == torch.bfloat16
    plain = [solo.generate([p], [sp])[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    batch = _llm(setup, method, 3, kv_cache_dtype="bfloat16").generate(prompts, params)
    assert [o.outputs[0].token_ids for o in batch] == plain


def test_kv_cache_dtype_auto(setup, gguf_files):
    """auto: the activations' dtype for dense models, bf16 for GGUF-packed ones on the CPU."""
    from specdec.engine import kv_cache_dtype_of
    from specdec.model import load_model

    dense = LLM(model=setup["target"], dtype="float32", num_speculative_tokens=0)
    assert dense.engine.kv.k[0].dtype == torch.float32
    packed = load_model(gguf_files["llama_q"], quantization="gguf")
    assert kv_cache_dtype_of(packed, "auto") == torch.bfloat16
    assert kv_cache_dtype_of(packed, "float32") == torch.float32
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_cache_dtype_of(packed, "fp8")


def test_engine_flags_on_the_command_line(setup, capsys):
    import json

    from specdec.cli import main

    args = ["generate", "def add(a, b):", "--model", str(setup["target"]), "--dtype", "float32", "--max-tokens", "6",
            "--ignore-eos", "--json", "--num-speculative-tokens", "0"]
    assert main(args + ["--max-num-seqs", "2", "--max-num-batched-tokens", "4", "--kv-cache-memory", "1M"]) == 0
    chunked = json.loads(capsys.readouterr().out)["token_ids"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == chunked        # a prompt in chunks of 4
    assert main(args + ["--enable-prefix-caching"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == chunked
    assert main(args[:-2] + ["--speculative-model", str(setup["draft"]), "--enable-prefix-caching"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == chunked       # a draft model with the cache
    with pytest.raises(SystemExit) as e:
        main(args + ["--kv-cache-memory", "lots"])
    assert e.value.code == 2 and "kv_cache_memory must be a number of bytes" in capsys.readouterr().err
    assert main(args + ["--kv-cache-memory", "10"]) == 2
    assert "kv_cache_memory of 10 bytes" in capsys.readouterr().err


def test_generate_shows_progress_as_vllm_does(setup, capsys):
    """use_tqdm=True: a bar over the prompts on stderr with the speeds so far; a tqdm-like class
    is used instead when given; nothing by default."""
    llm = LLM(model=setup["target"], dtype="float32", num_speculative_tokens=0, max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, n=2)
    prompts = PROMPTS[:3]
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert capsys.readouterr().err == ""
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=True)] == plain
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "3/3" in err and "output: " in err and "toks/s" in err

    class Recorder:
        def __init__(self, total, **kw):
            self.total, self.n, self.postfix, self.closed = total, 0, "", False
            seen.append(self)

        def update(self, k):
            self.n += k

        def set_postfix_str(self, s, refresh=True):
            self.postfix = s

        def close(self):
            self.closed = True

    seen: list = []
    llm.generate(prompts, params, use_tqdm=Recorder)
    (bar,) = seen
    assert bar.total == bar.n == 3 and bar.closed and bar.postfix.startswith("est. speed input: ")


def test_an_eagle_tree_runs_to_the_end_of_its_context_with_k_past_its_depth():
    """A tree of K = 6 nodes, 3 wide and 4 deep: near the end of the context K is cut below the
    depth, where the tree's extra slots peak (the pool sized a sequence for K alone: 'slots
    exceed the 128 a sequence may hold', failing every request of the step)."""
    from specdec.defaults import BUNDLED_TARGET, MODELS_DIR

    spec = {"method": "eagle", "model": str(MODELS_DIR / "eagle"), "num_speculative_tokens": 6, "topk": 3, "depth": 4}
    llm = LLM(model=str(BUNDLED_TARGET), max_model_len=126, speculative_config=spec)
    plain = LLM(model=str(BUNDLED_TARGET), max_model_len=126, num_speculative_tokens=0)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(100, 100 + n))} for n in (121, 118, 110)]
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


@pytest.mark.skipif(kernels.load() is None, reason="a recompute prefills the output in one tall product: its "
                    "bf16 rows equal the decoding steps' through the C kernels only (README)")
@pytest.mark.parametrize("method", ["ngram+eagle", "ngram+draft_model"])
def test_a_preempted_hybrid_request_samples_as_alone(method):
    """The hybrid's per-request records (which source, how long) survive a preemption: dropped,
    the recomputed request chose other drafts and its seeded draws differed from its solo run."""
    from specdec.defaults import BUNDLED_DRAFT, BUNDLED_TARGET, MODELS_DIR

    learned = str(MODELS_DIR / "eagle") if method == "ngram+eagle" else str(BUNDLED_DRAFT)
    spec = {"method": method, "model": learned, "num_speculative_tokens": 4}
    probe = LLM(model=str(BUNDLED_TARGET), speculative_config=spec, max_model_len=128)
    per_block = 16 * (probe.target.kv_bytes_per_slot() + probe.engine.proposer.kv_bytes_per_slot())
    llm = LLM(model=str(BUNDLED_TARGET), speculative_config=spec, max_model_len=128,
              kv_cache_memory=probe.engine.blocks.max_blocks_per_seq * per_block)
    ids = llm.tokenizer.encode(open(__file__).read())
    prompts = [{"prompt_token_ids": ids[s:s + n]} for s, n in ((100, 98), (400, 10), (900, 60), (1300, 30))]
    params = [SamplingParams(temperature=0.8, seed=7 + i, max_tokens=30, ignore_eos=True) for i in range(4)]
    batch = llm.generate(prompts, params)
    assert llm.engine.num_preemptions > 0
    for p, sp, got in zip(prompts, params, batch):
        assert got.outputs[0].token_ids == llm.generate([p], [sp])[0].outputs[0].token_ids


def test_a_preempted_suffix_request_joins_the_response_cache_once_whole():
    """Suffix decoding's response cache takes a finished request's output (with the prompt's last
    tokens); a preemption used to add the partial output too, and the recompute's prompt chunks
    moved the prompt's end into the output (its start lost from the cached answer)."""
    from specdec.defaults import BUNDLED_TARGET
    from specdec.proposers.suffix import HEADER_TOKENS

    spec = {"method": "suffix", "num_speculative_tokens": 4}
    probe = LLM(model=str(BUNDLED_TARGET), speculative_config=spec, max_model_len=128)
    per_block = 16 * probe.target.kv_bytes_per_slot()
    llm = LLM(model=str(BUNDLED_TARGET), speculative_config=spec, max_model_len=128,
              kv_cache_memory=probe.engine.blocks.max_blocks_per_seq * per_block)
    ids = llm.tokenizer.encode(open(__file__).read())
    prompts = [ids[s:s + n] for s, n in ((100, 98), (400, 10), (900, 60), (1300, 30))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert llm.engine.num_preemptions > 0
    docs = sorted(d.tolist() for d in llm.engine.proposer.cache.docs)
    # each output with the prompt's last HEADER_TOKENS tokens, as the datastore's documents (the
    # prompt's length is the request's own, no longer a prefill's cache length, seq[:-1])
    assert docs == sorted(p[-HEADER_TOKENS:] + o.outputs[0].token_ids for p, o in zip(prompts, outs))


def test_max_num_batched_tokens_below_max_num_seqs_is_refused_as_vllm_does(setup):
    with pytest.raises(ValueError, match=r"max_num_batched_tokens must be greater than or equal to max_num_seqs \(16\)"):
        LLM(model=setup["target"], dtype="float32", max_num_batched_tokens=8)


@pytest.mark.parametrize("method", ["draft_model", "eagle-tree", "ngram"])
def test_drafts_are_cut_to_the_step_token_budget(setup, method):
    """4 decoding rows and a budget of 6 tokens a step: drafts of K = 3 would feed 16; they are cut
    so that every step's forward stays within max_num_batched_tokens (vLLM trims speculative
    tokens to the budget), and the outputs stay plain decoding's."""
    llm = _llm(setup, method, 3, max_num_seqs=4, max_num_batched_tokens=6)
    engine, seen = llm.engine, []
    step = engine.step

    def watched():
        events = step()
        seen.append(engine.last_step_tokens)
        return events

    engine.step = watched
    outs = llm.generate(MIXED, _params(True))
    assert [o.outputs[0].token_ids for o in outs] == setup["plain"]
    assert max(seen) <= 6, max(seen)
    assert sum(o.stats.accepted_tokens for o in outs) > 0        # some rows still drafted

