"""One thread owns the batch engine: between steps it admits new requests and aborts cancelled
ones; each step advances every running request in one forward, and its events reach their
requests as soon as the step ends.

The torch engine is not thread-safe, so nothing else touches it. The engine queues what does
not fit (max_num_seqs seats, max_num_batched_tokens per step, the KV pool) and preempts when
the pool runs dry; the worker only moves requests in and out. Events travel to the asyncio
side through each job's `deliver` callback (loop.call_soon_threadsafe), so the event loop
never waits on torch, and a client that leaves frees its seat and KV blocks before the next
step.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import threading
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field, replace

import torch

from .. import kernels
from ..config import SamplingParams
from ..engine import Engine, StepEvent

log = logging.getLogger("specdec.server")


@dataclass(eq=False)
class Job:
    """One completion choice. `deliver` is called on the worker thread with StepEvents, or one
    Exception; after an Exception or a finished event, nothing more comes. A cancelled job ends
    with a finished event too (finish_reason "abort", its statistics once the engine stopped it)."""
    prompt_ids: list[int]
    params: SamplingParams
    seed_offset: int
    deliver: Callable[[object], None]
    request_id: str = ""                           # the engine's (unique; set by submit)
    name: str = ""                                 # the logs' (the HTTP request's id); default request_id
    priority: int = 0                              # scheduling_policy="priority": lower first
    lora_request: object | None = None             # the LoRA adapter it runs with (specdec.lora.LoRARequest)
    prediction: list[int] | None = None            # Predicted Outputs: token ids the output is expected to repeat
    trace_headers: dict | None = None              # W3C trace context of its span (traceparent, tracestate)
    cache_salt: str | None = None                  # vLLM's: prefix-cache blocks shared only under the same salt
    echo_only: bool = False                        # echo with max_tokens 0: its one token is dropped (on_step sees none)
    cancelled: bool = False                        # set by any thread; the worker acts on it
    started: bool = field(default=False, repr=False)   # handed to the engine


class ShuttingDown(RuntimeError):
    pass


class EngineDeadError(ShuttingDown):
    """vLLM's: the engine cannot serve any more (a step failure it did not recover from, this
    one's __cause__); the server answers 503 and shuts down."""


# failed steps, with no step decoding between them, after which the engine is probed. One failure
# is taken as transient: its requests fail and the next step runs. Only a step that decodes (takes
# a request past its first token) clears the count: a fault on the decode path alone (a drafter
# whose device is gone) fails every request after its first token, and each new request's first
# steps, which pass, would clear it for ever. At the second failure a probe (a short prompt decoded
# for a few tokens, drafts included, the engine empty) tells a persistent fault (a device gone, a
# model that always raises: the engine is dead, as vLLM's engine core at its first failure, rather
# than a server whose /health says 200 drawing its healthy peers' traffic) from requests that fail
# on their own (a client retrying the request that failed: the probe passes and the server goes on)
FATAL_STEP_FAILURES = 2


# vLLM's pause modes (POST /pause?mode=): in-flight requests aborted, waited for, or frozen
PAUSE_MODES = ("abort", "wait", "keep")


# per thread that handed its compute to an engine thread: its torch thread count before that (a
# second worker started from the same thread computes with it, not with the 1 left after release)
_RELEASED = threading.local()


class EngineWorker:
    def __init__(self, engine: Engine, on_step: Callable[[Engine, list[StepEvent]], None] | None = None,
                 freeze_heap: bool = True):
        """freeze_heap: gc.freeze() at start (a server process: its model and pool leave the
        collector's walks); a library object that may be dropped and made again passes False."""
        self.engine = engine
        self.freeze_heap = freeze_heap
        self.on_step = on_step                     # told of every step (the metrics)
        self._cond = threading.Condition()
        self._inbox: deque[Job] = deque()          # submitted, not yet in the engine
        self._cancels: deque[Job] = deque()        # in the engine, to abort before the next step
        self._jobs: dict[str, Job] = {}            # request id -> job, while in the engine
        # call(): run between steps; (fn, future, work): `work` ones compute requests (pooling) and
        # wait while paused, as generation jobs do
        self._calls: deque[tuple[Callable[[Engine], object], Future, bool]] = deque()
        self._ids = itertools.count()
        self._closing = False
        self.error: BaseException | None = None        # what killed the engine (alive is then False)
        self._failures = 0                             # failed steps since one last decoded
        self._taken: deque[Future | Job] = deque()     # calls and new jobs off their queues, not yet answered
        # vLLM's pause_generation: while paused no step runs and new jobs wait in the inbox;
        # while holding (pause mode "wait", draining) the running ones go on and new ones wait
        self._paused = self._holding = self._no_pauses = False
        self._pauses: list[tuple[Future, str, bool]] = []   # pause() calls not yet settled: (future, mode, clear_cache)
        # a step's events, handed over when the next forward starts (or before the thread waits):
        # the event loop's work on them then overlaps that forward, which runs without the GIL,
        # instead of taking the GIL from the next step's drafting and scheduling
        self._pending: list[tuple[Job, object]] = []
        engine.before_forward = self._hand_over
        self._thread = threading.Thread(target=self._guarded_loop, name="specdec-engine", daemon=True)
        self._threads, self._starter = torch.get_num_threads(), None    # start(): the starter's count and id

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting + len(self._inbox)

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closing

    def start(self) -> None:
        # the model, tokenizer and pool are loaded: move them out of the collector's way, so
        # that collections triggered by each step's short-lived objects stop walking them
        # (vLLM freezes its heap after start-up for the same reason)
        if self.freeze_heap:
            gc.collect()
            gc.freeze()
        # the engine thread computes from now on, with this thread's thread count; this thread's
        # OpenMP team goes, so that the process holds one team (kernels.release_threads: why)
        self._starter = threading.get_ident()
        if getattr(_RELEASED, "threads", None) is None:
            _RELEASED.threads = torch.get_num_threads()
        self._threads = _RELEASED.threads
        self.engine.owner = self
        kernels.release_threads()
        self._thread.start()

    def dead(self) -> EngineDeadError:
        """The error a dead engine answers with (what killed it, its __cause__)."""
        dead = EngineDeadError(f"the engine is dead: {type(self.error).__name__}: {self.error}")
        dead.__cause__ = self.error
        return dead

    def _refusal(self) -> ShuttingDown:
        return self.dead() if self.error is not None else ShuttingDown("the server is shutting down")

    def submit(self, jobs: list[Job]) -> None:
        """Queue all of a request's jobs at once, or none of them."""
        with self._cond:
            if self._closing:
                raise self._refusal()
            for job in jobs:
                job.request_id = f"req-{next(self._ids)}"
                job.name = job.name or job.request_id
            self._inbox.extend(jobs)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Drop a job: one not yet in the engine leaves the queue now, one in it is aborted
        (its seat and blocks freed) before the next step; either way its last event follows (an
        abort, with what the engine computed for it until it stopped it)."""
        with self._cond:
            job.cancelled = True
            queued = job in self._inbox
            if queued:
                self._inbox.remove(job)
            elif job.started:
                self._cancels.append(job)
            self._cond.notify()
        if queued:
            self._send(job, StepEvent([], "", 0, finished=True, finish_reason="abort", request_id=job.request_id))

    def call(self, fn: Callable[[Engine], object], work: bool = False) -> Future:
        """fn(engine) on the engine's thread between two steps (the engine is not thread-safe:
        loading a LoRA adapter, say); its result or exception in the Future. work: fn computes
        requests (embeddings, scores), so it waits while the engine is paused, as new jobs do.
        Before start() or after the thread has ended, fn runs here and now; while the worker
        stops, ShuttingDown."""
        future: Future = Future()
        with self._cond:
            if self.error is not None:       # not on a dead engine, here or on its thread
                raise self.dead()
            if self._thread.is_alive():
                if self._closing:
                    raise ShuttingDown("the server is shutting down")
                self._calls.append((fn, future, work))
                self._cond.notify()
                return future
        _run(fn, self.engine, future)
        return future

    @property
    def paused(self) -> bool:
        return self._paused

    def pause(self, mode: str = "abort", clear_cache: bool = True) -> Future:
        """vLLM's pause_generation, before weights change: from now on no new job enters the
        engine (they wait, and run after resume()); mode "abort" ends every job submitted so far
        (finish_reason "abort", the output so far), "wait" lets the engine's requests finish
        first, "keep" freezes them where they are (no step runs; they go on after resume()).
        clear_cache (abort, wait): the prefix cache is forgotten once nothing runs. The Future
        is done when the engine is paused."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        future: Future = Future()
        waited = []
        with self._cond:
            if self._closing or self._no_pauses:
                raise self._refusal()
            if mode == "keep" or (self._paused and mode == "wait"):
                self._paused = True          # a step under way ends first; none starts after it
                # pauses draining ("wait") are paused now too; an "abort" still aborts
                waited = [p for p in self._pauses if p[1] == "wait"] + [(future, mode, clear_cache)]
                self._pauses = [p for p in self._pauses if p[1] != "wait"]
                self._holding = bool(self._pauses)
            else:
                self._holding = True
                self._pauses.append((future, mode, clear_cache))
            self._cond.notify()
        for f, _, _ in waited:
            _settle(f)
        return future

    def resume(self) -> None:
        """vLLM's resume_generation: steps run again and the waiting jobs enter the engine (a
        pause still draining is settled as it stands)."""
        with self._cond:
            self._paused = self._holding = False
            pending, self._pauses = self._pauses, []
            self._cond.notify()
        for future, _, _ in pending:
            _settle(future)

    def unpause_for_shutdown(self) -> None:
        """The server is going down (SIGTERM / SIGINT): a pause ends, so that what it held runs
        and the server drains instead of waiting on clients that wait on it; no pause is taken
        from now on."""
        with self._cond:
            self._no_pauses = True
        self.resume()

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new jobs, let the queued and running ones finish, then end the thread (a
        paused engine resumes for that)."""
        with self._cond:
            self._closing = True
            self._paused = self._holding = False
            pending, self._pauses = self._pauses, []
            self._cond.notify()
        for future, _, _ in pending:
            _settle(future, ShuttingDown("the server is shutting down"))
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive() and self.engine.before_forward == self._hand_over:
            self.engine.before_forward = None        # the engine may serve offline calls again
            self.engine.owner = None
        if threading.get_ident() == self._starter:
            torch.set_num_threads(self._threads)     # the starting thread computes again (tests, embedding)
            _RELEASED.threads = None

    def _guarded_loop(self) -> None:
        """_loop, and if anything escapes it (a BaseException such as a collective_rpc function's
        SystemExit, which its handlers do not catch: fatal, as a vLLM worker process exiting) the
        engine is dead (_fatal)."""
        try:
            self._loop()
        except BaseException as e:       # noqa: BLE001 - the thread ends here either way
            log.exception("the engine thread died")
            self._fatal(e)

    def _fatal(self, error: BaseException) -> None:
        """The engine thread is ending on `error`: every request and call waiting is answered,
        those it had taken off its queues included (the call that raised, the jobs it was
        admitting), rather than left hanging behind a thread that is gone."""
        self.error = self.error or error             # dead before its requests hear of it
        with contextlib.suppress(Exception):
            self._hand_over()                        # what was computed reaches them first
        self._die(error)                             # refused from now on; the queues answered
        with contextlib.suppress(Exception):
            self._fail_all(error if isinstance(error, Exception) else self.dead())
        dead = self.dead()
        for item in self._taken:
            if isinstance(item, Job):
                self._send(item, dead)
            else:
                with contextlib.suppress(InvalidStateError):     # run, or cancelled by its caller
                    item.set_exception(dead)
        self._taken.clear()

    def _loop(self) -> None:
        torch.set_num_threads(self._threads)     # this thread's OpenMP count (and torch's)
        kernels.set_threads(self._threads)
        while True:
            try:
                if not self._between_steps():
                    break
            except Exception as e:           # noqa: BLE001 - never a dead engine thread behind a live server
                log.exception("engine thread: admitting or cancelling requests failed")
                self._fail_all(e)
                continue
            if self._paused:                 # woken for a call or a cancel: the frozen requests stay as they are
                continue
            try:
                events = self.engine.step()
            except Exception as e:           # the step's requests cannot go on; the server may
                log.exception("engine step failed")
                self._hand_over()
                self._failures += 1
                clean = self._fail_all(e)
                if clean and self._failures >= FATAL_STEP_FAILURES and self._probe():
                    self._failures = 0           # the engine computes: the fault was those requests'
                if not clean or self._failures >= FATAL_STEP_FAILURES:
                    self._die(e)
                    break
                continue
            if any(e.stats.output_tokens > len(e.token_ids) for e in events):
                self._failures = 0           # it decoded: a request had a token before this step
            self._hand_over()                # the last step's, if this one had no forward
            seen = []                        # the events as the requests' clients see them (on_step's)
            for event in events:
                job = self._jobs.get(event.request_id)
                if job is not None:
                    if event.finished:
                        del self._jobs[event.request_id]     # the engine has freed its seat already
                    self._pending.append((job, event))
                    if job.echo_only:
                        event = replace(event, token_ids=[], num_accepted=0)
                seen.append(event)
            if self.on_step is not None:
                self.on_step(self.engine, seen)
        self._hand_over()

    def _hand_over(self) -> None:
        pending, self._pending = self._pending, []
        for job, event in pending:
            self._send(job, event)

    def _between_steps(self) -> bool:
        """Apply cancellations and admit new jobs; wait while there is nothing to do. False
        when closing and everything has finished."""
        if not self.engine.has_unfinished() or self._paused:
            self._hand_over()                # no forward is coming to carry them
        with self._cond:
            while not self._has_work():
                if self._closing:
                    return False
                self._cond.wait()
            admit = not (self._paused or self._holding)
            new, cancels = list(self._inbox) if admit else [], list(self._cancels)
            calls = [c for c in self._calls if admit or not c[2]]
            if admit:
                self._inbox.clear()
                self._calls.clear()
            else:
                self._calls = deque(c for c in self._calls if c[2])
            self._cancels.clear()
            for job in new:
                job.started = True
        for job in cancels:
            if self._jobs.pop(job.request_id, None) is not None:     # (one that finished has had its last event)
                event = self.engine.abort(job.request_id)
                self._pending.append((job, event or StepEvent([], "", 0, finished=True, finish_reason="abort",
                                                              request_id=job.request_id)))
        # taken off the queues: _fatal answers those still here if one ends the thread
        self._taken = deque([future for _, future, _ in calls] + new)
        for fn, future, _ in calls:
            _run(fn, self.engine, future)
            self._taken.popleft()
        while self._taken:
            self._admit(self._taken[0])
            self._taken.popleft()
        if self._pauses:
            self._settle_pauses()
        return True

    def _admit(self, job: Job) -> None:
        """A new job into the engine; one it refuses hears why (alone: the engine goes on)."""
        try:
            self.engine.add_request(job.prompt_ids, job.params, job.seed_offset, request_id=job.request_id,
                                    priority=job.priority, lora_request=job.lora_request,
                                    prediction=job.prediction, trace_headers=job.trace_headers,
                                    trace_name=job.name or None, cache_salt=job.cache_salt)
        except ValueError as e:
            self._send(job, e)
            return
        except Exception as e:           # noqa: BLE001 - this request fails alone; the engine goes on
            log.exception("request %s (%s) could not be added", job.name, job.request_id)
            try:
                self.engine.abort(job.request_id)
            except Exception:            # noqa: BLE001 - it was never admitted
                pass
            self._send(job, e)
            return
        self._jobs[job.request_id] = job

    def _has_work(self) -> bool:
        """Under the lock: something for the thread to do now."""
        stepping = self.engine.has_unfinished() and not self._paused
        held = self._paused or self._holding
        admitting = bool(self._inbox) and not held
        calling = any(not work or not held for _, _, work in self._calls)
        return bool(stepping or admitting or calling or self._cancels or self._pauses)

    def _settle_pauses(self) -> None:
        """The pending pause() calls: abort what they abort; once nothing runs, paused."""
        with self._cond:
            pauses = list(self._pauses)
            queued = [j for j in self._inbox if not j.cancelled] if any(m == "abort" for _, m, _ in pauses) else []
            for job in queued:
                self._inbox.remove(job)
        if any(mode == "abort" for _, mode, _ in pauses):
            for rid, job in list(self._jobs.items()):
                event = self.engine.abort(rid)
                del self._jobs[rid]
                self._pending.append((job, event or StepEvent([], "", 0, finished=True, finish_reason="abort",
                                                              request_id=rid)))
            for job in queued:
                self._pending.append((job, StepEvent([], "", 0, finished=True, finish_reason="abort",
                                                     request_id=job.request_id)))
            self._hand_over()
        if self.engine.has_unfinished():
            return                           # "wait": the running requests go on until they finish
        if any(clear for _, _, clear in pauses):
            self.engine.reset_prefix_cache()
        with self._cond:
            settled = [p for p in self._pauses if p in pauses]
            self._pauses = [p for p in self._pauses if p not in pauses]
            self._paused, self._holding = True, bool(self._pauses)
        for future, _, _ in settled:
            _settle(future)

    def _fail_all(self, error: Exception) -> bool:
        """The engine's requests end with `error` and leave it. -> whether the engine is left
        consistent: every abort went through and no request is left in it."""
        clean = True
        for rid, job in list(self._jobs.items()):
            try:
                self.engine.abort(rid)
            except Exception:                # noqa: BLE001 - the engine is already in trouble
                log.exception("abort after a failed step")
                clean = False
            self._send(job, error)
        self._jobs.clear()
        try:
            return clean and not self.engine.has_unfinished()
        except Exception:                    # noqa: BLE001 - as inconsistent as it gets
            return False

    def _probe(self) -> bool:
        """Whether the engine, left empty by failed steps, still computes each kind of step: a
        two-token prompt (a prompt chunk, then the first token) decoded greedily for enough
        tokens that a step decodes past the first one, with room for a whole draft when
        speculating; stepped here (its events go nowhere)."""
        rid = f"specdec-probe-{uuid.uuid4().hex}"
        engine = self.engine
        params = SamplingParams(temperature=0, max_tokens=2 + (engine.max_k if engine.proposer is not None else 0),
                                ignore_eos=True)
        try:
            engine.add_request([0, 0][:engine.max_model_len - 1], params, request_id=rid)
            while engine.has_unfinished():
                engine.step()
            return True
        except Exception:                    # noqa: BLE001 - the fault is the engine's
            log.exception("engine probe after failed steps")
            with contextlib.suppress(Exception):
                engine.abort(rid)
            return False

    def _die(self, error: BaseException) -> None:
        """The engine is dead (vLLM's EngineDeadError): new requests, calls and pauses are refused,
        those queued get the error; the thread ends. The server's watchdog then shuts it down."""
        if self.error is None:
            log.error("the engine is dead after %d failed step(s) with none decoding between: %s: %s",
                      self._failures, type(error).__name__, error)
            self.error = error
        dead = self.dead()
        with self._cond:
            self._closing = True                     # alive turns False: /health answers 503
            queued, self._inbox = list(self._inbox), deque()
            calls, self._calls = list(self._calls), deque()
            pauses, self._pauses = self._pauses, []
        for job in queued:
            self._send(job, dead)
        for future in [c[1] for c in calls] + [p[0] for p in pauses]:
            _settle(future, dead)

    def _send(self, job: Job, item) -> None:
        try:
            job.deliver(item)
        except RuntimeError:                 # the event loop is gone: nobody is listening any more
            # cancelled between two steps: events are handed over as the next forward starts, and
            # an abort then would fail that step for every request in it
            self.cancel(job)


def _run(fn: Callable[[Engine], object], engine: Engine, future: Future) -> None:
    """fn(engine) into the future, unless its caller gave up first (an awaiting task cancelled
    cancels the future: setting it then raised, and the worker failed every request)."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn(engine)
    except Exception as e:               # noqa: BLE001 - the caller reads it from the future
        future.set_exception(e)
        return
    future.set_result(result)


def _settle(future: Future, error: BaseException | None = None) -> None:
    """A pause's future done (None, or the error), unless its caller cancelled it."""
    if future.set_running_or_notify_cancel():
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)


def deliver(loop, queue, index: int, item) -> None:
    """A Job's deliver (bound with functools.partial): on the worker thread, hand one event of
    choice `index` to an asyncio queue on `loop`."""
    loop.call_soon_threadsafe(queue.put_nowait, (index, item))
