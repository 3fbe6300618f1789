"""specdec: lossless speculative decoding for Llama-family models.

The names below are imported when first used (`from specdec import LLM` as before): the `specdec`
command's module loads without torch, so its Ctrl-C handling is in place while torch loads."""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "SpeculativeConfig", "RequestOutput", "CompletionOutput", "TextPrompt",
           "TokensPrompt", "RequestOutputKind", "AsyncLLM", "AsyncLLMEngine", "AsyncEngineArgs", "EngineArgs",
           "LLMEngine", "__version__"]

# name -> the module that defines it (async_llm brings the server's worker along)
_HOMES = {"LLM": "llm", "CompletionOutput": "llm", "RequestOutput": "llm",
          "SamplingParams": "config", "SpeculativeConfig": "config", "RequestOutputKind": "config",
          "TextPrompt": "inputs", "TokensPrompt": "inputs",
          **dict.fromkeys(("AsyncLLM", "AsyncLLMEngine", "AsyncEngineArgs", "EngineArgs", "LLMEngine"), "async_llm")}


def __getattr__(name):
    import importlib
    import importlib.util

    if name in _HOMES:
        value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f".{name}", __name__)      # a submodule: specdec.kernels, as before
    else:
        raise AttributeError(f"module 'specdec' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *__all__})
