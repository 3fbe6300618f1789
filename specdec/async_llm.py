"""vLLM's AsyncLLM (also AsyncLLMEngine): the batch engine behind an asyncio API, for code that
serves requests its own way (a web framework, a Ray Serve deployment, an agent loop).

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model="models/target"))
    async for out in engine.generate("def fib(n):", SamplingParams(max_tokens=32), "req-1"):
        print(out.outputs[0].text)        # the text so far (output_kind CUMULATIVE, vLLM's default)

One thread owns the engine (server/worker.EngineWorker, as in `specdec serve`): concurrent
generate() calls are batched in its steps, each request's outputs come as its tokens do. A
consumer that stops iterating (break, task cancelled) aborts its request; abort(request_id) ends
another's stream with finish_reason "abort". SamplingParams.output_kind says what each output
holds: CUMULATIVE (the completion so far), DELTA (what is new), FINAL_ONLY (one output at the
end, every completion in it); with n > 1 streamed, each output holds one completion (the one that
moved; its `index` says which), as vLLM v1's (outputs.RequestStream, which llm.llm_engine's step()
shares). The outputs are the offline LLM's: greedy and
seeded requests give LLM.generate's tokens and text. add_request() is generate() without the
loop: a RequestOutputCollector whose get() awaits the next output, as vLLM's.

An exception in an engine step (or any BaseException on the engine's thread, a collective_rpc
function's SystemExit) is fatal, as in vLLM's engine core: the requests and calls in flight get
EngineDeadError (the step's exception its __cause__), errored turns True, check_health() raises
and new requests are refused (a server's EngineWorker instead fails the step's requests and goes on).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import inspect
import logging
import threading
from collections import deque
from collections.abc import AsyncGenerator, Iterable

import torch

from .config import RequestOutputKind, SamplingParams
from .llm import LLM, RequestOutput, _salt
from .outputs import RequestStream
from .server.worker import _RELEASED, PAUSE_MODES, EngineWorker, Job, ShuttingDown, deliver
from .tracing import extract_trace_headers, warn_tracing_disabled

log = logging.getLogger("specdec.async_llm")
__all__ = ["AsyncLLM", "AsyncLLMEngine", "AsyncEngineArgs", "EngineArgs", "EngineDeadError", "LLMEngine",
           "RequestOutputCollector", "RequestOutputKind"]


# vLLM's scheduler flags that LLM() accepts (and ignores with a warning where they would matter)
_IGNORED_SCHEDULER_FLAGS = (("--long-prefill-token-threshold", int), ("--max-num-partial-prefills", int),
                            ("--max-long-partial-prefills", int), ("--preemption-mode", str),
                            ("--prefix-caching-hash-algo", str))


class EngineArgs:
    """vLLM's EngineArgs: the LLM's keyword arguments (model, speculative_config, max_model_len,
    ...), kept to build an engine from (AsyncLLM.from_engine_args); an argument not given reads as
    LLM's default. add_cli_args / from_cli_args: the same flags as `specdec serve` / `generate`."""

    def __init__(self, model: str | None = None, **kwargs):
        self.model, self.kwargs = model, kwargs

    def __getattr__(self, name):
        kwargs = self.__dict__.get("kwargs", {})
        if name in kwargs:
            return kwargs[name]
        default = _llm_defaults().get(name, inspect.Parameter.empty)
        if default is inspect.Parameter.empty:
            raise AttributeError(f"{type(self).__name__} has no argument {name!r}")
        return default

    @staticmethod
    def add_cli_args(parser):
        """vLLM's: the engine's flags on an argparse parser (specdec's model and batching flags)."""
        from .cli import add_engine_args, add_model_args

        add_model_args(parser)
        add_engine_args(parser)
        given = {o for a in parser._actions for o in a.option_strings}
        if "--seed" not in given:
            parser.add_argument("--seed", type=int, default=0, help="the engine's sampling seed (default 0)")
        if "--enable-log-requests" not in given:
            parser.add_argument("--enable-log-requests", action="store_true",
                                help="a log line as each request arrives and as it ends")
        for flag, kind in _IGNORED_SCHEDULER_FLAGS:      # LLM() takes them, warning where they matter
            if flag not in given:
                parser.add_argument(flag, type=kind, default=argparse.SUPPRESS, help="vLLM's; taken by LLM()")
        return parser

    @classmethod
    def from_cli_args(cls, args):
        """vLLM's: the engine arguments of a namespace that add_cli_args' parser made."""
        from .cli import llm_kwargs

        kwargs = llm_kwargs(args, seed=getattr(args, "seed", 0))
        if getattr(args, "enable_log_requests", False):
            kwargs["enable_log_requests"] = True
        for flag, _ in _IGNORED_SCHEDULER_FLAGS:
            name = flag[2:].replace("-", "_")
            if hasattr(args, name):
                kwargs[name] = getattr(args, name)
        return cls(**kwargs)

    def create_engine_config(self, *args, **kwargs) -> dict:
        """The arguments the engine is built with (vLLM returns its VllmConfig)."""
        return {"model": self.model, **self.kwargs}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in {"model": self.model, **self.kwargs}.items())
        return f"{type(self).__name__}({args})"


def _engine_args_fields() -> dict:
    """LLM's keyword arguments as dataclass fields (their defaults LLM's): EngineArgs reads as a
    dataclass to dataclasses.asdict / fields, as vLLM's examples use it
    (`LLM(**(asdict(EngineArgs(model=...)) | {...}))`)."""
    params = [(name, object, dataclasses.field(default=p.default))
              for name, p in inspect.signature(LLM.__init__).parameters.items()
              if name != "self" and p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
              and p.default is not inspect.Parameter.empty]
    return dataclasses.make_dataclass("EngineArgsFields", params).__dataclass_fields__


EngineArgs.__dataclass_fields__ = _engine_args_fields()


class AsyncEngineArgs(EngineArgs):
    """vLLM's AsyncEngineArgs: EngineArgs and its request logging (enable_log_requests, or the
    older disable_log_requests=False): a log line as each request arrives and as it ends."""


# AsyncEngineArgs' own arguments, not LLM's
_ASYNC_ONLY = ("enable_log_requests", "disable_log_requests", "disable_log_stats")


@functools.cache
def _llm_defaults() -> dict:
    return {name: p.default for name, p in inspect.signature(LLM.__init__).parameters.items()
            if p.default is not inspect.Parameter.empty}


class EngineDeadError(RuntimeError):
    """vLLM's: the engine cannot serve any more (its thread has ended, or a step raised: the
    exception is this one's __cause__)."""


class _EngineCore(EngineWorker):
    """The AsyncLLM's engine thread, as vLLM's engine core: an exception in a step (or between
    two; a BaseException too, a collective_rpc function's SystemExit) is fatal, and every request
    and call still waiting gets EngineDeadError. The engine's state after a failed forward is not
    to be trusted, and a fault that fails one step (a model that raises, a device gone) fails the
    next as well: a live thread failing every request would pass check_health() forever. (The
    server's worker, its base, probes the engine after failed steps instead.)"""

    def __init__(self, engine):
        super().__init__(engine, freeze_heap=False)
        self.loop: asyncio.AbstractEventLoop | None = None    # the event loop the requests come from

    def stop(self, timeout: float | None = None) -> None:
        super().stop(timeout)            # gives the starting thread its compute threads back when run there
        loop = self.loop
        if threading.get_ident() != self._starter and loop is not None and loop.is_running():
            with contextlib.suppress(RuntimeError):       # the loop closed meanwhile
                loop.call_soon_threadsafe(self._give_back_threads)

    def _give_back_threads(self) -> None:
        """On the starting thread (its event loop), after a stop() run elsewhere: its torch thread
        count back, as stop() gives it there (a count is per thread: only that thread can set it)."""
        if threading.get_ident() == self._starter and getattr(_RELEASED, "threads", None) is not None:
            torch.set_num_threads(self._threads)
            _RELEASED.threads = None

    def dead(self) -> EngineDeadError:
        dead = EngineDeadError(f"the engine is not running: it failed ({type(self.error).__name__}: {self.error})")
        dead.__cause__ = self.error
        return dead

    def _fail_all(self, error: BaseException) -> bool:
        """Any failure is fatal: the engine is dead, every request in it, queued or called hears so."""
        self.error = self.error or error
        self._die(error)                                 # refused from now on (alive False); the queues answered
        super()._fail_all(self.dead())                   # the requests in the engine
        return False

    def _between_steps(self) -> bool:
        return self.error is None and super()._between_steps()      # dead: the thread ends


class RequestOutputCollector:
    """vLLM's: one request's outputs, as add_request() returns them: get() awaits the next
    RequestOutput (raising the request's error), get_nowait() gives it or None. The engine's
    events come through `queue` (index, StepEvent | Exception; (None, None): aborted); the
    events queued by the time an output is asked for make one output (what one step gave every
    choice), as vLLM's collector merges what its consumer has not taken yet."""

    def __init__(self, request_id: str, streams: dict, worker: EngineWorker, log_requests: bool):
        self.request_id, self.queue = request_id, asyncio.Queue()
        self.jobs: list[Job] = []
        self.stream: RequestStream | None = None          # set once the request is checked
        self.aborted = self._closed = False
        self._streams, self._worker, self._log = streams, worker, log_requests
        self._ready: deque[RequestOutput] = deque()

    @property
    def finished(self) -> bool:
        return self.stream is not None and self.stream.finished and not self._ready

    def get_nowait(self) -> RequestOutput | None:
        if not self._ready and not self.queue.empty():
            self._take([])
        return self._ready.popleft() if self._ready else None

    async def get(self) -> RequestOutput:
        while not self._ready:
            self._take([await self.queue.get()])
        return self._ready.popleft()

    def _take(self, items: list) -> None:
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        outs = self.stream
        for index, item in items:
            if index is None:                    # abort(request_id)
                outs.abort()
                break
            if index not in outs.open:
                continue
            if isinstance(item, Exception):
                raise item
            outs.add(index, item)
        self._ready.extend(outs.outputs())
        if outs.finished:
            self.close()

    def close(self) -> None:
        """The request is done with: its id is free, its choices still running are aborted."""
        if self._closed:
            return
        self._closed = True
        if self._streams.get(self.request_id) is self:
            del self._streams[self.request_id]
        if self.stream is not None:
            for i in self.stream.open:
                self._worker.cancel(self.jobs[i])
            if self._log:
                log.info("Finished request %s: %s", self.request_id,
                         ", ".join(str(c.finish_reason) for c in self.stream.choices))


class AsyncLLM:
    """vLLM's AsyncLLM over one LLM (made from its keyword arguments, or given)."""

    def __init__(self, llm: LLM | None = None, log_requests: bool = False, **llm_kwargs):
        if llm is not None and llm_kwargs:
            raise ValueError("AsyncLLM: give an LLM or its keyword arguments, not both")
        self.llm = llm if llm is not None else LLM(**llm_kwargs)      # a pooling model serves encode()
        if self.llm.engine.owner is not None and self.llm.engine.owner.alive:
            raise ValueError("this LLM's engine already runs under another AsyncLLM (or a server)")
        self.tokenizer = self.llm.tokenizer
        self.log_requests = log_requests
        self._worker = _EngineCore(self.llm.engine)
        with contextlib.suppress(RuntimeError):          # built outside a loop: its first request's loop
            self._worker.loop = asyncio.get_running_loop()
        self._worker.start()
        self._streams: dict[str, RequestOutputCollector] = {}
        self._stopped = False

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **_ignored) -> AsyncLLM:
        """vLLM's constructor (start_engine_loop, usage_context and the like have no meaning here)."""
        if not isinstance(engine_args, EngineArgs):
            raise TypeError(f"from_engine_args takes an (Async)EngineArgs, got {type(engine_args).__name__}")
        kwargs = dict(engine_args.kwargs)
        own = {k: kwargs.pop(k) for k in _ASYNC_ONLY if k in kwargs}
        log = bool(own.get("enable_log_requests")) or own.get("disable_log_requests") is False
        return cls(model=engine_args.model, log_requests=log, **kwargs)

    # ---- generation ----

    async def add_request(self, request_id: str, prompt, params: SamplingParams | None, arrival_time: float | None = None,
                          lora_request=None, tokenization_kwargs: dict | None = None, trace_headers=None,
                          priority: int = 0, data_parallel_rank: int | None = None,
                          prompt_text: str | None = None) -> RequestOutputCollector:
        """vLLM's: check one request and queue it; its outputs come from the collector's get()
        (generate() is this and the loop over them). The caller that stops reading calls
        abort(request_id); the collector frees the id once the request has finished. A bad
        prompt or parameter, or a request id already running, is a ValueError; a dead engine
        EngineDeadError. arrival_time, prompt_text and data_parallel_rank (one engine here) are
        taken, as vLLM's."""
        if self._stopped:
            raise ShuttingDown("the engine has been shut down")
        if self.errored:                      # vLLM's EngineDeadError: no request waits on a dead engine
            raise self.dead_error
        prompt = self.llm._pretokenized(prompt, tokenization_kwargs)     # its text kept as the prompt (vLLM's)
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        self.llm.check_runner("generate")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        loop = self._worker.loop = asyncio.get_running_loop()
        self._streams[request_id] = q = RequestOutputCollector(request_id, self._streams, self._worker,
                                                               self.log_requests)   # the id is taken from here on
        try:
            llm = self.llm
            params = llm._params(params).clone()      # vLLM's: the caller's object may change, not the request
            if params.best_of is not None and params.best_of > params.n:
                raise ValueError("best_of > n ranks finished candidates: use LLM.generate "
                                 "(vLLM's AsyncLLM has no best_of)")
            text, ids = llm._prompt_ids(prompt, llm.engine.truncation(params))
            salt = _salt(prompt)
            ids = llm.engine.truncated(ids, params)
            llm.engine.check_priority(priority)
            llm.engine.check_prompt(ids, params)
            llm.engine.check_lora(lora_request)
            if params.structured_outputs is not None:        # compiled beside the engine, not on its thread
                grammars = llm.engine.grammars
                grammars.freeze(params.structured_outputs)
                await asyncio.to_thread(grammars.prebuild, params.structured_outputs, params.n)
            trace = extract_trace_headers(trace_headers)
            if trace is not None and llm.engine.tracer is None:
                warn_tracing_disabled()
            q.jobs = [Job(ids, params, i, None, priority=priority, lora_request=lora_request,
                          name=request_id if params.n == 1 else f"{request_id}-{i}", trace_headers=trace,
                          cache_salt=salt)
                      for i in range(params.n)]
            for i, job in enumerate(q.jobs):
                job.deliver = functools.partial(deliver, loop, q.queue, i)
            if self.log_requests:
                log.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s",
                         request_id, text, params, ids)
            q.stream = RequestStream(request_id, text, ids, params, llm._token_name, lora_request)
            if not q.aborted:          # abort(request_id) while its grammar compiled: its queue holds the
                self._worker.submit(q.jobs)          # abort, one output with finish_reason "abort" (vLLM's)
        except BaseException:
            if self._streams.get(request_id) is q:
                del self._streams[request_id]
            raise
        return q

    async def generate(self, prompt, sampling_params: SamplingParams | None, request_id: str, *,
                       prompt_text: str | None = None, lora_request=None, tokenization_kwargs: dict | None = None,
                       trace_headers=None, priority: int = 0,
                       data_parallel_rank: int | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Stream one request's RequestOutputs (prompt: text, {"prompt": ...} or
        {"prompt_token_ids": [...]}); the last has finished=True. A bad prompt or parameter is a
        ValueError before anything runs (raised where the first output is awaited, as vLLM's); a
        request id already streaming is one too. trace_headers: a request's W3C trace context
        (traceparent, tracestate), the parent of its span with otlp_traces_endpoint set.
        tokenization_kwargs: a text prompt's tokenizer arguments (truncation, max_length, ...), as
        vLLM's; prompt_text and data_parallel_rank (one engine here) are taken, as vLLM's."""
        q = await self.add_request(request_id, prompt, sampling_params, lora_request=lora_request,
                                   tokenization_kwargs=tokenization_kwargs, trace_headers=trace_headers,
                                   priority=priority, data_parallel_rank=data_parallel_rank, prompt_text=prompt_text)
        try:
            finished = False
            while not finished:
                out = q.get_nowait() or await q.get()
                finished = out.finished
                yield out
        finally:                                  # cancelled or left: its request is aborted (vLLM's re-raises too)
            q.close()

    async def encode(self, prompt, pooling_params=None, request_id: str | None = None, *, lora_request=None,
                     truncate_prompt_tokens: int | None = None, pooling_task: str | None = None,
                     **_vllm_only) -> AsyncGenerator[object, None]:
        """vLLM's AsyncLLM.encode for a pooling model (runner "pooling"): one output, LLM.encode's
        for the prompt (an EmbeddingRequestOutput, or a ClassificationRequestOutput for a
        classifier or pooling_task="classify"), named request_id. It runs on the engine's thread
        between two steps (and waits while the engine is paused, as requests do)."""
        if self._stopped:
            raise ShuttingDown("the engine has been shut down")
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        self.llm.check_runner("pooling")
        future = self._worker.call(lambda engine: self.llm.encode(
            [prompt], pooling_params, truncate_prompt_tokens=truncate_prompt_tokens, lora_request=lora_request,
            pooling_task=pooling_task), work=True)
        (out,) = await asyncio.wrap_future(future)
        if request_id is not None:
            out.request_id = request_id
        yield out

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        """End these requests now: their streams' last output has finish_reason "abort" (an id
        not streaming is ignored, as vLLM's)."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            stream = self._streams.pop(rid, None)          # the id is free again at once (vLLM's)
            if stream is None:
                continue
            stream.aborted = True
            for job in stream.jobs:
                self._worker.cancel(job)
            stream.queue.put_nowait((None, None))

    # ---- the engine ----

    async def get_tokenizer(self, lora_request=None):
        return self.tokenizer

    async def check_health(self) -> None:
        """vLLM's: raises (EngineDeadError) when the engine cannot serve: its thread ended, or a
        step failed (which is fatal, as in vLLM's engine core)."""
        if not self._worker.alive:
            raise self.dead_error
        self.llm.check_health()

    @property
    def is_running(self) -> bool:
        return self._worker.alive

    @property
    def is_stopped(self) -> bool:
        return self._stopped

    @property
    def errored(self) -> bool:
        return self._worker.error is not None or (not self._stopped and not self._worker.alive)

    @property
    def dead_error(self) -> BaseException:
        """vLLM's: the error a dead engine raises (the failed step's exception its __cause__)."""
        if self._worker.error is not None:
            return self._worker.dead()
        return EngineDeadError("the engine's thread is not running" + (" (shut down)" if self._stopped else ""))

    async def get_model_config(self) -> "ModelConfigView":
        """vLLM's ModelConfig as code reads it: model, max_model_len, dtype, hf_config (the target's
        configuration), get_vocab_size(), ..."""
        return ModelConfigView(self.llm)

    async def get_supported_tasks(self) -> tuple[str, ...]:
        """vLLM's: what the runner does (a pooling model's tasks, not "generate")."""
        return self.llm.supported_tasks

    async def is_tracing_enabled(self) -> bool:
        """vLLM's: whether requests get spans (otlp_traces_endpoint)."""
        return getattr(self.llm.engine, "tracer", None) is not None

    async def do_log_stats(self, *args, **kwargs) -> None:
        """vLLM's: log the engine's figures now (get_metrics' counters and gauges, one line; a
        labelled family such as vllm:request_success one figure per label, as
        vllm:request_success{finished_reason=stop}=3)."""
        figures = []
        for m in self.llm.get_metrics():
            value = getattr(m, "value", None)
            if value is None:
                continue
            own = ",".join(f"{k}={v}" for k, v in m.labels.items() if k not in ("model_name", "engine"))
            figures.append(f"{m.name}{{{own}}}={value}" if own else f"{m.name}={value}")
        log.info("engine stats: %s", ", ".join(figures))

    # vLLM's LoRA calls: the engine's (Engine.add_lora, ...), on its worker
    async def add_lora(self, lora_request) -> bool:
        return await self._call(lambda engine: engine.add_lora(lora_request))

    async def remove_lora(self, lora_id: int) -> bool:
        return await self._call(lambda engine: engine.remove_lora(lora_id))

    async def list_loras(self) -> set[int]:
        return await self._call(lambda engine: engine.list_loras())

    async def pin_lora(self, lora_id: int) -> bool:
        return await self._call(lambda engine: engine.pin_lora(lora_id))

    async def _call(self, fn):
        self._worker.loop = asyncio.get_running_loop()
        return await asyncio.wrap_future(self._worker.call(fn))

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """vLLM's current signature (an older one took a device first: a non-bool is refused,
        not read as the flag); reset_connector does nothing, there is no KV connector."""
        if not isinstance(reset_running_requests, bool) or not isinstance(reset_connector, bool):
            raise TypeError("reset_prefix_cache(reset_running_requests: bool = False, reset_connector: bool = False)")
        return await self._call(lambda engine: engine.reset_prefix_cache(reset_running_requests))

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

    def __del__(self):
        # vLLM's: one dropped without shutdown() stops its engine thread (which held the model)
        if getattr(self, "_worker", None) is not None and not getattr(self, "_stopped", True):
            try:
                self.shutdown()
            except Exception:        # noqa: BLE001 - at interpreter exit the loop or the thread may be gone
                pass

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop now, as vLLM's does: requests in flight end (finish_reason "abort"), the engine's
        thread stops (timeout: how long to wait for it), and the LLM may be used offline again."""
        if not self._stopped:
            self._stopped = True
            for rid, stream in list(self._streams.items()):
                self._streams.pop(rid, None)
                stream.aborted = True
                for job in stream.jobs:
                    self._worker.cancel(job)
                stream.queue.put_nowait((None, None))
            self._worker.stop(timeout)


def _weights_dtype(target) -> torch.dtype:
    """vLLM's ModelConfig.dtype: the dtype the model's dense weights are held in (bf16 for a bf16
    folder, whose activations run in fp32 on the CPU); packed weights: the activations' dtype."""
    layer = target.model.layers[0]
    w = getattr(getattr(getattr(layer, "self_attn", None), "qkv_proj", None), "weight", None)
    return w.dtype if isinstance(w, torch.Tensor) and w.is_floating_point() else target.dtype


class ModelConfigView:
    """What vLLM's ModelConfig gives the code around an AsyncLLM, read from the LLM."""

    def __init__(self, llm: LLM):
        cfg = llm.target.config
        self.model = self.tokenizer = llm.model_path
        self.max_model_len = llm.engine.max_model_len
        self.dtype = _weights_dtype(llm.target)
        self.hf_config = self.hf_text_config = cfg
        self.served_model_name = llm.model_path
        self.runner_type = llm.runner
        self.max_logprobs = llm.engine.max_logprobs

    def get_vocab_size(self) -> int:
        return self.hf_config.vocab_size

    def get_hidden_size(self) -> int:
        return self.hf_config.hidden_size

    def get_num_layers(self, *args) -> int:
        return self.hf_config.num_hidden_layers

    def get_sliding_window(self) -> int | None:
        return getattr(self.hf_config, "sliding_window", None)

    def __repr__(self) -> str:
        return f"ModelConfigView(model={self.model!r}, max_model_len={self.max_model_len}, dtype={self.dtype})"


class VllmConfigView:
    """What vLLM's VllmConfig gives code (llm.llm_engine.vllm_config): model_config,
    scheduler_config (max_num_seqs, max_num_batched_tokens, ...), cache_config (block_size,
    num_gpu_blocks, cache_dtype, enable_prefix_caching), parallel_config and speculative_config,
    read from the LLM."""

    def __init__(self, llm: LLM):
        import types

        engine = llm.engine
        self.model_config = ModelConfigView(llm)
        self.scheduler_config = engine.config
        self.cache_config = types.SimpleNamespace(
            block_size=engine.config.block_size, num_gpu_blocks=engine.blocks.num_blocks,
            cache_dtype=str(engine.kv_dtype).removeprefix("torch."),
            enable_prefix_caching=engine.config.enable_prefix_caching)
        self.parallel_config = types.SimpleNamespace(tensor_parallel_size=llm.parallel_size, pipeline_parallel_size=1,
                                                     data_parallel_size=1, world_size=llm.parallel_size)
        self.speculative_config = llm.spec

    def __repr__(self) -> str:
        return f"VllmConfigView(model={self.model_config.model!r})"


AsyncLLMEngine = AsyncLLM          # vLLM's older name (V1 makes it an alias too)


class LLMEngine:
    """vLLM's LLMEngine as its examples build it: LLMEngine.from_engine_args(EngineArgs(...)) is
    the engine of an LLM made from those arguments (llm.llm_engine: add_request(request_id,
    prompt, params), step(), has_unfinished_requests(), abort_request(), vllm_config, ...)."""

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **_ignored):
        if not isinstance(engine_args, EngineArgs):
            raise TypeError(f"from_engine_args takes an EngineArgs, got {type(engine_args).__name__}")
        kwargs = {k: v for k, v in engine_args.kwargs.items() if k not in _ASYNC_ONLY}
        return LLM(model=engine_args.model, **kwargs).llm_engine

    def __init__(self, *args, **kwargs):
        raise TypeError("build it with LLMEngine.from_engine_args(EngineArgs(model=...)), as vLLM's examples do")
