"""Tiny checkpoints written by transformers, shared by the tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

VOCAB = 96
torch.set_num_threads(1)   # 2-core machine: one thread is faster than two that contend


def make_tokenizer(folder: Path, vocab: int = VOCAB) -> None:
    """A byte-level BPE tokenizer trained on a few lines of code, with `vocab` tokens."""
    from specdec.train.tokenizer import train_tokenizer

    texts = [
        "def add(a, b):\n    return a + b\n",
        "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
        "for i in range(10):\n    print(i)\n",
        "import os\nimport sys\n\nif __name__ == '__main__':\n    main()\n",
    ] * 20
    train_tokenizer(folder, vocab, texts)


def make_checkpoint(folder: Path, arch: str = "llama", seed: int = 0, vocab: int | None = None,
                    layers: int = 2, hidden: int = 64, tokenizer_from: Path | None = None, **kw) -> Path:
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is None:
        make_tokenizer(folder)
    else:
        for f in tokenizer_from.glob("tokenizer*.json"):
            (folder / f.name).write_bytes(f.read_bytes())
        if (tokenizer_from / "special_tokens_map.json").is_file():
            (folder / "special_tokens_map.json").write_bytes((tokenizer_from / "special_tokens_map.json").read_bytes())
    tok_vocab = json.loads((folder / "tokenizer.json").read_text())
    n_tok = len(tok_vocab["model"]["vocab"]) + sum(1 for t in tok_vocab["added_tokens"] if t["content"] not in tok_vocab["model"]["vocab"])
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config}[arch]
    kw = {"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, **kw}
    cfg = cls(vocab_size=vocab or n_tok, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
              bos_token_id=0, eos_token_id=1, **kw)
    torch.manual_seed(seed)
    model_cls = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
                 "qwen2": transformers.Qwen2ForCausalLM}[arch]
    model = model_cls(cfg)
    # random init is nearly uniform; sharpen the output so greedy paths and acceptance mean something
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0) if not cfg.tie_word_embeddings else None
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pair")
    target = make_checkpoint(root / "target", seed=0, layers=3)
    draft = make_checkpoint(root / "draft", seed=1, layers=1, hidden=32, tokenizer_from=target)
    return target, draft


@pytest.fixture(scope="session")
def near_draft(tiny_pair, tmp_path_factory) -> Path:
    """The target with noise on its LM head: a draft that agrees often but not always."""
    import transformers

    target, _ = tiny_pair
    folder = tmp_path_factory.mktemp("near") / "draft"
    model = transformers.AutoModelForCausalLM.from_pretrained(target)
    torch.manual_seed(7)
    with torch.no_grad():
        w = model.lm_head.weight
        w.add_(torch.randn_like(w) * w.std() * 0.3)
    model.save_pretrained(folder)
    for f in target.glob("tokenizer*.json"):
        (folder / f.name).write_bytes(f.read_bytes())
    return folder
