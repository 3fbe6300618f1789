"""One OpenMP team per process: a thread that hands the compute to another gives its team up
(kernels.release_threads), and the server's engine thread computes with the thread count the
starting thread had (server/worker.py). Two teams on two cores had made every barrier sleep on
a futex: 28 ms per SmolLM2 token instead of 4 on an AMD EPYC VM."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from specdec import kernels
from specdec.config import SamplingParams
from specdec.llm import LLM
from specdec.server.worker import EngineWorker, Job

needs_two = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one CPU: no team to give up")


TEAM_NAME = b"specdec-team-t"       # this test thread's OS name, which its OpenMP workers inherit


def _os_threads() -> int:
    """OS threads named like the calling test thread: it and the team workers it started (other
    tests' threads come and go beside it)."""
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm", "rb") as f:
                count += f.read().strip() == TEAM_NAME
        except OSError:            # a thread that just ended
            pass
    return count


def _settles_at(count: int, timeout: float = 10.0) -> bool:
    """Whether _os_threads() reaches count within timeout: a released team's workers leave
    libgomp's pool when the pause returns, but the OS thread ends a moment later (under a
    loaded full suite, seen to take longer than the next line of the test)."""
    deadline = time.monotonic() + timeout
    while _os_threads() != count:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _name_this_thread() -> None:
    import ctypes

    ctypes.CDLL(None).prctl(15, ctypes.c_char_p(TEAM_NAME), 0, 0, 0)   # PR_SET_NAME


def _omp_max_threads() -> int:
    gomp = kernels._openmp()
    assert gomp is not None, "no libgomp in this process"
    return gomp.omp_get_max_threads()


def _in_thread(fn):
    """fn() on a new thread with two threads per team (conftest runs the suite with one)."""
    out = {}

    def run():
        _name_this_thread()
        saved = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            out["value"] = fn()
        except BaseException as e:      # noqa: BLE001 - re-raised on the calling thread
            out["error"] = e
        finally:
            torch.set_num_threads(saved)

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    if "error" in out:
        raise out["error"]
    return out["value"]


@needs_two
def test_release_threads_ends_the_callers_team():
    def body():
        n, before = torch.get_num_threads(), _os_threads()      # a new thread: no team yet
        if kernels.load() is not None:   # a kernel's parallel region (skinny.c)
            w = torch.randn(4096, 576)
            packed, x = kernels.pack(w), torch.randn(1, 576)
            work = lambda: kernels.linear(x, w, packed=packed)  # noqa: E731
        else:
            x = torch.randn(1 << 22)
            work = x.exp
        work()                           # this thread's team of n runs
        assert _os_threads() == before + n - 1
        assert kernels.release_threads()
        assert _settles_at(before), f"the team's workers did not exit ({_os_threads()} threads, {before} before)"
        assert _omp_max_threads() == 1
        if kernels.load() is not None:   # the kernels' later regions follow this thread's count: alone
            work()
            assert _os_threads() == before, "a later region started a new team"
        return True

    assert _in_thread(body)


@needs_two
def test_engine_worker_computes_with_the_starters_thread_count(tiny_pair):
    target, _ = tiny_pair

    def body():
        n = torch.get_num_threads()
        llm = LLM(str(target), max_model_len=64, dtype="float32")
        seen = []
        worker = EngineWorker(llm.engine, on_step=lambda engine, events: seen.append(
            (torch.get_num_threads(), _omp_max_threads(), threading.current_thread().name)))
        worker.start()
        assert _omp_max_threads() == 1, "the starting thread kept its team"
        done = threading.Event()
        tokens = []

        def deliver(item):
            assert not isinstance(item, Exception), item
            tokens.extend(item.token_ids)
            if item.finished:
                done.set()

        ids = llm.tokenizer.encode("def f(x):")
        worker.submit([Job(ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), 0, deliver)])
        assert done.wait(60)
        worker.stop(60)
        assert len(tokens) == 8
        assert seen and all(s == (n, n, "specdec-engine") for s in seen), seen
        assert torch.get_num_threads() == n and _omp_max_threads() == n, "stop() gives the starter its count back"
        expected = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert tokens == list(expected[0].outputs[0].token_ids)
        return True

    assert _in_thread(body)


def test_generate_from_several_threads_takes_turns(tiny_pair):
    """LLM.generate from several threads at once: the calls take turns on the engine (two steppers
    at once corrupted its memory: `free(): corrupted unsorted chunks`), each answer the one it gets alone."""
    target, draft = tiny_pair
    llm = LLM(str(target), speculative_model=str(draft), num_speculative_tokens=3)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = {i: llm.generate(f"def f{i}(x):", params)[0].outputs[0].token_ids for i in range(4)}
    got: list = []

    def run(i):
        got.append((i, llm.generate(f"def f{i}(x):", params)[0].outputs[0].token_ids))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4) for _ in range(2)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    assert len(got) == 8 and all(tokens == want[i] for i, tokens in got)
