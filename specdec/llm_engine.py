"""vLLM's objects behind `LLM`: `llm.llm_engine` (_EngineView: add_request / step /
abort_request as vLLM's LLMEngine), and the worker `collective_rpc` reaches (Worker, with
worker_extension_cls mixed in; model_runner.model is the target)."""

from __future__ import annotations

import importlib
import types
from typing import TYPE_CHECKING

import torch

from .outputs import RequestStream
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from .llm import LLM

class Worker:
    """The worker collective_rpc calls (vLLM's Worker, as RL code reaches it): `model_runner.model`
    (and get_model()) is the target model, rank 0 of 1, on `device`. worker_extension_cls's class
    is mixed in before it, so its methods see the same attributes."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self.model_runner = _ModelRunner(llm.target)
        self.rank = self.local_rank = 0
        self.world_size = 1
        self.device = llm.target.device

    def get_model(self):
        return self.model_runner.model

    def load_weights(self, weights) -> set[str]:
        """model.load_weights(weights): (Hugging Face name, tensor) pairs, in place."""
        return self.model_runner.model.load_weights(weights)


def _load_own_names(model, pairs) -> None:
    """(name, tensor) pairs under the model's own parameter / buffer names (reload_weights with
    is_checkpoint_format=False): each cast to its tensor's dtype and written in place, after every
    name and shape is checked."""
    own = dict(model.named_parameters())
    own.update((n, b) for n, b in model.named_buffers() if b is not None)
    checked = []
    for name, t in pairs:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"reload_weights: {name!r} is a {type(t).__name__}, not a tensor")
        if name not in own:
            raise ValueError(f"reload_weights: the model has no {name!r} (is_checkpoint_format=False takes "
                             f"llm.target.named_parameters()' names; Hugging Face names need is_checkpoint_format=True)")
        if tuple(t.shape) != tuple(own[name].shape):
            raise ValueError(f"reload_weights: {name} is {list(own[name].shape)}, got {list(t.shape)}")
        checked.append((own[name], t))
    with torch.no_grad():
        for dst, t in checked:
            dst.copy_(t.to(dst.dtype))


class _ModelRunner:
    """vLLM's worker.model_runner as RL code reaches it: `.model` and get_model()."""

    def __init__(self, model):
        self.model = model

    def get_model(self):
        return self.model


class _Executor:
    """llm.llm_engine.model_executor: vLLM's paths to the one worker
    (driver_worker.worker.model_runner.model, driver_worker.model_runner.model) and its calls."""

    def __init__(self, llm: LLM):
        self._llm = llm
        worker = llm.worker
        self.driver_worker = types.SimpleNamespace(worker=worker, model_runner=worker.model_runner)

    def collective_rpc(self, method, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None) -> list:
        return self._llm.collective_rpc(method, timeout, args, kwargs)

    def apply_model(self, func) -> list:
        return self._llm.apply_model(func)


def _worker_class(ext) -> type:
    if ext is None:
        return Worker
    if isinstance(ext, str):
        module, _, name = ext.rpartition(".")
        if not module:
            raise ValueError(f"worker_extension_cls {ext!r}: expected 'module.Class'")
        try:
            ext = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"worker_extension_cls {ext!r}: {e}") from None
    if not isinstance(ext, type):
        raise ValueError(f"worker_extension_cls must be a class or 'module.Class', got {type(ext).__name__}")
    return type(f"{ext.__name__}Worker", (ext, Worker), {})


def _modules_under(roots, depth: int = 3):
    """Every torch module reachable from roots: modules and their submodules, and the modules held
    by the attributes (lists, dicts) of other objects (a proposer and the proposers it combines)."""
    import torch

    seen: set[int] = set()
    stack = [(r, 0) for r in roots]
    while stack:
        obj, d = stack.pop()
        if obj is None or id(obj) in seen or isinstance(obj, (str, bytes, int, float)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            yield from obj.modules()
        elif isinstance(obj, (list, tuple)) and d < depth:
            stack += [(x, d + 1) for x in obj]
        elif isinstance(obj, dict) and d < depth:
            stack += [(x, d + 1) for x in obj.values()]
        elif hasattr(obj, "__dict__") and d < depth and type(obj).__module__.startswith("specdec."):
            stack += [(x, d + 1) for x in vars(obj).values()]


class _EngineView:
    """llm.llm_engine: the LLM's Engine (every attribute is the engine's) with the calls vLLM's
    LLMEngine offers that mean something here."""

    def __init__(self, llm: LLM):
        self._llm = llm
        self._own = {}      # request id -> (text, ids, params, {(id, i): Request}, logprobs, RequestStream | None)
        self._moved = {}    # the ids whose events came since the last step() (an insertion-ordered set)

    def __getattr__(self, name):
        return getattr(self._llm.engine, name)

    def get_tokenizer(self, lora_request=None) -> Tokenizer:
        return self._llm.tokenizer

    # vLLM's configuration objects, as code reads them (llm.llm_engine.vllm_config.scheduler_config...)
    @property
    def vllm_config(self):
        from .async_llm import VllmConfigView

        return VllmConfigView(self._llm)

    engine_config = vllm_config              # vLLM's older name

    @property
    def model_config(self):
        return self.vllm_config.model_config

    @property
    def cache_config(self):
        return self.vllm_config.cache_config

    def get_model_config(self):
        return self.model_config

    def get_vllm_config(self):
        return self.vllm_config

    def add_request(self, request_id, prompt=None, params=None, arrival_time=None, lora_request=None,
                    tokenization_kwargs=None, trace_headers=None, priority: int = 0, **engine_kwargs):
        """vLLM's LLMEngine.add_request(request_id, prompt, params): the prompt (text, {"prompt"} or
        {"prompt_token_ids"}) queued under request_id (a string, as vLLM v1's: anything else is a
        TypeError); step() returns its RequestOutputs (by output_kind, `finished` at the end).
        The engine's own form, add_request(prompt_ids, params, ...), goes straight to
        Engine.add_request."""
        self._llm._check_owner()             # an AsyncLLM's / a server's thread steps it: two steppers crash
        with self._llm._stepping:            # not in the middle of another thread's step
            if isinstance(request_id, (list, tuple)):       # specdec's Engine.add_request(prompt_ids, ...)
                return self._llm.engine.add_request(request_id, prompt, *(() if params is None else (params,)),
                                                    **engine_kwargs)
            self._add(request_id, prompt, params, lora_request, tokenization_kwargs, trace_headers, priority)

    def _add(self, rid, prompt, params, lora_request, tokenization_kwargs, trace_headers, priority) -> None:
        if not isinstance(rid, str):            # vLLM v1's refusal (abort_request looks ids up as given)
            raise TypeError(f"request_id must be a string, got {type(rid)}")
        from .llm import _check_kwargs, _salt

        llm = self._llm
        llm.check_runner("generate")
        own = self._own
        if rid in own:
            raise ValueError(f"request id {rid!r} is already running")
        # the request's own copy (vLLM's params.clone() at add time): later changes to the caller's
        # object (output_kind, max_tokens) do not reach it
        params = llm._params(params).clone()
        _check_kwargs("tokenization_kwargs", tokenization_kwargs)
        prompt = llm._pretokenized(prompt, tokenization_kwargs)
        text, ids = llm._prompt_ids(prompt, llm.engine.truncation(params))
        ids = llm.engine.truncated(ids, params)
        llm.engine.check_prompt(ids, params)
        reqs = {}
        for i in range(params.best_of or params.n):
            reqs[(rid, i)] = llm.engine.add_request(ids, params, seed_offset=i, request_id=f"{rid}#{i}",
                                                    priority=priority, lora_request=lora_request,
                                                    trace_headers=trace_headers, trace_name=rid,
                                                    cache_salt=_salt(prompt))
        ranked = (params.best_of or params.n) > params.n
        # best_of's n best are known at the end only: its one output then (LLM._output's); otherwise
        # the outputs AsyncLLM streams (output_kind: CUMULATIVE, DELTA, FINAL_ONLY)
        stream = None if ranked else RequestStream(rid, text, ids, params, llm._token_name, lora_request)
        own[rid] = (text, ids, params, reqs, {}, stream)

    def step(self) -> list:
        """vLLM's LLMEngine.step: one engine step -> the RequestOutputs of the requests that
        add_request(request_id, ...) queued and that moved since the last step() (in this step, or
        in an LLM.generate / stream() step in between), by their params' output_kind
        (outputs.RequestStream, as AsyncLLM's: CUMULATIVE the completion so far with its logprobs,
        DELTA what is new, FINAL_ONLY nothing until finished; n > 1 one output per completion
        that moved); the last one finished=True. best_of > n: one output when finished, its n best."""
        own = self._own
        self._llm._check_owner()
        with self._llm._stepping:            # not beside an LLM.generate on another thread
            self._llm._step()
            moved, self._moved = list(self._moved), {}
            outs = []
            for rid in moved:
                text, ids, params, reqs, logprobs, stream = own[rid]
                if stream is not None:
                    outs += stream.outputs()
                    if stream.finished:
                        del own[rid]
                        self._llm._count_prompt(params, list(reqs.values()))
                elif all(r.finished for r in reqs.values()):
                    del own[rid]
                    outs.append(self._llm._output(rid, text, ids, params, reqs, logprobs))
        return outs

    def take(self, events) -> None:
        """A step's events (this view's step, or LLM.generate's / stream()'s): those of the requests
        add_request(request_id, ...) queued, into their outputs for the next step()."""
        own = self._own
        for event in events:
            rid, mark, index = event.request_id.rpartition("#") if isinstance(event.request_id, str) else ("", "", "")
            if not mark or rid not in own:      # another caller's request (LLM.generate's, an engine id)
                continue
            stream = own[rid][5]
            if stream is not None:
                stream.add(int(index), event)
            elif event.logprobs:
                own[rid][4].setdefault(event.request_id, []).extend(event.logprobs)
            self._moved[rid] = None

    @property
    def model_executor(self) -> _Executor:
        return _Executor(self._llm)

    def collective_rpc(self, method, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None) -> list:
        return self._llm.collective_rpc(method, timeout, args, kwargs)

    def has_unfinished_requests(self) -> bool:
        """Requests in the engine, or outputs the next step() still owes (a request that
        finished in another caller's step: LLM.generate's)."""
        return self._llm.engine.has_unfinished() or bool(self._moved)

    def get_num_unfinished_requests(self) -> int:
        return self._llm.engine.num_running + self._llm.engine.num_waiting

    def abort_request(self, request_ids) -> None:
        self._llm._check_owner()
        own = self._own
        with self._llm._stepping:            # not in the middle of another thread's step
            for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
                if rid in own:                  # queued by add_request(request_id, ...): each choice
                    _, _, params, reqs, _, _ = own.pop(rid)
                    self._moved.pop(rid, None)
                    for key in reqs:
                        self._llm.engine.abort(f"{key[0]}#{key[1]}")
                    self._llm._count_prompt(params, list(reqs.values()))
                else:
                    self._llm.engine.abort(rid)

    # vLLM's LLMEngine LoRA calls: the engine's, in the caller's turn (they change its adapter slots)
    def add_lora(self, lora_request) -> bool:
        with self._llm._stepping:
            return self._llm.engine.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        with self._llm._stepping:
            return self._llm.engine.remove_lora(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        with self._llm._stepping:
            return self._llm.engine.pin_lora(lora_id)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return self._llm.reset_prefix_cache(reset_running_requests, reset_connector)

    def get_metrics(self) -> list:
        return self._llm.get_metrics()
