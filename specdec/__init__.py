"""specdec: lossless speculative decoding for Llama-family models."""

from .config import SamplingParams, SpeculativeConfig
from .inputs import TextPrompt, TokensPrompt
from .llm import LLM, CompletionOutput, RequestOutput

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "SpeculativeConfig", "RequestOutput", "CompletionOutput", "TextPrompt",
           "TokensPrompt", "__version__"]
