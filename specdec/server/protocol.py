"""Request bodies of OpenAI's completions and chat completions, with vLLM's extra sampling fields.

Strictly typed: "0.5" is not a number and true is not an integer, as in OpenAI's API. Value
ranges are left to SamplingParams, the one place that knows them; these models only fix types.
Unknown fields are ignored, so newer clients keep working.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """The fields both endpoints share."""
    model: str | None = Field(None, description="a served model name; omitted means the served model")
    max_tokens: int | None = None
    temperature: float | None = Field(None, description="0 is greedy; default 1")
    top_p: float | None = None
    top_k: int | None = Field(None, description="vLLM extension; -1 disables")
    min_p: float | None = Field(None, description="vLLM extension; 0 disables")
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, description="vLLM extension")
    ignore_eos: bool = Field(False, description="vLLM extension")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, description="only 0 is supported")
    frequency_penalty: float | None = Field(None, description="only 0 is supported")
    user: str | None = None
    return_tokens_as_token_ids: bool = Field(False, description="vLLM extension: logprobs name tokens "
                                                                "'token_id:<id>'")


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, description="return this many alternatives per token (0..20)")
    echo: bool = Field(False, description="only false is supported")


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, description="OpenAI's newer name for max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict | None = Field(None, description="only {'type': 'text'} is supported")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


