"""vLLM's module path for prompt types: `from vllm.inputs import TextPrompt, TokensPrompt` ports by
its module name alone. They are TypedDicts, plain dicts at run time: LLM.generate, beam_search,
embed and the rest take them as they take {"prompt": ...} and {"prompt_token_ids": [...]}."""

from __future__ import annotations

from typing import Any, Union

try:
    from typing import NotRequired, TypedDict
except ImportError:                # Python 3.10 (typing_extensions comes with torch)
    from typing_extensions import NotRequired, TypedDict


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the LLM (vLLM's). Non-empty multi_modal_data is refused (no model
    here reads it: vLLM's "... is not a multimodal model"); mm_processor_kwargs is not read;
    cache_salt keeps the prompt's prefix-cache blocks to requests of the same salt."""
    prompt: str
    multi_modal_data: NotRequired[Any]
    mm_processor_kwargs: NotRequired[dict[str, Any]]
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """A prompt of token ids (vLLM's): `prompt`, when given, is what RequestOutput.prompt shows."""
    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    token_type_ids: NotRequired[list[int]]
    multi_modal_data: NotRequired[Any]
    mm_processor_kwargs: NotRequired[dict[str, Any]]
    cache_salt: NotRequired[str]


SingletonPrompt = Union[str, TextPrompt, TokensPrompt]
PromptType = SingletonPrompt

__all__ = ["TextPrompt", "TokensPrompt", "SingletonPrompt", "PromptType"]
