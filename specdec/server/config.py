"""Server settings, frozen and validated once at the edge (the command line or a test)."""

from __future__ import annotations

from dataclasses import dataclass

from .lora import LoRAModulePath


@dataclass(frozen=True)
class ServerConfig:
    served_model_names: tuple[str, ...] = ("specdec",)
    api_key: str | tuple[str, ...] | None = None   # when set, /v1/* and the state-changing control routes need `Authorization: Bearer <key>` (any one)
    max_request_bytes: int = 1 << 20      # larger bodies get 413
    seed: int | None = None               # seeds unseeded sampling requests: seed, seed+1, ...
    chat_template: str | None = None      # replaces the tokenizer's (vLLM's --chat-template, already read)
    response_role: str = "assistant"      # the role chat responses name (vLLM's --response-role)
    trust_request_chat_template: bool = False   # a request's own chat_template runs only when set (vLLM's flag)
    # CORS, vLLM's defaults: any origin, method and header; no credentials
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    root_path: str = ""                   # the path prefix a proxy serves the app under (vLLM's --root-path)
    return_tokens_as_token_ids: bool = False    # logprobs name tokens "token_id:<id>" unless a request says
    disable_fastapi_docs: bool = False    # no /docs, /redoc, /openapi.json
    enable_auto_tool_choice: bool = False  # tool_choice "auto": the model's own calls, taken out by the parser
    tool_call_parser: str | None = None   # the format of those calls (tools.PARSERS)
    exclude_tools_when_tool_choice_none: bool = False   # tool_choice "none": no tools in the prompt (vLLM's flag)
    reasoning_parser: str | None = None   # thinking returned as reasoning_content (reasoning.PARSERS)
    enable_log_requests: bool = False     # log each request's prompt, parameters and end (vLLM's flag)
    enable_log_outputs: bool = False      # with enable_log_requests: each completion's output too (vLLM's flag)
    max_log_len: int | None = None        # at most this many prompt characters and token ids in that log
    # LoRA adapters served under their names (vLLM's --lora-modules; the LLM needs enable_lora=True)
    lora_modules: tuple[LoRAModulePath, ...] = ()
    allow_runtime_lora_updating: bool = False   # /v1/load_lora_adapter, /v1/unload_lora_adapter (vLLM's variable)
    dev_mode: bool = False     # VLLM_SERVER_DEV_MODE: /reload_weights, /collective_rpc, /reset_prefix_cache, ... (control.py)
    # vLLM's --enable-request-id-headers: every response carries X-Request-Id (the request's, or a
    # new one), which the completion ids and the request log also use
    enable_request_id_headers: bool = False
    enable_server_load_tracking: bool = False   # GET /load counts the requests running the model (vLLM's flag)
    # vLLM's periodic stats lines (throughput, queue, KV cache, SpecDecoding metrics) every
    # log_stats_interval seconds (VLLM_LOG_STATS_INTERVAL, default 10); --disable-log-stats turns them off
    log_stats: bool = True
    log_stats_interval: float = 10.0
    # /metrics' family names: "specdec" (specdec:...) or "vllm" (vllm:..., for vLLM's dashboards and alerts)
    metrics_prefix: str = "specdec"
    default_chat_template_kwargs: dict | None = None   # under each chat request's chat_template_kwargs (vLLM's flag)
    enable_force_include_usage: bool = False    # every stream ends with a usage chunk (vLLM's flag)
    enable_tokenizer_info_endpoint: bool = False   # GET /tokenizer_info (vLLM's flag)
    chat_template_content_format: str = "auto"     # a message's content as text or OpenAI's parts (vLLM's flag)
    log_config: dict | None = None                 # --log-config-file's dictConfig, for uvicorn's loggers too
    disable_uvicorn_access_log: bool = False       # no access log lines (vLLM's flag)
    disable_access_log_for_endpoints: tuple[str, ...] = ()   # none for these paths (vLLM's flag)

    def __post_init__(self):
        names = tuple(self.served_model_names)
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError("served_model_names must be non-empty strings")
        object.__setattr__(self, "served_model_names", names)
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            v = tuple(getattr(self, name))
            if not all(isinstance(x, str) and x for x in v):
                raise ValueError(f"{name} must be non-empty strings, got {v!r}")
            object.__setattr__(self, name, v)
        if self.root_path and not (self.root_path.startswith("/") and not self.root_path.endswith("/")):
            raise ValueError(f"root_path must start with / and not end with one, got {self.root_path!r}")
        if not isinstance(self.max_request_bytes, int) or self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be an integer >= 1024, got {self.max_request_bytes!r}")
        if self.api_key is not None:
            keys = (self.api_key,) if isinstance(self.api_key, str) else tuple(self.api_key)
            if not keys or not all(isinstance(k, str) and k for k in keys):
                raise ValueError(f"api_key must be non-empty strings, got {self.api_key!r}")
            object.__setattr__(self, "api_key", keys[0] if len(keys) == 1 else keys)
        from .tools import PARSERS

        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, got {self.tool_call_parser!r}")
        from .reasoning import PARSERS as REASONING

        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING)}, got {self.reasoning_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.default_chat_template_kwargs is not None and not isinstance(self.default_chat_template_kwargs, dict):
            raise ValueError("default_chat_template_kwargs must be a dict")
        if self.chat_template_content_format not in ("auto", "string", "openai"):
            raise ValueError(f"chat_template_content_format must be auto, string or openai, got "
                             f"{self.chat_template_content_format!r}")
        if self.metrics_prefix not in ("specdec", "vllm"):
            raise ValueError(f"metrics_prefix must be 'specdec' or 'vllm', got {self.metrics_prefix!r}")
        if not isinstance(self.response_role, str) or not self.response_role:
            raise ValueError("response_role must be a non-empty string")
        self._check_lora_modules()

    def _check_lora_modules(self) -> None:
        modules = tuple(self.lora_modules)
        object.__setattr__(self, "lora_modules", modules)
        names = self.served_model_names
        seen = set(names)
        for m in modules:
            if not isinstance(m, LoRAModulePath):
                raise ValueError(f"lora_modules must be LoRAModulePath entries, got {m!r}")
            if m.name in seen:
                what = "a served model name" if m.name in names else "given twice"
                raise ValueError(f"--lora-modules: the adapter name {m.name!r} is {what}")
            seen.add(m.name)

    @property
    def model_name(self) -> str:
        """The name responses report: the first served name, as vLLM does."""
        return self.served_model_names[0]
