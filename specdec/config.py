"""Frozen, validated configuration: built once at the edge (Python API, CLI, server)."""

from __future__ import annotations

import copy
import enum
import json
import logging
import math
import os
from dataclasses import dataclass, field

class RequestOutputKind(enum.IntEnum):
    """vLLM's: what each RequestOutput of a streamed request (AsyncLLM.generate) carries. CUMULATIVE:
    each completion's text and tokens so far; DELTA: only what is new since the last one; FINAL_ONLY:
    one output, at the end. LLM.generate returns final outputs whatever it says."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


MAX_STOP_STRINGS = 16         # each is looked for in the new text at every token, on the engine thread
CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
GREEDY_EPS = 1e-5
REPETITION_PENALTY = (0.01, 100.0)   # the accepted range (vLLM's: any finite value > 0)
MIN_TEMPERATURE = 0.01      # vLLM's: a smaller positive temperature is raised to it (half-precision logits overflow)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's `structured_outputs` (its older guided_json / guided_regex / guided_choice /
    guided_grammar, OpenAI's response_format): exactly one constraint.

    json: a JSON schema (dict or its text); regex: the output matches it whole; choice: the
    output is one of these strings; grammar: a Lark grammar, or GBNF (llama.cpp's EBNF, told
    apart by `::=`); json_object: any JSON object (OpenAI's json_object mode); structural_tag:
    free text in which each trigger (e.g. "<function=") starts a tagged segment that must follow
    its structure's begin, JSON schema and end (vLLM's {"structures": [{"begin", "schema",
    "end"}], "triggers": [...]}, as a dict or its JSON text).

    vLLM's options for JSON (json, json_object; the other kinds ignore them, as vLLM does):
    disable_any_whitespace: None (specdec's default) or True: compact JSON, no free whitespace,
        so a small model cannot loop on blank lines; False: any whitespace between tokens
        (vLLM's default);
    whitespace_pattern: a regex for the whitespace allowed between JSON tokens (wins over both);
    disable_additional_properties: accepted, changes nothing: an object whose schema lists its
        properties and leaves additionalProperties unsaid takes no other keys in any case, as
        vLLM's default backend (xgrammar, strict mode) compiles it (vLLM's option is guidance's);
    disable_fallback: accepted; specdec has one backend (llguidance), so nothing falls back."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict | str | None = None
    disable_any_whitespace: bool | None = None
    whitespace_pattern: str | None = None
    disable_additional_properties: bool = False
    disable_fallback: bool = False

    def __post_init__(self):
        given = [k for k in CONSTRAINT_KINDS if getattr(self, k) not in (None, False)]
        _check(len(given) == 1, "structured_outputs", f"must set exactly one of {', '.join(CONSTRAINT_KINDS)}", given)
        _check(self.structural_tag is None or isinstance(self.structural_tag, (dict, str)),
               "structured_outputs.structural_tag", "must be an object or its JSON text", self.structural_tag)
        _check(self.json is None or isinstance(self.json, (dict, str)), "structured_outputs.json", "must be a JSON schema", self.json)
        _check(self.regex is None or isinstance(self.regex, str), "structured_outputs.regex", "must be a string", self.regex)
        _check(self.grammar is None or isinstance(self.grammar, str), "structured_outputs.grammar", "must be a string", self.grammar)
        if self.choice is not None:
            _check(isinstance(self.choice, (list, tuple)) and self.choice and all(isinstance(c, str) for c in self.choice),
                   "structured_outputs.choice", "must be a non-empty list of strings", self.choice)
            object.__setattr__(self, "choice", list(self.choice))
        for name in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
            value = getattr(self, name)
            _check(value is None or isinstance(value, bool), f"structured_outputs.{name}", "must be true or false", value)
        _check(self.whitespace_pattern is None or isinstance(self.whitespace_pattern, str),
               "structured_outputs.whitespace_pattern", "must be a regex string", self.whitespace_pattern)

    @property
    def kind(self) -> str:
        return next(k for k in CONSTRAINT_KINDS if getattr(self, k) not in (None, False))


@dataclass
class SamplingParams:
    """vLLM's sampling parameters. temperature 0 means greedy; top_k <= 0 and top_p 1 disable.
    Fields may be set after construction, as vLLM's own examples do (`sp.max_tokens = 20`): each
    assignment is validated; `clone()` copies. A request keeps a copy of the params it was given.

    Output text (vLLM's rules): a stop string ends the text and is left out of it, and so is the
    text of the stop token (EOS, stop_token_ids) that ended it, unless include_stop_str_in_output;
    stop strings are looked for only in the text after the first min_tokens tokens; at most 16
    (MAX_STOP_STRINGS: each is searched for at every token; vLLM has no limit, OpenAI allows 4).
    detokenize=False: token ids only, no text (no stop strings then).
    truncate_prompt_tokens: keep the prompt's last k tokens (-1: as many as the context holds; a
        text prompt keeps its BOS, as vLLM's tokenizer truncating from the left does).
    seed: None (or -1, vLLM's) draws fresh randomness; logprobs / prompt_logprobs True mean 1.
    allowed_token_ids: only these tokens are ever generated (a mask on p and q alike).
    spaces_between_special_tokens: taken; the tokenizer's own decoding is the text either way.
    extra_args: kept for plugins, unread (vLLM's).

    Controls that read the sequence (applied, in vLLM's order, before temperature and the
    filters; greedy decoding takes the argmax after them):
    structured_outputs: only tokens the grammar allows (EOS only where the output is complete);
    bad_words: a word's last token is banned where the output ends with the rest of it;
    min_tokens: EOS and stop_token_ids banned until this many tokens are out (EOS even with
        ignore_eos, as vLLM's);
    logit_bias: {token id: bias in [-100, 100]} added to the logits (OpenAI);
    repetition_penalty: a token seen in the prompt or the output has its logit divided by it
        when positive, multiplied when negative (HF/vLLM; 1 = off);
    frequency_penalty / presence_penalty: subtract penalty x (count in the output so far) /
        penalty x (seen in the output) (OpenAI; in [-2, 2], 0 = off).
    best_of: draw this many candidates, return the n of highest cumulative log-probability
        (vLLM's meaning; >= n).
    """
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None
    min_tokens: int = 0
    structured_outputs: StructuredOutputsParams | None = None
    best_of: int | None = None
    prompt_logprobs: int | None = None   # vLLM's: each prompt token's logprob and this many alternatives
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True
    allowed_token_ids: list[int] | None = None
    extra_args: dict | None = None
    guided_decoding: StructuredOutputsParams | None = None   # vLLM < 0.11's name of structured_outputs
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE   # AsyncLLM.generate's outputs (vLLM's)

    def __setattr__(self, name, value):
        """After construction an assignment is validated like the constructor's arguments (a bad
        value is refused and the old one kept)."""
        if not self.__dict__.get("_ready"):
            object.__setattr__(self, name, value)
            return
        if name == "guided_decoding" and value is not None:     # the alias: sets structured_outputs
            name = "structured_outputs"
        old = self.__dict__.get(name)
        object.__setattr__(self, name, value)
        try:
            self.__post_init__()
        except ValueError:
            object.__setattr__(self, name, old)
            raise

    @staticmethod
    def from_optional(**kwargs) -> "SamplingParams":
        """vLLM's: the constructor's keywords, None for n, temperature, top_p or a penalty meaning its
        default (what a request that leaves them unsaid sends); the others take None as the
        constructor does (max_tokens None: no limit)."""
        defaulted = ("n", "temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
        return SamplingParams(**{k: v for k, v in kwargs.items() if v is not None or k not in defaulted})

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM's). What was derived from the fields and kept on the object (the bad
        words' tokens, sampling.bad_words_of) is shared, not copied: the engine clones each
        request's params on its thread. So is a frozen structured_outputs (GrammarCompiler.freeze: a
        server's, which nobody changes), with its grammar text and prebuilt matchers: a large schema
        is not deep-copied once per choice there."""
        shared = [v for k, v in vars(self).items() if k.startswith("_") and k != "_ready"]
        if self.structured_outputs is not None and "_frozen" in self.structured_outputs.__dict__:
            shared.append(self.structured_outputs)
        return copy.deepcopy(self, {id(v): v for v in shared})

    def __post_init__(self):
        # no upper bound here (vLLM's); the server caps the choices of one HTTP request (serving.MAX_CHOICES)
        _check(_int(self.n) and self.n >= 1, "n", "must be an integer >= 1", self.n)
        _check(_real(self.temperature) and self.temperature >= 0, "temperature", "must be a finite number >= 0", self.temperature)
        if 0 < self.temperature < MIN_TEMPERATURE:     # vLLM's: raised, with a warning (it still samples)
            logging.getLogger("specdec").warning("temperature %s is below %s: raised to %s, as vLLM does",
                                                 self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        _check(_real(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _check(isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and (self.top_k >= 1 or self.top_k in (0, -1)),
               "top_k", "must be -1 or 0 (disabled) or a positive integer", self.top_k)
        _check(_real(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        if self.seed == -1 and not isinstance(self.seed, bool):    # vLLM's: no seed (what UIs send for "random")
            object.__setattr__(self, "seed", None)
        _check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)), "seed", "must be an integer", self.seed)
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool) and self.max_tokens >= 1),
               "max_tokens", "must be an integer >= 1", self.max_tokens)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        _check(all(isinstance(s, str) and s for s in stop), "stop", "must be non-empty strings", self.stop)
        _check(all(is_unicode_text(s) for s in stop), "stop", "must be valid Unicode text (no lone surrogates)", self.stop)
        _check(len(stop) <= MAX_STOP_STRINGS, "stop", f"must hold at most {MAX_STOP_STRINGS} strings "
               "(each is looked for in the text at every token)", len(stop))
        object.__setattr__(self, "stop", stop)
        ids = list(self.stop_token_ids or [])
        _check(all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids), "stop_token_ids", "must be token ids >= 0", ids)
        object.__setattr__(self, "stop_token_ids", ids)
        # the upper limit is the engine's max_logprobs (20 by default, vLLM's); -1: the whole vocabulary
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is True:        # vLLM's: True asks for the sampled token's alone
                object.__setattr__(self, name, 1)
            v = getattr(self, name)
            _check(v is None or (_int(v) and v >= -1), name, "must be an integer >= 0, or -1 (every token)", v)
        for name in ("include_stop_str_in_output", "spaces_between_special_tokens", "detokenize"):
            _check(isinstance(getattr(self, name), bool), name, "must be true or false", getattr(self, name))
        t = self.truncate_prompt_tokens
        _check(t is None or (_int(t) and (t >= 1 or t == -1)), "truncate_prompt_tokens", "must be an integer >= 1, or -1", t)
        _check(self.detokenize or not stop, "detokenize", "must be true when stop strings are given (they are text)",
               self.detokenize)
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            _check(isinstance(ids, (list, tuple)) and ids and all(_int(i) and i >= 0 for i in ids), "allowed_token_ids",
                   "must be a non-empty list of token ids >= 0", ids)
            object.__setattr__(self, "allowed_token_ids", list(ids))
        _check(self.extra_args is None or isinstance(self.extra_args, dict), "extra_args", "must be a dict", self.extra_args)
        kinds = [k.value for k in RequestOutputKind]
        _check(_int(self.output_kind) and self.output_kind in kinds, "output_kind",
               "must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)", self.output_kind)
        object.__setattr__(self, "output_kind", RequestOutputKind(self.output_kind))
        self._check_controls()
        object.__setattr__(self, "_ready", True)

    def _check_controls(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(_real(v) and -2 <= v <= 2, name, "must be in [-2, 2]", v)
        # vLLM takes any finite value > 0; beyond these bounds float32 logits overflow (x / 1e-40 is
        # inf, and a row of infinities samples nothing) while no useful penalty lies there
        _check(_real(self.repetition_penalty) and REPETITION_PENALTY[0] <= self.repetition_penalty <= REPETITION_PENALTY[1],
               "repetition_penalty", f"must be in [{REPETITION_PENALTY[0]}, {REPETITION_PENALTY[1]:g}]", self.repetition_penalty)
        bias = self.logit_bias or {}
        # no limit on the entries (vLLM's): they are distinct token ids the engine checks against the
        # vocabulary, applied by one tensor operation per step (sampling.Controls.bias)
        _check(isinstance(bias, dict), "logit_bias", "must map token ids to biases", type(bias).__name__)
        clean = {}
        for tok, b in bias.items():
            # OpenAI's JSON keys are strings of token ids
            ok = isinstance(tok, int) and not isinstance(tok, bool) or (isinstance(tok, str) and tok.isdigit())
            _check(ok and int(tok) >= 0, "logit_bias", "keys must be token ids >= 0", tok)
            # clamped to [-100, 100] as vLLM's server does (-1000 bans the token; a bias of 1e37 would
            # overflow the float32 logits)
            _check(isinstance(b, (int, float)) and not isinstance(b, bool) and not math.isnan(b), "logit_bias",
                   "values must be numbers", b)
            clean[int(tok)] = min(100.0, max(-100.0, float(b)))
        object.__setattr__(self, "logit_bias", clean or None)
        words = self.bad_words or []
        _check(isinstance(words, (list, tuple)) and all(isinstance(w, str) and w.strip() for w in words),
               "bad_words", "must be non-empty strings", self.bad_words)
        _check(all(is_unicode_text(w) for w in words), "bad_words", "must be valid Unicode text (no lone surrogates)", self.bad_words)
        object.__setattr__(self, "bad_words", list(words) or None)
        _check(isinstance(self.min_tokens, int) and not isinstance(self.min_tokens, bool) and self.min_tokens >= 0,
               "min_tokens", "must be an integer >= 0", self.min_tokens)
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               "must be <= max_tokens", self.min_tokens)
        if self.guided_decoding is not None:
            _check(self.structured_outputs is None or self.structured_outputs == self.guided_decoding, "guided_decoding",
                   "is structured_outputs' older name: set one of them", self.guided_decoding)
            object.__setattr__(self, "structured_outputs", self.guided_decoding)
            object.__setattr__(self, "guided_decoding", None)     # an alias: structured_outputs holds it
        so = self.structured_outputs
        if isinstance(so, dict):
            so = StructuredOutputsParams(**so)
            object.__setattr__(self, "structured_outputs", so)
        _check(so is None or isinstance(so, StructuredOutputsParams), "structured_outputs",
               "must be a StructuredOutputsParams", so)
        b = self.best_of
        _check(b is None or (_int(b) and b >= self.n), "best_of", f"must be an integer >= n (n = {self.n})", b)

    @property
    def penalties(self) -> bool:
        """Whether a penalty reads the sequence's token counts."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def reads_sequence(self) -> bool:
        """Whether processing depends on the tokens before each row (then every draft position
        is processed with the drafts before it counted as output)."""
        return self.penalties or bool(self.bad_words) or self.min_tokens > 0 or self.structured_outputs is not None

    @property
    def greedy(self) -> bool:
        # temperature 0 (a positive one below MIN_TEMPERATURE was raised to it)
        return self.temperature < GREEDY_EPS


def _real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_unicode_text(text: str) -> bool:
    """Whether text can be encoded (a lone surrogate, which JSON may spell, cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check(ok: bool, name: str, rule: str, value) -> None:
    if not ok:
        raise ValueError(f"{name} {rule}, got {value!r}")


STRUCTURED_BACKENDS = ("auto", "guidance", "xgrammar", "outlines", "lm-format-enforcer")
# vLLM's reasoning parsers specdec has (server/reasoning.py reads their replies)
REASONING_PARSERS = ("deepseek_r1", "qwen3", "openai_gptoss")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """vLLM's --structured-outputs-config (LLM(structured_outputs_config=...)): engine-wide
    defaults of structured outputs. backend: vLLM's names are taken, and every one runs on
    llguidance (vLLM's "guidance"), specdec's only backend. disable_any_whitespace /
    disable_additional_properties: what a request that leaves them unsaid gets (None: compact
    JSON, specdec's default; False: any whitespace, vLLM's). disable_fallback: nothing falls back.
    reasoning_parser: the model's reasoning format (vLLM's --reasoning-parser lives here too; "":
    none). enable_in_reasoning: False (vLLM's default) leaves a reasoning model's think block free
    and constrains only what follows its end marker (`</think>`; structured.ReasoningGrammar);
    True constrains the reply from its first token, as without a reasoning parser."""
    backend: str = "auto"
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool = False
    disable_fallback: bool = False
    reasoning_parser: str = ""
    enable_in_reasoning: bool = False

    def __post_init__(self):
        _check(self.backend in STRUCTURED_BACKENDS, "structured_outputs_config.backend",
               f"must be one of {', '.join(STRUCTURED_BACKENDS)}", self.backend)
        if self.reasoning_parser is None:
            object.__setattr__(self, "reasoning_parser", "")
        _check(self.reasoning_parser in ("", *REASONING_PARSERS), "structured_outputs_config.reasoning_parser",
               f"must be one of {', '.join(REASONING_PARSERS)} (or empty: none)", self.reasoning_parser)
        for name in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback", "enable_in_reasoning"):
            value = getattr(self, name)
            _check(isinstance(value, bool) or (value is None and name == "disable_any_whitespace"),
                   f"structured_outputs_config.{name}", "must be true or false", value)

    @classmethod
    def of(cls, value) -> "StructuredOutputsConfig":
        """From None, an instance or a dict (unknown keys are a ValueError naming them)."""
        if value is None or isinstance(value, cls):
            return value or cls()
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs_config must be a dict, got {value!r}")
        unknown = sorted(set(value) - {f for f in cls.__dataclass_fields__})
        if unknown:
            raise ValueError(f"structured_outputs_config takes {', '.join(cls.__dataclass_fields__)}; got "
                             f"{', '.join(unknown)}")
        return cls(**value)


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters served beside the base model (vLLM's --enable-lora and its limits).

    max_loras: adapters a single step may run at once (each holds a slot of weights beside
        the model's matrices); requests for further adapters wait until a slot frees.
    max_lora_rank: the largest rank an adapter may have (slots are sized by it).
    max_cpu_loras: adapters kept loaded in memory once no request uses them (default: max_loras).
    lora_dtype: the slots' dtype: "auto" (bfloat16 when the model's matrices are quantized or
        bf16, as vLLM's follows the model's dtype; float32 for an fp32 model), "float16" (vLLM's;
        float32 on the CPU), "bfloat16" or "float32". Decoding reads the slots' bytes with the weights'.
    """
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"

    def __post_init__(self):
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            _check(isinstance(v, int) and not isinstance(v, bool) and v >= 1, name, "must be an integer >= 1", v)
        v = self.max_cpu_loras
        _check(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= self.max_loras),
               "max_cpu_loras", f"must be an integer >= max_loras ({self.max_loras})", v)
        _check(self.lora_dtype in ("auto", "float16", "bfloat16", "float32"), "lora_dtype",
               "must be one of auto, float16, bfloat16, float32", self.lora_dtype)


@dataclass(frozen=True)
class SchedulerConfig:
    """How many requests run at once and what they may use (vLLM's engine arguments).

    max_num_seqs: requests decoded together; the rest wait (FIFO).
    max_num_batched_tokens: tokens one step may feed the target (decoding tokens and drafts
        first, then prompt chunks): long prompts are prefilled in chunks so that running
        streams keep flowing.
    kv_cache_memory: bytes for the KV pool (target + draft caches); None = enough for
        max_num_seqs sequences of max_model_len, capped at DEFAULT_KV_CAP bytes.
    gpu_memory_utilization: on CUDA, the fraction of the GPU's memory the process may use
        (weights included), vLLM's meaning; the KV pool gets what is left of it.
    block_size: slots per KV block.
    enable_prefix_caching: a prompt's leading full blocks are taken from earlier requests' caches
        when they hold the same tokens (model/kv.py), with any speculative method.
    scheduling_policy: "fcfs" (waiting requests join in arrival order; the newest running one is
        preempted) or "priority" (vLLM's: by each request's priority, lower first, then arrival;
        the least urgent running one is preempted).
    """
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float | None = None
    block_size: int = 16
    enable_prefix_caching: bool = False
    scheduling_policy: str = "fcfs"
    num_gpu_blocks_override: int | None = None   # vLLM's: the pool's blocks, whatever the budget says

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            v = getattr(self, name)
            _check(isinstance(v, int) and not isinstance(v, bool) and v >= 1, name, "must be an integer >= 1", v)
        # vLLM's rule: every running sequence gets at least one token each step
        _check(self.max_num_batched_tokens >= self.max_num_seqs, "max_num_batched_tokens",
               f"must be greater than or equal to max_num_seqs ({self.max_num_seqs})", self.max_num_batched_tokens)
        v = self.kv_cache_memory
        _check(v is None or (isinstance(v, int) and not isinstance(v, bool) and v > 0), "kv_cache_memory",
               "must be a number of bytes > 0", v)
        _check(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching", "must be true or false",
               self.enable_prefix_caching)
        u = self.gpu_memory_utilization
        _check(u is None or (_real(u) and 0 < u <= 1), "gpu_memory_utilization", "must be in (0, 1]", u)
        b = self.num_gpu_blocks_override
        _check(b is None or (isinstance(b, int) and not isinstance(b, bool) and b >= 1), "num_gpu_blocks_override",
               "must be an integer >= 1", b)
        _check(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy",
               f"must be one of {', '.join(SCHEDULING_POLICIES)}", self.scheduling_policy)


DEFAULT_KV_CAP = 1 << 30
SCHEDULING_POLICIES = ("fcfs", "priority")


def parse_bytes(value) -> int:
    """A byte count: an integer, or a string with a suffix k/m/g (powers of 1000) or K/M/G, KiB,
    MiB, GiB (powers of 1024), as vLLM reads --kv-cache-memory."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip()
    units = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30,
             "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    for suffix in sorted(units, key=len, reverse=True):
        if text.endswith(suffix) and text[:-len(suffix)].strip():
            try:
                return int(float(text[:-len(suffix)]) * units[suffix])
            except ValueError:
                break
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"kv_cache_memory must be a number of bytes (e.g. 536870912, 512M, 2G), got {value!r}") from None


# the MTP layers a target ships (model/mtp.py): vLLM's "mtp" and its older per-family names, and
# prompt lookup with the MTP layer behind it; `model` defaults to the target's own checkpoint
MTP_METHODS = ("mtp", "deepseek_mtp", "mimo_mtp", "glm4_moe_mtp", "ngram+mtp")
METHODS = ("draft_model", "ngram", "suffix", "layer_skip", "medusa", "eagle", "eagle3", "mlp_speculator", *MTP_METHODS,
           "ngram+eagle", "ngram+draft_model")
# what each method's `model` is, for the methods that need one (hybrids: their learned drafter's)
MODEL_KIND = {"draft_model": "a draft model folder", "ngram+draft_model": "a draft model folder",
              "medusa": "a heads folder (specdec train medusa)", "eagle": "a heads folder (specdec train eagle)",
              "ngram+eagle": "a heads folder (specdec train eagle)",
              "mlp_speculator": "an MLP speculator folder (IBM's accelerators: model_type 'mlp_speculator')"}


# specdec's own folders (`specdec train ...`) by their config.json architectures
OWN_FOLDER_METHODS = {"SpecdecEagleHead": "eagle", "SpecdecMedusaHeads": "medusa", "SpecdecSuffixDatastore": "suffix"}


def _architectures(model) -> list:
    try:
        with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError, TypeError):
        return []
    archs = cfg.get("architectures") if isinstance(cfg, dict) else None
    return archs if isinstance(archs, list) else []


def _method_of(model) -> str:
    """The method a draft folder implies when none is named (vLLM reads its config the same
    way): specdec's own heads or datastore folder's, an MLP speculator's, released Medusa heads',
    an EAGLE-3 head's or the EAGLE authors' head's, else a draft model."""
    from .model.eagle3 import is_eagle3
    from .model.heads import is_eagle_authors, is_released_medusa
    from .model.mlp_speculator import is_mlp_speculator
    own = [OWN_FOLDER_METHODS[a] for a in _architectures(model) if a in OWN_FOLDER_METHODS]
    if own:
        return own[0]
    if is_mlp_speculator(model):
        return "mlp_speculator"
    if is_released_medusa(model):
        return "medusa"
    if is_eagle3(model):
        return "eagle3"
    from .model.mtp import is_speculators_mtp
    if is_speculators_mtp(model):
        return "mtp"
    return "eagle" if is_eagle_authors(model) else "draft_model"


def _n_predict(model) -> int:
    import json
    from pathlib import Path
    try:
        return int(json.loads((Path(model) / "config.json").read_text()).get("n_predict", 3))
    except (OSError, ValueError, TypeError):
        return 3


NGRAM_MODELS = ("[ngram]", "ngram")     # vLLM's `model` values that mean prompt lookup
DEFAULT_K = 4                            # num_speculative_tokens left out (vLLM requires it for most methods)
DEFAULT_LOOKUP_MAX = 4                   # suffix's and the hybrids' prompt_lookup_max when not given
OPTIONAL_FIELDS = ("model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "num_layers", "max_k",
                   "disable_by_batch_size")


def _flag(v) -> bool:
    return v is None or isinstance(v, bool)


def _text(v) -> bool:
    return v is None or isinstance(v, str)


def _only(*values):
    return lambda v: any(v is x or (type(v) is type(x) and v == x) for x in values)


# vLLM's SpeculativeConfig fields (0.6 .. current) beside the ones specdec reads: key -> (the values
# taken, what else is wrong with a value). A value taken changes nothing here: vLLM's default, or a
# setting of its engine's internals (eager mode, logging, kernels) with no meaning in specdec; any
# other is a one-line error naming the key, as it would change what runs in a way specdec cannot.
_FLAG, _TEXT = "must be true, false or null", "must be a string or null"
VLLM_SPEC_KEYS: dict[str, tuple] = {
    **{k: (_flag, _FLAG) for k in ("enforce_eager", "disable_log_stats", "disable_logprobs", "disable_mqa_scorer",
                                   "enable_chunked_prefill", "disable_padded_drafter_batch",
                                   "disable_eagle_block_drop", "use_local_argmax_reduction")},
    **{k: (_text, _TEXT) for k in ("revision", "code_revision", "quantization", "attention_backend", "moe_backend")},
    # filled in by vLLM's engine, never by a user: taken as vLLM takes them
    **{k: (lambda v: True, "") for k in ("target_model_config", "target_parallel_config", "draft_model_config",
                                         "draft_parallel_config")},
    # the exception to "changes nothing": a drafter model's context, lowered to it (proposers._draft_context)
    "max_model_len": (lambda v: v is None or (_int(v) and v >= 1), "must be an integer >= 1 or null"),
    "kv_cache_dtype": (_only(None, "auto"), "not supported: the draft's KV cache follows the target's "
                                            "(set LLM's kv_cache_dtype / --kv-cache-dtype)"),
    "draft_tensor_parallel_size": (_only(None, 1), "specdec runs the drafter unsharded (1)"),
    "tensor_parallel_size": (_only(None), "not a valid argument in the speculative_config: pass "
                                          "draft_tensor_parallel_size instead (vLLM's rule)"),
    "speculative_token_tree": (_only(None), "not supported: specdec grows EAGLE-2 dynamic trees (set topk and "
                                            "num_speculative_tokens, the number of nodes)"),
    "rejection_sample_method": (_only("standard"), "not supported: specdec verifies by standard rejection sampling "
                                                   "('standard', vLLM's default)"),
    **{k: (_only(None), "not supported: only with rejection_sample_method 'synthetic', which specdec does not run")
       for k in ("synthetic_acceptance_rates", "synthetic_acceptance_length")},
    # specdec's learned drafters draw from q when sampling (vLLM's 'probabilistic'); lossless either way
    "draft_sample_method": (_only("greedy", "probabilistic"), "must be 'greedy' or 'probabilistic'"),
    "parallel_drafting": (_only(None, False), "not supported: specdec drafts one token after another"),
    "use_heterogeneous_vocab": (_only(None, False), "not supported: a draft shares the target's vocabulary"),
    "num_speculative_tokens_per_batch_size": (_only(None), "not supported: specdec sets K by batch size with "
                                                           "disable_by_batch_size, or per step with "
                                                           "num_speculative_tokens \"auto\""),
    "index_share_for_mtp_iteration": (_only(None), "not supported: specdec's MTP layers have no sparse-attention "
                                                   "indices to share"),
    "enable_adaptive_verification": (_only(None, False), "not supported: vLLM's dspark method only"),
    "dspark_draft_topk": (_only(None), "not supported: vLLM's dspark method only"),
    "draft_load_config": (_only(None), "not supported: specdec loads the draft as it loads the target"),
}


def check_vllm_key(key: str, value) -> None:
    """One line naming the key where a vLLM speculative_config value is not one specdec takes."""
    ok, why = VLLM_SPEC_KEYS[key]
    if ok(value):
        return
    if why.startswith("not supported: "):
        raise ValueError(f"speculative_config.{key} is not supported (got {value!r}): {why[15:]}")
    raise ValueError(f"speculative_config.{key}={value!r}: {why}")


@dataclass(frozen=True, init=False)
class SpeculativeConfig:
    """vLLM's `speculative_config`. num_speculative_tokens: an int, or "auto" (adaptive K); left
    out, 4 (an MLP speculator's n_predict). method left out: read from `model`'s folder, as vLLM
    does; neither given is vLLM's error. vLLM's other field names (enforce_eager=...,
    suffix_decoding_min_token_prob=..., topk=...) are taken as keywords too and kept in `extra`,
    as from_dict keeps a dict's."""
    method: str | None = None
    model: str | None = None
    num_speculative_tokens: int | str | None = None
    # None: not given. method "ngram" follows vLLM (neither given: both 5; one given: the other
    # copies it); specdec's own lookup methods (suffix, the hybrids) keep min 1 / max 4
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    num_layers: int | None = None        # layer_skip: exit after this many layers
    max_k: int | None = None             # upper bound for "auto": K (default 8), tree size (32)
    disable_by_batch_size: int | None = None   # vLLM's: from this many running requests on, nobody drafts
    extra: dict = field(default_factory=dict)
    # the keys the user gave (from_dict's; else the fields not left at None, and `extra`'s): what
    # the unread-key warnings and the chain depth's default read; kept by dataclasses.replace
    given: frozenset | None = field(default=None, compare=False, repr=False)

    def __init__(self, method=None, model=None, num_speculative_tokens=None, prompt_lookup_max=None,
                 prompt_lookup_min=None, num_layers=None, max_k=None, disable_by_batch_size=None, extra=None,
                 given=None, **keys):
        if keys:
            from .proposers import READ_KEYS    # the keys specdec's methods read (suffix_*, topk, ...)
            bad = sorted(set(keys) - set(VLLM_SPEC_KEYS) - READ_KEYS)
            if bad:
                raise TypeError(f"SpeculativeConfig() got an unexpected keyword argument {bad[0]!r}")
        values = dict(method=method, model=model, num_speculative_tokens=num_speculative_tokens,
                      prompt_lookup_max=prompt_lookup_max, prompt_lookup_min=prompt_lookup_min, num_layers=num_layers,
                      max_k=max_k, disable_by_batch_size=disable_by_batch_size, extra={**(extra or {}), **keys},
                      given=given)
        for name, value in values.items():
            object.__setattr__(self, name, value)
        self.__post_init__()

    def __post_init__(self):
        if isinstance(self.model, os.PathLike):
            object.__setattr__(self, "model", os.fspath(self.model))
        _check(self.model is None or isinstance(self.model, str), "speculative_config.model",
               "must be a path (a string)", self.model)
        _check(self.method is None or isinstance(self.method, str), "speculative_config.method", "must be a string",
               self.method)
        if self.given is None:
            raw = {f for f in OPTIONAL_FIELDS if getattr(self, f) is not None}
            object.__setattr__(self, "given", frozenset(raw | set(self.extra)))
        self._infer_method()
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, got {self.method!r}")
        for key, value in self.extra.items():
            if key in VLLM_SPEC_KEYS:
                check_vllm_key(key, value)
        k = self.num_speculative_tokens
        ok = k == "auto" or (isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= 64)
        _check(ok, "num_speculative_tokens", 'must be an integer in [0, 64] or "auto"', k)
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, v in (("prompt_lookup_max", hi), ("prompt_lookup_min", lo)):
            _check(v is None or (_int(v) and 1 <= v <= 64), f"speculative_config.{name}",
                   "must be an integer in [1, 64]", v)
        if self.method == "ngram":          # vLLM's SpeculativeConfig: 5 and 5, or the one given twice
            lo, hi = (5, 5) if lo is None and hi is None else (lo or hi, hi or lo)
        else:                               # specdec's own lookup methods: their defaults as measured
            lo = 1 if lo is None else lo
            hi = max(DEFAULT_LOOKUP_MAX, lo) if hi is None else hi
        _check(lo <= hi, "speculative_config.prompt_lookup_max", f"must be >= prompt_lookup_min ({lo})", hi)
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        _check(self.num_layers is None or (_int(self.num_layers) and self.num_layers >= 1),
               "speculative_config.num_layers", "must be an integer >= 1", self.num_layers)
        if self.max_k is None:
            object.__setattr__(self, "max_k", 32 if self.method in ("medusa", "eagle") else 8)
        _check(isinstance(self.max_k, int) and not isinstance(self.max_k, bool) and 1 <= self.max_k <= 64,
               "max_k", "must be an integer in [1, 64]", self.max_k)
        d = self.disable_by_batch_size
        # vLLM's: >= 2 (from one running request on nobody would ever draft)
        _check(d is None or (isinstance(d, int) and not isinstance(d, bool) and d >= 2),
               "disable_by_batch_size", "must be an integer >= 2", d)
        if self.method in MODEL_KIND and not self.model:
            raise ValueError(f"speculative_config.model is required for method {self.method!r}: {MODEL_KIND[self.method]}")

    def _infer_method(self) -> None:
        """vLLM's rules: {"model": "[ngram]"} is prompt lookup; without a method, the draft folder's
        config says which it is; with neither, vLLM's error (no silent default method)."""
        method, model, k = self.method, self.model, self.num_speculative_tokens
        if model in NGRAM_MODELS and method in (None, *NGRAM_MODELS):
            model, method = None, "ngram"
            object.__setattr__(self, "given", self.given - {"model"})
        if method == "[ngram]":
            method = "ngram"
        if method is None and not model:
            if k is not None:
                raise ValueError("speculative_config: num_speculative_tokens was provided but without speculative "
                                 "model: set \"method\" (e.g. \"ngram\") or \"model\" (a draft folder)")
            raise ValueError("speculative_config names no method and no model: set \"method\" (e.g. \"ngram\") "
                             "or \"model\" (a draft folder)")
        if method is None:
            method = _method_of(model)
        if k is None:               # vLLM's mlp_speculator default: all its stages
            k = _n_predict(model) if method == "mlp_speculator" and model else DEFAULT_K
        for name, value in (("method", method), ("model", model), ("num_speculative_tokens", k)):
            object.__setattr__(self, name, value)

    @property
    def adaptive(self) -> bool:
        return self.num_speculative_tokens == "auto"

    @classmethod
    def from_dict(cls, d: dict) -> "SpeculativeConfig":
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be an object, got {type(d).__name__}")
        known = set(cls.__dataclass_fields__) - {"extra", "given"}
        given = frozenset(k for k, v in d.items() if v is not None and k != "method")
        fields = {k: v for k, v in d.items() if k in known}
        return cls(**fields, extra={k: v for k, v in d.items() if k not in known}, given=given)


# vLLM's compilation_config keys about torch.compile / Inductor, which specdec does not run: taken, no effect
COMPILATION_IGNORED_KEYS = {"level", "mode", "backend", "custom_ops", "splitting_ops", "use_inductor", "compile_sizes",
                            "inductor_compile_config", "inductor_passes", "cudagraph_num_of_warmups",
                            "cudagraph_copy_inputs", "pass_config", "debug_dump_path", "cache_dir",
                            "use_inductor_graph_partition", "compile_mm_encoder", "cudagraph_specialize_lora",
                            "local_cache_dir", "fast_moe_cold_start", "dynamic_shapes_config"}
CUDAGRAPH_MODES = {"NONE": False, "FULL_DECODE_ONLY": True, "FULL": True, "FULL_AND_PIECEWISE": True, "PIECEWISE": True}


def cuda_graph_sizes(compilation_config: dict | int | str | None, enforce_eager: bool, max_num_seqs: int) -> tuple[int, ...] | None:
    """The batch sizes to capture CUDA graphs at (model/graphs.py), or None: eager forwards.

    vLLM's `compilation_config`: cudagraph_mode ("NONE", or "FULL_DECODE_ONLY": graphs of the
    decoding forwards; "FULL", "FULL_AND_PIECEWISE" and "PIECEWISE" run as FULL_DECODE_ONLY, the
    only graphs specdec captures), cudagraph_capture_sizes, max_cudagraph_capture_size; an
    optimisation level (an int, `-O3`) and the torch.compile keys are taken with no effect.
    specdec's default is "NONE" (vLLM's captures): its graphs are not yet measured on a GPU.
    enforce_eager (vLLM's) turns them off whatever the config says."""
    if isinstance(compilation_config, str):
        text = compilation_config.strip()
        compilation_config = int(text) if text.isdigit() else json.loads(text)
    if compilation_config is None or isinstance(compilation_config, int):
        return None
    if not isinstance(compilation_config, dict):
        raise ValueError(f"compilation_config must be a dict, a JSON object or an optimisation level, got {compilation_config!r}")
    known = {"cudagraph_mode", "cudagraph_capture_sizes", "max_cudagraph_capture_size", "cuda_graph_sizes"}
    unknown = sorted(set(compilation_config) - known - COMPILATION_IGNORED_KEYS)
    if unknown:
        raise ValueError(f"compilation_config: unknown key(s) {', '.join(unknown)}; specdec reads {', '.join(sorted(known))}")
    mode = str(compilation_config.get("cudagraph_mode", "NONE")).upper().removeprefix("CUDAGRAPHMODE.")
    if mode not in CUDAGRAPH_MODES:
        raise ValueError(f"compilation_config: cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}, got {mode!r}")
    if enforce_eager or not CUDAGRAPH_MODES[mode]:
        return None
    from .model.graphs import BATCH_SIZES

    sizes = compilation_config.get("cudagraph_capture_sizes") or compilation_config.get("cuda_graph_sizes")
    if sizes is not None and not (isinstance(sizes, list) and sizes and all(isinstance(s, int) and s > 0 for s in sizes)):
        raise ValueError(f"compilation_config: cudagraph_capture_sizes must be a list of positive integers, got {sizes!r}")
    top = compilation_config.get("max_cudagraph_capture_size")
    if top is not None and not (isinstance(top, int) and top > 0):
        raise ValueError(f"compilation_config: max_cudagraph_capture_size must be a positive integer, got {top!r}")
    sizes = sorted(set(sizes or BATCH_SIZES))
    cover = next((s for s in sizes if s >= max_num_seqs), sizes[-1])     # a full batch fits a graph
    top = min(top, cover) if top else cover
    return tuple(s for s in sizes if s <= top) or (sizes[0],)
