"""One thread owns the engine; the active completions take turns, one decoding step each.

The torch engine is not thread-safe and a CPU box has few cores, so there is no batching: a
round-robin over at most `max_num_seqs` active jobs (the rest wait FIFO) keeps every client
moving. Steps travel to the asyncio side through each job's `deliver` callback, which the
server builds from `loop.call_soon_threadsafe`, so the event loop never waits on torch.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ..config import SamplingParams
from ..engine import Engine, StepEvent
from .logprobs import LogprobScorer, TokenLogprob

log = logging.getLogger("specdec.server")


@dataclass(frozen=True)
class StepOutput:
    event: StepEvent
    logprobs: list[TokenLogprob] | None = None


@dataclass(eq=False)
class Job:
    """One completion choice. `deliver` is called on the worker thread with a StepOutput or an
    Exception; after an Exception, or a finished event, nothing more comes."""
    prompt_ids: list[int]
    params: SamplingParams
    seed_offset: int
    deliver: Callable[[object], None]
    cancelled: bool = False                        # set by any thread; the worker acts on it
    steps: Iterator[StepEvent] | None = field(default=None, repr=False)
    scorer: LogprobScorer | None = field(default=None, repr=False)


class ShuttingDown(RuntimeError):
    pass


class EngineWorker:
    def __init__(self, engine: Engine, max_num_seqs: int):
        self.engine, self.max_num_seqs = engine, max_num_seqs
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._active: list[Job] = []
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="specdec-engine", daemon=True)

    @property
    def num_running(self) -> int:
        return len(self._active)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closing

    def start(self) -> None:
        self._thread.start()

    def submit(self, jobs: list[Job]) -> None:
        """Queue all of a request's jobs at once, or none of them."""
        with self._cond:
            if self._closing:
                raise ShuttingDown("the server is shutting down")
            self._waiting.extend(jobs)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Drop a job: a waiting one leaves the queue now, an active one at its next turn."""
        job.cancelled = True
        with self._cond:
            if job in self._waiting:
                self._waiting.remove(job)
            self._cond.notify()

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new jobs, let the queued and active ones finish, then end the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _loop(self) -> None:
        while (turn := self._next_turn()) is not None:
            for job in turn:
                self._step(job)

    def _next_turn(self) -> list[Job] | None:
        with self._cond:
            while True:
                while self._waiting and len(self._active) < self.max_num_seqs:
                    self._active.append(self._waiting.popleft())
                if self._active:
                    return list(self._active)
                if self._closing:
                    return None
                self._cond.wait()

    def _step(self, job: Job) -> None:
        if job.cancelled:
            self._retire(job)
            return
        try:
            if job.steps is None:
                job.steps = self.engine.generate(job.prompt_ids, job.params, seed_offset=job.seed_offset)
                if job.params.logprobs is not None:
                    job.scorer = LogprobScorer(self.engine.target, job.prompt_ids, self.engine.max_model_len,
                                               job.params.logprobs)
            event = next(job.steps)
            out = StepOutput(event, job.scorer.score(event.token_ids) if job.scorer else None)
        except Exception as e:           # one failing request must not stop the others
            log.exception("request failed in the engine")
            self._retire(job)
            self._send(job, e)
            return
        if event.finished:
            self._retire(job)            # the slot is free before the client hears of the end
        self._send(job, out)

    def _retire(self, job: Job) -> None:
        if job.steps is not None:
            job.steps.close()
            job.steps, job.scorer = None, None
        with self._cond:
            if job in self._active:
                self._active.remove(job)

    def _send(self, job: Job, item) -> None:
        try:
            job.deliver(item)
        except RuntimeError:             # the event loop is gone: nobody is listening any more
            job.cancelled = True
