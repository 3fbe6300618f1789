"""`specdec bench --peers llamacpp`: llama.cpp (through llama-cpp-python) on the same tiny GGUF
file and prompt token ids. Runs only where the binding is installed; without it the methods are
skipped with a reason (also tested here, everywhere). Timings are never asserted."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

from specdec.bench import llamacpp
from specdec.cli import main

needs_binding = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                   reason="llama-cpp-python is not installed (pip install -e '.[peers]')")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, gguf_files):
    """llama_q's checkpoint again with a pre-tokenizer name llama.cpp knows ("default"; ids are
    fed directly, so its split regex never runs)."""
    from gguf_helpers import T, write_gguf

    kinds = {"attn_q": T.Q8_0, "attn_k": T.Q8_0, "attn_v": T.Q8_0, "attn_output": T.Q4_0, "ffn_gate": T.Q4_1,
             "ffn_up": T.Q4_1, "ffn_down": T.Q8_0, "token_embd": T.Q8_0}
    pick = lambda name, ndim: next((v for k, v in kinds.items() if f".{k}." in name or name.startswith(k + ".")), T.F32)  # noqa: E731
    return write_gguf(gguf_files["llama_q_hf"], tmp_path_factory.mktemp("lc") / "tiny.gguf", pick, pre="default")


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "for i in range(10):\n    print(i)\nfor i in range(10):\n", "id": "loop"},
            {"prompt": "def add(a, b):\n    return a + b\n\ndef add(", "id": "add"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@needs_binding
def test_llamacpp_peers_run_on_the_same_file_and_ids(tiny_gguf, prompts_file, tmp_path):
    torch.set_num_threads(1)
    out = tmp_path / "out"
    rc = main(["bench", "--model", str(tiny_gguf), "--methods", "plain,ngram,llamacpp_prompt_lookup", "--peers", "llamacpp",
               "--num-speculative-tokens", "3", "--temperature", "0,0.7", "--prompts", str(prompts_file),
               "--repeats", "1", "--max-tokens", "12", "--threads", "1", "--out", str(out)])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert "--peers llamacpp" in results["command"] and results["config"]["threads"] == 1
    greedy, sampled = results["scenarios"]
    by_name = {m["name"]: m for m in greedy["methods"]}
    assert list(by_name) == ["plain", "ngram K=3", "llamacpp_plain", "llamacpp_prompt_lookup K=3",
                             "llamacpp_prompt_lookup K=10"]           # the K asked for, and its default
    plain, pld = by_name["llamacpp_plain"], by_name["llamacpp_prompt_lookup K=3"]
    assert plain["family"] == pld["family"] == "llama.cpp"
    assert plain["output_tokens"] > 0 and pld["output_tokens"] > 0
    assert pld["draft_tokens"] > 0 and pld["settings"]["num_pred_tokens"] == 3 and pld["settings"]["logits_all"]
    # compared with specdec plain and with llama.cpp's own plain decoding (reported, not asserted:
    # their int8 activations round differently from ours)
    assert plain["greedy_match"] is not None and pld["greedy_match_own_plain"] is not None
    assert by_name["ngram K=3"]["speedup_vs_llamacpp_plain"] is not None
    assert all(m["roofline_fraction"] is not None for m in greedy["methods"])
    assert {m["name"] for m in sampled["methods"]} == set(by_name)
    table = (out / "results.md").read_text()
    assert "llamacpp_plain (llama.cpp)" in table and "× llama.cpp plain" in table and "llama-cpp-python" in table


def test_without_the_binding_the_methods_are_skipped(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)      # import llama_cpp now raises ImportError
    variants, skipped = llamacpp.llamacpp_variants(["llamacpp_plain"], [3], "x.gguf", 1, 64, [0])
    assert variants == [] and "pip install" in skipped[0].reason


def test_acceptance_is_counted_against_what_was_generated():
    rec = llamacpp._Recorder(lambda ids: ids[-2:], prompt_len=3)
    rec([1, 2, 3])                       # before any output: draft [2, 3]
    rec([1, 2, 3, 2, 3, 9])              # after 3 outputs: draft [3, 9]
    s = rec.stats([2, 3, 9, 3, 7])
    assert (s.num_drafts, s.draft_tokens, s.accepted_tokens) == (2, 4, 3)
    assert s.accepted_per_position == [2, 1]
