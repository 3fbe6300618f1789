"""Spec-Bench in `specdec bench`: the question loader, the chat template, per-category results."""

from __future__ import annotations

import json

import pytest
import torch

from specdec.bench import spec_bench
from specdec.bench.prompts import load_prompts
from specdec.cli import main
from specdec.tokenizer import Tokenizer

from conftest import make_checkpoint


def test_vendored_questions_load_with_their_categories():
    rows = spec_bench.read_questions()
    assert len(rows) == 240 and len({r["id"] for r in rows}) == 240
    cats = {r["category"] for r in rows}
    assert cats == set(spec_bench.TASKS) | set(spec_bench.MT_BENCH)
    first = spec_bench.read_questions(limit_per_category=2)
    assert len(first) == 2 * len(cats)
    assert first[0] == rows[0]            # file order kept
    assert (spec_bench.QUESTIONS.parent / "LICENSE").is_file()


def test_categories_select_questions_and_an_unknown_one_names_the_known():
    rows = spec_bench.read_questions(limit_per_category=3, categories=["rag", "qa"])
    assert [r["category"] for r in rows] == ["qa"] * 3 + ["rag"] * 3      # file order kept
    with pytest.raises(ValueError, match=r"no category 'ragg' \(categories: .*rag"):
        spec_bench.read_questions(categories=["ragg"])


def test_bad_question_file_names_the_line(tmp_path):
    bad = tmp_path / "q.jsonl"
    bad.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["Who?"]}) + "\n"
                   + json.dumps({"question_id": 2, "category": "qa"}) + "\n")
    with pytest.raises(ValueError, match=r"q.jsonl:2: not a Spec-Bench question"):
        spec_bench.read_questions(bad)


def test_groups_follow_spec_bench_order():
    cats = ["qa", "writing", "rag", "coding", "qa"]
    groups = spec_bench.category_indices(cats)
    assert list(groups) == ["overall", "mt_bench", "qa", "rag", "writing", "coding"]
    assert groups["mt_bench"] == [1, 3] and groups["qa"] == [0, 4] and groups["overall"] == [0, 1, 2, 3, 4]


@pytest.fixture(scope="module")
def long_target(tmp_path_factory):
    # Spec-Bench's articles need a few thousand tokens of context with the tiny byte-level tokenizer
    return make_checkpoint(tmp_path_factory.mktemp("sb") / "target", layers=2, max_position_embeddings=8192)


def test_prompts_go_through_the_chat_template(long_target):
    tok = Tokenizer(long_target)
    name, prompts = load_prompts("spec-bench", tok, 16, 8192, limit_per_category=1)
    assert name == "spec-bench" and len(prompts) == 13
    q = spec_bench.read_questions(limit_per_category=1)[0]
    assert prompts[0].ids == tok.apply_chat_template([{"role": "user", "content": q["prompt"]}],
                                                     add_generation_prompt=True)["input_ids"]
    assert prompts[0].category == q["category"] and prompts[0].id == q["id"]


def test_bench_reports_per_category(long_target, tmp_path):
    torch.set_num_threads(1)
    out = tmp_path / "out"
    rc = main(["bench", "--model", str(long_target), "--methods", "ngram", "--num-speculative-tokens", "2",
               "--temperature", "0", "--prompts", "spec-bench", "--limit-per-category", "1", "--max-tokens", "4",
               "--repeats", "1", "--no-peers", "--out", str(out)])
    assert rc == 0
    s = json.loads((out / "results.json").read_text())["scenarios"][0]
    cats = s["categories"]
    assert list(cats)[:7] == ["overall", "mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"]
    assert cats["overall"]["num_prompts"] == 13 and cats["mt_bench"]["num_prompts"] == 8
    ngram = [m for m in cats["rag"]["methods"] if m["method"] == "ngram"][0]
    assert ngram["speedup_vs_plain"] is not None and ngram["greedy_match"]["identical"]
    md = (out / "results.md").read_text()
    assert "Per category (Spec-Bench)" in md and "| ngram K=2 |" in md
    assert "Decoding phase alone" in md
    assert (out / "categories_spec-bench_t0.png").is_file()
    results = json.loads((out / "results.json").read_text())
    assert "--limit-per-category 1" in results["command"]
    card = spec_bench.method_card_table(results, "ngram K=2")
    assert "| 0 | overall | 13 |" in card and "| 0 | rag | 1 |" in card and card.count("\n") == 16
    # tau is tokens per target forward, as in the per-category tables (not 1 + accepted / drafts)
    overall = [m for m in cats["overall"]["methods"] if m["name"] == "ngram K=2"][0]
    assert f"| 0 | overall | 13 | {overall['tokens_per_forward']:.2f} |" in card


def test_bench_categories_by_the_cpu_clock_report_the_decoding_phase(long_target, tmp_path):
    torch.set_num_threads(1)
    out = tmp_path / "out"
    rc = main(["bench", "--model", str(long_target), "--methods", "ngram", "--num-speculative-tokens", "2",
               "--temperature", "0", "--prompts", "spec-bench", "--categories", "qa,rag", "--limit-per-category", "1",
               "--max-tokens", "4", "--repeats", "1", "--clock", "cpu", "--no-peers", "--out", str(out)])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    cats = results["scenarios"][0]["categories"]
    assert list(cats) == ["overall", "qa", "rag"] and "--categories qa,rag" in results["command"]
    # the engine timed its steps by the same CPU clock, so the prefill can be left out
    assert all(m["decode_speedup_vs_plain"] is not None for m in cats["overall"]["methods"])


def test_chat_prompts_hold_one_bos(tiny_pair):
    """The bench's and the trainer's chat prompts are LLM.chat's: the template writes BOS, encoding
    adds none (the toy's began [BOS, BOS, ...])."""
    from specdec import LLM
    from specdec.bench.spec_bench import chat_prompt
    from specdec.train.answers import chat_ids

    llm = LLM(str(tiny_pair[0]), num_speculative_tokens=0)
    want = llm.chat_prompt([{"role": "user", "content": "hi"}])["prompt_token_ids"]
    assert chat_prompt(llm.tokenizer, "hi") == chat_ids(llm.tokenizer, "hi") == want
    assert want.count(llm.tokenizer.bos_token_id) == 1
