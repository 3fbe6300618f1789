"""A `tokenizers.Tokenizer` rebuilt from a GGUF's `tokenizer.ggml.*` metadata.

A .gguf carries no tokenizer.json: it lists the tokens, their types (1 normal, 2 unknown,
3 control, 4 user-defined, 6 byte), the BPE merges, the special ids and a `pre` name for the
pre-tokenizer. GGUF is llama.cpp's format, so the tokenizer follows llama.cpp's
(llama-vocab.cpp) where it and transformers' GGUF loader differ. Two models cover the
architectures specdec runs:

- `gpt2`: byte-level BPE. Tokens are spelled in GPT-2's byte alphabet (each byte a printable
  character). Text is split by the regexes llama.cpp uses for the file's `pre` name (GPT-2's
  for an unknown name, with a warning; llama.cpp's "default" set when the file names none),
  then byte-mapped and merged. The `pre` name also decides, as in llama.cpp, whether a word
  that is a token is taken whole (ignore_merges) and whether BOS is added when the file has
  no `add_bos_token` key (llama3's, tekken's, ...).
- `llama`: SentencePiece-style BPE. Spaces become "\u2581" and, unless the file's
  `add_space_prefix` is false, a "\u2581" is prepended to every piece of text (the text's start
  and the text after each special token, even text that already starts with a space, as
  llama.cpp and sentencepiece do); unknown characters fall back to <0xNN> byte tokens. Files
  without merges get them derived from the vocabulary, best score first.

Both: control tokens become special added tokens, user-defined ones plain added tokens, matched
whole in the text (llama.cpp's tokenizer_st_partition). A byte-level file stores a control or
user-defined token as its raw text ("<tool call>", "héllo", DeepSeek's "<｜User｜>"), which
llama.cpp matches and prints as it is (token_to_piece); transformers' loader respells it in the
byte alphabet, splitting it into pieces, or byte-decodes it ("h\ufffdllo"), and specdec follows
llama.cpp. A file without the special ids gets llama.cpp's: UNK 0, BOS 1, EOS 2 for SentencePiece,
BOS = EOS = 11 for byte-level BPE (llama.cpp's other vocabularies, WPM and UGM, are not read).
BOS is added by a post-processor when the file asks for it. Otherwise it encodes as transformers'
own GGUF loader (tests/test_tokenizer.py checks it on a few hundred strings).
`GGUFVocab.eog_token_ids` is llama.cpp's end-of-generation set.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

log = logging.getLogger("specdec.gguf")

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp, llm_tokenizer_bpe), by pre type. A type is a
# list of regexes applied in turn: each splits the pieces the previous one left, its matches and
# the text between them becoming pieces (llama.cpp's unicode_regex_split; a Split "isolated").
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
# o200k's letter runs as llama.cpp writes them: a run of letters that are not a-z, then one of
# letters that are not A-Z (non-ASCII letters count as both cases)
_UPPER_LOWER = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+@C"
                r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*@C")
_TEKKEN = (_UPPER_LOWER.replace("@C", "") + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_O200K = (_UPPER_LOWER.replace("@C", _CONTRACTIONS + "?") + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
_O200K_MARKS = _O200K.replace(r"(?=[\p{L}])", r"(?=[\p{L}\p{M}])")
_O200K_CLASSES = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTIONS +
                  r"?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS +
                  r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK3 = (r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CJK_KANA = r"[一-龥぀-ゟ゠-ヿ]+"
_NORDIC = r" ?[^(\s|.,!?…。，、।۔،)]+"
_SPLITS = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
    "gpt2": [],                                 # GPT-2's own: ByteLevel's regex
    "llama3": [_LLAMA3],
    "jais2": [_LLAMA3.replace(r"|\s+(?!\S)|\s+", "") + "".join(rf"|\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4))
              + r"|\s{1,2}(?!\S)|\s{1}"],
    "deepseek-llm": [r"[\r\n]",
                     "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
                     "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
                     "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
                     "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
                     "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-"
                     "\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
                     "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
                     "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
                     "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
                     "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
                     "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
                     r"\s?[!-/:-~！-／：-～‘-‟　-。]+", r"\s+$", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}+"],
    "deepseek-v3": [r"\p{N}{1,3}", _CJK_KANA, _DEEPSEEK3],
    "spark2_5": [r"\p{N}{1,3}", _CJK_KANA, _DEEPSEEK3.replace(r"[\r\n]*|\s*[\r\n]+|", r"|[\r\n]|"), r"\p{N}"],
    "youtu": [r"[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+",
              _O200K.replace(r"|\p{N}{1,3}|", r"|\p{N}|")],
    "deepseek-coder": [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"],
    "starcoder": [r"\p{N}", _GPT2],             # digits one by one
    "qwen2": [_QWEN2],
    "qwen35": [_QWEN35],
    "poro": [_NORDIC],
    "viking": [_NORDIC, r"\p{N}"],
    "tekken": [_TEKKEN],
    "chameleon": [r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )", r"\p{N}",
                  r"[\p{P}!-/:-@\[-`{-~]", _GPT2],
    "gpt-4o": [_O200K],
    "granite-emb-multi": [_O200K_MARKS],
    "tiny-aya": [r"\d{1,3}(?=(?:\d{3})*\b)", _O200K_CLASSES],
    "bailingmoe": [r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"],
    "seed-coder": [_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+"
                   r"|\s+(?!\S)|\s+"],
    "ufakzeka": [_QWEN2[len(_CONTRACTIONS) + 1:]],
    "laguna": [r"[^\n]+|[\n]+", _QWEN2],
    "exaone-moe": [_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+"],
    "minicpm5": [r"\p{N}{1,3}", _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}+")],
}


@dataclass(frozen=True)
class PreType:
    """What a `tokenizer.ggml.pre` name means to llama.cpp."""
    split: str                  # a key of _SPLITS
    add_bos: bool = False       # BOS added when the file has no add_bos_token key
    ignore_merges: bool = False  # a piece that is a token is taken whole


def _names(names: str, split: str, **kw) -> dict[str, PreType]:
    return dict.fromkeys(names.split(), PreType(split, **kw))


# llama.cpp's pre names (llama_vocab::impl::load). Left out, as they need llama.cpp's own code or
# no byte mapping: kimi-k2, afmoe, superbpe, gemma4, sarvam-moe, whitespace, granite-embed-multi-311m.
PRE_TYPES = {
    **_names("default", "default"),
    **_names("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano", "llama3",
             add_bos=True, ignore_merges=True),
    **_names("dbrx smaug-bpe glm4 chatglm-bpe", "llama3"),
    **_names("jais-2", "jais2"),
    **_names("deepseek-llm", "deepseek-llm"),
    **_names("deepseek-coder", "deepseek-coder"),
    **_names("deepseek-v3 hunyuan-dense joyai-llm hy_v4", "deepseek-v3"),
    **_names("spark2_5", "spark2_5"),
    **_names("youtu", "youtu", ignore_merges=True),
    **_names("falcon", "falcon"),
    **_names("starcoder refact command-r smollm codeshell exaone minerva-7b mellum2", "starcoder"),
    # "gpt2" is not llama.cpp's spelling ("gpt-2"), but files (and specdec's tests) use it
    **_names("gpt-2 gpt2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert mpt olmo "
             "jais trillion granite-docling exaone4 jina-v1-en jina-v2-code roberta-bpe", "gpt2"),
    **_names("stablelm2 qwen2 deepseek-r1-qwen kormo f2llmv2 hunyuan solar-open megrez", "qwen2"),
    **_names("qwen35", "qwen35"),
    **_names("poro-chat bloom gpt3-finnish", "poro"),
    **_names("viking", "viking"),
    **_names("tekken", "tekken", add_bos=True, ignore_merges=True),
    **_names("chameleon", "chameleon", add_bos=True),
    **_names("gpt-4o llama4 kanana2 talkie minimax-m2", "gpt-4o"),
    **_names("granite-embed-multi-97m", "granite-emb-multi", ignore_merges=True),
    **_names("tiny_aya cohere2moe", "tiny-aya"),
    **_names("bailingmoe bailingmoe2 llada-moe", "bailingmoe"),
    **_names("seed-coder", "seed-coder"),
    **_names("ufakzeka", "ufakzeka"),
    **_names("grok-2", "qwen2"),
    **_names("laguna", "laguna"),
    **_names("exaone-moe", "exaone-moe"),
    **_names("minicpm5", "minicpm5", ignore_merges=True),
}
_warned: set[str] = set()


def pre_type(pre: str | None) -> PreType:
    """llama.cpp's reading of a pre name: a file without one gets its "default" set; a name it
    does not know (llama.cpp refuses the file) keeps GPT-2's split, with a warning once per name."""
    if pre is None or pre == "":
        if "" not in _warned:
            _warned.add("")
            log.warning("GGUF tokenizer: no tokenizer.ggml.pre; using llama.cpp's 'default' pre-tokenizer")
        return PRE_TYPES["default"]
    found = PRE_TYPES.get(pre)
    if found is None:
        if pre not in _warned:
            _warned.add(pre)
            log.warning("GGUF tokenizer: unknown tokenizer.ggml.pre %r; splitting text as GPT-2 does", pre)
        return PreType("gpt2")
    return found


# llama.cpp's end-of-generation tokens by text (llama-vocab.cpp: special_eog_ids)
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
})


# llama.cpp's FIM tokens that also end generation (pad, repo name, file separator): the file's
# tokenizer.ggml.fim_*_token_id, else the first token spelled as one of these
FIM_EOG_TEXTS = (("pad", ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>")),
                 ("rep", ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")),
                 ("sep", ("<|file_sep|>",)))


def _fim_id(given: int | None, tokens, texts: tuple[str, ...]) -> int | None:
    if given is not None:
        return given
    return next((i for i, t in enumerate(tokens) if t in texts), None)


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
    add_space_prefix: bool = True    # SentencePiece: "\u2581" before each piece of text (llama.cpp's default)
    eom_token_id: int | None = None  # end of message (Llama 3.1's <|eom_id|>): also ends generation
    fim_token_ids: tuple = ()        # FIM pad / repo / file separator: llama.cpp ends generation on them too
    tool_template: str | None = None  # tokenizer.chat_template.tool_use: llama.cpp's template for requests with tools
    # BPE's default id 11 where the file names no BOS / EOS: it begins and ends text as llama.cpp,
    # but stays a plain token unless its type says otherwise (in GPT-2's vocabulary it is ",")
    assumed_ids: tuple = ()

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
        add_prefix = g.get("tokenizer.ggml.add_space_prefix")
        pre = g.get("tokenizer.ggml.pre")
        opt = lambda key, default=None: default if g.get(key) is None else int(g.get(key))  # noqa: E731
        # llama.cpp's ids for a vocabulary without the keys (llama-vocab.cpp, where the id exists):
        # SentencePiece UNK 0, BOS 1, EOS 2; byte-level BPE BOS = EOS = 11 (Falcon's <|endoftext|>)
        spm_id = lambda i: i if model == "llama" and i < len(tokens) else None  # noqa: E731
        bpe_id = 11 if model == "gpt2" and len(tokens) > 11 else None
        bos, eos = (opt(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos"))
        eot = opt("tokenizer.ggml.eot_token_id")
        if eot is None and "<end_of_turn>" in tokens:     # llama.cpp's rule: Gemma's end of turn
            eot = list(tokens).index("<end_of_turn>")
        # llama.cpp: a SentencePiece vocabulary adds BOS unless the file says otherwise, a
        # byte-level one when its pre type does (llama3's, tekken's, ...)
        bos_default = model == "llama" or pre_type(pre).add_bos
        return cls(model=model, pre=pre, tokens=list(tokens),
                   token_types=[int(t) for t in types], merges=g.get("tokenizer.ggml.merges"),
                   scores=g.get("tokenizer.ggml.scores"),
                   bos_token_id=bos if bos is not None else spm_id(1) if model == "llama" else bpe_id,
                   eos_token_id=eos if eos is not None else spm_id(2) if model == "llama" else bpe_id,
                   assumed_ids=(bpe_id,) if None in (bos, eos) and bpe_id not in (bos, eos) else (),
                   eot_token_id=eot, unk_token_id=opt("tokenizer.ggml.unknown_token_id", spm_id(0)),
                   pad_token_id=opt("tokenizer.ggml.padding_token_id"),
                   add_bos_token=bool(add_bos) if add_bos is not None else bos_default,
                   add_eos_token=bool(g.get("tokenizer.ggml.add_eos_token") or False),
                   chat_template=g.get("tokenizer.chat_template"), architecture=g.architecture,
                   tool_template=g.get("tokenizer.chat_template.tool_use"),
                   # llama.cpp: true for SentencePiece unless the file's key says false
                   add_space_prefix=bool(add_prefix) if add_prefix is not None else model == "llama",
                   eom_token_id=opt("tokenizer.ggml.eom_token_id"),
                   fim_token_ids=tuple(i for i in (_fim_id(opt(f"tokenizer.ggml.fim_{kind}_token_id"), tokens, texts)
                                                   for kind, texts in FIM_EOG_TEXTS) if i is not None))

    def token(self, i: int | None) -> str | None:
        return self.tokens[i] if i is not None and 0 <= i < len(self.tokens) else None

    def eog_token_ids(self) -> list[int]:
        """llama.cpp's end-of-generation set (special_eog_ids): eos, eot, eom and FIM pad / repo /
        file separator, and every
        token spelled as one of EOG_TEXTS; <|end|> left out where <|return|> and <|call|> (or
        <|calls|> and <|flush|>) are there too (gpt-oss's harmony, where it ends a message, not
        the answer), </s> where <|tool_response> is."""
        n = len(self.tokens)
        ids = {i for i, t in enumerate(self.tokens) if t in EOG_TEXTS}
        ids |= {i for i in (self.eos_token_id, self.eot_token_id, self.eom_token_id, *self.fim_token_ids)
                if i is not None and 0 <= i < n}
        texts = {self.tokens[i]: i for i in ids}
        has_call = "<|call|>" in texts or "<|calls|>" in texts
        if "<|end|>" in texts and has_call and ("<|return|>" in texts or "<|flush|>" in texts):
            ids.discard(texts["<|end|>"])
        if "</s>" in texts and "<|tool_response>" in texts:
            ids.discard(texts["</s>"])
        return sorted(ids)


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
    respell = lambda tok: "".join(spell[b] for b in tok.encode("utf-8"))  # noqa: E731
    # a token written outside the byte alphabet (some converters store raw text) is respelled,
    # but a control or user-defined one keeps its raw text: llama.cpp's converter writes added
    # tokens so (DeepSeek's "<｜User｜>"), and llama.cpp matches them whole in the text and prints
    # them as they are; so do the named BOS / EOS / UNK / PAD, which are special added tokens
    # (a token listed twice keeps its last id)
    whole = {i for i, kind in enumerate(v.token_types) if kind in (CONTROL, USER_DEFINED)}
    raw_key = whole | _named_ids(v)
    vocab = {tok if set(tok) <= alphabet or i in raw_key else respell(tok): i for i, tok in enumerate(v.tokens)}
    pre = pre_type(v.pre)
    tk = Tokenizer(BPE(vocab, _merges(v, vocab), dropout=None, fuse_unk=False, byte_fallback=False,
                       ignore_merges=pre.ignore_merges))
    splits = _SPLITS[pre.split]
    if not splits:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tk.pre_tokenizer = pre_tokenizers.Sequence([*(pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits),
                                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    # ByteLevel decodes every token, added ones too, and keeps raw only a token with a character
    # outside the alphabet: a raw control or user-defined token made of alphabet characters
    # (DeepSeek-Coder's "ø", "héllo") is respelled first, matched whole so that no other token is touched
    raw = [tok for i, tok in enumerate(v.tokens) if i in whole and set(tok) <= alphabet and respell(tok) != tok]
    tk.decoder = decoders.Sequence([*(decoders.Replace(Regex(rf"\A{re.escape(tok)}\z"), respell(tok)) for tok in raw),
                                    decoders.ByteLevel()]) if raw else decoders.ByteLevel()
    return tk


def _sentencepiece(v: GGUFVocab) -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(v.tokens)}
    tk = Tokenizer(BPE(vocab, _merges(v, vocab), dropout=None, fuse_unk=True, byte_fallback=True))
    # llama.cpp: " " before every piece of text (the start, and after each special token), even
    # one that starts with a space, unless add_space_prefix is false; then spaces -> "\u2581"
    # (a normalizer, as Llama 2's own tokenizer.json; Metaspace would skip text starting with one)
    prefix = [normalizers.Prepend("\u2581")] if v.add_space_prefix else []
    tk.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", "\u2581")])
    strip = [decoders.Strip(content=" ", left=1, right=0)] if v.add_space_prefix else []
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
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
    # control tokens stay whole and are special (skipped when decoding), whatever their spelling
    # (a byte-level file stores them as raw text, as llama.cpp matches them). The tokens named
    # BOS, EOS, UNK and PAD are special too, whatever their type (not BPE's assumed 11).
    named = {v.tokens[i] for i in _named_ids(v)}
    control = [t for t, kind in zip(v.tokens, v.token_types) if kind == CONTROL]
    special = list(dict.fromkeys([*control, *sorted(named - set(control))]))
    tk.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    vocab = tk.get_vocab()
    user = [AddedToken(t, normalized=False, special=False) for t, kind in zip(v.tokens, v.token_types)
            if kind == USER_DEFINED and t in vocab]
    tk.add_tokens(user)
    tk.post_processor = _post_processor(v)
    return tk


def _named_ids(v: GGUFVocab) -> set[int]:
    """The ids of the BOS, EOS, UNK and PAD the file names (not BPE's assumed 11)."""
    return {i for i in (v.bos_token_id, v.eos_token_id, v.unk_token_id, v.pad_token_id)
            if i not in v.assumed_ids and v.token(i) is not None}


def _post_processor(v: GGUFVocab):
    bos, eos = v.token(v.bos_token_id), v.token(v.eos_token_id)
    add_bos, add_eos = v.add_bos_token and bos is not None, v.add_eos_token and eos is not None
    single = " ".join([*([f"{bos}:0"] if add_bos else []), "$A:0", *([f"{eos}:0"] if add_eos else [])])
    pair = " ".join([single, *([f"{bos}:1"] if add_bos else []), "$B:1", *([f"{eos}:1"] if add_eos else [])])
    special = [*([(bos, v.bos_token_id)] if add_bos else []), *([(eos, v.eos_token_id)] if add_eos else [])]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
