"""A `tokenizers.Tokenizer` rebuilt from a GGUF's `tokenizer.ggml.*` metadata.

A .gguf carries no tokenizer.json: it lists the tokens, their types (1 normal, 2 unknown,
3 control, 4 user-defined, 6 byte), the BPE merges, the special ids and a `pre` name for the
pre-tokenizer. Two models cover the architectures specdec runs:

- `gpt2`: byte-level BPE. Tokens are spelled in GPT-2's byte alphabet (each byte a printable
  character). Text is split by a regex -- GPT-2's unless `pre` names another family (llama3's,
  qwen2's, ...) -- then byte-mapped and merged.
- `llama`: SentencePiece-style BPE. Spaces become "\u2581", a "\u2581" is prepended to the first
  piece, unknown characters fall back to <0xNN> byte tokens. Files without merges get them
  derived from the vocabulary, best score first.

The result encodes exactly as transformers' own GGUF loader (tests/test_tokenizer.py checks it on
a few hundred strings): control tokens become special added tokens, user-defined ones plain
added tokens, and BOS is added by a post-processor when the file asks for it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Split regexes of the `pre` families whose merges were not learned on GPT-2's split.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k (GPT-4o's, gpt-oss's tokenizer.json; llama.cpp's "gpt-4o" pre type, which Llama 4's files
# name too): letter runs split where lower case turns to upper ("HelloWorld" -> Hello, World),
# digits in threes, punctuation runs keep a trailing "/" or newlines
_O200K = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3", "pixtral"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2),
    **dict.fromkeys(("gpt-4o", "llama4"), _O200K),
}
# Everything else (gpt2, smollm, starcoder, default, ...) keeps GPT-2's own split.


class GGUFTokenizerError(ValueError):
    pass


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer part of a GGUF's metadata."""
    model: str                       # "gpt2" | "llama"
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    merges: list[str] | None
    scores: list[float] | None
    bos_token_id: int | None
    eos_token_id: int | None
    eot_token_id: int | None         # end of turn (Llama 3's <|eot_id|>): also ends generation
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None
    architecture: str | None = None  # general.architecture (Gemma's SentencePiece files differ)

    @classmethod
    def from_gguf(cls, g) -> "GGUFVocab":
        """g: a model.gguf.GGUFFile."""
        model = g.get("tokenizer.ggml.model")
        if model is None:
            raise GGUFTokenizerError(f"{g.path}: no tokenizer in the metadata (tokenizer.ggml.model); pass --tokenizer DIR")
        if model not in ("gpt2", "llama"):
            raise GGUFTokenizerError(f"{g.path}: unsupported tokenizer model {model!r} (supported: gpt2, llama)")
        tokens = g.require("tokenizer.ggml.tokens")
        types = g.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
        add_bos = g.get("tokenizer.ggml.add_bos_token")
        opt = lambda key: None if g.get(key) is None else int(g.get(key))  # noqa: E731
        eot = opt("tokenizer.ggml.eot_token_id")
        if eot is None and "<end_of_turn>" in tokens:     # llama.cpp's rule: Gemma's end of turn
            eot = list(tokens).index("<end_of_turn>")
        return cls(model=model, pre=g.get("tokenizer.ggml.pre"), tokens=list(tokens),
                   token_types=[int(t) for t in types], merges=g.get("tokenizer.ggml.merges"),
                   scores=g.get("tokenizer.ggml.scores"),
                   bos_token_id=opt("tokenizer.ggml.bos_token_id"), eos_token_id=opt("tokenizer.ggml.eos_token_id"),
                   eot_token_id=eot, unk_token_id=opt("tokenizer.ggml.unknown_token_id"),
                   pad_token_id=opt("tokenizer.ggml.padding_token_id"),
                   # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
                   add_bos_token=bool(add_bos) if add_bos is not None else model == "llama",
                   add_eos_token=bool(g.get("tokenizer.ggml.add_eos_token") or False),
                   chat_template=g.get("tokenizer.chat_template"), architecture=g.architecture)

    def token(self, i: int | None) -> str | None:
        return self.tokens[i] if i is not None and 0 <= i < len(self.tokens) else None


def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> character map: printable Latin-1 bytes stand for themselves,
    the other 68 bytes (controls, space, ...) are shifted to code points 256 and up."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    moved = [b for b in range(256) if b not in keep]
    table = {b: chr(b) for b in keep}
    table.update({b: chr(256 + n) for n, b in enumerate(moved)})
    return table


def _byte_level(v: GGUFVocab) -> Tokenizer:
    spell = byte_alphabet()
    alphabet = set(spell.values())
    # a token written outside the byte alphabet (some converters store raw text) is respelled
    # (a token listed twice keeps its last id, as transformers' loader does)
    vocab = {tok if set(tok) <= alphabet else "".join(spell[b] for b in tok.encode("utf-8")): i
             for i, tok in enumerate(v.tokens)}
    tk = Tokenizer(BPE(vocab, _merges(v, vocab), dropout=None, fuse_unk=False, byte_fallback=False))
    split = PRE_SPLITS.get(v.pre)
    if split is None:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    return tk


def _sentencepiece(v: GGUFVocab) -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(v.tokens)}
    tk = Tokenizer(BPE(vocab, _merges(v, vocab), dropout=None, fuse_unk=True, byte_fallback=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(content=" ", left=1, right=0)])
    return tk


def _gemma_sentencepiece(v: GGUFVocab) -> Tokenizer:
    """Gemma's SentencePiece (as transformers' GemmaTokenizer and its GGUF loader build it): no
    prefix space, spaces turned into "▁" by a normalizer; a token of spaces only is stored as
    real spaces and looked up as as many "▁"; without merges in the file, the merges are
    rebuilt ranked by the tokens' order in the file (Gemma's scores do not follow its merges)."""
    tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in v.tokens]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    respelled = dataclasses.replace(v, tokens=tokens, scores=None if v.merges else [-float(i) for i in range(len(tokens))])
    tk = Tokenizer(BPE(vocab, _merges(respelled, vocab), dropout=None, fuse_unk=True, byte_fallback=True,
                       unk_token=v.token(v.unk_token_id)))
    tk.normalizer = normalizers.Replace(" ", "▁")
    tk.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tk


GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")


def _merges(v: GGUFVocab, vocab: dict[str, int]) -> list[tuple[str, str]]:
    if v.merges:
        out = []
        for m in v.merges:
            a, sep, b = m.partition(" ")
            if not sep:
                raise GGUFTokenizerError(f"tokenizer.ggml.merges: malformed merge {m!r}")
            out.append((a, b))
        return out
    # no merges (older SentencePiece files): every split of a token into two vocabulary
    # tokens is a merge, ranked by the merged token's score (best first)
    scores = v.scores or [-float(i) for i in range(len(v.tokens))]
    score_of = dict(zip(v.tokens, scores))
    ranked = []
    for tok, score in score_of.items():
        pairs = [(tok[:j], tok[j:]) for j in range(1, len(tok)) if tok[:j] in vocab and tok[j:] in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        ranked += [(a, b, score) for a, b in pairs]
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in ranked]


def build_tokenizer(v: GGUFVocab) -> Tokenizer:
    if v.model == "gpt2":
        tk = _byte_level(v)
    else:
        tk = _gemma_sentencepiece(v) if v.architecture in GEMMA_ARCHITECTURES else _sentencepiece(v)
    byte_level = v.model == "gpt2"
    alphabet = set(byte_alphabet().values())
    # control tokens stay whole and are special (skipped when decoding); a "control" token
    # spelled outside the byte alphabet of a byte-level vocabulary is a converter's mislabel.
    # The tokens named BOS, EOS, UNK and PAD are special too, whatever their type.
    named = {v.token(i) for i in (v.bos_token_id, v.eos_token_id, v.unk_token_id, v.pad_token_id)} - {None}
    control = [t for t, kind in zip(v.tokens, v.token_types)
               if kind == CONTROL and (not byte_level or set(t) <= alphabet)]
    special = list(dict.fromkeys([*control, *sorted(named - set(control))]))
    tk.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    vocab = tk.get_vocab()
    user = [AddedToken(t, normalized=False, special=False) for t, kind in zip(v.tokens, v.token_types)
            if kind == USER_DEFINED and t in vocab]
    tk.add_tokens(user)
    tk.post_processor = _post_processor(v)
    return tk


def _post_processor(v: GGUFVocab):
    bos, eos = v.token(v.bos_token_id), v.token(v.eos_token_id)
    add_bos, add_eos = v.add_bos_token and bos is not None, v.add_eos_token and eos is not None
    single = " ".join([*([f"{bos}:0"] if add_bos else []), "$A:0", *([f"{eos}:0"] if add_eos else [])])
    pair = " ".join([single, *([f"{bos}:1"] if add_bos else []), "$B:1", *([f"{eos}:1"] if add_eos else [])])
    special = [*([(bos, v.bos_token_id)] if add_bos else []), *([(eos, v.eos_token_id)] if add_eos else [])]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
