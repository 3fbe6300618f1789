"""vLLM's AsyncLLM / AsyncLLMEngine: concurrent generate() streams batched by one engine thread,
their outputs those of the offline LLM (greedy and seeded, speculation on), in each of vLLM's
output kinds; abort, a consumer that stops, bad input, pause / resume, shutdown."""

from __future__ import annotations

import asyncio
import time

import pytest

from specdec import (LLM, AsyncEngineArgs, AsyncLLM, AsyncLLMEngine, RequestOutputKind, SamplingParams,
                     TokensPrompt)
from specdec.server.worker import ShuttingDown

PROMPTS = ["def fib(n):", "import os\nimport sys\n", "class Point:\n    def __init__(self, x, y):", "# a comment"]


@pytest.fixture(scope="module")
def engine(tiny_pair):
    target, draft = tiny_pair
    eng = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(target), speculative_model=str(draft),
                                                    num_speculative_tokens=3))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def offline(tiny_pair):
    target, draft = tiny_pair
    return LLM(str(target), speculative_model=str(draft), num_speculative_tokens=3)


async def _collect(engine, prompt, params, rid):
    return [o async for o in engine.generate(prompt, params, rid)]


def test_concurrent_streams_equal_the_offline_llm(engine, offline):
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=40, temperature=1.0, seed=7, n=2, ignore_eos=True, logprobs=2)

    async def main():
        return await asyncio.gather(*[_collect(engine, p, greedy, f"g{i}") for i, p in enumerate(PROMPTS)],
                                    _collect(engine, PROMPTS[0], seeded, "s"))
    *streams, sampled = asyncio.run(main())
    want = offline.generate(PROMPTS, greedy)
    for outs, ref in zip(streams, want):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1]) and len(outs) > 1
        assert outs[-1].outputs[0].token_ids == ref.outputs[0].token_ids
        assert outs[-1].outputs[0].text == ref.outputs[0].text
        # cumulative (vLLM's default): each output extends the one before
        texts = [o.outputs[0].text for o in outs]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
        assert outs[-1].prompt_token_ids == ref.prompt_token_ids and outs[-1].request_id.startswith("g")
    (ref,) = offline.generate(PROMPTS[0], seeded)
    # n=2 streamed: each output holds the one completion that moved (vLLM v1), the last finishes the request
    assert all(len(o.outputs) == 1 for o in sampled) and {o.outputs[0].index for o in sampled} == {0, 1}
    assert sampled[-1].finished and not any(o.finished for o in sampled[:-1])
    last = {o.outputs[0].index: o.outputs[0] for o in sampled}
    finals = [last[0], last[1]]
    assert [c.token_ids for c in finals] == [c.token_ids for c in ref.outputs]
    assert [len(c.logprobs) for c in finals] == [40, 40]
    assert [[next(iter(lp)) for lp in c.logprobs] for c in finals] == \
        [[next(iter(lp)) for lp in c.logprobs] for c in ref.outputs]
    assert finals[0].cumulative_logprob == pytest.approx(ref.outputs[0].cumulative_logprob, abs=1e-4)
    assert sampled[-1].metrics.output_tokens == 80 and sampled[-1].metrics.target_forward_passes > 0


def test_output_kinds(engine):
    def params(kind, n=1):
        return SamplingParams(max_tokens=30, temperature=0.8, seed=3, n=n, ignore_eos=True, output_kind=kind)

    async def main():
        return await asyncio.gather(_collect(engine, PROMPTS[2], params(RequestOutputKind.CUMULATIVE, 2), "c"),
                                    _collect(engine, PROMPTS[2], params(RequestOutputKind.DELTA, 2), "d"),
                                    _collect(engine, PROMPTS[2], params(RequestOutputKind.FINAL_ONLY, 2), "f"))
    cumulative, delta, final = asyncio.run(main())
    assert len(final) == 1 and final[0].finished
    for i in range(2):
        whole = [c for o in cumulative for c in o.outputs if c.index == i][-1]
        parts = [c for o in delta for c in o.outputs if c.index == i]
        assert "".join(c.text for c in parts) == whole.text == final[0].outputs[i].text
        assert [t for c in parts for t in c.token_ids] == whole.token_ids
        assert parts[-1].finish_reason == "length" and all(c.finish_reason is None for c in parts[:-1])


def test_abort_and_a_consumer_that_stops(engine, monkeypatch):
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    core, aborted = engine.llm.engine, []
    real_abort = core.abort

    def abort(request_id):                   # a spy: the engine's own abort, each one it did recorded
        event = real_abort(request_id)
        if event is not None:
            aborted.append(event)
        return event
    monkeypatch.setattr(core, "abort", abort)

    async def main():
        outs = []
        async for o in engine.generate(TokensPrompt(prompt_token_ids=[1, 2, 3]), long, "a"):
            outs.append(o)
            if len(outs) == 3:
                await engine.abort("a")
        stopped = 0
        async for _ in engine.generate(PROMPTS[0], long, "b"):
            stopped += 1
            if stopped == 2:
                break                        # the request is aborted: its seat and blocks come back
        deadline = time.monotonic() + 60     # (once the generator is closed and the engine thread gets to it)
        while len(aborted) < 2 or core.has_unfinished():
            assert time.monotonic() < deadline, (len(aborted), core.has_unfinished())
            await asyncio.sleep(0.01)
        return outs
    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs[-1].outputs[0].token_ids) < 200
    # both left through an abort, "b" too (not by running its 200 tokens out)
    assert len(aborted) == 2 and all(e.finish_reason == "abort" and e.stats.output_tokens < 200 for e in aborted)
    assert not core.has_unfinished()


def test_bad_input_is_a_value_error(engine):
    async def first(prompt, params, rid):
        async for o in engine.generate(prompt, params, rid):
            return o

    ok = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="a prompt must be"):
        asyncio.run(first(3.5, ok, "x"))
    with pytest.raises(ValueError, match="best_of"):
        asyncio.run(first("hi", SamplingParams(n=1, best_of=2), "x"))
    with pytest.raises(ValueError, match="request_id"):
        asyncio.run(first("hi", ok, ""))
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=7)

    async def twice():
        gen = engine.generate("hi", SamplingParams(max_tokens=50, ignore_eos=True), "same")
        await gen.__anext__()
        try:
            await first("hi", ok, "same")
        finally:
            await gen.aclose()
    with pytest.raises(ValueError, match="already running"):
        asyncio.run(twice())


def test_pause_resume_and_alias(engine):
    assert AsyncLLMEngine is AsyncLLM

    async def main():
        await engine.pause_generation(mode="keep")
        assert await engine.is_paused()
        task = asyncio.create_task(_collect(engine, PROMPTS[1], SamplingParams(max_tokens=8, temperature=0), "p"))
        worker, deadline = engine._worker, time.monotonic() + 60
        while worker.num_waiting == 0:       # submitted: queued for the paused engine ...
            assert time.monotonic() < deadline and not task.done(), "the request did not queue"
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        # ... and held there while paused
        assert not task.done() and worker.num_waiting == 1 and engine.llm.engine.num_running == 0
        await engine.resume_generation()
        outs = await task
        with pytest.raises(ValueError, match="pause mode"):
            await engine.pause_generation(mode="never")
        return outs
    outs = asyncio.run(main())
    assert outs[-1].outputs[0].finish_reason == "length"
    assert asyncio.run(engine.collective_rpc(lambda worker: worker.rank)) == [0]


def test_shutdown(tiny_pair):
    eng = AsyncLLM(model=str(tiny_pair[0]))
    assert eng.is_running
    eng.shutdown()
    assert eng.is_stopped and not eng.errored

    async def first():
        async for o in eng.generate("hi", SamplingParams(max_tokens=2), "z"):
            return o
    with pytest.raises(ShuttingDown):
        asyncio.run(first())
    # the LLM is the offline one again
    assert eng.llm.generate("hi", SamplingParams(max_tokens=2, temperature=0))[0].outputs[0].token_ids


# ---- regressions found by a tester ----

def test_offline_calls_run_on_its_thread_or_are_refused(engine, offline):
    """One thread steps an engine: LLM.generate from elsewhere runs on the AsyncLLM's thread while
    it is idle, and is refused while its requests are in flight (it would take their events)."""
    params = SamplingParams(max_tokens=6, temperature=0)
    assert engine.llm.generate(PROMPTS, params)[0].outputs[0].token_ids == \
        offline.generate(PROMPTS, params)[0].outputs[0].token_ids

    async def busy():
        gen = engine.generate("hi", SamplingParams(max_tokens=100, ignore_eos=True), "busy")
        await gen.__anext__()
        try:
            with pytest.raises(ValueError, match="serving requests"):
                await asyncio.to_thread(engine.llm.generate, "hi", params)
        finally:
            await gen.aclose()
    asyncio.run(busy())
    with pytest.raises(ValueError, match="run by an AsyncLLM"):
        next(iter(engine.llm.stream("hi", params)))
    with pytest.raises(ValueError, match="run by an AsyncLLM"):
        engine.llm.collective_rpc(lambda worker: 1)
    with pytest.raises(ValueError, match="already runs"):
        AsyncLLM(engine.llm)


def test_no_frozen_heap_and_the_callers_threads_come_back(tiny_pair):
    import gc

    import torch

    before_threads, frozen = torch.get_num_threads(), gc.get_freeze_count()
    a = AsyncLLM(model=str(tiny_pair[0]))
    b = AsyncLLM(model=str(tiny_pair[0]))          # started from a thread that gave its team to a's engine
    assert b._worker._threads == before_threads
    b.shutdown()
    a.shutdown()
    assert torch.get_num_threads() == before_threads and gc.get_freeze_count() <= frozen    # nothing frozen


def test_ids_prompt_logprobs_and_shutdown_as_vllm(engine, tiny_pair):
    from specdec.config import StructuredOutputsParams

    regex = SamplingParams(max_tokens=30, temperature=0, structured_outputs=StructuredOutputsParams(regex="[a-z ]+"))

    async def twice():              # the id is taken before the grammar compiles
        return await asyncio.gather(_collect(engine, "hi", regex, "same"), _collect(engine, "hi", regex, "same"),
                                    return_exceptions=True)
    results = asyncio.run(twice())
    assert sum(isinstance(r, ValueError) and "already running" in str(r) for r in results) == 1

    async def reuse():
        gen = engine.generate("hi", SamplingParams(max_tokens=100, ignore_eos=True), "job")
        await gen.__anext__()
        await engine.abort("job")
        again = await _collect(engine, "hi", SamplingParams(max_tokens=3), "job")    # free at once
        rest = [o async for o in gen]
        return again, rest
    again, rest = asyncio.run(reuse())
    assert again[-1].finished and rest[-1].outputs[0].finish_reason == "abort"

    delta = SamplingParams(max_tokens=6, prompt_logprobs=1, output_kind=RequestOutputKind.DELTA, ignore_eos=True)
    outs = asyncio.run(_collect(engine, PROMPTS[0], delta, "plp"))
    assert outs[0].prompt_logprobs is not None and all(o.prompt_logprobs is None for o in outs[1:])

    eng = AsyncLLM(model=str(tiny_pair[0]))

    async def cut():
        outs = []
        async for o in eng.generate("hi", SamplingParams(max_tokens=200, ignore_eos=True), "long"):
            outs.append(o)
            if len(outs) == 2:
                eng.shutdown()             # vLLM's: now, not after the request
        return outs
    outs = asyncio.run(cut())
    assert outs[-1].outputs[0].finish_reason == "abort" and len(outs[-1].outputs[0].token_ids) < 200


def test_engine_args_as_vllm(tiny_pair):
    import argparse

    args = AsyncEngineArgs(model=str(tiny_pair[0]), enable_log_requests=True)
    assert args.max_model_len is None and args.tensor_parallel_size == 1 and args.enable_prefix_caching is None
    parser = AsyncEngineArgs.add_cli_args(argparse.ArgumentParser())
    parsed = AsyncEngineArgs.from_cli_args(parser.parse_args(["--model", str(tiny_pair[0]), "--max-model-len", "128",
                                                              "--seed", "5", "--enable-log-requests"]))
    assert parsed.max_model_len == 128 and parsed.model == str(tiny_pair[0])
    assert parsed.seed == 5 and parsed.enable_log_requests
    eng = AsyncLLM.from_engine_args(args)
    try:
        assert eng.log_requests and asyncio.run(eng.get_supported_tasks()) == ("generate",)
        config = asyncio.run(eng.get_model_config())
        assert config.get_vocab_size() > 0 and config.max_model_len == eng.llm.engine.max_model_len
        assert asyncio.run(eng.list_loras()) == set()
        assert isinstance(eng.dead_error, RuntimeError)
    finally:
        eng.shutdown()


def test_encode_on_a_pooling_model(tiny_pair):
    """vLLM's AsyncLLM.encode: concurrent calls, each one output equal to the offline LLM.embed's."""
    from specdec.pooling import PoolingParams

    target, _ = tiny_pair
    offline = LLM(str(target), convert="embed", dtype="float32")
    want = offline.embed(PROMPTS[:3], PoolingParams(dimensions=None, normalize=True))
    engine = AsyncLLM(model=str(target), convert="embed", dtype="float32")
    assert asyncio.run(engine.get_supported_tasks()) == ("encode", "embed")      # not "generate" (vLLM's)

    async def one(prompt, rid):
        return [o async for o in engine.encode(prompt, PoolingParams(normalize=True), rid)]

    async def main():
        outs = await asyncio.gather(*[one(p, f"e{i}") for i, p in enumerate(PROMPTS[:3])])
        with pytest.raises(ValueError, match="runner='generate'"):
            await anext(engine.generate("x", SamplingParams(max_tokens=2), "g"))
        return outs
    try:
        outs = asyncio.run(main())
    finally:
        engine.shutdown()
    for i, (got, ref) in enumerate(zip(outs, want)):
        assert len(got) == 1 and got[0].request_id == f"e{i}" and got[0].finished
        assert got[0].prompt_token_ids == ref.prompt_token_ids
        assert got[0].outputs.embedding == pytest.approx(ref.outputs.embedding, abs=1e-5)


def test_encode_needs_a_pooling_model(engine):
    async def main():
        async for _ in engine.encode("hi", None, "e"):
            pass
    with pytest.raises(ValueError, match="runner='pooling'"):
        asyncio.run(main())


def test_cached_tokens_count_the_prompt_once_with_n_choices(engine):
    """n choices of a cached prompt: num_cached_tokens is the prompt's (the most any choice found),
    as LLM.generate and the server report it (it was summed over the choices: 288 of a 157-token
    prompt with n=2)."""
    prompt = "def add(a, b):\n    return a + b\n" * 5
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=3, n=3)
    asyncio.run(_collect(engine, prompt, SamplingParams(max_tokens=1), "warm-cache"))
    last = asyncio.run(_collect(engine, prompt, params, "cached-n3"))[-1]
    assert 0 < last.num_cached_tokens < len(last.prompt_token_ids)


def test_a_cancelled_engine_call_harms_no_request(engine):
    """A caller that gives up on an engine call (a wait_for timeout, a client gone) cancels its
    future: setting it on the engine's thread then raised, and every running stream failed with
    InvalidStateError (queued calls never returned); now only that caller is affected."""
    async def main():
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        streams = [asyncio.create_task(_collect(engine, p, params, f"c{i}")) for i, p in enumerate(PROMPTS)]
        while engine.llm.engine.num_running < len(PROMPTS):
            await asyncio.sleep(0.005)
        for call in (engine.reset_prefix_cache, engine.list_loras) * 3:
            task = asyncio.create_task(call())
            await asyncio.sleep(0)               # queued for the engine's thread
            task.cancel()
            await asyncio.sleep(0.01)
        pause = asyncio.create_task(engine.pause_generation(mode="wait"))
        await asyncio.sleep(0)
        pause.cancel()                           # its caller gave up: resuming must still work
        await asyncio.sleep(0.01)
        await engine.resume_generation()
        outs = [await s for s in streams]
        await engine.reset_prefix_cache()       # the engine's calls go on
        return outs
    outs = asyncio.run(main())
    assert [o[-1].outputs[0].finish_reason for o in outs] == ["length"] * len(PROMPTS)


def test_the_engine_view_refuses_an_engine_another_thread_steps(engine):
    """llm.llm_engine's add_request / step / abort_request beside an AsyncLLM on the same LLM: two
    threads stepped one engine and the process died (SIGSEGV); now refused, as LLM.stream is."""
    view = engine.llm.llm_engine
    for call in (lambda: view.add_request("v", "def f():", SamplingParams(max_tokens=4)), view.step,
                 lambda: view.abort_request("v")):
        with pytest.raises(ValueError, match="run by an AsyncLLM"):
            call()


def test_a_dropped_engine_stops_its_thread(tiny_pair):
    """An AsyncLLM dropped without shutdown() stops its engine thread, as vLLM's __del__ does (the
    thread and the model it held stayed: ~190 MB each); shutdown takes vLLM's timeout."""
    import gc
    import threading

    def engine_threads():
        return sum(t.name.startswith("specdec-engine") for t in threading.enumerate())

    before = engine_threads()
    eng = AsyncLLM(model=str(tiny_pair[0]), num_speculative_tokens=0)
    asyncio.run(_collect(eng, "def f():", SamplingParams(max_tokens=4, temperature=0), "d"))
    assert engine_threads() == before + 1
    del eng
    gc.collect()
    assert engine_threads() == before
    other = AsyncLLM(model=str(tiny_pair[0]), num_speculative_tokens=0)
    other.shutdown(timeout=30)
    assert engine_threads() == before


def test_generate_takes_vllms_keywords_only_and_a_dead_engine_says_so(tiny_pair):
    """generate() takes vLLM's keywords (tokenization_kwargs truncating a text prompt, as vLLM's
    tokenizer does) and refuses others (a misspelt lora_requst ran the base model); a request to
    an engine whose thread has died is refused at once (it waited forever), as vLLM's
    EngineDeadError; get_supported_tasks / is_tracing_enabled say what the engine does."""
    eng = AsyncLLM(model=str(tiny_pair[0]), num_speculative_tokens=0)
    params = SamplingParams(max_tokens=2, temperature=0)
    try:
        out = asyncio.run(_collect(eng, "def add(a, b):\n    return", params, "t"))[-1]
        short = asyncio.run(eng.generate("def add(a, b):\n    return", params, "u",
                                         tokenization_kwargs={"truncation": True, "max_length": 3}).__anext__())
        assert len(short.prompt_token_ids) == 3 < len(out.prompt_token_ids)
        with pytest.raises(TypeError):
            asyncio.run(eng.generate("x", params, "v", lora_requst=None).__anext__())
        assert asyncio.run(eng.get_supported_tasks()) == ("generate",) and not asyncio.run(eng.is_tracing_enabled())
        eng._worker.stop()                        # the engine's thread gone, not by shutdown()
        with pytest.raises(RuntimeError, match="not running"):
            asyncio.run(eng.generate("x", params, "w").__anext__())
        assert eng.errored
    finally:
        eng.shutdown()


def test_an_abort_while_the_grammar_compiles_ends_with_an_output(engine):
    """abort(request_id) that lands while the request's grammar compiles ends its stream with one
    output, finish_reason "abort", as at any later point (it ended with none: outs[-1] failed)."""
    from specdec.config import StructuredOutputsParams

    schema = {"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": "[a-z]{3,9}"} for i in range(40)}}
    params = SamplingParams(max_tokens=20, structured_outputs=StructuredOutputsParams(json=schema))

    async def main():
        task = asyncio.create_task(_collect(engine, "x", params, "g"))
        await asyncio.sleep(0.001)
        await engine.abort("g")
        return await task
    outs = asyncio.run(main())
    assert outs and outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
