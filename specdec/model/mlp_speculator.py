"""IBM's MLP speculators ("accelerators": `MLPSpeculatorPreTrainedModel`, config model_type
`mlp_speculator`; vLLM's `"method": "mlp_speculator"`), the drafter of Wertheimer et al. 2024
(IBM's technical report, "Accelerating Production LLMs with Combined Token/Embedding
Speculators"; fms-extras).

No attention and no cache: n_predict stages, each an MLP step over a state. Stage 0 starts from
the target's final-norm feature of the token before the sequence's last (the vector its LM head
turned into that last token), normed and divided by sqrt(2) when scale_input is set. Stage i
takes the state s and the token t drafted last (the sequence's last token for stage 0):

    s <- gelu(ln_i(proj_i(s) + (emb_weight / state_weight) * emb_i(t)))
    logits_i = head_i(s)

with state_weight = 0.5 ** (0.5 / n_predict), emb_weight = sqrt((1 - state_weight^2) * inner / 2),
ln_i an RMS norm with a weight and a bias (no mean subtracted), gelu the exact one; stage i's
token (the argmax, or a draw) feeds stage i + 1. With tie_weights every stage after the first
shares one proj, and all share one emb, head and ln. A chain of at most n_predict tokens.

Folders: config.json (emb_dim, inner_dim (0: emb_dim), n_predict, vocab_size, tie_weights,
scale_input) and model.safetensors or pytorch_model.bin with emb.{i}.weight, proj.{i}.weight,
head.{i}.weight, ln.{i}.weight, ln.{i}.bias (a "speculator." prefix is taken off).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .checkpoint import CheckpointError, read_head_file
from .llama import Embedding, Linear


ARCHITECTURES = ("MLPSpeculatorPreTrainedModel", "MLPSpeculator")
LN_EPS = 1e-6


def is_mlp_speculator(folder: str | os.PathLike) -> bool:
    path = Path(folder) / "config.json"
    if not path.is_file():
        return False
    try:
        cfg = json.loads(path.read_text())
    except ValueError:
        return False
    return cfg.get("model_type") == "mlp_speculator" or any(a in ARCHITECTURES for a in cfg.get("architectures") or [])


class ScaledNorm(nn.Module):
    """fms-extras' LayerNormParameterized as the speculators use it: x / rms(x), then (when
    affine) times a weight plus a bias; no mean is subtracted."""

    def __init__(self, dim: int, affine: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None
        self.bias = nn.Parameter(torch.zeros(dim)) if affine else None

    def forward(self, x: Tensor) -> Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + LN_EPS)
        return x if self.weight is None else x * self.weight + self.bias


class MLPSpeculator(nn.Module):
    def __init__(self, emb_dim: int, inner_dim: int, vocab_size: int, n_predict: int, tie_weights: bool,
                 scale_input: bool):
        super().__init__()
        self.emb_dim, self.inner_dim, self.vocab_size, self.n_predict = emb_dim, inner_dim, vocab_size, n_predict
        self.tie_weights, self.scale_input = tie_weights, scale_input
        stages = 1 if tie_weights else n_predict
        self.emb = nn.ModuleList(Embedding(vocab_size, inner_dim) for _ in range(stages))
        self.proj = nn.ModuleList(Linear(emb_dim if i == 0 else inner_dim, inner_dim, bias=False)
                                  for i in range(min(2, n_predict) if tie_weights else n_predict))
        self.head = nn.ModuleList(Linear(inner_dim, vocab_size, bias=False) for _ in range(stages))
        self.ln = nn.ModuleList(ScaledNorm(inner_dim, True) for _ in range(stages))
        self.ln0 = ScaledNorm(emb_dim, False) if scale_input else None
        self.state_weight = 0.5 ** (0.5 / n_predict)
        self.emb_weight = math.sqrt((1 - self.state_weight ** 2) * (inner_dim / 2))

    def _stage(self, modules: nn.ModuleList, i: int) -> nn.Module:
        if not self.tie_weights:
            return modules[i]
        return modules[min(i, len(modules) - 1)]       # proj: the first, then the shared one

    def start(self, feature: Tensor) -> Tensor:
        """[B, emb_dim] target features -> the state stage 0 reads."""
        return self.ln0(feature) / math.sqrt(2) if self.ln0 is not None else feature

    def step(self, i: int, state: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Stage i on states [B, .] and the tokens drafted last [B] -> (logits [B, V], new states)."""
        z = self._stage(self.emb, i)(tokens).to(state.dtype)
        s = self._stage(self.proj, i)(state) + z * (self.emb_weight / self.state_weight)
        s = F.gelu(self._stage(self.ln, i)(s))
        return self._stage(self.head, i)(s), s


def _weights(folder: Path) -> dict[str, Tensor]:
    return {k.removeprefix("speculator."): v for k, v in read_head_file(folder).items()}


def load_mlp_speculator(folder: str | os.PathLike, target) -> MLPSpeculator:
    """The MLP speculator in `folder` for `target` (its hidden size and vocabulary checked),
    in the target's dtype on its device."""
    folder = Path(folder)
    if not is_mlp_speculator(folder):
        raise CheckpointError(f"{folder}: not an MLP speculator folder (config.json's model_type is not "
                              "'mlp_speculator')")
    cfg = json.loads((folder / "config.json").read_text())
    tcfg = target.config
    emb_dim = int(cfg.get("emb_dim", 0))
    inner = int(cfg.get("inner_dim") or emb_dim)
    n_predict, vocab = int(cfg.get("n_predict", 3)), int(cfg.get("vocab_size", 0))
    if emb_dim != tcfg.hidden_size:
        raise CheckpointError(f"{folder}: the speculator reads features of size {emb_dim} (emb_dim), "
                              f"the target's hidden size is {tcfg.hidden_size}")
    if vocab > tcfg.vocab_size or vocab < 1:
        raise CheckpointError(f"{folder}: the speculator's vocabulary ({vocab}) does not fit the target's "
                              f"({tcfg.vocab_size})")
    if n_predict < 1:
        raise CheckpointError(f"{folder}: n_predict must be >= 1, got {n_predict}")
    tie = bool(cfg.get("tie_weights", False))
    if tie and n_predict < 2:
        raise CheckpointError(f"{folder}: tie_weights needs n_predict >= 2")
    model = MLPSpeculator(emb_dim, inner, vocab, n_predict, tie, bool(cfg.get("scale_input", False)))
    sd = _weights(folder)
    want = model.state_dict()
    if tie:    # tied checkpoints may list every stage (the same tensors): keep the ones the model holds
        sd = {k: v for k, v in sd.items() if k in want}
    missing = sorted(set(want) - set(sd))
    if missing:
        raise CheckpointError(f"{folder}: {missing[0]} missing" + (f" (and {len(missing) - 1} more)"
                                                                   if len(missing) > 1 else ""))
    for name, t in sd.items():
        if name in want and t.shape != want[name].shape:
            raise CheckpointError(f"{folder}: {name} has shape {tuple(t.shape)}, expected {tuple(want[name].shape)}")
    unknown = sorted(set(sd) - set(want))
    if unknown:
        raise CheckpointError(f"{folder}: unexpected weight {unknown[0]}")
    model.load_state_dict(sd)
    # a bf16 checkpoint beside fp32 activations on the CPU stays bf16 (the kernels widen its
    # weights in registers: half the bytes); the states are computed in the target's dtype
    bf16 = all(t.dtype == torch.bfloat16 for t in sd.values() if t.is_floating_point())
    keep_bf16 = bf16 and target.dtype == torch.float32 and target.device.type == "cpu"
    model = model.to(device=target.device, dtype=torch.bfloat16 if keep_bf16 else target.dtype)
    return model.requires_grad_(False).eval()        # inference only: the kernels take its products
