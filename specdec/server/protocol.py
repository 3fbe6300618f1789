"""Request bodies of OpenAI's completions and chat completions, with vLLM's extra sampling fields.

Strictly typed: "0.5" is not a number and true is not an integer, as in OpenAI's API. Value
ranges are left to SamplingParams, the one place that knows them; these models only fix types.
Unknown fields are ignored, so newer clients keep working.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..config import is_unicode_text
from .errors import clipped


def _lone_surrogate(value, path: str) -> str | None:
    """The path of the first string in value (dicts, lists) holding a lone surrogate, or None.
    Walked with a stack of iterators, not by recursion: the JSON parser takes bodies nested deeper
    than the frames left under this validator (a RecursionError had been a 500)."""
    keys, stack = [_TOP], [iter([(_TOP, value)])]      # the keys down to each iterator's container
    while stack:
        step = next(stack[-1], None)
        if step is None:
            keys.pop()
            stack.pop()
            continue
        key, item = step
        if isinstance(key, str) and not is_unicode_text(key):
            # escaped (\ud800), and cut: pydantic cannot carry the surrogate itself in its message (a 500)
            key = clipped(key.encode("utf-8", "backslashreplace").decode())
            where = _path(path, keys)
            return f"{where}.{key} (a key)" if where else f"{key} (a key)"
        if isinstance(item, str) and not is_unicode_text(item):
            return _path(path, [*keys, key])
        if isinstance(item, (dict, list, tuple)):
            keys.append(key)
            stack.append(iter(item.items()) if isinstance(item, dict) else enumerate(item))
    return None


_TOP = object()     # _lone_surrogate's key of the value itself


def _path(path: str, keys: list) -> str:
    """path.key[0].other: a dict's key after a dot, a list's index in brackets."""
    for key in keys:
        if key is not _TOP:
            path = f"{path}.{key}" if path and isinstance(key, str) else f"{path}[{key}]" if path else str(key)
    return path


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data):
        """JSON may spell a lone surrogate (\\ud800), which no UTF-8 text holds: a 400 naming
        the field, before a tokenizer or the engine thread meets it."""
        where = _lone_surrogate(data, "")
        if where is not None:
            raise ValueError(f"{where or 'the body'} is not valid Unicode text (a lone surrogate)")
        return data


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM extension: with include_usage, every chunk "
                                                           "carries its choice's usage so far")


class _Sampling(_Body):
    """The fields both endpoints share."""
    model: str | None = Field(None, description="a served model name, or a LoRA adapter's; omitted or empty "
                                                "means the served model")
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
    skip_special_tokens: bool = Field(True, description="vLLM extension: leave special tokens out of the text")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, description="[-2, 2]: subtract from tokens already in the output")
    frequency_penalty: float | None = Field(None, description="[-2, 2]: subtract times each token's count in the output")
    repetition_penalty: float | None = Field(None, description="vLLM extension: [0.01, 100], over prompt and output; 1 = off")
    logit_bias: dict[str, float] | None = Field(None, description='{"token id": bias}, clamped to [-100, 100] (vLLM\'s)')
    bad_words: list[str] | None = Field(None, description="vLLM extension: words never generated")
    min_tokens: int | None = Field(None, description="vLLM extension: EOS and stop tokens banned until this many tokens")
    best_of: int | None = Field(None, description="draw this many, return the n of highest cumulative logprob")
    response_format: dict | None = Field(None, description="{'type': 'text' | 'json_object' | 'json_schema', 'json_schema': {'schema': ...}}")
    structured_outputs: dict | None = Field(None, description="vLLM: one of json, regex, choice, grammar, json_object, "
                                                                  "structural_tag, with the JSON options")
    guided_json: dict | str | None = Field(None, description="vLLM (older name): a JSON schema")
    guided_regex: str | None = Field(None, description="vLLM (older name): a regular expression")
    guided_choice: list[str] | None = Field(None, description="vLLM (older name): one of these strings")
    guided_grammar: str | None = Field(None, description="vLLM (older name): a Lark or GBNF grammar")
    guided_whitespace_pattern: str | None = Field(None, description="vLLM (older name): the whitespace a JSON "
                                                                    "constraint allows between tokens, a regex")
    user: str | None = None
    prompt_logprobs: int | None = Field(None, description="vLLM extension: each prompt token's logprob, rank and "
                                                          "this many alternatives (not streamed)")
    return_tokens_as_token_ids: bool | None = Field(None, description="vLLM extension: logprobs name tokens "
                                                                "'token_id:<id>'")
    return_token_ids: bool | None = Field(False, description="vLLM extension: each choice's generated token ids "
                                                             "(`token_ids`) and the prompt's (`prompt_token_ids`); "
                                                             "streamed: each chunk's new ids, the prompt's in the "
                                                             "first chunk")
    priority: int = Field(0, description="vLLM extension: with --scheduling-policy priority, lower is served first")
    cache_salt: str | None = Field(None, min_length=1, description="vLLM extension: prefix-cache blocks are shared "
                                                                   "only between requests with the same salt")
    use_beam_search: bool = Field(False, description="vLLM extension: the n best beams (n = beam width); streamed "
                                                     "once the search ends")
    length_penalty: float = Field(1.0, description="vLLM extension, with use_beam_search: rank by cum / len ** this "
                                                     "(finite)")
    include_stop_str_in_output: bool = Field(False, description="vLLM extension: the stop string (or stop token) "
                                                                "that ended the text stays in it")
    truncate_prompt_tokens: int | None = Field(None, description="vLLM extension: keep the prompt's last k tokens "
                                                                 "(-1: as many as the context holds)")
    allowed_token_ids: list[int] | None = Field(None, description="vLLM extension: only these tokens are generated")
    spaces_between_special_tokens: bool = Field(True, description="vLLM extension: taken (the tokenizer's own "
                                                                  "decoding either way)")

    @field_validator("stream_options", mode="before")
    @classmethod
    def _empty_options(cls, options):
        """An empty object is none given: vLLM's validate_stream_options refuses stream_options
        without streaming only when they are truthy."""
        return None if options == {} else options


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, description="return this many alternatives per token (0 to --max-logprobs, default 20)")
    echo: bool = Field(False, description="prepend the prompt to each choice's text (max_tokens 0: the prompt "
                                          "alone, scored with logprobs)")
    suffix: str | None = Field(None, description="OpenAI's insertion suffix: refused (400), as vLLM does")


class ContentPart(_Body):
    type: str
    text: str | None = None
    refusal: str | None = None      # a "refusal" part's text (vLLM reads it as text)
    thinking: str | None = None     # a "thinking" part's text


class ChatMessage(_Body):
    role: str
    content: str | list[str | ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = Field(None, description="an assistant's earlier calls (given to the chat template)")
    tool_call_id: str | None = Field(None, description="a tool message: the call it answers")
    reasoning_content: str | None = Field(None, description="vLLM: an assistant's earlier thinking, for the chat "
                                                            "template (Qwen3's reads reasoning_content, gpt-oss's "
                                                            "thinking: both are given)")
    reasoning: str | None = Field(None, description="the same, under its newer name")

    @field_validator("tool_calls")
    @classmethod
    def _calls(cls, calls):
        """OpenAI's shape: {"id", "type": "function", "function": {"name", "arguments"}} (a
        malformed one reached the template and was a 500)."""
        for i, c in enumerate(calls or []):
            fn = c.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                    not isinstance(fn.get("arguments", ""), (str, dict)):
                raise ValueError(f"tool_calls[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": "
                                 f"<string>, \"arguments\": <JSON string>}}}}")
        return calls


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, description="OpenAI's newer name for max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = Field(None, description='[{"type": "function", "function": {"name", "description", '
                                                        '"parameters"}}]')
    tool_choice: str | dict | None = Field(None, description='"none", "auto" (default with tools; needs the server\'s '
                                                              '--enable-auto-tool-choice), "required", or '
                                                              '{"type": "function", "function": {"name": ...}}')
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call (tool_choice required)")
    # vLLM's chat extensions
    echo: bool = Field(False, description="vLLM: when the last message has the reply's role, put its content "
                                          "before each reply")
    add_generation_prompt: bool = Field(True, description="vLLM: end the prompt with the template's assistant header")
    continue_final_message: bool = Field(False, description="vLLM: the reply continues the last (assistant) message; "
                                                            "needs add_generation_prompt false")
    chat_template: str | None = Field(None, description="vLLM: a Jinja chat template for this request instead of "
                                                         "the server's")
    chat_template_kwargs: dict | None = Field(None, description="vLLM: extra variables for the chat template")
    documents: list[dict[str, str]] | None = Field(None, description="vLLM: documents for a RAG chat template, which "
                                                                  "gets them as `documents`")
    include_reasoning: bool = Field(True, description="vLLM: with the server's --reasoning-parser, return the "
                                                      "thinking as reasoning_content (false: leave it out)")
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = Field(
        None, description="OpenAI: how much a reasoning model thinks; the chat template gets it as reasoning_effort "
                          "(gpt-oss's writes it into its system message)")
    prediction: dict | None = Field(
        None, description='OpenAI\'s Predicted Outputs: {"type": "content", "content": text or [{"type": "text", '
                          '"text": ...}]}, what the reply is expected to repeat; drafted from where it does '
                          "(lossless: the reply is the same with or without it)")
    n: int | None = Field(1, description="null means 1 (OpenAI's and vLLM's chat take it; completions do not)")

    @field_validator("n")
    @classmethod
    def _n(cls, n):
        return 1 if n is None else n


class BatchChatCompletionRequest(ChatCompletionRequest):
    """vLLM's /v1/chat/completions/batch: the chat fields, with `messages` a list of conversations;
    each runs as its own chat completion and the reply has one choice per conversation (index i).
    No streaming, tools, beam search or n > 1 (vLLM's limits)."""
    messages: list[Annotated[list[ChatMessage], Field(min_length=1)]] = Field(..., min_length=1)

    def single(self, messages: list[ChatMessage]) -> ChatCompletionRequest:
        """One conversation's request: every other field as sent."""
        return ChatCompletionRequest.model_construct(
            **{name: getattr(self, name) for name in ChatCompletionRequest.model_fields if name != "messages"},
            messages=messages)


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt, or messages through the chat template."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = Field(None, description="default: true for a prompt, false for messages "
                                                              "(the template writes them)")
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None
    tools: list[dict] | None = None
    documents: list[dict[str, str]] | None = Field(None, description="vLLM: documents for a RAG chat template, which "
                                                                  "gets them as `documents`")
    return_token_strs: bool = Field(False, description="also list each token's string")


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(_Body):
    """vLLM's /v1/load_lora_adapter body (load_inplace: replace the adapter of that name)."""
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(_Body):
    """vLLM's /v1/unload_lora_adapter body (lora_int_id is accepted and ignored, as there)."""
    lora_name: str = ""
    lora_int_id: int | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


