"""The server's engine worker: when a step's events reach the event loop."""

from __future__ import annotations

import threading

from specdec import SamplingParams
from specdec.llm import LLM
from specdec.server.worker import EngineWorker, Job


def test_a_steps_events_go_out_as_the_next_forward_starts(tiny_pair):
    """A step's events are handed over right before the next target forward (its batch built),
    so that the event loop's work on them overlaps a forward that runs without the GIL instead of
    the next step's drafting; the last ones go out before the worker waits for work."""
    target, draft = tiny_pair
    llm = LLM(str(target), speculative_model=str(draft), num_speculative_tokens=2, max_model_len=96, dtype="float32")
    log, done = [], threading.Event()
    worker = EngineWorker(llm.engine)
    hand_over = llm.engine.before_forward
    assert hand_over is not None

    def before_forward():
        log.append("forward")
        hand_over()

    llm.engine.before_forward = before_forward
    tokens = []

    def deliver(item):
        assert not isinstance(item, Exception), item
        log.append("event")
        tokens.extend(item.token_ids)
        if item.finished:
            done.set()

    worker.start()
    try:
        ids = llm.tokenizer.encode("def f(x):")
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        worker.submit([Job(ids, params, 0, deliver)])
        assert done.wait(60), "the last event went out without another forward"
    finally:
        worker.stop(60)
    assert llm.engine.before_forward is before_forward      # stop() clears only its own hook
    log = list(log)
    # the prompt's step emits nothing; from then on each step's event follows the next forward's
    # start, and the last one (no forward after it) goes out as the worker runs out of work
    first = log.index("event")
    assert first >= 2 and set(log[:first - 1]) == {"forward"}
    assert log[first - 1:-1] == ["forward", "event"] * ((len(log) - first) // 2) and log[-1] == "event", log
    llm.engine.before_forward = None        # offline, as after stop()
    expected = llm.generate([{"prompt_token_ids": ids}], params)
    assert tokens == list(expected[0].outputs[0].token_ids)


def test_stop_takes_the_hook_off_the_engine(tiny_pair):
    target, _ = tiny_pair
    llm = LLM(str(target), max_model_len=64, dtype="float32")
    worker = EngineWorker(llm.engine)
    assert llm.engine.before_forward is not None
    worker.start()
    worker.stop(60)
    assert llm.engine.before_forward is None


def test_a_base_exception_never_leaves_a_waiter_hanging(tiny_pair):
    """A BaseException on the engine thread (a collective_rpc function's SystemExit, one escaping
    a step: the handlers catch Exception) is fatal, as a vLLM worker process exiting: the call that
    raised, the requests in flight and later calls are answered with the engine's death, where the
    thread had died silently and its callers waited for ever."""
    import sys

    from specdec.server.worker import EngineDeadError

    target, _ = tiny_pair
    ids = None
    for kind in ("call", "step"):
        llm = LLM(str(target), max_model_len=64, dtype="float32")
        ids = ids or llm.tokenizer.encode("def f(x):")
        worker = EngineWorker(llm.engine)
        got, first, done = [], threading.Event(), threading.Event()

        def deliver(item):
            got.append(item)
            first.set()
            if isinstance(item, BaseException) or item.finished:
                done.set()

        real_step = llm.engine.step
        if kind == "step":
            def dying_step():
                llm.engine.step = real_step
                raise SystemExit(4)
            llm.engine.step = dying_step
        worker.start()
        try:
            worker.submit([Job(ids, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), 0, deliver)])
            if kind == "call":
                assert first.wait(30)
                future = worker.call(lambda engine: sys.exit(3))
                try:
                    future.result(30)
                    raise AssertionError("the call should fail")
                except EngineDeadError as e:
                    assert "SystemExit" in str(e)
            assert done.wait(30), "the request was left waiting on a dead thread"
            assert isinstance(got[-1], BaseException) and worker.error is not None
            try:                                                              # refused, not hanging
                worker.call(lambda engine: 7).result(30)
                raise AssertionError("a dead engine took a call")
            except EngineDeadError:
                pass
        finally:
            worker.stop(30)


def test_jobs_taken_with_a_call_that_kills_the_thread_are_answered(tiny_pair):
    """A request taken off the queue between two steps together with a call that then raises a
    BaseException (a collective_rpc function's SystemExit) was never admitted: the dying thread
    answers it too, where it had waited for ever."""
    from specdec.server.worker import EngineDeadError

    target, _ = tiny_pair
    llm = LLM(str(target), max_model_len=64, dtype="float32")
    ids = llm.tokenizer.encode("def f(x):")
    worker = EngineWorker(llm.engine)
    holding, release, got, done = threading.Event(), threading.Event(), [], threading.Event()

    def hold(engine):
        holding.set()
        release.wait(30)

    def leave(engine):
        raise SystemExit("the worker function exits")

    def deliver(item):
        got.append(item)
        if isinstance(item, BaseException) or item.finished:
            done.set()

    worker.start()
    try:
        worker.call(hold)
        assert holding.wait(30)              # the thread is busy: the next two are queued together
        fatal = worker.call(leave)
        worker.submit([Job(ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), 0, deliver)])
        release.set()
        try:
            fatal.result(30)
            raise AssertionError("the call should fail")
        except EngineDeadError as e:
            assert "SystemExit" in str(e)
        assert done.wait(30), "the request taken with the call was left waiting"
        assert isinstance(got[-1], EngineDeadError) and not worker._taken
    finally:
        release.set()
        worker.stop(30)
