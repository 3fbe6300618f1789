"""The tokenizer and chat template of a model: a Hugging Face folder or a GGUF file.

A folder: tokenizer.json, tokenizer_config.json (special tokens), the chat templates of
chat_template.jinja and additional_chat_templates/, else chat_template.json's or
tokenizer_config.json's, and the end-of-sequence ids of config.json and generation_config.json.
A .gguf (or a folder holding one): everything from its metadata (gguf_tokenizer.py).

`LLM.get_tokenizer()` hands this class to users where vLLM hands them a transformers tokenizer,
so it also answers the calls commonly made on one (`len(tok)`, `tok(texts)`, `encode`, `decode`,
`batch_decode`, `convert_ids_to_tokens`, `get_vocab`, `pad`, `apply_chat_template`, settable
special tokens, vLLM's TokenizerLike members), with the same arguments, defaults and results as
transformers 5 on the same folder or .gguf: `apply_chat_template` tokenizes and adds no
generation prompt unless asked (specdec's own callers pass tokenize=False,
add_generation_prompt=True for a prompt's text), `decode` keeps special tokens, `vocab_size` is
the model's vocabulary without the added tokens (len() counts them), tokenizer_config.json's
`add_bos_token` is ignored (the tokenizer.json's post-processor decides), `chat_template` is a
dict by name where a folder has several templates (`chat_template="<name>"` picks one), and
`return_overflowing_tokens` gives a row per window of a truncated text.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path

import jinja2
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

# chat templates render in Jinja's immutable sandbox, bounded; a request's own template in a child
# process with a memory and a time limit (jinja_sandbox.py)
from .jinja_sandbox import (TemplateProcessBusy, TemplateProcessError, compiled, failure, isolated_renderer,
                            literal_text, render)
from .model.config import text_config


# Texts at least this long are tokenized through the backend's encode_batch, which releases the
# GIL (its encode holds it for the whole text: a server's event loop and every other Python thread
# stop while a 1 MB prompt is tokenized, even on a worker thread); the ids are the same.
LONG_TEXT = 8192
# the post-processor transformers gives a tokenizer.json that has none: a pair's second text type id 1
PLAIN = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1")
SECOND_TEXT = processors.TemplateProcessing(single="$A:1", pair="$A:1 $B:1")


def _check_unicode(text) -> None:
    """A ValueError for text the tokenizer cannot take because it is not Unicode text: a lone
    surrogate, as Python gives undecodable bytes of argv, stdin or a file read with
    errors="surrogateescape" (the binding says only `TypeError: TextInputSequence must be str`)."""
    if not isinstance(text, str):
        return
    for i, ch in enumerate(text):
        if 0xD800 <= ord(ch) <= 0xDFFF:
            raise ValueError(f"the text is not valid Unicode: a lone surrogate at character {i} "
                             f"(bytes that are not UTF-8?): {text[max(0, i - 20):i + 1]!r}") from None


class TokenizerError(ValueError):
    pass


class ChatTemplateError(TokenizerError, jinja2.TemplateError):
    """A chat template that failed as Jinja (its raise_exception(...) among them): a ValueError,
    and the jinja2.TemplateError transformers raises."""


def _tool_schema(fn) -> dict:
    """A Python function given as a tool -> its JSON schema, by transformers' get_json_schema
    (its type hints and Google-style docstring)."""
    try:
        from transformers.utils import get_json_schema
    except ImportError:
        raise TokenizerError("a Python function as a tool needs transformers (its get_json_schema): "
                             "pass the tool's JSON schema instead") from None
    return get_json_schema(fn)


class TokenizerBusy(TokenizerError):
    """A request's own chat template cannot be rendered now (the child process is taken): a 429."""


def _token_content(tok) -> str | None:
    if tok is None:
        return None
    return tok["content"] if isinstance(tok, dict) else str(tok)


class BatchEncoding(dict):
    """What `Tokenizer(...)(text)` returns, as transformers' BatchEncoding: a dict of input_ids
    and attention_mask whose keys also read as attributes (`enc.input_ids`); from `tok(...)`, also
    each row's tokens, word and sequence ids and character offsets (`enc.tokens()`, `word_ids()`,
    `sequence_ids()`, `char_to_token()`, `n_sequences`)."""

    def __init__(self, data=None, rows=None, n_sequences=None, **kw):
        super().__init__(data or {}, **kw)
        self.__dict__["_rows"], self.__dict__["_n_sequences"] = rows, n_sequences

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __reduce__(self):
        return BatchEncoding, (dict(self), self.__dict__.get("_rows"), self.__dict__.get("_n_sequences"))

    @property
    def data(self) -> dict:
        return dict(self)

    @property
    def n_sequences(self) -> int | None:
        return self.__dict__.get("_n_sequences")

    @property
    def is_fast(self) -> bool:
        return self.__dict__.get("_rows") is not None

    def _row(self, batch_index: int = 0) -> _Row:
        rows = self.__dict__.get("_rows")
        if rows is None:
            raise ValueError("this BatchEncoding was not made by the tokenizer's __call__: it has no token information")
        return rows[batch_index]

    def tokens(self, batch_index: int = 0) -> list[str]:
        return list(self._row(batch_index).tokens)

    def word_ids(self, batch_index: int = 0) -> list[int | None]:
        return list(self._row(batch_index).words)

    def words(self, batch_index: int = 0) -> list[int | None]:
        return self.word_ids(batch_index)

    def sequence_ids(self, batch_index: int = 0) -> list[int | None]:
        return list(self._row(batch_index).sequences)

    def token_to_chars(self, batch_or_token_index: int, token_index: int | None = None):
        batch, token = (0, batch_or_token_index) if token_index is None else (batch_or_token_index, token_index)
        row = self._row(batch)
        return None if row.sequences[token] is None else tuple(row.offsets[token])

    def char_to_token(self, batch_or_char_index: int, char_index: int | None = None, sequence_index: int = 0):
        """The index of the token holding a character of the text (sequence_index 1: of the pair's
        second text), None when no token does."""
        batch, char = (0, batch_or_char_index) if char_index is None else (batch_or_char_index, char_index)
        row = self._row(batch)
        return next((i for i, (seq, (a, b)) in enumerate(zip(row.sequences, row.offsets))
                     if seq == sequence_index and a <= char < b), None)

    def to(self, device) -> BatchEncoding:
        return BatchEncoding({k: v.to(device) if hasattr(v, "to") else v for k, v in self.items()},
                             self.__dict__.get("_rows"), self.__dict__.get("_n_sequences"))


class _Row:
    """One encoded text (or pair) as transformers' fast tokenizers keep it: its tokenizers.Encoding,
    and the tokens specdec puts around it (BOS, padding). A column (ids, tokens, offsets, word and
    sequence ids, ...) becomes a Python list only when read: `tok(texts)` pays for the ids and the
    attention mask, not for eight lists of every token (1.7x slower, 7x the memory)."""

    __slots__ = ("enc", "pair", "puts", "columns")
    # a column -> the Encoding's attribute
    COLUMNS = {"ids": "ids", "type_ids": "type_ids", "special": "special_tokens_mask", "offsets": "offsets",
               "tokens": "tokens", "words": "word_ids", "sequences": "sequence_ids", "attention": "attention_mask"}

    def __init__(self, enc, pair: bool = False):
        self.enc, self.pair, self.puts, self.columns = enc, pair, (), None

    def __len__(self) -> int:
        return len(self.enc) + sum(n for _, n, _ in self.puts)

    def __getattr__(self, name):
        attr = _Row.COLUMNS.get(name)
        if attr is None:
            raise AttributeError(name)
        columns = self.columns if self.columns is not None else {}
        if name not in columns:
            column = list(getattr(self.enc, attr))
            if name == "sequences" and self.pair:   # post_process of a pair leaves the first text's tokens unmarked
                start = next((k for k, seq in enumerate(column) if seq == 1), len(column))
                column[:start] = [None if w is None else 0 for w in self.enc.word_ids[:start]]
            for at, n, values in self.puts:
                column[at:at] = [values[name]] * n
            columns[name] = column
            self.columns = columns
        return columns[name]

    def put(self, at: int, n: int, token_id: int, token: str | None, type_id: int = 0, real: int = 1) -> None:
        """n copies of a special token with no text at index `at` (BOS; padding, real=0)."""
        values = {"ids": token_id, "type_ids": type_id, "special": 1, "offsets": (0, 0), "tokens": token,
                  "words": None, "sequences": None, "attention": real}
        for name, column in (self.columns or {}).items():     # the columns already read
            column[at:at] = [values[name]] * n
        self.puts = (*self.puts, (at, n, values))

    def windows(self) -> list[_Row]:
        """The rows of the text's overflowing tokens (truncation with return_overflowing_tokens)."""
        return [_Row(e, self.pair) for e in self.enc.overflowing]


# transformers' named special tokens, in its order (all_special_tokens, special_tokens_map)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# transformers' model_max_length where the tokenizer sets none (no truncation to it, no padding to it)
VERY_LARGE_INTEGER = int(1e30)
LARGE_INTEGER = int(1e20)
PADDING = (True, False, None, "longest", "max_length", "do_not_pad")
TRUNCATION = (True, False, None, "longest_first", "only_first", "only_second", "do_not_truncate")


class _SpecialToken:
    """A named special token (`tok.pad_token`) or, with `id=True`, its id (`tok.pad_token_id`), as
    transformers keeps them: setting either sets both, so `tok.pad_token = tok.eos_token` gives
    pad_token_id the eos id."""

    def __init__(self, id: bool = False):
        self.id = id

    def __set_name__(self, owner, name):
        self.name = name.removesuffix("_id")

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        return obj.__dict__.get("_special_ids" if self.id else "_special", {}).get(self.name)

    def __set__(self, obj, value):
        tokens, ids = obj.__dict__.setdefault("_special", {}), obj.__dict__.setdefault("_special_ids", {})
        if self.id:
            ids[self.name] = None if value is None else int(value)
            tokens[self.name] = None if value is None else obj.backend.id_to_token(int(value))
        else:
            tokens[self.name] = _token_content(value)
            ids[self.name] = None if value is None else obj.convert_tokens_to_ids(tokens[self.name])


def _as_list(ids):
    """Token ids given as a list, a tuple, an int, a tensor or an array -> a list (nested for a batch)."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return ids if isinstance(ids, list) else [ids] if isinstance(ids, int) else list(ids)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _ids(value) -> list[int]:
    """An eos_token_id field: an int, a list of ints, or absent."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    return [i for i in (value or []) if isinstance(i, int) and not isinstance(i, bool)]


def named_templates(value) -> dict[str, str]:
    """tokenizer_config.json's list of {name, template} -> {name: template}."""
    if not isinstance(value, list):
        return {}
    return {t.get("name"): t.get("template") for t in value if isinstance(t, dict) and isinstance(t.get("template"), str)}


def folder_chat_template(folder: Path, cfg: dict) -> str | dict[str, str] | None:
    """The folder's chat template as transformers 5 reads it: chat_template.jinja (the default one)
    and additional_chat_templates/<name>.jinja, which win over tokenizer_config.json's (a string or
    a list of {name, template}); several templates as a dict by name, the default under "default"
    (transformers' `tok.chat_template`). A processor's chat_template.json where neither has one."""
    files = {}
    if (folder / "chat_template.jinja").is_file():
        files["default"] = (folder / "chat_template.jinja").read_text()
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        files.update({f.stem: f.read_text() for f in sorted(extra.glob("*.jinja"))})
    value = files or _read_json(folder / "chat_template.json").get("chat_template") or cfg.get("chat_template")
    if isinstance(value, list):
        value = named_templates(value)
    if isinstance(value, dict):
        return value["default"] if list(value) == ["default"] else value or None
    return value if isinstance(value, str) else None


class Tokenizer:
    """`Tokenizer(path)`: a Hugging Face folder, a .gguf file, or a folder holding one .gguf."""

    bos_token, eos_token, unk_token, sep_token, pad_token, cls_token, mask_token = (_SpecialToken() for _ in range(7))
    bos_token_id, eos_token_id, unk_token_id, sep_token_id, pad_token_id, cls_token_id, mask_token_id = (
        _SpecialToken(id=True) for _ in range(7))
    # transformers' constants of a fast tokenizer (vLLM's TokenizerLike reads is_fast, truncation_side)
    is_fast, truncation_side, pad_token_type_id, split_special_tokens = True, "right", 0, False
    # transformers 5's: the added tokens that apply_chat_template(sanitize_control_tokens=True) takes
    # for control tokens besides the special ones (tokenizer_config.json's; None: those the template names)
    chat_control_tokens: list[str] | None = None

    def __init__(self, source, gguf=None):
        """gguf: an already opened model.gguf.GGUFFile for `source` (saves parsing it twice)."""
        from .model.gguf import GGUFError, GGUFFile, find_gguf

        path = Path(source)
        try:
            gguf_path = None if gguf is not None else find_gguf(path)
            if gguf is not None or gguf_path is not None:
                self._from_gguf(gguf or GGUFFile(gguf_path))
                return
        except GGUFError as e:
            raise TokenizerError(str(e)) from None
        self._from_folder(path)

    def _set_special(self, name: str, token: str | None, token_id: int | None) -> None:
        """A named special token and its id as loaded (the id may come from config.json)."""
        self.__dict__.setdefault("_special", {})[name] = token
        self.__dict__.setdefault("_special_ids", {})[name] = token_id

    def info(self, chat_template: str | None = None) -> dict:
        """vLLM's /tokenizer_info: the tokenizer's configuration (tokenizer_config.json's keys, a
        GGUF's from its metadata) with its special tokens, `tokenizer_class` and the chat template
        in use (chat_template: the server's own, else the tokenizer's)."""
        out = {k: v for k, v in self.init_config.items() if k not in ("vocab_file", "merges_file", "chat_template")}
        out.update({"bos_token": self.bos_token, "eos_token": self.eos_token, "unk_token": self.unk_token,
                    "pad_token": self.pad_token, "add_bos_token": self.add_bos_token,
                    "model_max_length": self.model_max_length if self.model_max_length < VERY_LARGE_INTEGER
                    else self.init_config.get("model_max_length"),    # the file's own number (1e30), else none
                    "padding_side": self.padding_side,
                    "additional_special_tokens": list(self.additional_special_tokens)})
        out.setdefault("added_tokens_decoder", {
            str(i): {"content": t.content, "special": bool(t.special)}
            for i, t in sorted(self.backend.get_added_tokens_decoder().items())})
        out["tokenizer_class"] = self.init_config.get("tokenizer_class") or "PreTrainedTokenizerFast"
        template = chat_template or self.chat_template
        if template:
            out["chat_template"] = template
        return out

    def _from_folder(self, folder: Path) -> None:
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{folder}: no tokenizer.json")
        try:
            self.backend = HFTokenizer.from_file(str(path))
        except Exception as e:
            raise TokenizerError(f"{path}: cannot load tokenizer ({str(e).splitlines()[0]})") from None
        cfg = _read_json(folder / "tokenizer_config.json")
        self.init_config = dict(cfg)        # tokenizer_config.json as read (vLLM's /tokenizer_info)
        model_cfg = text_config(_read_json(folder / "config.json"))    # a multimodal one's language model
        gen_cfg = _read_json(folder / "generation_config.json")
        for name in SPECIAL_TOKENS:
            token = _token_content(cfg.get(name))
            self._set_special(name, token, self.backend.token_to_id(token) if token else None)
        if not self.bos_token:
            self._set_special("bos_token", None, model_cfg.get("bos_token_id"))
        cfg_eos = _ids(model_cfg.get("eos_token_id")) + _ids(gen_cfg.get("eos_token_id"))
        if self.eos_token_id is None:
            self._set_special("eos_token", self.eos_token, cfg_eos[0] if cfg_eos else None)
        # every id that ends generation: the tokenizer's eos and the configs' lists
        self.eos_token_ids = sorted({i for i in [self.eos_token_id, *cfg_eos] if i is not None})
        # transformers 5 drops tokenizer_config.json's add_bos_token where a tokenizer.json is present:
        # BOS is whatever its post-processor adds (vLLM's prompts too). Set to True, encode() adds it.
        self.add_bos_token = False
        self.chat_template = folder_chat_template(folder, cfg)     # a dict of them where it names several
        self.tool_template = None           # a folder's "tool_use" is one of chat_template's
        self.special_ids = set(self.backend.get_added_tokens_decoder().keys())
        extra = cfg.get("additional_special_tokens") or cfg.get("extra_special_tokens") or []
        self.additional_special_tokens = [_token_content(t) for t in (extra.values() if isinstance(extra, dict) else extra)]
        self.padding_side = cfg.get("padding_side") if cfg.get("padding_side") in ("left", "right") else "right"
        self.model_max_length = cfg.get("model_max_length") if isinstance(cfg.get("model_max_length"), int) else VERY_LARGE_INTEGER
        self.truncation_side = cfg.get("truncation_side") if cfg.get("truncation_side") in ("left", "right") else "right"
        self.clean_up_tokenization_spaces = bool(cfg.get("clean_up_tokenization_spaces", False))
        self.split_special_tokens = bool(cfg.get("split_special_tokens", False))
        self.chat_control_tokens = cfg.get("chat_control_tokens")
        if self.chat_control_tokens is not None and not isinstance(self.chat_control_tokens, list):
            raise TokenizerError(f"{folder}: tokenizer_config.json's chat_control_tokens must be a list of strings, "
                                 f"got {self.chat_control_tokens!r:.80}")
        self.name_or_path = str(folder)

    def _from_gguf(self, g) -> None:
        from .gguf_tokenizer import GGUFTokenizerError, GGUFVocab, build_tokenizer

        try:
            v = GGUFVocab.from_gguf(g)
            self.backend = build_tokenizer(v)
        except GGUFTokenizerError as e:
            raise TokenizerError(str(e) if str(e).startswith(str(g.path)) else f"{g.path}: {e}") from None
        except Exception as e:    # tokenizers rejects an inconsistent vocabulary or merge list
            raise TokenizerError(f"{g.path}: cannot build the tokenizer ({str(e).splitlines()[0]})") from None
        for name in SPECIAL_TOKENS:
            self._set_special(name, None, None)
        for name, i in (("bos_token", v.bos_token_id), ("eos_token", v.eos_token_id)):
            self._set_special(name, v.token(i), i)
        for name, i in (("unk_token", v.unk_token_id), ("pad_token", v.pad_token_id)):
            self._set_special(name, v.token(i), i if v.token(i) is not None else None)
        # every id that ends generation: llama.cpp's end-of-generation set (eos, eot, eom and the
        # tokens spelled <|im_end|>, <|endoftext|>, <|end|>, ...; gpt-oss's <|return|> and <|call|>)
        self.eos_token_ids = v.eog_token_ids()
        self.add_bos_token = False          # the post-processor adds it (v.add_bos_token)
        # the named template "tool_use" (as llama.cpp's converter writes Hermes-2-Pro's, Command-R's)
        # renders requests with tools; llama.cpp falls back on it where the file has no default one
        self.chat_template = v.chat_template or v.tool_template
        self.tool_template = v.tool_template
        self.special_ids = set(self.backend.get_added_tokens_decoder().keys())
        self.additional_special_tokens, self.padding_side, self.model_max_length = [], "right", VERY_LARGE_INTEGER
        self.clean_up_tokenization_spaces, self.name_or_path = False, str(Path(g.path).parent)
        self.init_config = {}

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary, without the tokens added on top of it (transformers 5's
        vocab_size); len() counts every token, added ones included: size things by len()."""
        return self.backend.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def max_token_id(self) -> int:
        """The largest id in the vocabulary (vLLM's TokenizerLike.max_token_id)."""
        cached = self.__dict__.get("_max_token_id")
        if cached is None:
            cached = self.__dict__["_max_token_id"] = max(self.get_vocab().values())
        return cached

    def id_to_token(self, i: int) -> str | None:
        return self.backend.id_to_token(i)

    def encode(self, text, text_pair=None, add_special_tokens: bool | None = True, padding: bool | str = False,
               truncation: bool | str | None = None, max_length: int | None = None, stride: int = 0,
               padding_side: str | None = None, return_tensors: str | None = None, **kwargs):
        """transformers' encode: the ids of a text (or a text pair) as __call__ gives them, its
        arguments too; a list of texts gives a list of rows, return_tensors a [1, T] tensor."""
        add = True if add_special_tokens is None else add_special_tokens
        if (text_pair is None and isinstance(text, str) and not kwargs and padding is False and truncation is None
                and max_length is None and return_tensors is None):
            try:
                backend = self._encoder()
                if len(text) < LONG_TEXT:
                    ids = backend.encode(text, add_special_tokens=add).ids
                else:   # the same ids, the GIL let go (the binding's encode holds it: 0.5-1 s for 1 MB)
                    ids = backend.encode_batch([text], add_special_tokens=add)[0].ids
            except TypeError:
                _check_unicode(text)
                raise
            return self._with_bos(ids) if add else ids
        return self(text, text_pair, add_special_tokens=add, padding=padding, truncation=truncation,
                    max_length=max_length, stride=stride, padding_side=padding_side, return_tensors=return_tensors,
                    return_attention_mask=False, **kwargs)["input_ids"]

    def encode_pair(self, text: str, pair: str, add_special_tokens: bool = True, max_length: int | None = None) -> list[int]:
        """A text pair as one sequence, the tokenizer's pair template deciding the special tokens
        (what transformers' `tokenizer(text, text_pair)` gives: a cross-encoder's input).
        max_length: transformers' `truncation=True, max_length=...` ("longest_first": the longer
        text loses its last token until the whole fits, the special tokens stay); a ValueError
        when not even the special tokens fit."""
        return self._row(text, pair, add_special_tokens, max_length,
                         "longest_first" if max_length is not None else None).ids

    def _with_bos(self, ids: list[int]) -> list[int]:
        """BOS in front where the checkpoint asks for it and the post-processor did not add it."""
        if self._adds_bos(ids):
            return [self.bos_token_id] + ids
        return ids

    def _adds_bos(self, ids: list[int]) -> bool:
        return self.add_bos_token and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id)

    def decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None,
               **kwargs):
        """ids: a list (or int, tensor, array) of ids -> text; a list of lists -> a list of texts.
        Special tokens are kept unless skip_special_tokens, as transformers' decode (what vLLM's
        get_tokenizer() returns); specdec's own outputs skip them (SamplingParams' default).
        clean_up_tokenization_spaces (default: tokenizer_config.json's, else False) strips the
        spaces before punctuation as transformers 5 does: not for a BPE model, where it would
        corrupt the text. Other keywords (spaces_between_special_tokens, ...) are accepted and
        ignored, as transformers 5's fast tokenizers ignore them."""
        ids = token_ids["input_ids"] if isinstance(token_ids, dict) else token_ids
        if not isinstance(ids, list):
            ids = _as_list(ids)
        if ids and isinstance(ids[0], list):
            return self.batch_decode(ids, skip_special_tokens, clean_up_tokenization_spaces)
        text = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces
        if clean and type(self.backend.model).__name__ != "BPE":
            text = clean_up_tokenization(text)
        return text

    def batch_decode(self, sequences, skip_special_tokens: bool = False,
                     clean_up_tokenization_spaces: bool | None = None, **kwargs) -> list[str]:
        """[decode(s) for s in sequences], with decode's default of keeping special tokens."""
        return [self.decode(_as_list(s), skip_special_tokens, clean_up_tokenization_spaces) for s in _as_list(sequences)]

    # -- the rest of transformers' tokenizer surface ---------------------------------------------

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict:
        """id -> AddedToken of each token added on top of the model's vocabulary, by id."""
        return dict(sorted(self.backend.get_added_tokens_decoder().items()))

    @property
    def added_tokens_encoder(self) -> dict[str, int]:
        return {t.content: i for i, t in self.added_tokens_decoder.items()}

    def get_added_vocab(self) -> dict[str, int]:
        return self.added_tokens_encoder

    @property
    def model_input_names(self) -> list[str]:
        names = self.init_config.get("model_input_names")
        return list(names) if isinstance(names, list) else ["input_ids", "attention_mask"]

    @property
    def extra_special_tokens(self) -> list[str]:
        return list(self.additional_special_tokens)

    add_eos_token = False

    def num_special_tokens_to_add(self, pair: bool = False) -> int:
        return len(self._row("", "" if pair else None, True, None, None).ids)

    def tokenize(self, text: str, pair: str | None = None, add_special_tokens: bool = False, **kwargs) -> list[str]:
        return self(text, pair, add_special_tokens=add_special_tokens, **kwargs).tokens()

    def add_tokens(self, new_tokens, special_tokens: bool = False) -> int:
        """transformers' add_tokens: tokens (strings or tokenizers.AddedToken) added to the
        vocabulary after its last id; the number of tokens that were new."""
        from tokenizers import AddedToken

        new_tokens = [new_tokens] if isinstance(new_tokens, (str, AddedToken)) else list(new_tokens)
        tokens = [t if isinstance(t, AddedToken) else AddedToken(t, special=special_tokens, normalized=not special_tokens)
                  for t in new_tokens]
        if special_tokens:
            for t in tokens:
                t.special = True
        before = len(self)
        add = self.backend.add_special_tokens if special_tokens else self.backend.add_tokens
        add(tokens)
        self.special_ids = {i for i, t in self.backend.get_added_tokens_decoder().items()}
        for key in ("_layout", "_max_token_id", "_split_encoder"):
            self.__dict__.pop(key, None)
        return len(self) - before

    def add_special_tokens(self, special_tokens_dict: dict, replace_extra_special_tokens: bool = True) -> int:
        """transformers' add_special_tokens: {"pad_token": "<pad>", "additional_special_tokens":
        [...], ...}: each added as a special token where new, and set as that named token."""
        added = 0
        for key, value in special_tokens_dict.items():
            if key in ("additional_special_tokens", "extra_special_tokens"):
                values = [_token_content(v) for v in value]
                added += self.add_tokens(list(value), special_tokens=True)
                self.additional_special_tokens = values if replace_extra_special_tokens else \
                    list(dict.fromkeys([*self.additional_special_tokens, *values]))
            elif key in SPECIAL_TOKENS:
                added += self.add_tokens([value], special_tokens=True)
                setattr(self, key, value)
            else:
                raise ValueError(f"{key} is not a special token name: one of {', '.join(SPECIAL_TOKENS)}, "
                                 f"additional_special_tokens")
        return added

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        """An id -> its token (None if out of range); a list of ids -> a list of tokens. skip drops
        all_special_ids (BOS, EOS, UNK, PAD and the additional ones) as transformers does."""
        if isinstance(ids, int) or (hasattr(ids, "ndim") and ids.ndim == 0):
            return self.backend.id_to_token(int(ids))
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.backend.id_to_token(i) for i in _as_list(ids) if i not in skip]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (OpenAI's logprobs `bytes`, "useful where characters are
        represented by multiple tokens"): a byte-level BPE token's own bytes, a byte-fallback token's
        one byte, a SentencePiece piece with its spaces; else (special tokens, other decoders) its
        text. A piece of a character is its bytes where its text is U+FFFD, so the bytes of a reply's
        tokens add up to the reply."""
        kind, added = self._byte_layout()
        tok = self.backend.id_to_token(int(token_id))
        if tok is not None and int(token_id) not in added:
            if kind == "ByteLevel" and all(c in _BYTE_OF for c in tok):
                return bytes(_BYTE_OF[c] for c in tok)
            if kind == "Metaspace":
                m = _BYTE_TOKEN.fullmatch(tok)
                return bytes([int(m.group(1), 16)]) if m else tok.replace("\u2581", " ").encode("utf-8")
        return self.decode([int(token_id)]).encode("utf-8")

    def _byte_layout(self) -> tuple[str | None, frozenset]:
        """(how the decoder maps tokens to bytes: "ByteLevel", "Metaspace" (its ▁ as spaces and
        <0xNN> byte fallback) or None, the added tokens' ids), read once."""
        layout = self.__dict__.get("_layout")
        if layout is None:
            try:
                decoder = json.loads(self.backend.decoder.__getstate__()) if self.backend.decoder is not None else {}
            except (AttributeError, TypeError, ValueError):
                decoder = {}
            parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
            types = {d.get("type") for d in parts}
            replaces_pieces = any(d.get("type") == "Replace" and d.get("pattern", {}).get("String") == "\u2581"
                                  for d in parts) or "Metaspace" in types
            kind = "ByteLevel" if "ByteLevel" in types else "Metaspace" if replaces_pieces else None
            layout = self.__dict__["_layout"] = (kind, frozenset(self.backend.get_added_tokens_decoder()))
        return layout

    def convert_tokens_to_ids(self, tokens):
        """A token -> its id (UNK's id, or None, for one not in the vocabulary); a list -> a list."""
        if isinstance(tokens, str):
            i = self.backend.token_to_id(tokens)
            return self.unk_token_id if i is None else i
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        decoder = self.backend.decoder
        return decoder.decode(list(tokens)) if decoder is not None else " ".join(tokens)

    def get_special_tokens_mask(self, token_ids_0, token_ids_1=None,
                                already_has_special_tokens: bool = False) -> list[int]:
        """transformers': 1 for a special token, 0 for a text's token. already_has_special_tokens:
        token_ids_0 is a whole sequence, whose all_special_ids are marked (what data collators ask);
        else the mask of the sequence the tokenizer makes of the ids (and token_ids_1's), its
        post-processor's tokens (and BOS) around them, as tok(text, return_special_tokens_mask=True)."""
        ids_0 = _as_list(token_ids_0)
        if already_has_special_tokens:
            if token_ids_1 is not None:
                raise ValueError("You should not supply a second sequence if the provided sequence of ids is already "
                                 "formatted with special tokens for the model.")
            special = set(self.all_special_ids)
            return [int(int(i) in special) for i in ids_0]
        # the template's layout from one placeholder token per text: None marks a token it adds
        lengths = [len(ids_0)] + ([] if token_ids_1 is None else [len(_as_list(token_ids_1))])
        texts = [self.backend.encode("a", add_special_tokens=False) for _ in lengths]
        if any(len(t) == 0 for t in texts):
            raise NotImplementedError(f"{type(self).__name__} cannot place its special tokens: its vocabulary "
                                      "encodes no placeholder text")
        for t in texts:
            t.truncate(1)
        first, second = texts[0], texts[1] if len(texts) > 1 else None
        row = self._bos(_Row(self._post_process(first, second), second is not None), True)
        return [m for seq in row.sequences for m in ([1] if seq is None else [0] * lengths[seq])]

    @property
    def special_tokens_map(self) -> dict:
        names = {k: getattr(self, k) for k in SPECIAL_TOKENS}
        return {k: v for k, v in names.items() if v is not None}

    @property
    def all_special_tokens(self) -> list[str]:
        named = [*(getattr(self, k) for k in SPECIAL_TOKENS), *self.additional_special_tokens]
        return list(dict.fromkeys(t for t in named if t is not None))

    @property
    def all_special_ids(self) -> list[int]:
        return [i for i in map(self.backend.token_to_id, self.all_special_tokens) if i is not None]

    def __call__(self, text=None, text_pair=None, text_target=None, text_pair_target=None,
                 add_special_tokens: bool = True, padding: bool | str = False, truncation: bool | str | None = None,
                 max_length: int | None = None, stride: int = 0, is_split_into_words: bool = False,
                 pad_to_multiple_of: int | None = None, padding_side: str | None = None,
                 return_tensors: str | None = None, return_token_type_ids: bool | None = None,
                 return_attention_mask: bool | None = None, return_overflowing_tokens: bool = False,
                 return_special_tokens_mask: bool = False, return_offsets_mapping: bool = False,
                 return_length: bool = False, verbose: bool = True, tokenizer_kwargs: dict | None = None,
                 **kwargs) -> BatchEncoding:
        """transformers' `tokenizer(text)`, its arguments in its order: a text (or a list of texts,
        and optionally their pairs; is_split_into_words: lists of words) -> BatchEncoding(input_ids,
        attention_mask, and token_type_ids, special_tokens_mask, offset_mapping, length when
        asked; text_target's ids as labels). padding: True / "longest" (to the longest in the
        batch) or "max_length"; truncation ("longest_first", "only_first", "only_second"; on by
        itself when only max_length is given) cuts the texts, never the special tokens;
        return_tensors: "pt" or "np" (then a single text gets a batch of one)."""
        args = {k: v for k, v in locals().items() if k not in ("self", "kwargs", "tokenizer_kwargs", "text",
                                                               "text_pair", "text_target", "text_pair_target")}
        for key in ("split_special_tokens", "sanitize_control_tokens"):
            if key in kwargs:
                args[key] = kwargs[key]
        args.update(tokenizer_kwargs or {})
        if text is None and text_target is None:
            raise ValueError("You need to specify either `text` or `text_target`.")
        target = None if text_target is None else self._encode_batch(text_target, text_pair_target, **args)
        if text is None:
            return target
        out = self._encode_batch(text, text_pair, **args)
        if target is not None:
            out["labels"] = target["input_ids"]
        return out

    def _padding_side(self, padding, padding_side: str | None) -> str:
        """The side to pad on, after transformers' checks of a padding strategy and a side."""
        if padding not in PADDING:
            raise ValueError(f"{padding} is not a valid PaddingStrategy, please select one of "
                             "['longest', 'max_length', 'do_not_pad']")
        side = padding_side or self.padding_side
        if side not in ("left", "right"):
            raise ValueError(f"Unknown `direction`: `{side}`. Use one of `left` or `right`")
        return side

    def _encode_batch(self, text, text_pair, add_special_tokens, padding, truncation, max_length, stride,
                      is_split_into_words, pad_to_multiple_of, padding_side, return_tensors, return_token_type_ids,
                      return_attention_mask, return_overflowing_tokens, return_special_tokens_mask,
                      return_offsets_mapping, return_length, verbose, **kwargs) -> BatchEncoding:
        side = self._padding_side(padding, padding_side)
        if truncation not in TRUNCATION:
            raise ValueError(f"{truncation} is not a valid TruncationStrategy, please select one of "
                             "['only_first', 'only_second', 'longest_first', 'do_not_truncate']")
        # transformers' strategies: max_length alone truncates; a padding or truncation to the
        # model's length does nothing where the tokenizer sets none
        if max_length is not None and padding is False and truncation is None:
            truncation = "longest_first"
        pad = None if padding in (False, None, "do_not_pad") else "longest" if padding is True else padding
        cut = None if truncation in (False, None, "do_not_truncate") else "longest_first" if truncation is True else truncation
        if max_length is None:
            if pad == "max_length":
                pad, max_length = (None, None) if self.model_max_length > LARGE_INTEGER else (pad, self.model_max_length)
            if cut is not None:
                if self.model_max_length > LARGE_INTEGER:
                    cut = None
                else:
                    max_length = self.model_max_length
        if pad is not None and self.pad_token_id is None:
            raise ValueError("Asking to pad but the tokenizer does not have a padding token. Please select a token "
                             "to use as `pad_token` `(tokenizer.pad_token = tokenizer.eos_token e.g.)` or add a new "
                             "pad token via `tokenizer.add_special_tokens({'pad_token': '[PAD]'})`.")
        if cut and pad and pad_to_multiple_of and max_length is not None and max_length % pad_to_multiple_of:
            raise ValueError(f"Truncation and padding are both activated but truncation length ({max_length}) "
                             f"is not a multiple of pad_to_multiple_of ({pad_to_multiple_of}).")
        if is_split_into_words:
            batched = isinstance(text, (list, tuple)) and bool(text) and isinstance(text[0], (list, tuple))
        else:
            batched = isinstance(text, (list, tuple))
        texts = list(text) if batched else [text]
        pairs = [None] * len(texts) if text_pair is None else list(text_pair) if batched else [text_pair]
        if len(pairs) != len(texts):
            raise ValueError(f"{len(texts)} texts but {len(pairs)} text pairs")
        if batched and text_pair is None and not is_split_into_words:
            # transformers' (and tokenizers') reading of a list item that is a (text, pair) couple:
            # tok([["a", "b"]]) is a batch of one pair
            couples = [isinstance(t, (list, tuple)) and len(t) == 2 for t in texts]
            pairs = [t[1] if c else None for t, c in zip(texts, couples)]
            texts = [t[0] if c else t for t, c in zip(texts, couples)]
        if kwargs.get("sanitize_control_tokens"):      # a chat marked by apply_chat_template
            ids = [self._marked_ids(t) for t in texts]
            if cut is not None and max_length is not None:      # transformers': the tokenizer's side
                ids = [r[:max_length] if self.truncation_side == "right" else r[-max_length:] for r in ids]
            return self.pad({"input_ids": ids if batched or return_tensors else ids[0]}, padding=pad or False,
                            max_length=max_length, pad_to_multiple_of=pad_to_multiple_of, padding_side=side,
                            return_attention_mask=return_attention_mask, return_tensors=return_tensors)
        cut_side = self.truncation_side if kwargs.get("truncation_side") is None else kwargs["truncation_side"]
        rows = [self._row(t, p, add_special_tokens, max_length, cut, cut_side, is_split_into_words, stride,
                          kwargs.get("split_special_tokens")) for t, p in zip(texts, pairs)]
        sample = None
        if return_overflowing_tokens:     # transformers' fast tokenizers: a row per window, and its text's index
            windows = [[r, *(self._bos(w, add_special_tokens) for w in r.windows())] for r in rows]
            rows = [w for ws in windows for w in ws]
            sample = [i for i, ws in enumerate(windows) for _ in ws]
        if pad is not None:
            width = max_length if pad == "max_length" else max(map(len, rows), default=0)
            if pad_to_multiple_of and width % pad_to_multiple_of:
                width += pad_to_multiple_of - width % pad_to_multiple_of
            for r in rows:                      # a longer row stays as it is
                if width > len(r):
                    r.put(0 if side == "left" else len(r), width - len(r), self.pad_token_id, self.pad_token,
                          type_id=self.pad_token_type_id, real=0)
        names = self.model_input_names
        columns = {"input_ids": "ids"}
        if return_token_type_ids or (return_token_type_ids is None and "token_type_ids" in names):
            columns["token_type_ids"] = "type_ids"
        if return_attention_mask or (return_attention_mask is None and "attention_mask" in names):
            columns["attention_mask"] = "attention"
        if return_special_tokens_mask:
            columns["special_tokens_mask"] = "special"
        if return_offsets_mapping:
            columns["offset_mapping"] = "offsets"
        data = {key: [getattr(r, column) for r in rows] for key, column in columns.items()}
        if return_length:
            data["length"] = [len(r) for r in rows]
        if sample is not None:
            data["overflow_to_sample_mapping"] = sample
        n_sequences = rows[0].enc.n_sequences if rows else 1       # transformers': the first row's
        if return_tensors is not None:
            return BatchEncoding({k: _vector(v, return_tensors) if k in ("length", "overflow_to_sample_mapping")
                                  else _tensor(v, return_tensors) for k, v in data.items()}, rows, n_sequences)
        if not batched and sample is None:      # transformers keeps the windows' batch
            data = {k: v if k == "length" else v[0] for k, v in data.items()}
        return BatchEncoding(data, rows, n_sequences)

    def _row(self, text, pair, add_special_tokens: bool, max_length: int | None, cut: str | None,
             side: str = "right", split: bool = False, stride: int = 0,
             split_special_tokens: bool | None = None) -> _Row:
        """One text (or pair) encoded: truncated as tokenizers truncates (the special tokens kept,
        the texts cut to the rest of max_length; what is cut off kept as overflowing windows that
        overlap by `stride` tokens), then its special tokens (and BOS) added."""
        for t in (text, pair):
            if t is not None and not (isinstance(t, (list, tuple)) if split else isinstance(t, str)):
                raise TypeError(f"text must be a string or a list of strings, not {type(t).__name__}")
        try:
            first = self._content(text, split, split_special_tokens)
            second = None if pair is None else _second_text(self._content(pair, split, split_special_tokens))
        except TypeError:
            _check_unicode(text)
            _check_unicode(pair)
            raise
        if max_length is not None and cut is not None:
            n1, n2 = len(first), len(second) if second is not None else 0
            special = 0
            if add_special_tokens:           # the template's tokens, and a BOS _with_bos would put in front
                special = len(self._with_bos(self._post_process(first, second).ids)) - n1 - n2
            budget = max_length - special
            if second is None:
                if cut == "only_second" and n1 > budget:     # transformers': only when a cut is needed
                    raise ValueError("Truncation error: Second sequence not provided")
                if cut != "only_second":
                    _truncate(first, max(0, budget), stride, side)
            elif n1 + n2 > budget:
                if budget < 0:
                    raise ValueError(f"max_length {max_length} is shorter than the pair's {special} special tokens")
                if cut == "longest_first":
                    keep = longest_first(n1, n2, budget)
                    _truncate(first, keep[0], stride, side)
                    _truncate(second, keep[1], stride, side)
                else:
                    target = first if cut == "only_first" else second
                    over = n1 + n2 - budget
                    if len(target) <= over:
                        raise ValueError("Truncation error: Sequence to truncate too short to respect the provided "
                                         "max_length")
                    _truncate(target, len(target) - over, stride, side)
        row = _Row(self._post_process(first, second, add_special_tokens), second is not None)
        return self._bos(row, add_special_tokens)

    def _post_process(self, first, second, add_special_tokens: bool = True):
        """A text's (and its pair's) encodings as one, the tokenizer's special tokens added; where the
        tokenizer.json has no post-processor, the one transformers gives it (the backend is left as
        it is: its serialization fingerprints training data)."""
        if self.backend.post_processor is None:
            return PLAIN.process(first, second, add_special_tokens)
        return self.backend.post_process(first, second, add_special_tokens=add_special_tokens)

    def _bos(self, row: _Row, add_special_tokens: bool) -> _Row:
        if add_special_tokens and self.add_bos_token and self._adds_bos(row.ids):
            row.put(0, 1, self.bos_token_id, self.bos_token)
        return row

    def _content(self, text, split: bool, split_special_tokens: bool | None = None):
        """A text's encoding without special tokens (a long text's with the GIL let go)."""
        backend = self._encoder(split_special_tokens)
        if split:
            return backend.encode(list(text), is_pretokenized=True, add_special_tokens=False)
        if len(text) < LONG_TEXT:
            return backend.encode(text, add_special_tokens=False)
        return backend.encode_batch([text], add_special_tokens=False)[0]

    def _encoder(self, split_special_tokens: bool | None = None) -> HFTokenizer:
        """The backend that encodes text; split_special_tokens (default: the tokenizer's attribute, as
        transformers'): a copy of it that reads special-token text as ordinary text (tokenizers'
        encode_special_tokens), as transformers does. A copy, made once: transformers flips the
        shared backend's flag, which would split the prompts other threads encode meanwhile."""
        split = self.split_special_tokens if split_special_tokens is None else split_special_tokens
        if not split or self.backend.encode_special_tokens:
            return self.backend
        encoder = self.__dict__.get("_split_encoder")
        if encoder is None:
            encoder = HFTokenizer.from_str(self.backend.to_str())
            encoder.encode_special_tokens = True
            self.__dict__["_split_encoder"] = encoder
        return encoder

    def encode_last(self, text: str, max_length: int, add_special_tokens: bool = True) -> list[int]:
        """transformers' encode(text, truncation=True, max_length=max_length) on a tokenizer with
        truncation_side="left", as vLLM tokenizes a text prompt with truncate_prompt_tokens: the
        text's last tokens, its special tokens (BOS) kept around them; a ValueError when not even
        the special tokens fit."""
        ids = self._row(text, None, add_special_tokens, max_length, "longest_first", "left").ids
        if len(ids) > max_length:
            raise ValueError(f"max_length {max_length} is shorter than the text's {len(ids)} special tokens")
        return ids

    def pad(self, encoded_inputs, padding: bool | str = True, max_length: int | None = None,
            pad_to_multiple_of: int | None = None, padding_side: str | None = None,
            return_attention_mask: bool | None = None, return_tensors: str | None = None,
            verbose: bool = True) -> BatchEncoding:
        """transformers' pad: encodings (a dict of rows, a list of dicts, or one unbatched dict)
        padded to the longest row (or max_length), with an attention mask."""
        if isinstance(encoded_inputs, (list, tuple)) and encoded_inputs and isinstance(encoded_inputs[0], dict):
            encoded_inputs = {k: [e[k] for e in encoded_inputs] for k in encoded_inputs[0]}
        data = {k: _as_list(v) if hasattr(v, "tolist") or isinstance(v, (list, tuple)) else v
                for k, v in dict(encoded_inputs).items()}
        ids = data.get("input_ids")
        if ids is None:
            raise ValueError("You should supply an encoding or a list of encodings to this method that includes "
                             "input_ids, but you provided " + str(list(data)))
        batched = bool(ids) and isinstance(ids[0], (list, tuple))
        data = {k: [_as_list(r) for r in v] if batched and isinstance(v, list) else v for k, v in data.items()}
        if not batched:
            data = {k: [v] for k, v in data.items()}
        if return_attention_mask is not False and "attention_mask" in self.model_input_names or return_attention_mask:
            data.setdefault("attention_mask", [[1] * len(r) for r in data["input_ids"]])
        side = self._padding_side(padding, padding_side)
        if padding not in (False, None, "do_not_pad"):
            if self.pad_token_id is None:
                raise ValueError("Asking to pad but the tokenizer does not have a padding token. Please select a "
                                 "token to use as `pad_token` `(tokenizer.pad_token = tokenizer.eos_token e.g.)`.")
            width = max_length if padding == "max_length" and max_length is not None else max(map(len, data["input_ids"]))
            if pad_to_multiple_of and width % pad_to_multiple_of:
                width += pad_to_multiple_of - width % pad_to_multiple_of
            fill = {"input_ids": self.pad_token_id, "attention_mask": 0, "token_type_ids": self.pad_token_type_id,
                    "special_tokens_mask": 1}
            for key, value in fill.items():
                if key in data:
                    data[key] = [[value] * (width - len(r)) + r if side == "left" else r + [value] * (width - len(r))
                                 for r in data[key]]
        if return_tensors is not None:
            return BatchEncoding({k: _tensor(v, return_tensors) for k, v in data.items()})
        return BatchEncoding(data if batched else {k: v[0] for k, v in data.items()})

    def get_chat_template(self, chat_template: str | None = None, tools: list | None = None) -> str:
        """transformers' choice of template: chat_template (the name of one of the tokenizer's
        named templates, or a template), else "tool_use" when tools are given and the tokenizer
        names one, else the tokenizer's."""
        templates = self.chat_template
        if isinstance(templates, dict):         # the folder's templates by name
            if chat_template is not None:
                return templates.get(chat_template, chat_template)
            name = "tool_use" if tools is not None and "tool_use" in templates else "default"
            if name not in templates:
                raise TokenizerError(f"this tokenizer has several chat templates and none is the default: pass "
                                     f"chat_template=, a template or one of the names {sorted(templates)}")
            return templates[name]
        if chat_template is not None:
            return chat_template
        template = (getattr(self, "tool_template", None) if tools else None) or templates
        if not template:           # vLLM's refusal (transformers 4.44 dropped its default template)
            raise TokenizerError(NO_CHAT_TEMPLATE)
        return template

    def save_pretrained(self, save_directory, **kwargs) -> tuple[str, ...]:
        """The tokenizer as a Hugging Face folder that transformers (and specdec) load:
        tokenizer.json, tokenizer_config.json, chat_template.jinja (and additional_chat_templates/)."""
        out = Path(save_directory)
        out.mkdir(parents=True, exist_ok=True)
        cfg = {k: v for k, v in self.init_config.items() if k not in ("chat_template", "added_tokens_decoder")}
        cfg.update({k: v for k, v in self.special_tokens_map.items()})
        cfg.update(add_bos_token=self.add_bos_token, padding_side=self.padding_side,
                   truncation_side=self.truncation_side, clean_up_tokenization_spaces=self.clean_up_tokenization_spaces,
                   split_special_tokens=self.split_special_tokens)
        if self.model_max_length < VERY_LARGE_INTEGER:
            cfg["model_max_length"] = self.model_max_length
        if self.additional_special_tokens:
            cfg["extra_special_tokens"] = list(self.additional_special_tokens)
        if self.chat_control_tokens is not None:
            cfg["chat_control_tokens"] = list(self.chat_control_tokens)
        cfg.setdefault("tokenizer_class", "TokenizersBackend")
        files = [out / "tokenizer_config.json", out / "tokenizer.json"]
        files[0].write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
        self.backend.save(str(files[1]))
        templates = dict(self.chat_template) if isinstance(self.chat_template, dict) else \
            {"default": self.chat_template} if self.chat_template else {}
        if getattr(self, "tool_template", None):
            templates.setdefault("tool_use", self.tool_template)
        for name, template in templates.items():
            if name == "default":
                files.append(out / "chat_template.jinja")
            elif template != templates.get("default"):
                (out / "additional_chat_templates").mkdir(exist_ok=True)
                files.append(out / "additional_chat_templates" / f"{name}.jinja")
            else:
                continue
            files[-1].write_text(template)
        return tuple(map(str, files))

    def apply_chat_template(self, /, conversation, tools: list[dict] | None = None,
                            documents: list[dict] | None = None, chat_template: str | None = None,
                            add_generation_prompt: bool = False, continue_final_message: bool | str = False,
                            tokenize: bool = True, sanitize_control_tokens: bool = False,
                            padding: bool | str = False, truncation: bool = False,
                            max_length: int | None = None, return_tensors: str | None = None,
                            return_dict: bool = True, return_assistant_tokens_mask: bool = False,
                            tokenizer_kwargs: dict | None = None, *, sandbox_process: bool = False, **kwargs):
        """transformers 5's apply_chat_template, its arguments in its order and with its defaults:
        conversation (or a list of conversations: then one row each; messages as dicts, or as
        pydantic models, like the OpenAI SDK's, or dataclasses) through the chat template, tools
        and documents (and any other kwargs) its variables. tokenize=True (the default):
        a BatchEncoding (input_ids, attention_mask) with return_dict=True, the ids alone with
        return_dict=False; padding, truncation, max_length, return_tensors and tokenizer_kwargs
        go to __call__; return_assistant_tokens_mask adds "assistant_masks": 1 for each token
        that overlaps the text of a `{% generation %}` block (all 0 for a template without one).
        sanitize_control_tokens=True: a control token (a special token, or an added one the template
        names, or tokenizer_config.json's chat_control_tokens) written in the messages, tools,
        documents or kwargs is encoded as plain text, only the template's own as the token.
        tokenize=False: the text, to encode with add_special_tokens=False (the template writes
        BOS). No generation prompt unless add_generation_prompt=True: specdec's callers that
        want the text of a prompt for the assistant pass tokenize=False, add_generation_prompt=True.
        sandbox_process (specdec's): render in a child process with a memory and a time limit (a
        template sent with a request: jinja_sandbox.IsolatedRenderer)."""
        if "self" in kwargs:        # Jinja's render takes no variable of that name (a TypeError there)
            raise TokenizerError("'self' cannot be a chat template variable")
        if tools is not None:       # transformers' conversion of a Python function to its JSON schema
            kwargs["tools"] = [_tool_schema(t) if inspect.isfunction(t) or inspect.ismethod(t) else t for t in tools]
        if isinstance(conversation, (list, tuple)) and len(conversation) == 0:
            raise TokenizerError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if documents is not None:
            kwargs["documents"] = documents
        if return_assistant_tokens_mask and not (tokenize and return_dict):
            raise ValueError("return_assistant_tokens_mask=True requires return_dict=True and tokenize=True")
        if return_assistant_tokens_mask and continue_final_message:
            raise ValueError("continue_final_message is not compatible with return_assistant_tokens_mask")
        if sanitize_control_tokens and (not tokenize or return_assistant_tokens_mask):
            raise ValueError("`sanitize_control_tokens=True` requires `tokenize=True` and is not compatible with "
                             "`return_assistant_tokens_mask=True`.")
        template = self.get_chat_template(chat_template, kwargs.get("tools"))
        batched = isinstance(conversation, (list, tuple)) and (
            isinstance(conversation[0], (list, tuple)) or hasattr(conversation[0], "messages"))
        conversations = [chat_messages(c) for c in (conversation if batched else [conversation])]
        if sanitize_control_tokens:     # transformers 5's: marked here, encoded as text by _marked_ids
            control = _control_patterns(self._control_tokens(template))[0]
            conversations = [_mark_control_tokens(c, control) for c in conversations]
            kwargs = _mark_control_tokens(kwargs, control)
        spans = [[] if return_assistant_tokens_mask else None for _ in conversations]
        texts = [self._render(c, add_generation_prompt, template, continue_final_message, kwargs,
                              sandbox_process, spans[i]) for i, c in enumerate(conversations)]
        if not tokenize:
            return texts if batched else texts[0]
        if not return_assistant_tokens_mask:
            marked = {"sanitize_control_tokens": True} if sanitize_control_tokens else {}
            out = self(texts if batched else texts[0], add_special_tokens=False, padding=padding, truncation=truncation,
                       max_length=max_length, return_tensors=return_tensors, **(tokenizer_kwargs or {}), **marked)
            return out if return_dict else out["input_ids"]
        out = self(texts, add_special_tokens=False, padding=padding, truncation=truncation, max_length=max_length,
                   **{**(tokenizer_kwargs or {}), "return_attention_mask": True})
        side = (tokenizer_kwargs or {}).get("truncation_side") or self.truncation_side
        encoder = self._encoder((tokenizer_kwargs or {}).get("split_special_tokens"))
        out["assistant_masks"] = [self._assistant_mask(encoder, t, row, s, side) for t, row, s in
                                  zip(texts, out["attention_mask"], spans)]
        if return_tensors is not None:
            return BatchEncoding({k: _tensor(v, return_tensors) for k, v in out.items()})
        return out if batched else BatchEncoding({k: v[0] for k, v in out.items()})

    def _control_tokens(self, template: str) -> tuple[str, ...]:
        """transformers 5's control tokens of a template: the special added tokens, and the other
        added tokens in chat_control_tokens, or (where that is None) in the template's literal text,
        whitespace tokens aside (Gemma's "\\n" is ordinary text in templates)."""
        added = self.added_tokens_decoder.values()
        if self.chat_control_tokens is not None:
            named = set(self.chat_control_tokens)
            return tuple(t.content for t in added if t.special or t.content in named)
        text = literal_text(template)
        return tuple(t.content for t in added if t.special or (t.content in text and not t.content.isspace()))

    def _marked_ids(self, chat: str) -> list[int]:
        """transformers 5's encode_marked_chat: a chat rendered from marked inputs encoded, each marked
        control token as plain text, the rest (the template's own control tokens) as usual; a lone
        marker is dropped but still breaks the text, so that its two sides cannot join into a token."""
        markers = _control_patterns(tuple(self.added_tokens_encoder))[1]
        pieces = markers.split(chat)        # text, marked token (None: a lone marker), text, ...
        newline = self._content("\n", False).ids
        ids = self._content(pieces[0], False).ids
        for i, piece in enumerate(pieces[1:], start=1):
            if not piece:
                continue
            as_text = i % 2 == 1
            # after a newline, then cut: SentencePiece adds no prefix space in the middle of a chat
            piece_ids = self._content("\n" + piece, False, True if as_text else None).ids
            if piece_ids[:len(newline)] == newline:
                piece_ids = piece_ids[len(newline):]
            else:
                piece_ids = self._content(piece, False, True if as_text else None).ids
            if as_text and self.backend.token_to_id(piece) in piece_ids:
                raise ValueError(f"Can't sanitize {piece!r}: the tokenizer produces it from plain text")
            ids += piece_ids
        return ids

    def _assistant_mask(self, encoder, text: str, attention: list[int], spans: list[tuple[int, int]],
                        side: str = "right") -> list[int]:
        """transformers' assistant mask of one row: 1 for a token whose characters overlap a span, in its
        one pass over the spans in the order they were recorded (a block nested in another comes first)
        (the row's tokens, cut by truncation, are the text's first ones, or its last ones when the
        truncation side is left; padding gets 0)."""
        offsets = encoder.encode(text, add_special_tokens=False).offsets
        kept = sum(1 for real in attention if real)
        offsets = iter(offsets[len(offsets) - kept:] if side == "left" else offsets[:kept])
        mask, at = [], 0
        for real in attention:
            if not real:
                mask.append(0)
                continue
            start, end = next(offsets)
            while at < len(spans) and start >= spans[at][1]:
                at += 1
            mask.append(int(at < len(spans) and end > spans[at][0]))
        return mask

    def _render(self, messages: list[dict], add_generation_prompt: bool, template: str,
                continue_final_message: bool | str, kwargs: dict, sandbox_process: bool = False,
                spans: list | None = None) -> str:
        """The text of one conversation (chat_messages'); spans, when a list: filled with the (start,
        end) of each `{% generation %}` block's text in it, as transformers' AssistantTracker records
        them (the text is the same as without). continue_final_message: True (the final message's
        "content"), or transformers 5's name of the field to continue (e.g. "reasoning_content")."""
        if continue_final_message and add_generation_prompt:
            raise TokenizerError("continue_final_message and add_generation_prompt cannot both be set")
        messages = [_alias_reasoning(m) for m in messages]
        if continue_final_message:
            # transformers 5's way: a marker after the final message's field, the text cut there
            # (an empty message is continued from its start)
            if not messages:
                raise TokenizerError("continue_final_message is set but the conversation is empty")
            field = continue_final_message if isinstance(continue_final_message, str) else "content"
            final, last = _with_marker(messages[-1], field, template)
            messages = [*messages[:-1], last]
        # transformers' variables: the named special tokens that are set (undefined otherwise),
        # tools and documents None unless given (a template may test `tools is not none`)
        context = {k: getattr(self, k) for k in _TEMPLATE_TOKENS if getattr(self, k, None) is not None}
        context.update(messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt)
        context.update(kwargs)
        try:
            if sandbox_process:     # a request's own template: in the child, under its limits
                text = isolated_renderer().render(template, context, spans=spans)
            else:
                text = render(template, context, spans=spans)
        except TemplateProcessBusy as e:
            raise TokenizerBusy(str(e)) from None
        except TemplateProcessError as e:
            raise TokenizerError(f"chat template failed: {e}") from None
        except Exception as e:      # noqa: BLE001 - whatever a template raises is its input's fault (vLLM: 400)
            # the template met a value of a shape it does not take (vLLM's serving answers these
            # with a 400 too): e.g. content as a list of parts for a template that adds strings,
            # an OverflowError of its arithmetic, a RecursionError
            error = ChatTemplateError if isinstance(e, jinja2.TemplateError) else TokenizerError
            raise error(f"chat template failed: {failure(e)}") from None
        if continue_final_message:      # cut what the template wrote after the last message
            mark = CONTINUE_MARK.strip()
            # transformers refuses it too: the model would start a new turn
            if mark not in text or final.strip() not in text:
                raise TokenizerError("continue_final_message is set but the chat template does not reproduce the "
                                     "final message's content, so it cannot be continued")
            at = text.rindex(mark)
            # the marker's trailing space survived: the content's own trailing whitespace did too. Else
            # the template trimmed the content (Llama 3's `| trim`), and transformers drops the whitespace
            # before the marker as well, so the prompt does not end in a space the template never writes
            text = text[:at] if text.startswith(CONTINUE_MARK, at) else text[:at].rstrip()
        return text


_TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# put after the final message's content by continue_final_message, and the rendered text cut there:
# transformers' own tag, trailing space included (whether the template kept that space decides the cut)
CONTINUE_MARK = "CONTINUE_FINAL_MESSAGE_TAG "


# the names a message's reasoning is sent under, in transformers' order of preference
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message):
    """transformers 5's _alias_reasoning_fields: a message's reasoning, sent under any of its
    names, also under reasoning_content (Qwen3's templates) and thinking (gpt-oss's)."""
    if not isinstance(message, dict):
        return message
    thought = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    return message if thought is None else {"thinking": thought, **message, "reasoning_content": thought}


def _as_dicts(value):
    """transformers 5's _message_objects_to_dicts: mappings, pydantic models (model_dump: the
    OpenAI SDK's messages, their tool calls) and dataclasses as dicts, all the way down."""
    if isinstance(value, Mapping):
        return {k: _as_dicts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_dicts(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_as_dicts(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _as_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _as_dicts(value.model_dump())
    return value


def chat_messages(conversation) -> list[dict]:
    """transformers 5's normalisation of a conversation (or an object with .messages): its messages
    as dicts (_as_dicts), their keys set to None left out (a None content printed "None" in Mistral's
    and Gemma's templates and stopped Llama 3.1's; a pydantic reply holds content=None)."""
    try:
        messages = _as_dicts(list(getattr(conversation, "messages", conversation)))
    except RecursionError:
        raise TokenizerError("the conversation is nested too deeply") from None
    for m in messages:
        if not isinstance(m, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {m!r:.80}.")
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


# what marks a control token written in apply_chat_template(sanitize_control_tokens=True)'s inputs:
# transformers 5's private-use characters, put around it and taken off again by _marked_ids
MARK_START, MARK_END = "\U000f0000", "\U000f0001"


@functools.lru_cache(maxsize=16)
def _control_patterns(tokens: tuple[str, ...]) -> tuple[re.Pattern, re.Pattern]:
    """(any of the tokens, the longest first; one marked, or a lone marker), as transformers 5's."""
    control = re.compile("|".join(map(re.escape, sorted(tokens, key=len, reverse=True))) or "(?!)")
    return control, re.compile(f"{MARK_START}({control.pattern}){MARK_END}|[{MARK_START}{MARK_END}]")


def _mark_control_tokens(value, control: re.Pattern):
    """transformers 5's mark_control_tokens: each control token in the strings of value (lists, dicts'
    values) put between the markers, any marker already there dropped (it would forge one)."""
    if isinstance(value, str):
        value = value.replace(MARK_START, "").replace(MARK_END, "")
        return control.sub(f"{MARK_START}\\g<0>{MARK_END}", value)
    if isinstance(value, dict):
        return {k: _mark_control_tokens(v, control) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_mark_control_tokens(v, control) for v in value]
    return value


def _with_marker(message, field: str, template: str) -> tuple[str, dict]:
    """(the final message's text in `field`, the message with CONTINUE_MARK after it), as transformers
    5 marks it: a reasoning field under each of its names that holds the same text, a list of parts
    in its last part with a "text" key. No such field, one the template never names, or no text to
    continue: refused, as transformers refuses it."""
    content = message.get(field) if isinstance(message, dict) else None
    if content is None:
        raise TokenizerError(f'continue_final_message is set but the final message has no "{field}" to continue')
    fields = [f for f in _REASONING_FIELDS if message.get(f) == content] if field in _REASONING_FIELDS else [field]
    if not any(f in template for f in fields):
        raise TokenizerError(f'continue_final_message is set but the chat template never reads "{field}"')
    if isinstance(content, (list, tuple)):
        at = max((i for i, p in enumerate(content) if isinstance(p, dict) and "text" in p), default=None)
        if at is None or not isinstance(content[at]["text"], str):
            raise TokenizerError("continue_final_message is set but the final message has no text to continue")
        final = content[at]["text"]
        content = [*content[:at], {**content[at], "text": final + CONTINUE_MARK}, *content[at + 1:]]
    elif isinstance(content, str):
        final, content = content, content + CONTINUE_MARK
    else:
        raise TokenizerError(f'continue_final_message is set but the final message\'s "{field}" is not text')
    return final, {**message, **dict.fromkeys(fields, content)}


CONTENT_FORMATS = ("auto", "string", "openai")
# a template that loops over a message's content reads OpenAI's list of parts ({% for part in message['content'] %})
def _truncate(enc, keep: int, stride: int, side: str) -> None:
    """enc cut to `keep` tokens, the rest kept as its overflowing windows (`stride` tokens of overlap)."""
    if 0 < keep < len(enc) and stride >= keep:   # tokenizers would panic (a BaseException)
        raise ValueError(f"stride ({stride}) must be smaller than the {keep} tokens a text keeps under max_length "
                         "(its special tokens subtracted)")
    enc.truncate(keep, stride=stride, direction=side)


def _second_text(enc):
    """A pair's second text with type id 1, as tokenizers' encode(text, pair) has it before
    truncation and post-processing: the windows of its overflowing tokens keep it whatever the
    post-processor says (transformers' results)."""
    return SECOND_TEXT.process(enc)


def longest_first(n1: int, n2: int, budget: int) -> tuple[int, int] | None:
    """The lengths a pair keeps under tokenizers' "longest_first" truncation to `budget` tokens
    (None when the budget is negative): a text no longer than half the budget stays whole and the
    other takes the rest; else the longer keeps the larger half (the second on a tie)."""
    if budget < 0:
        return None
    if n1 + n2 <= budget:
        return n1, n2
    lo, hi = budget // 2, budget - budget // 2
    if n1 > n2:
        return (budget - n2, n2) if n2 <= lo else (hi, lo)
    return (n1, budget - n1) if n1 <= lo else (lo, hi)


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a byte-level BPE vocabulary writes for
    each byte -> that byte (printable bytes stand for themselves, the rest are shifted past 255)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


_BYTE_OF = _bytes_to_unicode()
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_CONTENT_LOOP = re.compile(r"for\s+\w+\s+in\s+\w+\s*(?:\[\s*['\"]content['\"]\s*\]|\.content\b)")


def content_format(template: str | None, fmt: str = "auto") -> str:
    """vLLM's chat_template_content_format: "string" (a message's content is its text) or "openai"
    (a list of {"type": "text", "text": ...} parts); "auto" reads the template, as vLLM does: one
    that loops over a message's content takes parts."""
    if fmt not in CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)}, got {fmt!r}")
    if fmt != "auto":
        return fmt
    if isinstance(template, dict):      # a tokenizer's named templates: its default one
        template = template.get("default")
    return "openai" if isinstance(template, str) and _CONTENT_LOOP.search(template) else "string"


def template_in_use(tokenizer, chat_template: str | None = None, tools: list | None = None) -> str | None:
    """The template a request renders with (get_chat_template's choice: a named one, the
    tool_use one when tools are given, the default), None where there is none: what content_format
    reads, as vLLM and transformers read the template they render."""
    try:
        return tokenizer.get_chat_template(chat_template, tools)
    except TokenizerError:
        return None


# vLLM's text content parts (chat_utils' MM_PARSER_MAP): a part's type -> the key its text is under
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking"}
log = logging.getLogger("specdec.tokenizer")


def _part_text(part) -> str | None:
    """A content part's text, as vLLM's chat_utils reads it: a plain string is text, and so are
    TEXT_PARTS; None for a part with no text (vLLM skips it with a warning); any other part (an
    image, audio) is refused, this engine reads text only."""
    if isinstance(part, str):
        return part
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in TEXT_PARTS:
        raise ValueError(f"content part {kind if isinstance(kind, str) else part!r} is not supported: this model reads "
                         f"text only (strings or parts of type {', '.join(TEXT_PARTS)})")
    text = part.get(TEXT_PARTS[kind])
    if text is None:
        log.warning("skipping a %r content part with no %r", kind, TEXT_PARTS[kind])
    elif not isinstance(text, str):
        raise ValueError(f"a {kind!r} content part's {TEXT_PARTS[kind]!r} must be a string, got {type(text).__name__}")
    return text


def template_content(content, fmt: str):
    """A message's content (a string, None, or OpenAI's parts: TEXT_PARTS or plain strings) as the
    template takes it in `fmt` (content_format's): the text, parts joined one per line (vLLM's), or
    a list of text parts; a part with no text is left out, as vLLM leaves it out."""
    if content is None or content == "":
        return ""
    if isinstance(content, str):
        return content if fmt == "string" else [{"type": "text", "text": content}]
    if not isinstance(content, (list, tuple)):
        raise ValueError(f"message content must be a string or a list of content parts, got {type(content).__name__}")
    texts = [t for t in map(_part_text, content) if t is not None]
    return "\n".join(texts) if fmt == "string" else [{"type": "text", "text": t} for t in texts]


def template_messages(messages) -> list[dict]:
    """Chat messages as vLLM's chat_utils hands them to the template (_parse_chat_message_content,
    _postprocess_messages): role and content ("" for none); name and task when strings; an
    assistant's tool_calls and earlier reasoning; a tool message's tool_call_id, its text parts
    joined one per line (templates print a tool result as a string); a developer message's tools.
    Any other field is left out, and so is one sent as null. An assistant's earlier tool_calls get
    their arguments as objects (Hugging Face templates read them; OpenAI sends JSON strings; null
    or a string that is not JSON is {}), and an empty list of them is dropped (templates test
    `'tool_calls' in message` and would render a call)."""
    out = []
    for m in messages:
        role, content = m.get("role"), m.get("content")
        msg = {"role": role, "content": content or ""}
        if role == "tool" and isinstance(content, list) and all(
                isinstance(p, dict) and p.get("type") == "text" for p in content):
            msg["content"] = "\n".join(p.get("text", "") for p in content)
        for key in ("name", "task"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        if role == "tool" and m.get("tool_call_id") is not None:
            msg["tool_call_id"] = m["tool_call_id"]
        if role == "developer" and m.get("tools") is not None:
            msg["tools"] = m["tools"]
        if role == "assistant":
            thought = m.get("reasoning_content") or m.get("reasoning")
            if thought:
                # under the names templates read it by: reasoning (vLLM's newer name), Qwen3's
                # reasoning_content, gpt-oss's thinking (vLLM's chat_utils gives the first two)
                msg.update(reasoning=m.get("reasoning") or thought, reasoning_content=thought, thinking=thought)
            if m.get("tool_calls"):
                msg["tool_calls"] = [_template_call(i, c) for i, c in enumerate(m["tool_calls"])]
        out.append(msg)
    return out


def _template_call(i: int, call) -> dict:
    """One of an assistant's earlier tool_calls with its arguments as the template takes them."""
    if not isinstance(call, dict) or not isinstance(call.get("function") or {}, dict):
        raise TokenizerError(f"tool_calls[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                             f"'arguments': ...}}}}, got {call!r:.80}")
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:       # "", whitespace or malformed: {} (vLLM's _postprocess_messages)
            args = {}
        except RecursionError:             # vLLM's: an error of the request (400)
            raise TokenizerError(f"tool_calls[{i}].function.arguments is nested too deeply") from None
        if args is None:                   # "null": {} too, as vLLM's
            args = {}
    elif not isinstance(args, (dict, list)):
        args = {}
    return {**call, "function": {**fn, "arguments": args}}


def _vector(values: list[int], kind: str):
    """return_length's lengths as a 1-D tensor or array."""
    if kind == "np":
        import numpy as np
        return np.array(values, dtype=np.int64)
    import torch
    return torch.tensor(values, dtype=torch.long)


def clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization: the spaces WordPiece leaves before punctuation and
    English contractions taken out."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
                 (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


def _tensor(rows: list[list[int]], kind: str):
    """Equal-length rows -> a [B, T] torch tensor ("pt") or numpy array ("np")."""
    if kind not in ("pt", "np"):
        raise ValueError(f"return_tensors={kind!r}: specdec's tokenizer returns 'pt' or 'np'")
    if len({len(r) for r in rows}) > 1:
        raise ValueError("rows of different lengths cannot make one tensor: pass padding=True")
    if kind == "np":
        import numpy as np
        return np.array(rows, dtype=np.int64)
    import torch
    return torch.tensor(rows, dtype=torch.long)


NO_CHAT_TEMPLATE = ("this model's tokenizer has no chat template; pass --chat-template (a Jinja file or the "
                    "template itself; LLM.chat's chat_template=)")


def first_vocab_mismatch(a: Tokenizer, b: Tokenizer) -> int | None:
    """The first token id whose text differs between two tokenizers, or None if they agree."""
    n = max(len(a), len(b))           # added tokens included
    for i in range(n):
        if a.id_to_token(i) != b.id_to_token(i):
            return i
    return None


def load_chat_template(value: str | None) -> str | None:
    """--chat-template as vLLM reads it: a file's text, else the value itself when it looks like a
    template (it has braces or line breaks), its backslash escapes decoded (vLLM's
    codecs.decode(value, "unicode_escape"): `\\n` typed on a command line is a line break);
    checked to compile, so a bad one fails at start."""
    import codecs

    if value is None:
        return None
    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except OSError:         # a name too long for one (ENAMETOOLONG): vLLM's open() fails the same way
        is_file = False
    if is_file:
        try:
            template = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {value}: cannot be read ({e})") from None
    elif any(c in value for c in "{}\n"):
        try:        # characters past latin-1 go in as escapes, so they come out whole (vLLM's garbles them)
            template = codecs.decode(value.encode("latin-1", "backslashreplace"), "unicode_escape")
        except UnicodeDecodeError as e:
            raise ValueError(f"--chat-template (inline): a bad backslash escape ({e.reason})") from None
    else:
        raise ValueError(f"--chat-template {value}: no such file (and not a template: it has no braces)")
    try:
        compiled(template)
    except jinja2.TemplateError as e:
        raise ValueError(f"--chat-template {value if is_file else '(inline)'}: not a valid template: {e}") from None
    return template


def model_eos_ids(folder: Path) -> list[int]:
    """The ids a model folder's config.json and generation_config.json say end generation."""
    model_cfg = text_config(_read_json(folder / "config.json"))
    return _ids(model_cfg.get("eos_token_id")) + _ids(_read_json(folder / "generation_config.json").get("eos_token_id"))
