"""Training end to end on a tiny config: target, an interruption and resume, draft distillation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers

from specdec.cli import main
from specdec.model import load_model
from specdec.train.data import corpus_files, split_of

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny.json"


def test_split_is_deterministic_by_path():
    files = corpus_files()
    assert files["test"] and files["validation"] and files["train"]
    assert not set(files["test"]) & set(files["train"])
    assert all(split_of(f) == "test" for f in files["test"])


def test_train_lm_resume_and_distil_draft(tmp_path, capsys):
    work, out = tmp_path / "work", tmp_path / "target"
    assert main(["train", "lm", "--config", str(CONFIG), "--out", str(out), "--work", str(work), "--stop-after", "3"]) == 0
    assert "stopped at step 3" in capsys.readouterr().out and not out.exists()
    assert main(["train", "lm", "--config", str(CONFIG), "--out", str(out), "--work", str(work)]) == 0
    resumed = json.loads((out / "training.json").read_text())
    # an uninterrupted run with the same seed lands on the same weights
    shutil.copytree(work / "tokenizer", tmp_path / "work2" / "tokenizer")
    assert main(["train", "lm", "--config", str(CONFIG), "--out", str(tmp_path / "straight"),
                 "--work", str(tmp_path / "work2")]) == 0
    a, b = load_model(out, "float32"), load_model(tmp_path / "straight", "float32")
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    assert resumed["result"]["steps"] == 6 and resumed["commands"][0].startswith("specdec train lm")
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "README.md"):
        assert (out / name).is_file(), name
    card = (out / "README.md").read_text()
    assert "specdec train lm" in card and "test loss" in card

    # transformers loads what we wrote, and its logits match the runtime's
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok("def f(x):\n    return x")["input_ids"]
    assert ids[0] == tok.bos_token_id
    x = torch.tensor([ids])
    with torch.no_grad():
        assert (hf(x).logits - a(x).logits).abs().max() < 1e-4
    assert "<|assistant|>" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                       add_generation_prompt=True)

    draft = tmp_path / "draft"
    assert main(["train", "draft", "--target", str(out), "--config", str(CONFIG), "--out", str(draft),
                 "--work", str(tmp_path / "dwork"), "--max-steps", "3"]) == 0
    assert "distilled" in (draft / "README.md").read_text()
    assert load_model(draft, "float32").config.vocab_size == a.config.vocab_size
