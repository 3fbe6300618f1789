"""AsyncLLM as vLLM v1's: an exception in an engine step is fatal (EngineDeadError for the
requests in flight and after, errored, check_health raising), and add_request() returning a
RequestOutputCollector (get / get_nowait), the call generate() is made of."""

from __future__ import annotations

import asyncio

import pytest

from specdec import LLM, AsyncLLM, RequestOutputKind, SamplingParams
from specdec.async_llm import EngineDeadError

PROMPT = "def fib(n):"


async def _drain(q):
    outs = []
    while not (outs and outs[-1].finished):
        outs.append(q.get_nowait() or await q.get())
    return outs


def test_a_failing_step_kills_the_engine_as_vllms(tiny_pair, monkeypatch):
    """A model forward that raises: both requests in flight end with EngineDeadError (the
    forward's exception its cause), errored is True, check_health raises and new requests are
    refused, as vLLM's engine core dies (check_health passed while every step failed)."""
    eng = AsyncLLM(model=str(tiny_pair[0]), num_speculative_tokens=0)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    try:
        async def healthy():
            await eng.check_health()
            return [o async for o in eng.generate(PROMPT, params, "ok")]
        assert asyncio.run(healthy())[-1].finished and not eng.errored

        def boom(*args, **kwargs):
            raise RuntimeError("boom: the device is gone")
        monkeypatch.setattr(eng.llm.engine.target, "forward", boom)

        async def one(rid):
            try:
                [o async for o in eng.generate(PROMPT, params, rid)]
            except Exception as e:       # noqa: BLE001 - the test reads it
                return e

        async def both():
            return await asyncio.gather(one("a"), one("b"))
        errors = asyncio.run(asyncio.wait_for(both(), 60))
        assert all(isinstance(e, EngineDeadError) for e in errors), errors
        assert "boom" in str(errors[0].__cause__)
        assert eng.errored and not eng.is_running
        with pytest.raises(EngineDeadError, match="boom"):
            asyncio.run(eng.check_health())
        with pytest.raises(EngineDeadError):
            asyncio.run(eng.generate(PROMPT, params, "c").__anext__())
        with pytest.raises(EngineDeadError):
            asyncio.run(eng.add_request("d", PROMPT, params))
        eng._worker.thread.join(30)              # the engine's thread has ended, not spinning on failed steps
        assert not eng._worker.thread.is_alive()
    finally:
        eng.shutdown()
    assert eng.errored                           # still, after shutdown (vLLM's)


def test_add_request_returns_a_collector_as_vllms(tiny_pair):
    """add_request(request_id, prompt, params) -> collector: get() / get_nowait() give generate()'s
    outputs (the offline LLM's tokens); the id is taken while it runs and free once it has
    finished; abort() ends it with finish_reason "abort"; DELTA outputs add up to the text."""
    target = str(tiny_pair[0])
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    (want,) = LLM(target, num_speculative_tokens=0).generate(PROMPT, params)
    eng = AsyncLLM(model=target, num_speculative_tokens=0)
    try:
        async def main():
            q = await eng.add_request("a", PROMPT, params)
            assert q.get_nowait() is None                 # nothing has come back yet
            with pytest.raises(ValueError, match="already running"):
                await eng.add_request("a", PROMPT, params)
            outs = await _drain(q)
            again = await _drain(await eng.add_request("a", {"prompt_token_ids": want.prompt_token_ids}, params))
            delta = await _drain(await eng.add_request(
                "d", PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                            output_kind=RequestOutputKind.DELTA)))
            long = await eng.add_request("b", PROMPT, SamplingParams(max_tokens=10_000, ignore_eos=True))
            await long.get()
            await eng.abort("b")
            cut = await _drain(long)
            return outs, again, delta, cut
        outs, again, delta, cut = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        eng.shutdown()
    assert outs[-1].request_id == "a" and not any(o.finished for o in outs[:-1])
    assert outs[-1].outputs[0].token_ids == want.outputs[0].token_ids
    assert outs[-1].outputs[0].text == want.outputs[0].text
    assert again[-1].outputs[0].token_ids == want.outputs[0].token_ids
    assert "".join(o.outputs[0].text for o in delta) == want.outputs[0].text
    assert cut[-1].finished and cut[-1].outputs[0].finish_reason == "abort"


def test_a_request_whose_loop_has_closed_harms_no_other(tiny_pair):
    """asyncio.run returning with a request still in the engine (an add_request collector nobody
    reads): its events meet a closed loop. The worker's answer, an abort, landed in the middle
    of the next step (events are handed over as its forward starts): that step failed with a
    KeyError, which now kills the engine (before: failed every request in it). The job is
    cancelled between two steps instead, and the next request runs."""
    eng = AsyncLLM(model=str(tiny_pair[0]), num_speculative_tokens=0)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    try:
        async def leave():
            q = await eng.add_request("left", PROMPT, SamplingParams(max_tokens=2000, ignore_eos=True))
            await q.get()                        # it runs; this loop ends without closing it
        asyncio.run(leave())

        async def after():
            return [o async for o in eng.generate(PROMPT, params, "next")]
        outs = asyncio.run(asyncio.wait_for(after(), 60))
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 12
        assert not eng.errored
        asyncio.run(eng.check_health())
    finally:
        eng.shutdown()


def test_reset_prefix_cache_has_vllms_current_signature(tiny_pair):
    """reset_prefix_cache(reset_running_requests, reset_connector): a positional True is the
    flag (it had been read as vLLM's old device argument, resetting nothing), a device a TypeError."""
    eng = AsyncLLM(model=str(tiny_pair[0]), num_speculative_tokens=0)
    try:
        async def run():
            assert await eng.reset_prefix_cache(True) is True
            assert await eng.reset_prefix_cache(reset_running_requests=False, reset_connector=False) is True
            with pytest.raises(TypeError):
                await eng.reset_prefix_cache("cpu")
        asyncio.run(run())
    finally:
        eng.shutdown()


def test_engine_args_take_vllms_scheduler_flags():
    """EngineArgs.add_cli_args / from_cli_args carry vLLM's scheduler flags LLM() takes (the
    parser refused them); left out, they stay out."""
    import argparse

    from specdec.async_llm import EngineArgs
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", "m", "--preemption-mode", "recompute", "--max-num-partial-prefills", "1",
                              "--long-prefill-token-threshold", "0"])
    kwargs = EngineArgs.from_cli_args(args).kwargs
    assert (kwargs["preemption_mode"], kwargs["max_num_partial_prefills"], kwargs["long_prefill_token_threshold"]) \
        == ("recompute", 1, 0)
    assert "preemption_mode" not in EngineArgs.from_cli_args(parser.parse_args(["--model", "m"])).kwargs
