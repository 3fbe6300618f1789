"""Tokenizer of a Hugging Face folder: tokenizer.json + tokenizer_config.json, with its chat template."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
from tokenizers import Tokenizer as HFTokenizer


class TokenizerError(ValueError):
    pass


def _token_content(tok) -> str | None:
    if tok is None:
        return None
    return tok["content"] if isinstance(tok, dict) else str(tok)


class Tokenizer:
    def __init__(self, folder: str | Path):
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{folder}: no tokenizer.json")
        try:
            self.backend = HFTokenizer.from_file(str(path))
        except Exception as e:
            raise TokenizerError(f"{path}: cannot load tokenizer ({str(e).splitlines()[0]})") from None
        cfg_path = folder / "tokenizer_config.json"
        try:
            cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        except json.JSONDecodeError as e:
            raise TokenizerError(f"{cfg_path}: not valid JSON ({e})") from None
        model_cfg = {}
        if (folder / "config.json").is_file():
            try:
                model_cfg = json.loads((folder / "config.json").read_text())
            except json.JSONDecodeError:
                pass
        self.bos_token = _token_content(cfg.get("bos_token"))
        self.eos_token = _token_content(cfg.get("eos_token"))
        self.bos_token_id = self.backend.token_to_id(self.bos_token) if self.bos_token else model_cfg.get("bos_token_id")
        eos_id = self.backend.token_to_id(self.eos_token) if self.eos_token else None
        cfg_eos = model_cfg.get("eos_token_id")
        cfg_eos = [cfg_eos] if isinstance(cfg_eos, int) else list(cfg_eos or [])
        self.eos_token_id = eos_id if eos_id is not None else (cfg_eos[0] if cfg_eos else None)
        # every id that ends generation: the tokenizer's eos and the model config's list
        self.eos_token_ids = sorted({i for i in [self.eos_token_id, *cfg_eos] if i is not None})
        self.add_bos_token = bool(cfg.get("add_bos_token", False))
        # transformers >= 4.43 may write the template beside the config instead of inside it
        jinja = folder / "chat_template.jinja"
        self.chat_template = cfg.get("chat_template") or (jinja.read_text() if jinja.is_file() else None)
        self.special_ids = set(self.backend.get_added_tokens_decoder().keys())

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, i: int) -> str | None:
        return self.backend.id_to_token(i)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None \
                and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        template = self.chat_template or _DEFAULT_TEMPLATE
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)

        def raise_exception(msg):
            raise TokenizerError(msg)

        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template failed: {e}") from None


# Used only for a folder that ships no chat_template.
_DEFAULT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def first_vocab_mismatch(a: Tokenizer, b: Tokenizer) -> int | None:
    """The first token id whose text differs between two tokenizers, or None if they agree."""
    n = max(a.vocab_size, b.vocab_size)
    for i in range(n):
        if a.id_to_token(i) != b.id_to_token(i):
            return i
    return None
