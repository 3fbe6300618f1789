"""`specdec train` fixes from review62: the Spec-Bench check sees Unicode variants and the
benchmark's short sentences under other instructions (without dropping ordinary prompts), sampled
answers do not depend on --batch, a shard of prompts all too long is done, and the report's
losses are training's. Tiny: seconds."""

from __future__ import annotations

import json
import unicodedata

import pytest
import torch

from specdec.cli import main
from specdec.tokenizer import Tokenizer
from specdec.train.answers import AnswerConfig, write_shards
from specdec.train.chatdata import SPEC_BENCH
from specdec.train.overlap import check_overlap, eval_texts
from specdec.train.seeds import TRANSLATE

from test_train_58 import TINY

ROWS = [json.loads(line) for line in SPEC_BENCH.read_text().splitlines() if line.strip()]
EVALS = eval_texts(SPEC_BENCH)


def kept_ids(prompts: list[dict]) -> list[str]:
    return [p["id"] for p in check_overlap(prompts, EVALS)[0]]


def test_spec_bench_turns_in_other_unicode_forms_are_dropped():
    """NFD (an accent as its own combining mark) split "Gültigkeit" into "gu ltigkeit": 21 of the
    45 accented first turns passed. Now every normal form, and case folding (ß is ss), matches."""
    for form in ("NFD", "NFKD", "NFC"):
        prompts = [{"id": r["question_id"], "prompt": unicodedata.normalize(form, r["turns"][0])} for r in ROWS]
        assert kept_ids(prompts) == [], form
    assert kept_ids([{"id": "upper", "prompt": "STRASSE " + ROWS[0]["turns"][0].upper()}]) == []
    assert kept_ids([{"id": "q", "prompt": "Where is the Straße?"}], ) == ["q"]
    assert check_overlap([{"id": "x", "prompt": "Wo ist die STRASSE mit dem Laden?"}],
                         ["Wo ist die Straße mit dem Laden?"])[0] == []


def test_a_spec_bench_sentence_under_another_instruction_is_dropped():
    """The WMT14 sentences (4 to 12 words) wrapped in specdec's other translation templates reached
    neither the 13-gram nor the 8-gram rule: 6 of 40 passed under each."""
    german = [r["turns"][0].split(": ", 1)[1] for r in ROWS if r["category"] == "translation"]
    for template in {t for t in TRANSLATE if "{src}" in t and "{lang_name}" not in t}:
        prompts = [{"id": i, "prompt": template.format(src=s)} for i, s in enumerate(german)]
        assert kept_ids(prompts) == [], template
    embedded = f"Here is a line from a news site. {german[1]} Please translate it, keeping the tone."
    assert kept_ids([{"id": "e", "prompt": embedded}]) == []


def test_ordinary_prompts_sharing_phrases_with_spec_bench_pass():
    """The check stays narrow: the instruction prefix, common words, a translation of another
    sentence, the first words of a question or a few words of a benchmark sentence are kept."""
    german = next(r["turns"][0] for r in ROWS if "Gültigkeit" in r["turns"][0])
    prompts = ["Translate German to English: Die Datei wurde nicht gefunden, bitte erneut versuchen.",
               "Translate this German sentence into English: Alle Kinder spielen gern im Garten.",
               "Summarize: The meeting covered the budget, the schedule and the new office.",
               "Write a C++ program to read a file and count its lines.",
               "Where was the first football world cup held, and who won it?",
               "Translate German to English: " + " ".join(german.split(": ", 1)[1].split()[:3]) + " Konzerte .",
               "Ein Gültigkeit Test: Café, naïve, São Paulo and Zoë met at the Straße.",
               "Explain how a hash map works, with an example in Python."]
    assert kept_ids([{"id": i, "prompt": p} for i, p in enumerate(prompts)]) == list(range(len(prompts)))


def answer(target, prompts, out, *flags):
    assert main(["train", "answers", "--target", str(target), "--prompts", str(prompts), "--out", str(out),
                 "--max-new-tokens", "10", "--per-shard", "3", "--greedy-fraction", "0", "--dtype", "float32",
                 "--backend", "specdec", "--eval", "none", *flags]) == 0
    return [torch.load(p) for p in sorted(out.glob("shard_*.pt"))]


def test_sampled_answers_do_not_depend_on_batch(tiny_pair, tmp_path):
    """Each prompt samples from its own generator (seed, prompt index), so --batch (only "how fast")
    changes no token, also when a run is resumed with another --batch; config.json says how."""
    from specdec.train.answers import ROW_SEEDS

    target, _ = tiny_pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n" for i, p in enumerate(
        ["Write a poem.", "Why is the sky blue?", "Name three colours.", "What is a list?", "Hello there.",
         "Give two tips for sleeping well."])))
    one = answer(target, prompts, tmp_path / "b1", "--batch", "1")
    four = answer(target, prompts, tmp_path / "b4", "--batch", "4")
    answer(target, prompts, tmp_path / "mix", "--batch", "1", "--stop-after", "1")
    mix = answer(target, prompts, tmp_path / "mix", "--batch", "4")
    assert not any(s["greedy"].any() for s in one)
    for a, b, c in zip(one, four, mix, strict=True):
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["tokens"], c["tokens"])
    assert json.loads((tmp_path / "mix" / "config.json").read_text())["row_seeds"] == ROW_SEEDS


def test_a_shard_of_prompts_all_too_long_is_done(tiny_pair, tmp_path):
    """It is not written, as before, but recorded in config.json as skipped: a resume neither redoes
    it nor waits for it, and the run says how many prompts were skipped."""
    from specdec.model import load_model
    from specdec.train.answers import skipped_shards

    target, _ = tiny_pair
    long = {"id": "long", "prompt": " ".join(["word"] * 1200)}          # > 900 tokens
    prompts = [{"id": "a", "prompt": "Hi."}, long, long, {"id": "b", "prompt": "Why?"}]
    model, tok, cfg = load_model(target, "float32"), Tokenizer(target), AnswerConfig(max_new_tokens=4, per_shard=1)
    logs = []
    paths = write_shards(model, tok, prompts, tmp_path / "ans", cfg, log=logs.append)
    assert [p.name for p in paths] == ["shard_00000.pt", "shard_00003.pt"]
    assert skipped_shards(tmp_path / "ans", prompts, 1) == {"shard_00001.pt": 1, "shard_00002.pt": 2}
    assert logs[-1].startswith("2 shards skipped, their 2 prompts all over 900 tokens")
    logs.clear()
    assert write_shards(model, tok, prompts, tmp_path / "ans", cfg, log=logs.append) == paths
    assert not any("too long" in s for s in logs) and len(logs) == 1        # nothing redone: the summary only
    assert skipped_shards(tmp_path / "ans", [long, *prompts[::3], long], 1) == {}     # other prompts in their places


def test_report_losses_are_trainings(tiny_pair, tmp_path):
    """`train report` evaluated every model on 16 windows of 512 tokens of the whole splits; now on
    the windows its training.json's evaluation used, so it reports training's losses."""
    from specdec.train.report import losses

    target, _ = tiny_pair
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({**TINY, "max_steps": 6, "seq_len": 24, "batch_size": 2, "eval_batches": 3, "lr": 0.01,
                               "corpus_limit_mb": 0.05, "warmup_steps": 1, "precision": "fp32"}))
    out = tmp_path / "d"
    assert main(["train", "draft", "--target", str(target), "--config", str(cfg), "--out", str(out),
                 "--work", str(tmp_path / "w")]) == 0
    trained = json.loads((out / "training.json").read_text())["result"]
    got = losses(out, Tokenizer(target))
    for k in ("validation_loss", "test_loss"):
        assert got[k] == pytest.approx(trained[k], abs=2e-3), k         # the saved weights are bf16
    assert got["windows"] == "6 windows of 24 tokens per split, its training's evaluation"
