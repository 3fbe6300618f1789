"""Embeddings: vLLM's pooling runner (`LLM(runner="pooling")`, `LLM.embed`, `/v1/embeddings`).

A decoder model used as an embedding model (Qwen3-Embedding, e5-mistral, gte-Qwen2) runs one
forward over the prompt and pools the final-norm hidden states of its tokens into one vector:

- LAST: the last token's state (decoder embedding models; vLLM's default for them),
- MEAN: the mean over the prompt's tokens,
- CLS: the first token's state,

then L2-normalizes it (unless told not to). The pooling comes from the folder's
sentence-transformers files when it has them (`modules.json` naming a Pooling module, whose
`config.json` sets `pooling_mode_*`, and a Normalize module), else LAST with normalization;
`pooler_config` (vLLM's `--pooler-config` / `--override-pooler-config`) overrides either.
Matryoshka models (`is_matryoshka` / `matryoshka_dimensions` in config.json) accept
`dimensions`: the first d components, normalized again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from .model import ForwardBatch

POOLING_TYPES = ("LAST", "MEAN", "CLS")
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self):
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")

    @classmethod
    def of(cls, folder: str | Path, override: dict | None = None) -> PoolerConfig:
        """The folder's pooling (sentence-transformers files, else LAST + normalize; a sequence
        classifier's: LAST, not normalized), then override."""
        root = Path(folder)
        root = root.parent if root.is_file() else root
        cfg = cls(normalize=not _classifier_config(root))
        modules = root / "modules.json"
        if modules.is_file():
            try:
                entries = json.loads(modules.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{modules}: not valid JSON ({e})") from None
            kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m.get("path", "") for m in entries if isinstance(m, dict)}
            mode = None
            if "Pooling" in kinds:
                pooling = root / kinds["Pooling"] / "config.json"
                st = json.loads(pooling.read_text()) if pooling.is_file() else {}
                mode = next((v for k, v in _ST_MODES.items() if st.get(k)), None)
            cfg = cls(mode or "LAST", "Normalize" in kinds)
        if override:
            unknown = set(override) - {f.name for f in fields(cls)}
            if unknown:
                raise ValueError(f"pooler_config: unknown field {sorted(unknown)[0]!r} (pooling_type, normalize)")
            cfg = replace(cfg, **{k: (str(v).upper() if k == "pooling_type" else bool(v)) for k, v in override.items()})
        return cfg


@dataclass(frozen=True)
class PoolingParams:
    """Per request (vLLM's): dimensions (matryoshka models), normalize (None: the pooler's),
    truncate_prompt_tokens (keep the last k prompt tokens)."""
    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None


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
    while start < len(prompts):
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
    vec = h[-1] if pooler.pooling_type == "LAST" else h[0] if pooler.pooling_type == "CLS" else h.mean(0)
    if params.dimensions is not None:
        vec = vec[:params.dimensions]
    if pooler.normalize if params.normalize is None else params.normalize:
        vec = torch.nn.functional.normalize(vec, dim=0)
    return vec.cpu().tolist()


def _classifier_config(root: Path) -> dict | None:
    from .model.checkpoint import is_classifier, read_config

    if not (root / "config.json").is_file():
        return None
    raw = read_config(root)
    return raw if is_classifier(raw) else None


@dataclass
class Classifier:
    """A sequence classifier's `score` head (transformers' *ForSequenceClassification) over the
    last token's final-norm state: probabilities by softmax, or sigmoid for one label (vLLM's)."""
    weight: torch.Tensor                  # [num_labels, hidden] fp32
    bias: torch.Tensor | None
    labels: list[str]

    @classmethod
    def of(cls, folder: str | Path, target) -> Classifier | None:
        from .model.checkpoint import read_state_dict

        root = Path(folder)
        raw = _classifier_config(root)
        if raw is None:
            return None
        sd = read_state_dict(root, lambda k: k in ("score.weight", "score.bias"))
        if "score.weight" not in sd:
            raise ValueError(f"{root}: a sequence classifier without score.weight")
        w = sd["score.weight"].float()
        if w.shape[1] != target.config.hidden_size:
            raise ValueError(f"{root}: score.weight is {tuple(w.shape)}, the hidden size is {target.config.hidden_size}")
        id2label = raw.get("id2label") or {}
        labels = [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(w.shape[0])]
        return cls(w, sd["score.bias"].float() if "score.bias" in sd else None, labels)

    def probs(self, state: list[float]) -> list[float]:
        logits = torch.nn.functional.linear(torch.tensor(state), self.weight, self.bias)
        return (torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, -1)).tolist()


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
