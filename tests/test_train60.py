"""`specdec train lm --tokenizer` and `train draft --target` read their tokenizer, never write one into
the folder given (a draft trained on a tokenizer of its own does not fit its target); `train
report` replaces only its own block in the model cards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdec.cli import main

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny.json"


def run(capsys, argv: list[str]) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def where(tmp_path, monkeypatch):
    """A folder to run in, with a model folder whose tokenizer is a tokenizer.model only (as many
    Llama folders ship): specdec reads no tokenizer there."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "llama" / "tokenizer.model").write_bytes(b"sentencepiece")
    return tmp_path


@pytest.mark.parametrize("argv,message", [
    (["draft", "--target", "missing"], "--target missing: not a model folder"),
    (["draft", "--target", "llama"], ("--target llama: no tokenizer specdec reads (llama: no tokenizer.json); specdec "
                                      "reads tokenizer.json, not tokenizer.model")),
    (["lm", "--tokenizer", "typo"], "--tokenizer typo: no such folder"),
    (["lm", "--tokenizer", "llama"], "--tokenizer llama: no tokenizer specdec reads"),
])
def test_an_input_without_a_tokenizer_is_refused_and_left_as_it_was(where, capsys, argv, message):
    before = snapshot(where)
    code, err = run(capsys, ["train", *argv, "--config", str(CONFIG), "--out", "out", "--work", "work"])
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("specdec: error: " + message)
    assert snapshot(where) == before        # no tokenizer trained into it, no work or out folder made


def test_train_reads_a_given_tokenizer_and_never_trains_one_into_it(tmp_path):
    """Called as a library, too: a tokenizer folder given to train() is not a cache to fill."""
    from specdec.tokenizer import TokenizerError
    from specdec.train.lm import TrainConfig, train

    given = tmp_path / "tokenizer"
    given.mkdir()
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        train(TrainConfig.load(CONFIG), tmp_path / "out", tmp_path / "work", tokenizer_dir=given)
    assert list(given.iterdir()) == [] and not (tmp_path / "work").exists()


def test_lm_with_a_tokenizer_folder_uses_it_as_it_is(tiny_pair, tmp_path):
    """The documented flow (`train lm --tokenizer runs/target/tokenizer`): the folder's tokenizer,
    copied into the output, the folder unchanged."""
    from specdec.model import load_model
    from specdec.tokenizer import Tokenizer

    given = tiny_pair[0]
    before, out = snapshot(given), tmp_path / "out"
    assert main(["train", "lm", "--config", str(CONFIG), "--tokenizer", str(given), "--out", str(out),
                 "--work", str(tmp_path / "work"), "--max-steps", "1"]) == 0
    assert snapshot(given) == before
    assert (out / "tokenizer.json").read_bytes() == (given / "tokenizer.json").read_bytes()
    assert load_model(out, "float32").config.vocab_size == len(Tokenizer(given))


def test_draft_of_a_gguf_target_takes_its_tokenizer(tiny_pair, tmp_path, capsys):
    """A target whose tokenizer is not a tokenizer.json (a GGUF's) is read as specdec.LLM reads it:
    the draft has the target's vocabulary and a tokenizer.json of it; the target is untouched."""
    from gguf_helpers import write_gguf

    from specdec.model import load_model
    from specdec.tokenizer import Tokenizer

    target = write_gguf(tiny_pair[0], tmp_path / "target" / "tiny.gguf")
    before = snapshot(target.parent)
    out = tmp_path / "draft"
    assert main(["train", "draft", "--target", str(target.parent), "--config", str(CONFIG), "--out", str(out),
                 "--work", str(tmp_path / "work"), "--max-steps", "1"]) == 0
    assert snapshot(target.parent) == before
    want = Tokenizer(target)
    assert load_model(out, "float32").config.vocab_size == len(want)
    got = Tokenizer(out)
    text = "def f(x):\n    return x + 1"
    assert got.encode(text) == want.encode(text)


def _report(rate: float) -> dict:
    run = {"acceptance_rate": rate, "mean_accepted_length": 3.25}
    return {"k": 4, "functions": 50, "max_tokens": 128, "dtype": "bfloat16", "greedy": run, "temperature_1": run,
            "ast_parse_share": 0.0, "machine": "a test CPU, 1 thread(s)",
            "target": {"validation_loss": 4.9, "test_loss": 4.3}, "draft": {"validation_loss": 4.8, "test_loss": 4.4}}


def test_report_replaces_only_its_own_block_in_the_cards(tmp_path):
    """`train report` run again rewrites its table and command, and keeps what was written by hand
    in the Quality section, above and below them (it used to replace the whole section)."""
    from specdec.train.report import write_into_cards

    folder = tmp_path / "target"
    folder.mkdir()
    (folder / "README.md").write_text("# target\n\nTrained by hand.\n")
    write_into_cards(_report(0.5111), "specdec train report --threads 1", folder)
    first = (folder / "README.md").read_text()
    assert first.startswith("# target\n\nTrained by hand.\n") and "0.5111" in first
    heading = "## Quality (held-out test split)\n"
    above, below = "**Read these numbers with care.** A note.\n\n", "\nLosses here are the report's.\n"
    (folder / "README.md").write_text(first.replace(heading, heading + "\n" + above) + below)

    write_into_cards(_report(0.5432), "specdec train report --threads 2", folder)
    card = (folder / "README.md").read_text()
    assert above in card and card.endswith(below) and card.count(heading) == 1
    assert "0.5432" in card and "0.5111" not in card
    assert "specdec train report --threads 2" in card and "--threads 1" not in card
    assert "bfloat16, on a test CPU, 1 thread(s)) by:" in card      # sampled sums differ per CPU: it is named
    assert json.loads((folder / "quality.json").read_text())["greedy"]["acceptance_rate"] == 0.5432
    write_into_cards(_report(0.5432), "specdec train report --threads 2", folder)
    assert (folder / "README.md").read_text() == card       # the same report: the same card


def test_report_replaces_an_unmarked_quality_section_once():
    """A card an older specdec wrote (its Quality section without the markers) gets that section
    replaced, as then, not a second one; the sections around it stay."""
    from specdec.train.report import HEADING, with_report

    old = f"# t\n\nintro\n\n{HEADING}\n\n| a | b |\nold table\n\n## Licence\n\nMIT\n"
    new = with_report(old, "NEW\n")
    assert new.count(HEADING) == 1 and "old table" not in new and "NEW\n" in new
    assert new.startswith("# t\n\nintro\n\n") and new.endswith("\n## Licence\n\nMIT\n")
    again = with_report(new, "NEWER\n")
    assert again.count(HEADING) == 1 and "NEWER" in again and again.count("NEW") == 1
