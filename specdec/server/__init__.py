"""OpenAI-compatible HTTP server: `specdec serve` or `python -m specdec.entrypoints.openai.api_server`.

    cli.py        vLLM's command line -> ServerConfig + LLM -> uvicorn
    app.py        build_app(llm, config): routes, error handlers, lifespan
    protocol.py   request bodies (OpenAI's schema, strictly typed)
    serving.py    request -> validated prompts and SamplingParams -> Generation
    responses.py  JSON bodies and server-sent-event chunks for completions and chat
    worker.py     the one thread that owns the batch engine: adds, aborts, steps, streams
    lora.py       LoRA adapters by name (vLLM's --lora-modules, /v1/load_lora_adapter)
    logprobs.py   OpenAI's logprobs shapes (the figures come from the verification forward)
    metrics.py    Prometheus metrics, one registry per app
    errors.py     OpenAI-style error JSON, the body size limit, the API key check
"""

__all__ = ["ServerConfig", "build_app"]


def __getattr__(name):
    """build_app and ServerConfig load when first used: the package's light modules (reasoning,
    tool parsers: `specdec generate` and `chat` use them) come without FastAPI's stack."""
    if name == "build_app":
        from .app import build_app as value
    elif name == "ServerConfig":
        from .config import ServerConfig as value
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value
