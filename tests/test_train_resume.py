"""Resuming and reusing training runs: a checkpoint or data folder reused with settings other
than those that made it is refused in one line (exit 2), never mixed in silently nor met with a
traceback; flags that cannot mean what they say are refused up front."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
import torch

from conftest import make_checkpoint
from specdec.cli import main
from test_chat_train import answers  # noqa: F401  (the module's fixture: a tiny target's answers folder)


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("specdec: error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture(scope="module")
def other(answers, tmp_path_factory):  # noqa: F811
    """(a second target of the same shape and tokenizer, other weights; a second answers folder:
    the first's shards in another order, so other validation and training data)."""
    target, root, rows = answers
    base = tmp_path_factory.mktemp("other")
    target2 = make_checkpoint(base / "target2", seed=5, layers=3, tokenizer_from=target)
    b = base / "answers_b"
    shutil.copytree(root / "answers", b)
    (b / "shard_00000.pt").replace(b / "tmp.pt")
    (b / "shard_00004.pt").replace(b / "shard_00000.pt")
    (b / "tmp.pt").replace(b / "shard_00004.pt")
    return target2, b


def heads_argv(kind, target, data, work, out, *extra):
    flags = ["--window", "8", "--batch", "2"] if kind == "eagle" else ["--num-heads", "2", "--batch", "16"]
    return ["train", kind, "--target", str(target), "--data", str(data), "--data-kind", "chat", "--val-shards", "1",
            "--report-prompts", "0", "--draft-vocab", "40", "--steps", "4", "--work", str(work), "--out", str(out),
            *flags, *extra]


def test_heads_resumed_on_other_data_are_refused_and_the_card_keeps_every_command(answers, other, tmp_path,  # noqa: F811
                                                                                   capsys):
    """D1: the draft vocabulary would be recomputed from the other data while the checkpoint's
    heads keep the first's: labels scrambled. Resuming on the same data goes on, and the card
    lists both commands of the run."""
    target, root, _ = answers
    _, data_b = other
    w, out = tmp_path / "w", tmp_path / "out"
    assert main(heads_argv("medusa", target, root / "answers", w, out, "--stop-after", "2")) == 0
    assert main(heads_argv("medusa", target, data_b, w, out)) == 2
    err = one_line_error(capsys)
    assert "--data" in err and "another --work" in err and not out.exists()
    assert main(heads_argv("medusa", target, root / "answers", w, out)) == 0
    info = json.loads((out / "training.json").read_text())
    assert info["result"]["steps"] == 4
    assert len(info["commands"]) == 2 and "--stop-after" in info["commands"][0] and "--stop-after" not in info["commands"][1]


def test_heads_on_answers_of_another_target_are_refused(answers, other, tmp_path, capsys):  # noqa: F811
    target, root, _ = answers
    target2, _ = other
    assert main(heads_argv("eagle", target2, root / "answers", tmp_path / "w", tmp_path / "out")) == 2
    err = one_line_error(capsys)
    assert "--target" in err and str(target.resolve()) in err


def test_heads_resumed_with_another_shape_say_so_in_one_line(answers, tmp_path, capsys):  # noqa: F811
    """D7: another --draft-vocab, --num-heads or kind in the same --work: one line, exit 2 (it was
    torch's RuntimeError with a traceback), also for a checkpoint written before the records."""
    target, root, _ = answers
    w, out, data = tmp_path / "w", tmp_path / "out", root / "answers"
    assert main(heads_argv("medusa", target, data, w, out, "--stop-after", "2")) == 0
    capsys.readouterr()
    argv = heads_argv("medusa", target, data, w, out)
    assert main([*argv[:argv.index("--draft-vocab")], "--draft-vocab", "30", *argv[argv.index("--draft-vocab") + 2:]]) == 2
    assert "--draft-vocab 40 (this run: 30)" in one_line_error(capsys)
    assert main([*argv, "--num-heads", "3"]) == 2
    assert "--num-heads 2 (this run: 3)" in one_line_error(capsys)
    assert main(heads_argv("eagle", target, data, w, out)) == 2
    assert "medusa" in one_line_error(capsys)
    # a checkpoint from before the records: the shape and vocabulary checks still hold
    ckpt = torch.load(w / "checkpoint.pt", weights_only=False)
    ckpt.pop("run", None)
    torch.save(ckpt, w / "checkpoint.pt")
    assert main([*argv[:argv.index("--draft-vocab")], "--draft-vocab", "30", *argv[argv.index("--draft-vocab") + 2:]]) == 2
    assert "--work" in one_line_error(capsys)
    assert main(heads_argv("eagle", target, data, w, out)) == 2
    one_line_error(capsys)
    assert main(argv) == 0 and (out / "model.safetensors").is_file()       # the same options resume it


def test_vocab_draft_resumed_on_other_data_is_refused(answers, other, tmp_path, capsys):  # noqa: F811
    target, root, _ = answers
    _, data_b = other
    argv = ["train", "vocab-draft", "--target", str(target), "--layers", "1", "--draft-vocab", "40", "--steps", "4",
            "--batch", "2", "--window", "48", "--val-shards", "1", "--precision", "fp32", "--report-prompts", "0",
            "--out", str(tmp_path / "out"), "--work", str(tmp_path / "w")]
    assert main([*argv, "--data", str(root / "answers"), "--stop-after", "2"]) == 0
    assert main([*argv, "--data", str(data_b)]) == 2
    assert "--data" in one_line_error(capsys)
    assert main([*argv, "--data", str(root / "answers"), "--layers", "2"]) == 2
    assert "--layers 1 (this run: 2)" in one_line_error(capsys)
    assert main([*argv, "--data", str(root / "answers")]) == 0


def test_answers_resumed_with_other_settings_or_target_are_refused(answers, other, tmp_path, capsys):  # noqa: F811
    """D3: the present shards were kept whatever --per-shard / --target / --prompts said."""
    target, root, rows = answers
    target2, _ = other
    out = tmp_path / "ans"

    def argv(t=target, per_shard="2", prompts=root / "short.jsonl", limit="4"):
        return ["train", "answers", "--target", str(t), "--prompts", str(prompts), "--out", str(out),
                "--max-new-tokens", "6", "--batch", "3", "--per-shard", per_shard, "--dtype", "float32", "--limit", limit]

    assert main(argv()) == 0
    capsys.readouterr()
    assert main(argv(per_shard="4")) == 2
    assert "--per-shard 2 (this run: 4)" in one_line_error(capsys)
    assert main(argv(t=target2)) == 2
    assert "--target" in one_line_error(capsys)
    reordered = tmp_path / "reordered.jsonl"
    reordered.write_text("".join(json.dumps(r) + "\n" for r in reversed(rows)))
    assert main(argv(prompts=reordered)) == 2
    assert "--prompts" in one_line_error(capsys)
    assert main(argv(limit="6")) == 0 and len(list(out.glob("shard_*.pt"))) == 3      # more prompts: goes on
    rec = json.loads((out / "config.json").read_text())
    assert rec["per_shard"] == 2 and rec["target"]["path"] == str(target.resolve())


def test_train_draft_resumed_with_another_teacher_is_refused(answers, other, tmp_path, capsys):  # noqa: F811
    """D2: steps 1-2 from one teacher, 3-4 from another, the card naming only the last."""
    from pathlib import Path

    target, _, _ = answers
    target2, _ = other
    config = Path(__file__).resolve().parents[1] / "configs" / "tiny.json"
    argv = ["train", "draft", "--config", str(config), "--out", str(tmp_path / "out"), "--work", str(tmp_path / "w"),
            "--max-steps", "4"]
    assert main([*argv, "--target", str(target), "--stop-after", "2"]) == 0
    assert main([*argv, "--target", str(target2)]) == 2
    assert "--target" in one_line_error(capsys)
    assert main([*argv, "--target", str(target)]) == 0
    commands = json.loads((tmp_path / "out" / "training.json").read_text())["commands"]
    assert len(commands) == 2 and "--stop-after" in commands[0]


def test_selfdistill_data_of_another_target_and_one_validation_shard(answers, other, tmp_path):  # noqa: F811
    """D5: a self-distillation folder made for one target is refused to another (its generations
    and features are the first's). D8: with one validation shard it is greedy (it was sampled:
    round(0.5) is 0), and an accuracy over no positions is absent, not 0.0."""
    from specdec.train.heads import HeadsConfig, train_heads
    from specdec.train.provenance import RunMismatch

    target, _, _ = answers
    target2, _ = other
    data = tmp_path / "sd"
    data.mkdir()
    cfg = HeadsConfig(kind="medusa", num_heads=2, batch=16, draft_vocab=40, steps=2, shards=1, val_shards=1,
                      corpus_limit_mb=0.02)
    r = train_heads(cfg, target, tmp_path / "out", tmp_path / "w", data, report_prompts=0, log=lambda s: None)
    assert all(isinstance(a, float) for a in r["top1_accuracy_per_head"])
    assert r["sampled_top1_accuracy_per_head"] == [None, None]
    assert torch.load(data / "validation" / "shard_00000.pt")["greedy"].all()
    card = (tmp_path / "out" / "README.md").read_text()
    assert "[None" not in card and "–" in card
    with pytest.raises(RunMismatch, match="--target"):
        train_heads(cfg, target2, tmp_path / "out2", tmp_path / "w2", data, report_prompts=0, log=lambda s: None)


def test_eagle3_features_follow_the_layers_and_a_changed_resume_is_refused(answers, tmp_path, capsys):  # noqa: F811
    """D4: work/features.pt was reused whatever --feature-layers said; now it is rebuilt, and a
    checkpoint made with other layers is refused."""
    from specdec.proposers.suffix import save_datastore
    from specdec.proposers.suffix_index import SuffixIndex

    target, _, _ = answers
    g = torch.Generator().manual_seed(0)
    save_datastore(SuffixIndex.build([torch.randint(5, 90, (24,), generator=g).tolist() for _ in range(8)]),
                   tmp_path / "store")
    argv = ["train", "eagle3", "--target", str(target), "--data", str(tmp_path / "store"), "--out", str(tmp_path / "out"),
            "--work", str(tmp_path / "w"), "--steps", "2", "--batch", "2", "--window", "8", "--draft-vocab", "30",
            "--val-docs", "2", "--precision", "fp32"]
    assert main([*argv, "--feature-layers", "0,1,2"]) == 0
    assert main([*argv, "--feature-layers", "1,2"]) == 2
    assert "--feature-layers 0,1,2 (this run: 1,2)" in one_line_error(capsys)
    (tmp_path / "w" / "checkpoint.pt").unlink()
    assert main([*argv, "--feature-layers", "1,2"]) == 0
    assert torch.load(tmp_path / "w" / "features.pt")["feats"].shape[1] == 2 * 64
    assert json.loads((tmp_path / "out" / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [1, 2]


def test_feature_layers_are_sorted_and_duplicates_refused():
    """D6: the loader (and vLLM) read the layers in ascending order."""
    from specdec.train.flags import layer_list

    assert layer_list("2,1,0") == (0, 1, 2)
    with pytest.raises(argparse.ArgumentTypeError, match="twice"):
        layer_list("1,1,2")


def test_steps_0_without_init_is_refused(answers, tmp_path, capsys):  # noqa: F811
    """D9: it wrote randomly initialised heads as a finished model."""
    target, root, _ = answers
    argv = heads_argv("eagle", target, root / "answers", tmp_path / "w", tmp_path / "out")
    argv[argv.index("--steps") + 1] = "0"
    assert main(argv) == 2
    assert "--steps 0" in one_line_error(capsys) and not (tmp_path / "out").exists() and not (tmp_path / "w").exists()
