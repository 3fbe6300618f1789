"""From a validated request body to a running Generation: prompts, SamplingParams, engine jobs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import dataclasses
import itertools
import logging
import os
import time
from functools import partial

from ..config import SamplingParams, is_unicode_text
from ..distributed import TensorParallelError
from ..engine import StepEvent
from ..llm import CHAT_TEMPLATE_ARGUMENTS, LLM
from ..metrics import RequestStats
from ..structured import REASONING_TOKENS
from ..tokenizer import (TEXT_PARTS, TokenizerBusy, TokenizerError, content_format, template_content,
                         template_in_use, template_messages)
from ..tracing import warn_tracing_disabled
from .config import ServerConfig
from .errors import APIError, bad_value
from .lora import Adapters
from .metrics import PREFIXES, ServerMetrics
from . import fields as extra
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, _Sampling
from .reasoning import HARMONY
from .tools import ToolPlan, plan_tools
from .worker import EngineWorker, Job, ShuttingDown, deliver

log = logging.getLogger("specdec.server")

# Choices (prompts x n) one request may ask for: each is decoded on its own, so this bounds
# the work one HTTP call can queue on a CPU server.
MAX_CHOICES = 16
# what the server itself passes to a chat template (apply_chat_template's own arguments)
_TEMPLATE_VARIABLES = {"messages", "bos_token", "eos_token", "unk_token", "pad_token", "tools"} | CHAT_TEMPLATE_ARGUMENTS


# the W3C trace context (traceparent, tracestate) of the HTTP request being answered, set by the
# app's request-id middleware: the engine's span of each of its completions goes under it
REQUEST_TRACE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("specdec_request_trace", default=None)


class Service:
    """What the routes need: the model, the worker that owns its engine, and the metrics.

    The prepare_* methods, tokenize and detokenize turn a request into prompts and SamplingParams
    (tokenizing, rendering the chat template, checking a grammar): CPU work that grows with the
    request, so the routes run them off the event loop (`off_loop`), as vLLM tokenizes in a
    thread pool, and one big request does not freeze every other stream. What they touch is safe
    from any thread: the tokenizer (read only), the grammar compiler (GrammarCompiler.check), the
    adapters' routing table (a dict read), and of the engine only what its configuration fixes
    (max_model_len, vocab_size, check_priority / check_logprobs / check_prompt / truncated),
    never its scheduler or caches, which only the engine's thread touches.
    """

    def __init__(self, llm: LLM, config: ServerConfig):
        model_cfg = getattr(getattr(llm, "target", None), "config", None)
        if config.reasoning_parser is None and getattr(model_cfg, "model_type", None) == "gpt_oss":
            config = dataclasses.replace(config, reasoning_parser=HARMONY)    # vLLM reads gpt-oss's harmony by itself
        if config.tool_call_parser == "openai" and config.reasoning_parser != HARMONY:
            raise ValueError("--tool-call-parser openai reads gpt-oss's harmony replies: it needs a gpt-oss model "
                             "(or --reasoning-parser openai_gptoss)")
        self.llm, self.config = llm, config
        self.tokenizer, self.engine = llm.tokenizer, llm.engine
        grammars = getattr(llm.engine, "grammars", None)
        if config.reasoning_parser and grammars is not None and not grammars.config.reasoning_parser:
            # vLLM's --reasoning-parser is its structured-outputs config's too: a constrained reply
            # thinks freely and its grammar holds what follows the reasoning (enable_in_reasoning off).
            # A tokenizer without the markers as tokens (vLLM refuses the parser there; here it still
            # splits text) keeps the grammar from the reply's first token, as enable_in_reasoning
            if grammars.has_reasoning_tokens(config.reasoning_parser):
                grammars.config = dataclasses.replace(grammars.config, reasoning_parser=config.reasoning_parser)
            elif not grammars.config.enable_in_reasoning:
                log.warning("--reasoning-parser %s: the tokenizer has no %s tokens, so structured outputs "
                            "constrain the reply from its first token (no think block)", config.reasoning_parser,
                            " / ".join(REASONING_TOKENS[config.reasoning_parser]))
        self.metrics = ServerMetrics(llm.engine, config.model_name, PREFIXES[config.metrics_prefix])
        if llm.engine.tracer is not None:      # spans name the served model, as responses do
            llm.engine.tracer.model_name = config.model_name
        self.worker = EngineWorker(llm.engine, on_step=self.metrics.step)
        # LoRA adapters served by name beside the base model: those of --lora-modules are loaded
        # now, so a bad folder fails before the port opens
        self.adapters = Adapters(config.served_model_names, llm.engine.lora is not None, self.worker.call)
        self.adapters.load_static(config.lora_modules)
        self.request_logger = RequestLogger(self.tokenizer, config.max_log_len, config.enable_log_outputs) \
            if config.enable_log_requests else None
        if config.enable_log_outputs and not config.enable_log_requests:
            log.warning("--enable-log-outputs logs nothing without --enable-log-requests (as vLLM's)")
        # choice i of prompt p samples with seed + p * n + i (at most MAX_CHOICES), so requests sit MAX_CHOICES apart
        self._seeds = itertools.count(config.seed, MAX_CHOICES) if config.seed is not None else None
        self._grammar_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, ((os.cpu_count() or 1) + 1) // 2), thread_name_prefix="specdec-grammar")

    async def off_loop(self, fn, *args):
        """fn(*args) on a worker thread (the loop's default executor); its APIError comes back as raised."""
        return await asyncio.to_thread(fn, *args)

    async def compile_grammars(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """Each choice's grammar matcher compiled before the request is submitted, on the grammar
        threads (vLLM's structured-output executor: half the cores), so that neither the engine's
        thread (which takes one per choice at admission) nor other requests' preparation waits on a
        large schema; a grammar that cannot start is a 400 here, before any response begins."""
        spec = params.structured_outputs
        if spec is None:
            return
        from ..structured import GrammarError

        count = len(prompts) * (params.best_of or params.n)
        loop = asyncio.get_running_loop()
        # one matcher a task: a request whose client leaves (this coroutine cancelled) drops those not started
        jobs = [loop.run_in_executor(self._grammar_pool, self.engine.grammars.prebuild, spec, 1) for _ in range(count)]
        try:
            await asyncio.gather(*jobs)
        except GrammarError as e:
            field = spec.__dict__.get("_field", "structured_outputs")
            raise APIError(400, f"{field} is invalid: {e.detail}", field) from None
        finally:
            for job in jobs:
                job.cancel()

    def close(self) -> None:
        """At shutdown: grammars still queued for requests that will not run are dropped."""
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)

    def prepare_completion(self, req: CompletionRequest) -> tuple[list[list[int]], SamplingParams]:
        self._check_generates("Completions")
        self._check_model(req)
        if req.suffix is not None:
            raise APIError(400, "suffix is not currently supported", "suffix")      # vLLM's answer too
        # echo with max_tokens 0 scores the prompt alone (OpenAI's, vLLM's): one token is made
        # and left out of the response (Generation.echo_only)
        params = self._params(req, 1 if echo_only(req) else req.max_tokens, req.logprobs)
        if req.echo and req.logprobs is not None and req.prompt_logprobs is None:
            params = dataclasses.replace(params, prompt_logprobs=req.logprobs)   # the prompt is scored too (OpenAI's echo)
        # a text prompt cut where it is tokenized (its BOS kept), token ids cut to their last k (vLLM's)
        prompts = [self.engine.truncated(p, params) for p in self._completion_prompts(req.prompt, params)]
        # max_tokens null: generation_config's cap is a default, each prompt's output ends where the
        # context does (vLLM's get_max_tokens, per prompt) rather than a 400
        self._check_prompts(prompts, params, "prompt", asked=req.max_tokens is not None)
        return prompts, params

    def reasoning_for(self, params: SamplingParams) -> str | None:
        """The reasoning parser a reply goes through: --reasoning-parser's; a constrained reply's
        too when the engine's grammar leaves its reasoning free (enable_in_reasoning off, vLLM's
        default), and none when the grammar holds the reply from its first token (no think block)."""
        if params.structured_outputs is None:
            return self.config.reasoning_parser
        grammars = getattr(self.engine, "grammars", None)
        return self.config.reasoning_parser if grammars is not None and grammars.reasoning_markers() else None

    def prepare_chat(self, req: ChatCompletionRequest) -> tuple[list[list[int]], SamplingParams, ToolPlan | None]:
        self._check_generates("Chat Completions")
        self._check_model(req)
        extra.check_chat(req)
        if req.top_logprobs not in (None, 0) and not req.logprobs:      # vLLM's check_logprobs: 0 is none asked
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, self.config.enable_auto_tool_choice,
                          self.config.tool_call_parser)
        # an empty tools list reaches the template as [] (vLLM's; a template may test `tools is not none`);
        # --exclude-tools-when-tool-choice-none: "none" gives it none (vLLM's tools=None)
        tools = plan.template_tools if plan else (None if req.tools is None else [])
        if plan is not None and plan.mode == "none" and self.config.exclude_tools_when_tool_choice_none:
            tools = None
        prompts = [self.tokenizer.encode(self._chat_text(req, tools),
                          add_special_tokens=False)]     # the template writes its special tokens
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        try:
            params = self._params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                                  plan.constraint if plan else None)
        except APIError as e:
            if e.param == "max_tokens" and req.max_completion_tokens is not None:
                e.param = "max_completion_tokens"           # the field the client sent
                e.message = e.message.replace("max_tokens", "max_completion_tokens", 1)
            raise
        if plan is not None and plan.mode == "auto" and plan.parser in ("mistral", "hermes"):
            # [TOOL_CALLS] is a special token, and so are <tool_call> / </tool_call> in some Hermes
            # checkpoints: the parser must see them (vLLM's parsers' adjust_request)
            params = dataclasses.replace(params, skip_special_tokens=False)
        if self.config.reasoning_parser == HARMONY and self.reasoning_for(params) is not None:
            params = dataclasses.replace(params, skip_special_tokens=False)   # its channels are special tokens
        prompts = [self.engine.truncated(p, params) for p in prompts]
        if max_tokens is None:
            params = _within_context(params, prompts, self.engine.max_model_len)
        self._check_prompts(prompts, params, "messages")
        return prompts, params, plan

    def chat_role(self, req: ChatCompletionRequest) -> str:
        """The role a chat reply names, as vLLM's: --response-role after a generation prompt;
        without one the reply goes on with the last message, so it takes that message's role."""
        if req.add_generation_prompt or not req.messages:
            return self.config.response_role
        return req.messages[-1].role

    def chat_echo(self, req: ChatCompletionRequest) -> str | None:
        """vLLM's chat echo: the last message's content put before each reply, when that message has
        the reply's role (chat_role: a message the reply continues)."""
        if not req.echo or not req.messages or req.messages[-1].role != self.chat_role(req):
            return None
        content = req.messages[-1].content
        return content if isinstance(content, str) else _join_text(content) if content else ""

    def echo_texts(self, req: CompletionRequest, prompts: list[list[int]]) -> list[str] | None:
        """Each prompt's text for echo: as sent, or decoded when sent as token ids."""
        if not req.echo:
            return None
        if isinstance(req.prompt, str):
            return [req.prompt]
        if req.prompt and isinstance(req.prompt[0], str):
            return list(req.prompt)
        return [self.tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts]

    def generation(self, prompts: list[list[int]], params: SamplingParams, arrival: float,
                   priority: int = 0, lora_request=None, request_id: str | None = None,
                   prediction: list[int] | None = None, cache_salt: str | None = None) -> Generation:
        """The request's choices queued on the engine. A sampling request without a seed takes the
        server's next one (--seed) here, on the event loop, so seeds go in the order requests reach
        the engine; each of its prompts x choices then samples with its own offset from it."""
        spread = False
        if params.seed is None and self._seeds is not None and not params.greedy:
            params, spread = dataclasses.replace(params, seed=next(self._seeds)), True
        trace = REQUEST_TRACE.get()
        if trace is not None and self.engine.tracer is None:
            warn_tracing_disabled()
        return Generation(self.worker, self.metrics, prompts, params, arrival, priority, self.request_logger,
                          lora_request, request_id, spread_prompts=spread, prediction=prediction,
                          trace_headers=trace, cache_salt=cache_salt)

    def prediction_ids(self, req) -> list[int] | None:
        """OpenAI's Predicted Outputs of a chat request, tokenized as the reply would be (no special
        tokens); a 400 naming `prediction` for any other shape."""
        pred = getattr(req, "prediction", None)
        if pred is None:
            return None
        if pred.get("type") != "content" or "content" not in pred or set(pred) - {"type", "content"}:
            raise APIError(400, 'prediction must be {"type": "content", "content": ...}', "prediction")
        content = pred["content"]
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise APIError(400, 'prediction.content parts must be {"type": "text", "text": ...}',
                               "prediction.content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise APIError(400, "prediction.content must be a string or a list of text parts", "prediction.content")
        try:
            return self.tokenizer.encode(content, add_special_tokens=False)     # []: an empty prediction, given
        except ValueError as e:
            raise APIError(400, str(e), "prediction.content") from None

    def lora_request(self, model: str | None):
        """The LoRA adapter a request's `model` names (None: a base model); 404 for an unknown name."""
        return self.adapters.route(model)

    def model_name(self, lora_request, requested: str | None = None) -> str:
        """The `model` responses report (vLLM's _get_model_name): the adapter's name, else the served
        name the request gave, else the first served name."""
        if lora_request is not None:
            return lora_request.lora_name
        return requested if requested in self.config.served_model_names else self.config.model_name

    def _check_generates(self, api: str) -> None:
        """A pooling model (runner "pooling": embeddings) has no generation endpoints (vLLM: 404)."""
        if self.llm.runner != "generate":
            raise APIError(404, f"the model {self.config.model_name!r} does not support the {api} API (it is served "
                                "with runner 'pooling': POST /v1/embeddings)")

    def _check_model(self, req: _Sampling) -> None:
        self.adapters.route(req.model)

    def _params(self, req: _Sampling, max_tokens, logprobs, tool_constraint=None) -> SamplingParams:
        try:
            self.engine.check_priority(req.priority)
        except ValueError as e:
            raise APIError(400, str(e), "priority") from None
        structured, field = extra.structured_outputs(req)
        if tool_constraint is not None:
            if structured is not None:
                raise APIError(400, f"{field} cannot be combined with a named or required tool_choice (the tools' "
                                    f"schemas constrain the reply)", field)
            structured, field = tool_constraint, "tools"
        extra.check_grammar(self.engine, structured, field)
        if structured is not None:       # compile_grammars' 400 names the field the client sent
            object.__setattr__(structured, "_field", field)
        if req.stream_options is not None and not req.stream:       # vLLM's and OpenAI's rule
            raise APIError(400, "stream_options can only be given when stream is true", "stream_options")
        if req.best_of is not None and req.best_of > req.n and req.stream:
            raise APIError(400, "best_of > n cannot be streamed (the best are known only at the end)", "best_of")
        # what a request leaves out comes from the model's generation_config.json (vLLM's
        # --generation-config auto), then from OpenAI's defaults; its max_new_tokens caps every request
        model = self.llm.generation_defaults
        fields = dict(n=req.n, temperature=_or(req.temperature, model.get("temperature", 1.0)),
                      top_p=_or(req.top_p, model.get("top_p", 1.0)), top_k=_or(req.top_k, model.get("top_k", -1)),
                      min_p=_or(req.min_p, model.get("min_p", 0.0)), seed=req.seed,
                      max_tokens=_capped(max_tokens, model.get("max_tokens")), stop=req.stop, stop_token_ids=req.stop_token_ids,
                      ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens, logprobs=logprobs,
                      presence_penalty=_or(req.presence_penalty, 0.0), frequency_penalty=_or(req.frequency_penalty, 0.0),
                      repetition_penalty=_or(req.repetition_penalty, model.get("repetition_penalty", 1.0)),
                      logit_bias=extra.logit_bias(req, self.engine.target.config.vocab_size), bad_words=req.bad_words, min_tokens=_or(req.min_tokens, 0),
                      structured_outputs=structured, best_of=req.best_of, prompt_logprobs=req.prompt_logprobs,
                      include_stop_str_in_output=req.include_stop_str_in_output,
                      truncate_prompt_tokens=req.truncate_prompt_tokens, allowed_token_ids=req.allowed_token_ids,
                      spaces_between_special_tokens=req.spaces_between_special_tokens)
        if req.prompt_logprobs not in (None, 0) and req.stream:        # vLLM's check_logprobs: 0 passes
            raise APIError(400, "prompt_logprobs cannot be streamed", "prompt_logprobs")
        try:
            params = _numerically_safe(SamplingParams(**fields))
            self.engine.check_logprobs(params)
        except ValueError as e:
            err = bad_value(e)
            if err.param == "logprobs" and isinstance(req, ChatCompletionRequest):
                err.param = "top_logprobs"          # the chat endpoint's name for the count
            raise err from None
        if params.seed is not None and not -2**63 <= params.seed < 2**63:     # choice i seeds with seed + i, mod 2^64
            raise APIError(400, f"seed must be a 64-bit integer, got {params.seed}", "seed")
        try:
            self.engine.truncation(params)
        except ValueError as e:          # vLLM's: more than max_model_len
            raise APIError(400, str(e), "truncate_prompt_tokens") from None
        return params

    def _completion_prompts(self, prompt, params: SamplingParams) -> list[list[int]]:
        """The prompt(s) as token ids; a text with truncate_prompt_tokens tokenized as vLLM's
        (Tokenizer.encode_last: its last tokens, the BOS kept)."""
        keep = self.engine.truncation(params)

        def encode(text: str) -> list[int]:
            if keep is None:
                return self.tokenizer.encode(text)
            try:
                return self.tokenizer.encode_last(text, keep)
            except ValueError as e:        # k below the special tokens' count
                raise APIError(400, str(e), "truncate_prompt_tokens") from None
        if isinstance(prompt, str):
            return [encode(prompt)]
        if not prompt:
            raise APIError(400, "prompt must not be empty", "prompt")
        if isinstance(prompt[0], int):
            return [list(prompt)]
        if isinstance(prompt[0], str):
            return [encode(p) for p in prompt]
        return [list(p) for p in prompt]

    def tokenize(self, req: TokenizeRequest) -> dict:
        """vLLM's /tokenize: {count, max_model_len, tokens, token_strs}."""
        self._check_model(req)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give either prompt or messages", "prompt")
        if req.messages is not None:
            extra.check_chat(req)
            if req.tools is not None:
                plan_tools(req.tools, "none", None, False, None)       # the tools' shape only
            ids = self.tokenizer.encode(self._chat_text(req, req.tools), add_special_tokens=bool(req.add_special_tokens))
        else:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=add)
        strs = [self.tokenizer.id_to_token(i) for i in ids] if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids, "token_strs": strs}

    def detokenize(self, req: DetokenizeRequest) -> dict:
        self._check_model(req)
        vocab = self.engine.target.config.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    def _chat_text(self, req, tools: list[dict] | None = None) -> str:
        """The conversation through the chat template (req: a chat or tokenize request)."""
        if not req.messages:
            raise APIError(400, "messages must not be empty", "messages")
        # --chat-template-content-format: a message's content as text, or as OpenAI's parts for a
        # template that loops over them (auto: read from the template in use, as vLLM's)
        fmt = content_format(template_in_use(self.tokenizer, req.chat_template or self.config.chat_template, tools),
                             self.config.chat_template_content_format)
        try:
            messages = template_messages(
                {"role": m.role,
                 "content": m.content if m.content is None or isinstance(m.content, str) and fmt == "string"
                 else template_content(m.content if isinstance(m.content, str) else _text_parts(m.content), fmt),
                 "name": m.name, "tool_calls": m.tool_calls, "tool_call_id": m.tool_call_id,
                 "reasoning": getattr(m, "reasoning", None), "reasoning_content": getattr(m, "reasoning_content", None)}
                for m in req.messages)       # earlier reasoning under each name templates read (template_messages)
        except TokenizerError as e:     # e.g. a tool call's arguments nested past the recursion limit
            raise APIError(400, str(e), "messages") from None
        if req.continue_final_message and req.add_generation_prompt:
            raise APIError(400, "continue_final_message needs add_generation_prompt: false", "continue_final_message")
        if req.chat_template is not None and not self.config.trust_request_chat_template:
            # a template is code: one sent by a client could loop for as long as it likes
            raise APIError(400, "this server does not run chat templates sent with a request "
                                "(it was not started with --trust-request-chat-template)", "chat_template")
        # --default-chat-template-kwargs under the request's own (vLLM's)
        kwargs = {**(self.config.default_chat_template_kwargs or {}), **(req.chat_template_kwargs or {})}
        reserved = sorted(set(kwargs) & _TEMPLATE_VARIABLES)
        if reserved:
            raise APIError(400, f"chat_template_kwargs may not set {reserved[0]!r} (the server does)", "chat_template_kwargs")
        if tools is not None:
            kwargs = {**kwargs, "tools": tools}
        documents = getattr(req, "documents", None)     # vLLM's RAG field (chat, tokenize)
        if documents is not None and "documents" not in kwargs:    # vLLM: chat_template_kwargs win
            kwargs = {**kwargs, "documents": documents}
        effort = getattr(req, "reasoning_effort", None)      # OpenAI's field, for templates that read it
        if effort is not None and "reasoning_effort" not in kwargs:
            kwargs = {**kwargs, "reasoning_effort": effort}
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt,
                chat_template=req.chat_template or self.config.chat_template,
                continue_final_message=req.continue_final_message, tokenize=False,
                sandbox_process=req.chat_template is not None, **kwargs)      # a request's template: in a child
        except TokenizerBusy as e:
            raise APIError(429, str(e), "chat_template") from None
        except TokenizerError as e:
            raise APIError(400, str(e), "chat_template" if req.chat_template else "messages") from None
        if not is_unicode_text(text):           # a template's own string (the request's text was checked)
            raise APIError(400, "the chat template wrote text that is not valid Unicode (a lone surrogate)",
                           "chat_template" if req.chat_template else "messages")
        return text

    def _check_prompts(self, prompts: list[list[int]], params: SamplingParams, param: str, asked: bool = True) -> None:
        """asked: max_tokens is the request's own (past the context: a 400); else a default cap,
        which the context bounds."""
        per_prompt = params.best_of or params.n
        if len(prompts) * per_prompt > MAX_CHOICES:
            raise APIError(400, f"at most {MAX_CHOICES} completions per request (prompts x max(n, best_of)), "
                                f"got {len(prompts) * per_prompt}", "best_of" if params.best_of else "n")
        if params.structured_outputs is not None:
            # the grammar text made and validated once, kept on the spec (the engine's checks of each
            # choice then reuse it); the matchers are compiled before submission (Generation.compile)
            from ..structured import GrammarError

            try:
                self.engine.grammars.freeze(params.structured_outputs)
            except GrammarError as e:
                raise APIError(400, str(e), "structured_outputs") from None
        limit = self.engine.max_model_len
        for ids in prompts:
            try:
                self.engine.check_prompt(ids, params)
            except ValueError as e:
                raise bad_value(e, param) from None
            if asked and params.max_tokens is not None and len(ids) + params.max_tokens > limit:
                raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you "
                                    f"requested {len(ids) + params.max_tokens} tokens ({len(ids)} in the "
                                    f"{param}, {params.max_tokens} for the completion).", "max_tokens")



# Below this the engine's float32 sampling keeps no token at all (top_p rounds to 0); raising top_p
# to 1e-6 changes nothing else: the most likely token always has probability >= 1/V > 1e-6. (A
# temperature below 0.01 is raised to 0.01 by SamplingParams, as vLLM's.)
_MIN_TOP_P = 1e-6


def _numerically_safe(params: SamplingParams) -> SamplingParams:
    if params.top_p < _MIN_TOP_P:
        params = dataclasses.replace(params, top_p=_MIN_TOP_P)
    return params


def _within_context(params: SamplingParams, prompts: list[list[int]], limit: int) -> SamplingParams:
    """generation_config.json's max_new_tokens, when the request named no max_tokens, is a default
    cap, not a request: what the context leaves bounds it (vLLM's get_max_tokens) where the
    request's own max_tokens past the context is a 400. A prompt with no room is left to that check.
    Several prompts (the batch chat endpoint's conversations) share the budget: the least room."""
    room = limit - max(map(len, prompts))
    if params.max_tokens is None or params.max_tokens <= room or room < 1:
        return params
    return dataclasses.replace(params, max_tokens=room)


def _capped(asked: int | None, cap: int | None) -> int | None:
    """max_tokens under generation_config.json's max_new_tokens: vLLM's server-wide limit."""
    return asked if cap is None else cap if asked is None else min(asked, cap)


def _or(value, default):
    return default if value is None else value


def _join_text(parts) -> str:
    """A message's text parts, one per line (vLLM's chat_utils joins them with newlines)."""
    return template_content(_text_parts(parts), "string")


def _text_parts(parts) -> list:
    """A message's content parts as template_content reads them (vLLM's: plain strings and
    TEXT_PARTS; a part sent without its text leaves the key out, and is skipped); any other is a 400."""
    parts = [p if isinstance(p, str) else p.model_dump(exclude_none=True) for p in parts]
    bad = next((p["type"] for p in parts if isinstance(p, dict) and p["type"] not in TEXT_PARTS), None)
    if bad is not None:
        raise APIError(400, f"content part {bad!r} is not supported: only text parts ({', '.join(TEXT_PARTS)})",
                       "messages")
    return parts


def echo_only(req: CompletionRequest) -> bool:
    return req.echo and req.max_tokens == 0


class _Clock:
    """Latency bookkeeping of one choice, for the histograms."""

    def __init__(self, arrival: float):
        self.arrival, self.first, self.last = arrival, None, None


class RequestLogger:
    """vLLM's --enable-log-requests: a line when a request's jobs are queued (prompt text and
    token ids, cut at max_log_len, the sampling parameters, the priority) and one as each ends;
    with --enable-log-outputs one more as each ends: its output text and token ids (cut the same
    way) and finish reason."""

    def __init__(self, tokenizer, max_len: int | None, outputs: bool = False):
        self.tokenizer, self.max_len, self.outputs = tokenizer, max_len, outputs

    def received(self, job: Job) -> None:
        ids, text = job.prompt_ids, self.tokenizer.decode(job.prompt_ids, skip_special_tokens=False)
        if self.max_len is not None:
            ids, text = ids[:self.max_len], text[:self.max_len]
        log.info("Received request %s: prompt: %r, params: %s, priority: %d, prompt_token_ids: %s",
                 job.name, text, job.params, job.priority, ids)

    def ended(self, job: Job, outcome: str, stats: RequestStats | None, output: tuple[list, str] | None = None) -> None:
        tokens = stats.output_tokens if stats is not None else 0
        log.info("Finished request %s: %s, %d prompt tokens, %d output tokens", job.name, outcome,
                 len(job.prompt_ids), tokens)
        if output is not None:
            ids, text = output
            if self.max_len is not None:
                ids, text = ids[:self.max_len], text[:self.max_len]
            log.info("Generated response %s: output: %r, output_token_ids: %s, finish_reason: %s",
                     job.name, text, ids, outcome)


def _check_group(target) -> None:
    """A tensor-parallel target whose group has stopped fails every step: a request reaching it is
    a 503 at once, as /health says (one it was generating when the group stopped keeps vLLM's 500
    for an engine that died under a request)."""
    leader = getattr(target, "leader", None)
    if leader is not None and leader.failure is not None:
        raise TensorParallelError(f"the engine cannot serve: {leader.failure}")


class Generation:
    """The engine jobs of one HTTP request (each prompt x n) as one stream of (choice index, StepEvent).

    Use `async with`: entering queues the jobs; leaving with choices unfinished (client gone,
    cancellation, engine error) cancels them, so their slots free at once. `request_id`: the
    HTTP request's (cmpl-<X-Request-Id>, ...), which names its jobs in the request log: itself
    for one job, with "-<i>" for each of several.
    """

    def __init__(self, worker: EngineWorker, metrics: ServerMetrics, prompts: list[list[int]],
                 params: SamplingParams, arrival: float, priority: int = 0, logger: RequestLogger | None = None,
                 lora_request=None, request_id: str | None = None, spread_prompts: bool = False,
                 prediction: list[int] | None = None, trace_headers: dict | None = None,
                 cache_salt: str | None = None):
        """spread_prompts: prompt p's choice i samples with seed + p * per_prompt + i (a seed the
        server gave: no two of the request's samples share draws), else with seed + i for every
        prompt (a seed the request gave, as vLLM: identical prompts then draw the same)."""
        self.prompts, self.params, self.arrival, self._logger = prompts, params, arrival, logger
        self.prediction = prediction     # Predicted Outputs' ids ([]: an empty one), None: no prediction
        self._worker, self._metrics = worker, metrics
        self._queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        # best_of > n: every candidate runs, the best n per prompt are kept at the end
        self.per_prompt = params.best_of or params.n
        self._jobs = [Job(ids, params, p * self.per_prompt * spread_prompts + i,
                          partial(deliver, loop, self._queue, p * self.per_prompt + i),
                          priority=priority, lora_request=lora_request, prediction=prediction,
                          trace_headers=trace_headers, cache_salt=cache_salt)
                      for p, ids in enumerate(prompts) for i in range(self.per_prompt)]
        if request_id is not None:
            for i, job in enumerate(self._jobs):
                job.name = request_id if len(self._jobs) == 1 else f"{request_id}-{i}"
        self._clocks = [_Clock(arrival) for _ in self._jobs]
        self.echo_only = False           # echo with max_tokens 0: each choice's one token is dropped
        self.stats: list[RequestStats | None] = [None] * len(self._jobs)
        self._open = set(range(len(self._jobs)))
        self._leaving: set[int] = set()  # choices whose client left, until the engine has stopped them
        self._drainer: asyncio.Task | None = None
        # per prompt (vLLM's parent request): its choices not ended yet, and the most tokens one
        # of its finished-request records generated (None while it has none)
        self._left = [self.per_prompt] * len(prompts)
        self._most: list[int | None] = [None] * len(prompts)
        # --enable-log-outputs: each choice's output so far (token ids, text), logged as it ends
        self._outputs = [([], "") for _ in self._jobs] if logger is not None and logger.outputs else None

    def prompt_of(self, index: int) -> list[int]:
        return self.prompts[index // self.per_prompt]

    async def __aenter__(self) -> Generation:
        for job in self._jobs:
            job.echo_only = self.echo_only
        try:
            _check_group(getattr(self._worker.engine, "target", None))
            self._worker.submit(self._jobs)
        except (ShuttingDown, TensorParallelError) as e:
            self._metrics.count("error", len(self._jobs))     # its answer may be an event of a stream
            raise APIError(503, str(e)) from None
        if self._logger is not None:
            for job in self._jobs:
                self._logger.received(job)
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if exc is None or isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
            outcome = "abort"
        else:       # the request's error answer: a client's error (4xx) or the server's
            outcome = "invalid" if isinstance(exc, APIError) and exc.status < 500 else "error"
        for i in sorted(self._open):
            self._worker.cancel(self._jobs[i])
            if outcome == "abort":       # counted now; its finished-request record once the engine stopped it
                self._metrics.count(outcome)
                self._leaving.add(i)
            else:
                self._finished(i, outcome)
        self._open.clear()
        if self._leaving:
            self._drainer = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        """The choices a client left: their events until the engine has stopped each (its last
        event: the abort, with all the engine computed for it, or its own end if that came
        first), then its finished-request record, as vLLM records a request once it has left the
        engine: its tokens are then all those generation_tokens counted."""
        while self._leaving:
            index, item = await self._queue.get()
            if index not in self._leaving:
                continue
            if isinstance(item, Exception):      # the engine failed it meanwhile: its work so far
                self._leaving.discard(index)
                self._finished(index, "abort", counted=True)
                continue
            self._observe(index, self._as_sent(item))

    def _finished(self, index: int, outcome: str, counted: bool = False) -> None:
        """Choice `index` is over: requests_total{outcome} (unless counted as its client left) and,
        for one the engine ran (stop, length, abort, or error: the engine failed it, as vLLM's
        FinishReason.ERROR), vLLM's finished-request record. A job
        cancelled before the engine took it makes none (vLLM's: a request that never reached
        its engine has no stats, and the engine made no span for it)."""
        if not counted:
            self._metrics.count(outcome or "stop")
        prompt = index // self.per_prompt
        if outcome in ("stop", "length", "abort", "error") and self._jobs[index].started:
            clock, stats = self._clocks[index], self.stats[index]
            generated = 0 if self.echo_only or stats is None else stats.output_tokens
            room = self._worker.engine.max_model_len - len(self.prompt_of(index))
            self._metrics.finished(outcome, stats, len(self.prompt_of(index)), generated, clock.arrival,
                                   clock.first, clock.last, time.perf_counter(),
                                   max_tokens=self.params.max_tokens or max(room, 0))
            self._most[prompt] = max(self._most[prompt] or 0, generated)
        self._left[prompt] -= 1
        if not self._left[prompt] and self._most[prompt] is not None:
            # the prompt's last choice: vLLM's per parent request figures (each prompt of a list is one)
            self._metrics.prompt_ended(self.params.n, self._most[prompt])
        if self._logger is not None:
            output = self._outputs[index] if self._outputs is not None else None
            self._logger.ended(self._jobs[index], outcome, self.stats[index], output)

    async def steps(self):
        """Yield (choice index, StepEvent) until every choice has finished."""
        while self._open:
            index, item = await self._queue.get()
            if isinstance(item, Exception):
                # the engine refused the request (a ValueError: a 400, counted as invalid) or failed
                failure = bad_value(item) if isinstance(item, ValueError) else \
                    APIError(500, f"generation failed: {type(item).__name__}: {item}")
                self._open.discard(index)
                self._finished(index, "invalid" if failure.status < 500 else "error")
                raise failure
            item = self._as_sent(item)
            self._observe(index, item)
            yield index, item

    def _as_sent(self, event: StepEvent) -> StepEvent:
        """The event as the response shows it (echo with max_tokens 0: without its token, which its
        statistics do not count either, as usage does not)."""
        if not self.echo_only:
            return event
        stats = None if event.stats is None else dataclasses.replace(event.stats, output_tokens=0)
        return dataclasses.replace(event, token_ids=[], text="", num_accepted=0, stats=stats,
                                   logprobs=[] if event.logprobs is not None else None,
                                   finish_reason=("length" if event.finish_reason != "abort" else "abort")
                                   if event.finished else None, stop_reason=None)

    def _observe(self, index: int, event: StepEvent) -> None:
        clock, now = self._clocks[index], time.perf_counter()
        self.stats[index] = event.stats
        if self._outputs is not None and (event.token_ids or event.text):
            ids, text = self._outputs[index]
            ids += event.token_ids
            self._outputs[index] = (ids, text + event.text)
        if event.token_ids:          # (its tokens and prompt are counted by the engine's step: metrics.step)
            if clock.last is None:
                self._metrics.ttft.observe(now - clock.arrival)
                clock.first = now
            else:
                self._metrics.inter_token(now - clock.last)
            clock.last = now
        if event.finished:
            counted = index in self._leaving         # its client left: counted in requests_total then
            self._open.discard(index)
            self._leaving.discard(index)
            self._finished(index, event.finish_reason, counted)


