"""Embeddings: vLLM's pooling runner (`LLM(runner="pooling")`, `LLM.embed`, `/v1/embeddings`).

A decoder model used as an embedding model (Qwen3-Embedding, e5-mistral, gte-Qwen2) runs one
forward over the prompt and pools the final-norm hidden states of its tokens into one vector:

- LAST: the last token's state (decoder embedding models; vLLM's default for them),
- MEAN: the mean over the prompt's tokens,
- CLS: the first token's state,

then L2-normalizes it (unless told not to). The pooling comes from the folder's
sentence-transformers files when it has them (`modules.json` naming a Pooling module, whose
`config.json` sets `pooling_mode_*`: several are concatenated in SentenceTransformer's order, and a
Normalize module), else LAST with normalization;
`pooler_config` (vLLM's `--pooler-config` / `--override-pooler-config`) overrides either.
Matryoshka models (`is_matryoshka` / `matryoshka_dimensions` in config.json, or in hf_overrides)
accept `dimensions`: the first d components, normalized again. A sentence-transformers folder's
`sentence_bert_config.json` (vLLM's encoder config) caps the context at its `max_seq_length` and,
with `do_lower_case`, lowercases text inputs.
"""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

import torch

from .model import ForwardBatch

POOLING_TYPES = ("LAST", "MEAN", "CLS", "MAX", "MEAN_SQRT_LEN")
# a sentence-transformers Pooling config's modes, in the order its forward() concatenates them
_ST_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_max_tokens": "MAX", "pooling_mode_mean_tokens": "MEAN",
             "pooling_mode_mean_sqrt_len_tokens": "MEAN_SQRT_LEN", "pooling_mode_lasttoken": "LAST"}
# pooler_config's fields: vLLM's use_activation (and its deprecated activation / softmax) is, for
# an embedding model, whether to normalize, and for a classifier the default of requests' use_activation
_OVERRIDES = ("pooling_type", "normalize", "use_activation", "activation", "softmax")
# a sentence-transformers Dense module's activation_function -> the function
_ST_ACTIVATIONS = {"torch.nn.modules.linear.Identity": lambda x: x, "torch.nn.modules.activation.Tanh": torch.tanh,
                   "torch.nn.modules.activation.Sigmoid": torch.sigmoid,
                   "torch.nn.modules.activation.ReLU": torch.relu,
                   "torch.nn.modules.activation.GELU": torch.nn.functional.gelu}


@dataclass(frozen=True)
class Dense:
    """A sentence-transformers Dense module after the pooling: activation(W x + b)."""
    weight: torch.Tensor          # [out, in] fp32
    bias: torch.Tensor | None
    activation: str

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _ST_ACTIVATIONS[self.activation](torch.nn.functional.linear(x, self.weight, self.bias))


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "LAST"
    normalize: bool = True
    dense: tuple[Dense, ...] = field(default=(), compare=False, repr=False)    # sentence-transformers' Dense modules
    use_activation: bool | None = None     # a classifier's default of a request's use_activation (None: True)
    concat: tuple[str, ...] = ()           # sentence-transformers' further pooling modes, appended to pooling_type's

    def __post_init__(self):
        for kind in (self.pooling_type, *self.concat):
            if kind not in POOLING_TYPES:
                raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {kind!r}")

    def out_features(self, hidden: int) -> int:
        """The embedding's size: the last Dense module's output, else the pooled vectors' (concatenated)."""
        return self.dense[-1].weight.shape[0] if self.dense else hidden * (1 + len(self.concat))

    @classmethod
    def of(cls, folder: str | Path, override=None, raw: dict | None = None) -> PoolerConfig:
        """The folder's pooling (sentence-transformers files, else LAST + normalize; a sequence
        classifier's: LAST, not normalized), then override (a dict, or a PoolerConfig: ours or
        vLLM's, its fields that are not None; use_activation as _OVERRIDES reads it). raw: the
        config.json with hf_overrides applied."""
        root = Path(folder)
        root = root.parent if root.is_file() else root
        classifier = _classifier_config(root, raw) is not None
        cfg = cls(normalize=not classifier)
        modules = root / "modules.json"
        if modules.is_file():
            try:
                entries = json.loads(modules.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{modules}: not valid JSON ({e})") from None
            steps = [(str(m.get("type", "")).rsplit(".", 1)[-1], str(m.get("path", "")))
                     for m in entries if isinstance(m, dict)]
            kinds = dict(steps)
            modes = []
            if "Pooling" in kinds:
                pooling = root / kinds["Pooling"] / "config.json"
                st = json.loads(pooling.read_text()) if pooling.is_file() else {}
                bad = [k for k in st if k.startswith("pooling_mode_") and st.get(k) and k not in _ST_MODES]
                if bad:
                    raise ValueError(f"{pooling}: {bad[0]} is not supported ({', '.join(_ST_MODES)})")
                modes = [v for k, v in _ST_MODES.items() if st.get(k)]     # several: concatenated, as ST does
            unknown = [k for k, _ in steps if k not in ("Transformer", "Pooling", "Normalize", "Dense")]
            if unknown:
                raise ValueError(f"{modules}: the sentence-transformers module {unknown[0]} is not supported "
                                 "(Transformer, Pooling, Dense, Normalize)")
            dense = tuple(_st_dense(root / path) for kind, path in steps if kind == "Dense")
            cfg = cls(modes[0] if modes else "LAST", "Normalize" in kinds, dense, concat=tuple(modes[1:]))
        if override is not None and not isinstance(override, dict):
            if not hasattr(override, "pooling_type"):
                raise ValueError(f"pooler_config must be a dict or a PoolerConfig, got {type(override).__name__}")
            override = {k: getattr(override, k) for k in _OVERRIDES if getattr(override, k, None) is not None}
        if override:
            unknown = set(override) - set(_OVERRIDES)
            if unknown:
                raise ValueError(f"pooler_config: unknown field {sorted(unknown)[0]!r} ({', '.join(_OVERRIDES)})")
            flags = {k: _flag(v, f"pooler_config {k}") for k, v in override.items() if k != "pooling_type"}
            changes = {k: v for k, v in flags.items() if k == "normalize"}
            active = use_activation(SimpleNamespace(**flags))
            if active is not None and classifier:
                changes["use_activation"] = active
            elif active is not None:
                changes["normalize"] = flags.get("normalize", active)
            if "pooling_type" in override:
                changes.update(pooling_type=str(override["pooling_type"]).upper(), concat=())
            cfg = replace(cfg, **changes)
        return cfg


ST_CONFIG_FILES = ("sentence_bert_config.json", "sentence_roberta_config.json", "sentence_distilbert_config.json",
                   "sentence_camembert_config.json", "sentence_albert_config.json",
                   "sentence_xlm-roberta_config.json", "sentence_xlnet_config.json")


def encoder_config(folder: str | Path) -> dict:
    """A sentence-transformers folder's tokenizer settings (vLLM's encoder_config: the first of
    its sentence_*_config.json files): max_seq_length, do_lower_case; {} without one."""
    root = Path(folder)
    root = root.parent if root.is_file() else root
    for name in ST_CONFIG_FILES:
        if (root / name).is_file():
            try:
                cfg = json.loads((root / name).read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{root / name}: not valid JSON ({e})") from None
            return cfg if isinstance(cfg, dict) else {}
    return {}


def lower_prompt(prompt):
    """A text prompt lowercased (do_lower_case); token ids as they are."""
    if isinstance(prompt, str):
        return prompt.lower()
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str) and "prompt_token_ids" not in prompt:
        return {**prompt, "prompt": prompt["prompt"].lower()}
    return prompt


class Aborted(Exception):
    """A pooling call stopped between two forwards: its client left (abort_when)."""


_ABORT = threading.local()


@contextmanager
def abort_when(stop):
    """embed_batch on this thread checks stop() before each forward and raises Aborted when it is
    true: a server stops a request whose client has gone (the engine thread runs its calls one at
    a time, so a thread-local reaches the LLM's pooling methods without a new argument)."""
    _ABORT.stop = stop
    try:
        yield
    finally:
        _ABORT.stop = None


def _flag(value, what: str) -> bool:
    """A JSON or command-line boolean: true / false, or the words "true" / "false"."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ValueError(f"{what} must be true or false, got {value!r}")


def _st_dense(folder: Path) -> Dense:
    """A sentence-transformers Dense module's folder (config.json: in_features, out_features, bias,
    activation_function; weights linear.weight / linear.bias in model.safetensors or
    pytorch_model.bin)."""
    from .model.checkpoint import read_state_dict

    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{folder}: a Dense module without a readable config.json ({e})") from None
    act = cfg.get("activation_function", "torch.nn.modules.linear.Identity")
    if act not in _ST_ACTIVATIONS:
        raise ValueError(f"{folder}: Dense activation_function {act!r} is not supported "
                         f"({', '.join(a.rsplit('.', 1)[-1] for a in _ST_ACTIVATIONS)})")
    sd = read_state_dict(folder, lambda k: k in ("linear.weight", "linear.bias"))
    if "linear.weight" not in sd:
        raise ValueError(f"{folder}: a Dense module without linear.weight")
    w = sd["linear.weight"].float()
    if w.shape != (cfg.get("out_features", w.shape[0]), cfg.get("in_features", w.shape[1])):
        raise ValueError(f"{folder}: linear.weight is {tuple(w.shape)}, config.json says "
                         f"{cfg.get('out_features')} x {cfg.get('in_features')}")
    bias = sd.get("linear.bias")
    return Dense(w, bias.float() if bias is not None else None, act)


@dataclass(frozen=True)
class PoolingParams:
    """Per request (vLLM's): dimensions (matryoshka models), normalize (None: the pooler's),
    truncate_prompt_tokens (keep the last k prompt tokens), use_activation (classify and a
    cross-encoder's score: False gives the raw logits; None: True; an embedding: whether to
    normalize, where normalize, vLLM's older name of it, is None). activation and softmax are
    vLLM's deprecated names of use_activation, read before it as vLLM and the server read them."""
    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None
    activation: bool | None = None
    softmax: bool | None = None
    task: str | None = None

    def __post_init__(self):
        for name in ("normalize", "use_activation", "activation", "softmax"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"PoolingParams {name} must be true or false (or None), got {getattr(self, name)!r}")
        object.__setattr__(self, "use_activation", use_activation(self))    # the server's reading of the names


def use_activation(body) -> bool | None:
    """vLLM's get_use_activation: a request's softmax or activation (deprecated), else its use_activation
    (an embedding request's normalize, vLLM's older name of it there, is read before this)."""
    for name in ("softmax", "activation"):
        if getattr(body, name, None) is not None:
            return getattr(body, name)
    return getattr(body, "use_activation", None)


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def data(self) -> torch.Tensor:
        """vLLM's PoolingOutput.data (what LLM.encode's outputs hold): the vector as a tensor."""
        return torch.tensor(self.embedding)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """vLLM's shape: `output.outputs.score` (an embedding model's: the cosine similarity)."""
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


def pairs(data_1, data_2) -> list[tuple]:
    """vLLM's pairing for scores: one text against each of a list (1:N), or two lists of the
    same length pairwise (N:N)."""
    one = isinstance(data_1, (str, dict))
    a = [data_1] if one else list(data_1)
    b = [data_2] if isinstance(data_2, (str, dict)) else list(data_2)
    if not a or not b:
        raise ValueError("score needs at least one text on each side")
    if len(a) == 1:
        return [(a[0], x) for x in b]
    if len(a) != len(b):
        raise ValueError(f"score pairs a list of {len(a)} texts with one of {len(b)}: give one text, or lists of "
                         "the same length")
    return list(zip(a, b))


def cosine(u: list[float], v: list[float]) -> float:
    return torch.nn.functional.cosine_similarity(torch.tensor(u), torch.tensor(v), dim=0).item()


@dataclass
class EmbeddingRequestOutput:
    """vLLM's shape: `output.outputs.embedding`, `output.prompt_token_ids`."""
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    prompt: str | None = None
    finished: bool = True


def matryoshka(hf_config: dict) -> tuple[bool, list[int] | None]:
    """(whether `dimensions` is accepted, the listed sizes or None for any)."""
    dims = hf_config.get("matryoshka_dimensions")
    return bool(hf_config.get("is_matryoshka") or dims), (list(dims) if dims else None)


def check_dimensions(dimensions: int | None, hidden: int, hf_config: dict) -> None:
    if dimensions is None:
        return
    ok, listed = matryoshka(hf_config)
    if not ok:
        raise ValueError(f"dimensions={dimensions}: this model does not support matryoshka representations "
                         "(config.json has no is_matryoshka / matryoshka_dimensions)")
    if not 1 <= dimensions <= hidden or (listed and dimensions not in listed):
        allowed = ", ".join(map(str, listed)) if listed else f"1 to {hidden}"
        raise ValueError(f"dimensions={dimensions}: this model supports {allowed}")


@torch.inference_mode()
def embed_batch(model, prompts: list[list[int]], pooler: PoolerConfig, params: list[PoolingParams],
                max_tokens: int = 2048) -> list[list[float]]:
    """Each prompt's embedding, in order. Prompts run together, up to `max_tokens` tokens per
    forward (a flat batch over a cache holding one sequence per prompt); every product and the
    attention give a row the same result alone or in a batch, so batching changes no bits."""
    out: list[list[float]] = []
    start = 0
    stop = getattr(_ABORT, "stop", None)
    while start < len(prompts):
        if stop is not None and stop():
            raise Aborted("the pooling request was aborted")
        end, total = start + 1, len(prompts[start])
        while end < len(prompts) and total + len(prompts[end]) <= max_tokens:
            total += len(prompts[end])
            end += 1
        chunk = prompts[start:end]
        kv = model.new_cache(len(chunk), max(len(ids) for ids in chunk))
        tokens = torch.tensor([t for ids in chunk for t in ids], dtype=torch.long, device=model.device)
        counts = [len(ids) for ids in chunk]
        hidden = model(tokens, kv, ForwardBatch.build(kv, list(range(len(chunk))), counts, [0] * len(chunk)),
                       logits=False, hidden=True).hidden.float()
        for h, p in zip(hidden.split(counts), params[start:end]):
            out.append(_pool(h, pooler, p))
        start = end
    return out


def _pool(h: torch.Tensor, pooler: PoolerConfig, params: PoolingParams) -> list[float]:
    """[T, D] final-norm states of one prompt -> its embedding."""
    vec = torch.cat([_pooled(h, kind) for kind in (pooler.pooling_type, *pooler.concat)])
    for dense in pooler.dense:
        vec = dense(vec)
    if params.dimensions is not None:
        vec = vec[:params.dimensions]
    # vLLM's use_activation is an embedding's normalize (normalize, its older name, read first)
    on = params.normalize if params.normalize is not None else params.use_activation
    if pooler.normalize if on is None else on:
        vec = torch.nn.functional.normalize(vec, dim=0)
    return vec.cpu().tolist()


def _pooled(h: torch.Tensor, kind: str) -> torch.Tensor:
    """[T, D] -> [D] by one pooling type."""
    return h[-1] if kind == "LAST" else h[0] if kind == "CLS" else h.max(0).values if kind == "MAX" \
        else h.sum(0) / len(h) ** 0.5 if kind == "MEAN_SQRT_LEN" else h.mean(0)


def _classifier_config(root: Path, raw: dict | None = None) -> dict | None:
    """The config (raw: the one hf_overrides made, else the folder's) of a sequence classifier, else None."""
    from .model.checkpoint import is_classifier, read_config

    if raw is None:
        if not (root / "config.json").is_file():
            return None
        raw = read_config(root)
    return raw if is_classifier(raw) else None


# a cross-encoder's activation as sentence-transformers names it in config.json -> ours
_CE_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity", "torch.nn.Identity": "identity",
                   "torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.Sigmoid": "sigmoid",
                   "torch.nn.modules.activation.Tanh": "tanh", "torch.nn.Tanh": "tanh"}


def _activate(logits: torch.Tensor, how: str) -> torch.Tensor:
    return {"identity": lambda x: x, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
            "softmax": lambda x: torch.softmax(x, -1)}[how](logits)


@dataclass
class Classifier:
    """A sequence classifier's `score` head (transformers' *ForSequenceClassification) over the
    last token's final-norm state, then vLLM's activations: for classify, as transformers' loss
    reads config.json's `problem_type` (regression: the raw value, multi_label_classification: a
    sigmoid per label, else softmax, or a sigmoid for one label); for score (a cross-encoder), the
    sentence-transformers `activation_fn` (or `sbert_ce_default_activation_function`) where the
    config names one, else the classify default."""
    weight: torch.Tensor                  # [num_labels, hidden] fp32
    bias: torch.Tensor | None
    labels: list[str]
    activation: str = "softmax"           # classify's: identity, sigmoid, softmax
    score_activation: str = "sigmoid"     # score's: identity, sigmoid, tanh, softmax

    @classmethod
    def of(cls, folder: str | Path, target, raw: dict | None = None, tokenizer=None) -> Classifier | None:
        """raw: the config.json with hf_overrides applied (None: the folder's). A config naming
        `classifier_from_token` (vLLM's recipe for a causal LM served as a classifier, as
        Qwen3-Reranker) takes its head from the LM head's rows of those tokens."""
        from .model.checkpoint import read_state_dict

        root = Path(folder)
        raw = _classifier_config(root, raw)
        if raw is None:
            return None
        if raw.get("classifier_from_token"):
            sd = {"score.weight": _head_from_tokens(raw, target, tokenizer)}
        else:
            sd = read_state_dict(root, lambda k: k in ("score.weight", "score.bias"))
        if "score.weight" not in sd:
            raise ValueError(f"{root}: a sequence classifier without score.weight")
        w = sd["score.weight"].float()
        if w.shape[1] != target.config.hidden_size:
            raise ValueError(f"{root}: score.weight is {tuple(w.shape)}, the hidden size is {target.config.hidden_size}")
        id2label = raw.get("id2label") or {}
        labels = [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(w.shape[0])]
        problem = raw.get("problem_type")
        default = "sigmoid" if w.shape[0] == 1 else "softmax"
        activation = {"regression": "identity", "multi_label_classification": "sigmoid"}.get(problem, default)
        st = raw.get("sentence_transformers")
        named = (st.get("activation_fn") if isinstance(st, dict) else None) or raw.get("sbert_ce_default_activation_function")
        if named is not None and named not in _CE_ACTIVATIONS:
            raise ValueError(f"{root}: the cross-encoder's activation_fn {named!r} is not supported "
                             "(torch.nn Identity, Sigmoid, Tanh)")
        return cls(w, sd["score.bias"].float() if "score.bias" in sd else None, labels, activation,
                   _CE_ACTIVATIONS[named] if named is not None else default)

    def logits(self, state: list[float]) -> torch.Tensor:
        return torch.nn.functional.linear(torch.tensor(state), self.weight, self.bias)

    def probs(self, state: list[float], use_activation: bool | None = None) -> list[float]:
        """classify's output (vLLM's `probs`, whatever the activation; use_activation False: the logits)."""
        return _activate(self.logits(state), self.activation if use_activation is not False else "identity").tolist()

    def score(self, state: list[float], use_activation: bool | None = None) -> float:
        """A cross-encoder's score of the pair read as `state`'s input (use_activation False: the logit)."""
        how = self.score_activation if use_activation is not False else "identity"
        return _activate(self.logits(state), how)[0].item()


def _head_from_tokens(raw: dict, target, tokenizer) -> torch.Tensor:
    """vLLM's classifier_from_token: the LM head's rows of the named tokens ([n, hidden]); with
    is_original_qwen3_reranker (method from_2_way_softmax) the tokens are (false, true) and the
    one label's row is true - false, as softmax over the two is sigmoid of their difference."""
    tokens = raw["classifier_from_token"]
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens) or tokenizer is None:
        raise ValueError(f"classifier_from_token must be a list of tokens, got {tokens!r}")
    two_way = raw.get("is_original_qwen3_reranker") or raw.get("method") == "from_2_way_softmax"
    if two_way and len(tokens) != 2:
        raise ValueError(f"is_original_qwen3_reranker needs classifier_from_token of two tokens (false, true), got {tokens}")
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    if None in ids or getattr(tokenizer, "unk_token_id", None) in ids:
        raise ValueError(f"classifier_from_token: {tokens[ids.index(None) if None in ids else 0]!r} is not "
                         "a token of the vocabulary")
    head = getattr(getattr(target, "lm_head", None), "weight", None)
    if not isinstance(head, torch.Tensor) or not head.is_floating_point() or head.dim() != 2:
        raise ValueError("classifier_from_token needs the model's LM head unquantized (a GGUF or quantized "
                         "head is not read here)")
    rows = head[ids].float().cpu()
    return (rows[1] - rows[0]).unsqueeze(0) if two_way else rows


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def data(self) -> torch.Tensor:
        """vLLM's PoolingOutput.data: the class probabilities as a tensor."""
        return torch.tensor(self.probs)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """vLLM's shape: `output.outputs.probs`."""
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True
