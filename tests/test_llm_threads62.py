"""Tester report 62: one LLM on several threads takes turns on every call that steps or changes
its engine (stream()'s steps, llm.llm_engine's add_request / abort_request, not generate() alone);
llm_engine.add_request keeps a copy of its params; a step-driven request loses nothing to an
LLM.generate() run between two llm_engine.step() calls."""

from __future__ import annotations

import threading

import pytest

from specdec import LLM, SamplingParams
from specdec.config import RequestOutputKind
from specdec.defaults import BUNDLED_TARGET

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(BUNDLED_TARGET, num_speculative_tokens=0)


def _inside_a_step(llm, call):
    """A forward hook that runs call() on another thread in the middle of the engine's first step
    (the target's forward), waits a while for it, and lets the step go on: a call that takes its
    turn waits until the stepping call is over; one that does not runs inside the step."""
    thread, errors = None, []

    def run():
        try:
            call()
        except Exception as e:          # noqa: BLE001 - reported by the test
            errors.append(e)

    def hook(module, args, out):
        nonlocal thread
        if thread is None:
            thread = threading.Thread(target=run)
            thread.start()
            thread.join(2)
    handle = llm.target.register_forward_hook(hook)
    return handle, lambda: (thread.join(60), errors)[1]


def test_a_stream_on_another_thread_waits_for_generate(llm):
    """A stream's step on one thread used to run inside generate()'s step on another (a crash,
    or `already holds KV blocks`): it now waits, and both answer what they answer alone."""
    params = SamplingParams(max_tokens=12, logprobs=1, **GREEDY)
    want = llm.generate(["def f(x):", "class A:"], params)
    want_stream = [t for e in llm.stream("import os", params) for t in e.token_ids]
    stream = llm.stream("import os", params)
    got_stream = []
    handle, done = _inside_a_step(llm, lambda: got_stream.extend(next(stream).token_ids))
    try:
        got = llm.generate(["def f(x):", "class A:"], params)
    finally:
        handle.remove()
    assert done() == []
    got_stream += [t for e in stream for t in e.token_ids]
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(a.outputs[0].logprobs) == len(b.outputs[0].logprobs) == 12
    assert got_stream == want_stream
    assert not llm.engine.has_unfinished()


def test_llm_engine_abort_on_another_thread_waits_for_generate(llm):
    """llm_engine.abort_request on another thread used to free a request in the middle of
    generate()'s step (KeyError in the step's commit)."""
    params = SamplingParams(max_tokens=10, **GREEDY)
    want = llm.generate(["def f(x):", "class A:"], params)
    view = llm.llm_engine
    view.add_request("v", "import os", params)
    handle, done = _inside_a_step(llm, lambda: view.abort_request("v"))
    try:
        got = llm.generate(["def f(x):", "class A:"], params)
    finally:
        handle.remove()
    assert done() == []
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert not llm.engine.has_unfinished() and llm.engine.kv_cache_usage == 0


def test_llm_engine_add_request_on_another_thread_waits_for_generate(llm):
    params = SamplingParams(max_tokens=10, **GREEDY)
    want = [t for e in llm.stream("import os", params) for t in e.token_ids]
    view = llm.llm_engine
    handle, done = _inside_a_step(llm, lambda: view.add_request("w", "import os", params))
    try:
        llm.generate("def f(x):", params)
    finally:
        handle.remove()
    assert done() == []
    outs = []
    while view.has_unfinished_requests():
        outs += view.step()
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == want


def test_llm_engine_add_request_keeps_a_copy_of_its_params(llm):
    """vLLM clones the params when the request is added: a later change to the caller's object
    (preparing the next request) does not reach the queued one."""
    view = llm.llm_engine
    sp = SamplingParams(max_tokens=6, **GREEDY)            # CUMULATIVE
    view.add_request("x", "def fib(n):", sp)
    sp.output_kind = RequestOutputKind.FINAL_ONLY
    sp.max_tokens = 2
    counts = []
    while view.has_unfinished_requests():
        counts += [len(o.outputs[0].token_ids) for o in view.step()]
    assert counts == [1, 2, 3, 4, 5, 6]


def test_generate_between_llm_engine_steps_loses_nothing(llm):
    """generate() steps the whole engine: the step-driven requests' events of those steps reach
    their llm_engine view, whose next step() returns them (vLLM's LLM.generate runs the engine's
    other requests too, and its LLMEngine then has nothing more of them)."""
    view = llm.llm_engine
    sp = SamplingParams(max_tokens=20, **GREEDY)
    ref = llm.generate("def fib(n):", sp)[0].outputs[0].token_ids
    other = SamplingParams(max_tokens=8, **GREEDY)
    view.add_request("x", "def fib(n):", sp)
    last = [view.step() for _ in range(3)][-1][-1]
    llm.generate("class A:", other)
    while view.has_unfinished_requests():
        last = (view.step() or [last])[-1]
    assert last.finished and last.outputs[0].token_ids == ref

    # one that finishes inside generate(): its finished output comes at the next step()
    delta = SamplingParams(max_tokens=20, output_kind=RequestOutputKind.DELTA, **GREEDY)
    view.add_request("y", "def fib(n):", delta)
    outs = view.step()
    llm.generate("class A:", SamplingParams(max_tokens=40, **GREEDY))
    assert view.has_unfinished_requests()
    while view.has_unfinished_requests():
        outs += view.step()
    assert outs[-1].finished and [t for o in outs for t in o.outputs[0].token_ids] == ref
    assert not view.has_unfinished_requests() and not view._own
