"""vLLM's AsyncLLM (also AsyncLLMEngine): the batch engine behind an asyncio API, for code that
serves requests its own way (a web framework, a Ray Serve deployment, an agent loop).

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model="models/target"))
    async for out in engine.generate("def fib(n):", SamplingParams(max_tokens=32), "req-1"):
        print(out.outputs[0].text)        # the text so far (output_kind CUMULATIVE, vLLM's default)

One thread owns the engine (server/worker.EngineWorker, as in `specdec serve`): concurrent
generate() calls are batched in its steps, each request's outputs come as its tokens do. A
consumer that stops iterating (break, task cancelled) aborts its request; abort(request_id) ends
another's stream with finish_reason "abort". SamplingParams.output_kind says what each output
holds: CUMULATIVE (each completion so far), DELTA (what is new: with n > 1 only the completions
that moved), FINAL_ONLY (one output at the end). The outputs are the offline LLM's: greedy and
seeded requests give LLM.generate's tokens and text.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import AsyncGenerator, Iterable

from .config import RequestOutputKind, SamplingParams
from .llm import LLM, CompletionOutput, RequestOutput
from .metrics import RequestStats
from .server.worker import PAUSE_MODES, EngineWorker, Job, ShuttingDown

__all__ = ["AsyncLLM", "AsyncLLMEngine", "AsyncEngineArgs", "EngineArgs", "RequestOutputKind"]


class EngineArgs:
    """vLLM's EngineArgs: the LLM's keyword arguments (model, speculative_config, max_model_len,
    ...), kept to build an engine from (AsyncLLM.from_engine_args)."""

    def __init__(self, model: str | None = None, **kwargs):
        self.model, self.kwargs = model, kwargs

    def __getattr__(self, name):
        try:
            return self.__dict__["kwargs"][name]
        except KeyError:
            raise AttributeError(name) from None

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in {"model": self.model, **self.kwargs}.items())
        return f"{type(self).__name__}({args})"


class AsyncEngineArgs(EngineArgs):
    """vLLM's AsyncEngineArgs (the same arguments)."""


@dataclasses.dataclass
class _Choice:
    """One completion's output so far."""
    index: int
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stats: RequestStats | None = None
    sent_tokens: int = 0                 # DELTA: what the last output already carried
    sent_text: int = 0


class _Stream:
    """A request's jobs and the queue their events come through."""

    def __init__(self, jobs: list[Job], queue: asyncio.Queue):
        self.jobs, self.queue = jobs, queue


def _deliver(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, index: int, item) -> None:
    loop.call_soon_threadsafe(queue.put_nowait, (index, item))


class AsyncLLM:
    """vLLM's AsyncLLM over one LLM (made from its keyword arguments, or given)."""

    def __init__(self, llm: LLM | None = None, **llm_kwargs):
        if llm is not None and llm_kwargs:
            raise ValueError("AsyncLLM: give an LLM or its keyword arguments, not both")
        self.llm = llm if llm is not None else LLM(**llm_kwargs)
        self.llm.check_runner("generate")
        self.tokenizer = self.llm.tokenizer
        self._worker = EngineWorker(self.llm.engine)
        self._worker.start()
        self._streams: dict[str, _Stream] = {}
        self._stopped = False

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **_ignored) -> AsyncLLM:
        """vLLM's constructor (start_engine_loop, usage_context and the like have no meaning here)."""
        if not isinstance(engine_args, EngineArgs):
            raise TypeError(f"from_engine_args takes an (Async)EngineArgs, got {type(engine_args).__name__}")
        return cls(model=engine_args.model, **engine_args.kwargs)

    # ---- generation ----

    async def generate(self, prompt, sampling_params: SamplingParams | None, request_id: str, *,
                       lora_request=None, priority: int = 0, **_vllm_only) -> AsyncGenerator[RequestOutput, None]:
        """Stream one request's RequestOutputs (prompt: text, {"prompt": ...} or
        {"prompt_token_ids": [...]}); the last has finished=True. A bad prompt or parameter is a
        ValueError before anything runs (raised where the first output is awaited, as vLLM's); a
        request id already streaming is one too."""
        if self._stopped:
            raise ShuttingDown("the engine has been shut down")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        llm = self.llm
        params = llm._params(sampling_params)
        if params.best_of is not None and params.best_of > params.n:
            raise ValueError("best_of > n ranks finished candidates: use LLM.generate (vLLM's AsyncLLM has no best_of)")
        text, ids = llm._prompt_ids(prompt)
        ids = llm.engine.truncated(ids, params)
        llm.engine.check_priority(priority)
        llm.engine.check_prompt(ids, params)
        llm.engine.check_lora(lora_request)
        if params.structured_outputs is not None:        # compiled beside the engine, not on its thread
            params = params.clone()
            grammars = llm.engine.grammars
            grammars.freeze(params.structured_outputs)
            await asyncio.to_thread(grammars.prebuild, params.structured_outputs, params.n)
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        jobs = [Job(ids, params, i, functools.partial(_deliver, loop, queue, i), priority=priority,
                    lora_request=lora_request, name=request_id if params.n == 1 else f"{request_id}-{i}")
                for i in range(params.n)]
        self._streams[request_id] = stream = _Stream(jobs, queue)
        choices = [_Choice(i, logprobs=[] if params.logprobs is not None else None) for i in range(params.n)]
        open_ = set(range(params.n))
        prompt_logprobs = None
        try:
            self._worker.submit(stream.jobs)
            while open_:
                moved = set()
                items = [await stream.queue.get()]
                while not stream.queue.empty():          # what one step gave every choice: one output
                    items.append(stream.queue.get_nowait())
                for index, item in items:
                    if index is None:                    # abort(request_id)
                        for i in open_:
                            choices[i].finish_reason = "abort"
                        moved |= open_
                        open_.clear()
                        break
                    if index not in open_:
                        continue
                    if isinstance(item, Exception):
                        raise item
                    c = choices[index]
                    c.token_ids += item.token_ids
                    c.text += item.text
                    if c.logprobs is not None and item.logprobs:
                        c.logprobs += [e.named(self.llm._token_name) for e in item.logprobs]
                    if item.prompt_logprobs is not None and prompt_logprobs is None:
                        prompt_logprobs = [e.named(self.llm._token_name) if e is not None else None
                                           for e in item.prompt_logprobs]
                    c.stats = item.stats
                    if item.finished:
                        c.finish_reason, c.stop_reason = item.finish_reason, item.stop_reason
                        open_.discard(index)
                    moved.add(index)
                if params.output_kind == RequestOutputKind.FINAL_ONLY and open_:
                    continue
                if moved:
                    yield self._output(request_id, text, ids, params, choices, moved, not open_, prompt_logprobs)
        finally:
            self._streams.pop(request_id, None)
            for i in open_:
                self._worker.cancel(stream.jobs[i])

    def _output(self, request_id, text, ids, params, choices, moved, finished, prompt_logprobs) -> RequestOutput:
        delta = params.output_kind == RequestOutputKind.DELTA
        outputs = []
        for c in (choices[i] for i in sorted(moved)) if delta else choices:
            toks, txt, lps = c.token_ids, c.text, c.logprobs
            if delta:
                toks, txt = toks[c.sent_tokens:], txt[c.sent_text:]
                lps = lps[c.sent_tokens:] if lps is not None else None
                c.sent_tokens, c.sent_text = len(c.token_ids), len(c.text)
            cumulative = sum(e.logprob for e in c.logprobs) if c.logprobs is not None else None
            outputs.append(CompletionOutput(c.index, txt, list(toks), c.finish_reason, c.stop_reason, cumulative,
                                            list(lps) if lps is not None else None))
        stats = RequestStats()
        for c in choices:
            if c.stats is not None:
                stats.merge(c.stats)
        stats.prompt_tokens = len(ids)
        if choices[0].stats is not None:
            stats.time_to_first_token_s = choices[0].stats.time_to_first_token_s
        return RequestOutput(request_id, text, ids, outputs, finished, stats, prompt_logprobs)

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        """End these requests now: their streams' last output has finish_reason "abort" (an id
        not streaming is ignored, as vLLM's)."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            stream = self._streams.get(rid)
            if stream is None:
                continue
            for job in stream.jobs:
                self._worker.cancel(job)
            stream.queue.put_nowait((None, None))

    # ---- the engine ----

    async def get_tokenizer(self, lora_request=None):
        return self.tokenizer

    async def check_health(self) -> None:
        if not self._worker.alive:
            raise RuntimeError("the engine is not running")
        self.llm.check_health()

    @property
    def is_running(self) -> bool:
        return self._worker.alive

    @property
    def is_stopped(self) -> bool:
        return self._stopped

    @property
    def errored(self) -> bool:
        return not self._stopped and not self._worker.alive

    async def _call(self, fn):
        return await asyncio.wrap_future(self._worker.call(fn))

    async def reset_prefix_cache(self, device=None, reset_running_requests: bool = False) -> bool:
        def reset(engine):
            if reset_running_requests:
                engine.preempt_all()
            return engine.blocks.reset_prefix_cache()
        return await self._call(reset)

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True,
                               wait_for_inflight_requests: bool = False) -> None:
        """vLLM's: no new request enters the engine until resume_generation(); those in flight are
        aborted ("abort"), waited for ("wait") or frozen ("keep")."""
        if wait_for_inflight_requests:
            mode = "wait"
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        await asyncio.wrap_future(self._worker.pause(mode, clear_cache))

    async def resume_generation(self) -> None:
        self._worker.resume()

    async def is_paused(self) -> bool:
        return self._worker.paused

    async def collective_rpc(self, method, timeout: float | None = None, args: tuple = (),
                             kwargs: dict | None = None) -> list:
        """LLM.collective_rpc, between two engine steps (requests may be in flight: they go on
        over the KV they have)."""
        return await self._call(lambda engine: self.llm.call_worker(method, args, kwargs, reset_running_requests=False))

    async def reload_weights(self, weights_path=None, reset_running_requests: bool = True) -> None:
        """LLM.reload_weights from a path: loaded beside the engine, copied in between two steps."""
        model = await asyncio.to_thread(self.llm.read_weights, weights_path)
        await self._call(lambda engine: self.llm.install_weights(model, reset_running_requests))

    async def start_profile(self) -> None:
        await self._call(lambda engine: self.llm._profiler().start())

    async def stop_profile(self) -> None:
        await self._call(lambda engine: self.llm._profiler().stop())

    async def sleep(self, level: int = 1) -> None:
        self.llm.sleep(level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        self.llm.wake_up(tags)

    async def is_sleeping(self) -> bool:
        return self.llm.is_sleeping()

    def shutdown(self) -> None:
        """Finish what runs, stop the engine's thread (the LLM may then be used offline again)."""
        if not self._stopped:
            self._stopped = True
            self._worker.stop()


AsyncLLMEngine = AsyncLLM          # vLLM's older name (V1 makes it an alias too)
