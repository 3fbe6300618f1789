"""AsyncLLM as vLLM's (review 62): a cancelled consumer ends cancelled, the request keeps a copy of
its SamplingParams, tokenization_kwargs keep the prompt, an engine thread that dies of a
BaseException answers every waiter, and a shutdown on another thread gives the starting thread
its compute threads back."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from specdec import LLM, AsyncLLM, RequestOutputKind, SamplingParams
from specdec.async_llm import EngineDeadError

TARGET = str(Path(__file__).resolve().parents[1] / "models" / "target")
PROMPT = "def fib(n):"


@pytest.fixture(scope="module")
def llm():
    return LLM(TARGET)


@pytest.fixture
def engine(llm):
    eng = AsyncLLM(llm)
    yield eng
    eng.shutdown()


def test_a_consumer_cancelled_after_abort_or_shutdown_ends_cancelled(engine):
    """vLLM's generate re-raises CancelledError: a task cancelled just after abort() (or
    shutdown(), the order an app exits in) ends cancelled, not past its `async for`."""
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    after_loop = []

    async def consume(rid, streaming):
        async for _ in engine.generate(PROMPT, params, rid):
            streaming.release()
        after_loop.append(rid)

    async def main():
        streaming = asyncio.Semaphore(0)
        task = asyncio.create_task(consume("a", streaming))
        await streaming.acquire()
        await engine.abort("a")
        task.cancel()
        aborted = await asyncio.gather(task, return_exceptions=True)
        streaming = asyncio.Semaphore(0)
        tasks = [asyncio.create_task(consume(f"c{i}", streaming)) for i in range(2)]
        for _ in tasks:
            await streaming.acquire()             # (both requests are in by the first output)
        engine.shutdown()
        for t in tasks:
            t.cancel()
        return aborted + await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(main())
    assert all(isinstance(r, asyncio.CancelledError) for r in results), results
    assert after_loop == []


def test_the_request_keeps_a_copy_of_its_params(engine):
    """A change to the caller's SamplingParams after generate() has started reaches no request
    in flight (vLLM clones them as the request is added): output_kind and max_tokens."""
    async def main():
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)     # CUMULATIVE
        outs = []
        async for out in engine.generate(PROMPT, params, "kind"):
            outs.append(out.outputs[0].token_ids)
            params.output_kind = RequestOutputKind.DELTA
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        await engine.pause_generation(mode="keep")
        q = await engine.add_request("length", PROMPT, params)
        params.max_tokens = 3                          # the job is queued, not yet in the engine
        await engine.resume_generation()
        out = await q.get()
        while not out.finished:
            out = await q.get()
        return outs, out

    outs, out = asyncio.run(main())
    assert len(outs[-1]) == 8 and all(o == outs[-1][:len(o)] for o in outs)     # each the completion so far
    assert len(out.outputs[0].token_ids) == 12 and out.outputs[0].finish_reason == "length"


def test_tokenization_kwargs_keep_the_prompt(engine, llm):
    """tokenization_kwargs as LLM.generate's: a text prompt's text stays the output's prompt, and a
    prompt that has token ids runs them (its text kept), not its text tokenized again."""
    params = SamplingParams(max_tokens=3, temperature=0)
    kwargs = {"truncation": True, "max_length": 4}
    text = "def fib(n): return n if n < 2 else fib(n-1)"
    both = {"prompt": "hello", "prompt_token_ids": [0, 272, 273, 274, 275, 276]}

    async def last(prompt, rid):
        return [o async for o in engine.generate(prompt, params, rid, tokenization_kwargs=kwargs)][-1]

    async def main():
        return await last(text, "text"), await last(both, "both")

    got = asyncio.run(main())
    assert not engine._worker._taken                 # what the engine thread answers is not kept
    offline = [llm.generate(p, params, tokenization_kwargs=kwargs)[0] for p in (text, both)]
    for a, o in zip(got, offline):
        assert (a.prompt, a.prompt_token_ids, a.outputs[0].token_ids) == \
            (o.prompt, o.prompt_token_ids, o.outputs[0].token_ids)
    assert got[0].prompt == text and len(got[0].prompt_token_ids) == 4
    assert got[1].prompt == "hello" and got[1].prompt_token_ids == both["prompt_token_ids"]


def test_an_engine_thread_dying_of_a_base_exception_answers_every_waiter(llm):
    """A collective_rpc function raising SystemExit kills the engine thread: the rpc's caller, a
    stream in flight and later calls get EngineDeadError (SystemExit its cause), none waits."""
    eng = AsyncLLM(llm)

    def leave(worker):
        raise SystemExit("the worker function exits")

    async def stream(streaming):
        async for _ in eng.generate(PROMPT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), "s"):
            streaming.set()

    async def main():
        streaming = asyncio.Event()
        task = asyncio.create_task(stream(streaming))
        await streaming.wait()
        await eng.pause_generation(mode="keep")       # the stream stays in flight, its request in the engine
        rpc = asyncio.create_task(eng.collective_rpc(leave))
        return await asyncio.wait_for(asyncio.gather(task, rpc, return_exceptions=True), 30)

    try:
        errors = asyncio.run(main())
        assert all(isinstance(e, EngineDeadError) for e in errors), errors
        assert all(isinstance(e.__cause__, SystemExit) for e in errors)
        assert eng.errored
        with pytest.raises(EngineDeadError):
            asyncio.run(eng.collective_rpc(lambda worker: None))
        with pytest.raises(EngineDeadError):
            asyncio.run(eng.generate(PROMPT, SamplingParams(max_tokens=2), "later").__anext__())
    finally:
        eng.shutdown()
    assert not llm.engine.has_unfinished()          # the stream's request left the engine
    assert llm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0))[0].outputs[0].token_ids


def test_a_shutdown_on_another_thread_gives_the_starter_its_threads_back(llm):
    """The starting thread hands its compute threads to the engine's; shut down from a worker
    thread (asyncio.to_thread), it gets them back before the await returns, as it does when
    shutdown() runs on it."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        eng = AsyncLLM(llm)

        async def main():
            async for _ in eng.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0), "a"):
                pass
            await asyncio.to_thread(eng.shutdown)
            return torch.get_num_threads()

        assert asyncio.run(main()) == 2
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
