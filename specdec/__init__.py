"""specdec: lossless speculative decoding for Llama-family models."""

from .config import RequestOutputKind, SamplingParams, SpeculativeConfig
from .inputs import TextPrompt, TokensPrompt
from .llm import LLM, CompletionOutput, RequestOutput

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "SpeculativeConfig", "RequestOutput", "CompletionOutput", "TextPrompt",
           "TokensPrompt", "RequestOutputKind", "AsyncLLM", "AsyncLLMEngine", "AsyncEngineArgs", "EngineArgs",
           "LLMEngine", "__version__"]

_ASYNC = ("AsyncLLM", "AsyncLLMEngine", "AsyncEngineArgs", "EngineArgs", "LLMEngine")


def __getattr__(name):
    """vLLM's async engine, imported when first named (it brings the server's worker along)."""
    if name in _ASYNC:
        from . import async_llm

        return getattr(async_llm, name)
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
