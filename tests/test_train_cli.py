"""`specdec train ...`: a bad flag value is one error line naming the flag, exit status 2, no
traceback, and nothing made on disk; checked before any model is loaded or data read (no
training here: each case fails in milliseconds)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdec.cli import main


def run(capsys, argv: list[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as e:       # argparse's refusals
        code = e.code
    return code, capsys.readouterr().err


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture
def where(tmp_path, monkeypatch):
    """A folder to run in (a default such as runs/selfdistill would land here) holding a
    model folder that is no model (config.json only: loading it fails, so a flag not checked
    up front shows as another error) and an answers folder of two (empty) shards."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{}")
    (tmp_path / "answers").mkdir()
    for i in range(2):
        (tmp_path / "answers" / f"shard_{i:05d}.pt").write_bytes(b"")
    return tmp_path


# (the command with its required flags, the bad flag, its bad value): paths point at nothing, so
# that before the checks each command failed at once on something else, or ran and wrote
HEADS = ["--target", "{t}/nothing", "--out", "{t}/out", "--work", "{t}/work"]
VOCAB_DRAFT = ["vocab-draft", "--target", "{t}/nothing", "--data", "{t}/nothing", "--out", "{t}/out", "--work", "{t}/work"]
EAGLE3 = ["eagle3", "--target", "{t}/nothing", "--data", "{t}/nothing", "--out", "{t}/out", "--work", "{t}/work"]
ANSWERS = ["answers", "--target", "{t}/nothing", "--prompts", "{t}/nothing.jsonl", "--out", "{t}/out"]
PROMPTS = ["prompts", "--out", "{t}/out", "--eval", "{t}/nothing.jsonl"]
REPORT = ["report", "--target", "{t}/nothing", "--draft", "{t}/nothing"]
SUFFIX = ["suffix", "--data", "{t}/nothing", "--out", "{t}/out"]
LM = ["lm", "--config", "{t}/nothing.json", "--out", "{t}/out", "--work", "{t}/work"]
DRAFT = ["draft", "--target", "{t}/nothing", "--config", "{t}/nothing.json", "--out", "{t}/out", "--work", "{t}/work"]

BAD = [
    (["eagle", *HEADS], "--threads", "0"),
    (["eagle", *HEADS], "--batch", "0"),
    (["eagle", *HEADS], "--draft-vocab", "0"),
    (["eagle", *HEADS], "--window", "0"),
    (["eagle", *HEADS], "--steps", "-1"),
    (["eagle", *HEADS], "--lr", "0"),
    (["eagle", *HEADS], "--noise", "-0.5"),
    (["eagle", *HEADS], "--unroll", "0"),
    (["eagle", *HEADS], "--token-weight", "-1"),
    (["eagle", *HEADS], "--stop-after", "0"),
    (["medusa", *HEADS], "--val-shards", "0"),
    (["medusa", *HEADS], "--shards", "0"),
    (["medusa", *HEADS], "--num-heads", "0"),
    (["medusa", *HEADS], "--report-prompts", "-1"),
    (["medusa", *HEADS], "--eval-every", "-5"),
    (VOCAB_DRAFT, "--batch", "0"),
    (VOCAB_DRAFT, "--window", "1"),
    (VOCAB_DRAFT, "--layers", "0"),
    (VOCAB_DRAFT, "--lr", "nan"),
    (VOCAB_DRAFT, "--hard-weight", "-1"),
    (VOCAB_DRAFT, "--steps", "-1"),
    (VOCAB_DRAFT, "--val-shards", "0"),
    (VOCAB_DRAFT, "--threads", "0"),
    (EAGLE3, "--window", "3"),
    (EAGLE3, "--val-docs", "0"),
    (EAGLE3, "--max-tokens", "0"),
    (EAGLE3, "--draft-vocab", "0"),
    (EAGLE3, "--threads", "0"),
    (EAGLE3, "--feature-layers", "2,x"),
    (ANSWERS, "--threads", "0"),
    (ANSWERS, "--limit", "-3"),
    (ANSWERS, "--per-shard", "0"),
    (ANSWERS, "--greedy-fraction", "1.5"),
    (PROMPTS, "--count", "-3"),
    (PROMPTS, "--threads", "0"),
    (PROMPTS, "--self-instruct", "-1"),
    (REPORT, "--functions", "0"),
    (REPORT, "--k", "0"),
    (REPORT, "--threads", "0"),
    (SUFFIX, "--shards", "0"),
    (LM, "--threads", "0"),
    (LM, "--max-steps", "-1"),
    (DRAFT, "--stop-after", "0"),
]


@pytest.mark.parametrize("command,flag,value", BAD, ids=[f"{c[0]} {f} {v}" for c, f, v in BAD])
def test_bad_flag_value_is_refused_up_front(where, capsys, command, flag, value):
    argv = ["train", *(w.format(t=where) for w in command), flag, value]
    before = files(where)
    code, err = run(capsys, argv)
    assert code == 2 and "Traceback" not in err
    assert err.splitlines()[-1].startswith(f"specdec train {command[0]}: error: argument {flag}: ")
    assert files(where) == before


@pytest.mark.parametrize("argv,message", [
    # a --data folder that is not there is refused (selfdistill data are made only in the default one)
    (["eagle", "--target", "{t}/target", "--data", "{t}/nothing", "--out", "{t}/out", "--work", "{t}/work"],
     "--data {t}/nothing: no such folder"),
    (["medusa", "--target", "{t}/target", "--data", "{t}/nothing", "--data-kind", "chat", "--out", "{t}/out"],
     "--data {t}/nothing: no such answers folder"),
    (["eagle", "--target", "{t}/target", "--data", "{t}/answers", "--data-kind", "chat", "--out", "{t}/out"],
     "--data {t}/answers: 2 answer shards, need more than --val-shards 4"),
    (["eagle", "--target", "{t}/target", "--data", "{t}/answers", "--data-kind", "chat", "--init", "{t}/nothing",
      "--out", "{t}/out"], "--init {t}/nothing: no such folder"),
    (["vocab-draft", "--target", "{t}/target", "--data", "{t}/answers", "--val-shards", "2", "--out", "{t}/out",
      "--work", "{t}/work"], "--data {t}/answers: 2 answer shards, need more than --val-shards 2"),
    (["vocab-draft", "--target", "{t}/target", "--data", "{t}/nothing", "--out", "{t}/out", "--work", "{t}/work"],
     "--data {t}/nothing: no such answers folder"),
    (["eagle3", "--target", "{t}/target", "--data", "{t}/nothing", "--out", "{t}/out", "--work", "{t}/work"],
     "--data {t}/nothing: no such datastore folder"),
    (["eagle3", "--target", "{t}/target", "--data", "{t}/answers", "--out", "{t}/out", "--work", "{t}/work"],
     "--data {t}/answers: not a suffix datastore"),
])
def test_missing_or_short_data_is_refused_before_anything_is_made(where, capsys, argv, message):
    before = files(where)
    code, err = run(capsys, ["train", *(w.format(t=where) for w in argv)])
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1
    assert err.startswith("specdec: error: " + message.format(t=where))
    assert files(where) == before


def test_eagle3_with_fewer_documents_than_val_docs(where, capsys):
    """The default --val-docs (48) on a 10-document datastore: one line saying to lower it."""
    from specdec.proposers.suffix import save_datastore
    from specdec.proposers.suffix_index import SuffixIndex

    save_datastore(SuffixIndex.build([[5 + i, 6, 7, 8] for i in range(10)]), where / "store")
    before = files(where)
    code, err = run(capsys, ["train", "eagle3", "--target", str(where / "target"), "--data", str(where / "store"),
                             "--out", str(where / "out"), "--work", str(where / "work")])
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1
    assert "10 documents, --val-docs 48 held out" in err and "lower --val-docs (below 10)" in err
    assert files(where) == before


def test_report_prompts_keep_to_the_context(tiny_pair):
    """Held-out prompts too long for 64 new tokens in the target's context are passed over with
    a warning naming --report-prompts (they made the engine refuse them after the weights were
    saved); where every one fits, the first n are taken, as before."""
    from specdec.train.headreport import fitting_prompts
    from specdec.train.heads import HeadsConfig, _report_prompts

    logged = []
    assert fitting_prompts([[1] * 10, [1] * 50, [1] * 20, [1] * 30], 2, 100, logged.append, max_tokens=64) == \
        [[1] * 10, [1] * 20]
    assert len(logged) == 1 and "--report-prompts 2" in logged[0] and "1 held-out prompt(s) too long" in logged[0]
    assert fitting_prompts([[1] * 50], 3, 100, logged.append, max_tokens=64) == []
    assert "no speculation numbers" in logged[-1]
    assert fitting_prompts([[1] * 10], 3, 100, logged.append, max_tokens=64) == [[1] * 10] and len(logged) == 2

    target, _ = tiny_pair
    cfg = HeadsConfig(kind="eagle")
    roomy, _ = _report_prompts(cfg, None, 5, target, 100_000, logged.append)
    assert len(roomy) == 5 and len(logged) == 2
    context = min(len(p) for p in roomy) + 64          # the shortest of those fits, the longest no longer does
    short, what = _report_prompts(cfg, None, 5, target, context, logged.append)
    assert short and all(len(p) + 64 <= context for p in short) and what == "test-split function headers"
    fit = [p for p in roomy if len(p) + 64 <= context]
    assert short[:len(fit)] == fit                      # the same order, the longer ones passed over
    assert "--report-prompts 5" in logged[-1] and f"{context}-token context" in logged[-1]

