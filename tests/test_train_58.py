"""`specdec train ...` guards (hunt train58): token ids outside the target's vocabulary, a
datastore of another target, diverged runs, config values, the Spec-Bench check, card numbers,
prompt counts, checkpoint leftovers and what a trained drafter's config names. Tiny: seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdec.cli import main
from specdec.model import load_model
from specdec.train.chatdata import SPEC_BENCH
from specdec.train.headdata import FlatData
from specdec.train.lm import TrainConfig, model_card, save_checkpoint
from specdec.train.overlap import eval_texts
from specdec.train.prompts import PromptConfig, build_prompts
from specdec.train.provenance import target_fingerprint

from test_train_cli import run

TINY = {"model": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2}, "seq_len": 64, "batch_size": 4, "max_steps": 8, "eval_every": 4,
        "save_every": 2}


def token_shard(path: Path, seqs: list[list[int]]) -> None:
    """An answers shard without features (as brought back from a GPU lease)."""
    lens = torch.tensor([len(s) for s in seqs])
    torch.save({"ids": [str(i) for i in range(len(seqs))], "tokens": torch.tensor(sum(seqs, []), dtype=torch.int32),
                "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]),
                "prompt_lens": torch.tensor([2] * len(seqs)), "greedy": torch.tensor([True] * len(seqs)),
                "finished": torch.tensor([True] * len(seqs))}, path)


def test_features_refuse_ids_outside_the_targets_vocabulary(tiny_pair, tmp_path, capsys):
    target, _ = tiny_pair
    V = load_model(target, "float32").config.vocab_size
    (tmp_path / "data").mkdir()
    token_shard(tmp_path / "data" / "shard_00000.pt", [[1, 2, 3, 4], [5, V + 5, 6, 7]])
    code, err = run(capsys, ["train", "features", "--target", str(target), "--data", str(tmp_path / "data"),
                             "--out", str(tmp_path / "out")])
    assert code == 2 and f"token id {V + 5} is outside" in err and "shard_00000.pt" in err
    assert len(err.strip().splitlines()) == 1 and not list((tmp_path / "out").glob("shard_*"))


def datastore(folder: Path, docs: list[list[int]], **extra) -> Path:
    from specdec.proposers.suffix import save_datastore
    from specdec.proposers.suffix_index import SuffixIndex

    save_datastore(SuffixIndex.build(docs), folder, {"source": {"target": extra.pop("target", None)}}, **extra)
    return folder


def eagle3(target, data, tmp_path, name="e3", *flags) -> list[str]:
    return ["train", "eagle3", "--target", str(target), "--data", str(data), "--out", str(tmp_path / name),
            "--work", str(tmp_path / f"{name}_work"), "--steps", "2", "--batch", "2", "--window", "8",
            "--draft-vocab", "16", "--val-docs", "1", "--feature-layers", "0,1,2", "--precision", "fp32", *flags]


def docs_of(V: int, n: int = 6, length: int = 24) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, V, (length,), generator=g).tolist() for _ in range(n)]


def test_eagle3_refuses_a_datastore_of_another_target_or_vocabulary(tiny_pair, tmp_path, capsys):
    target, other = tiny_pair
    V = load_model(target, "float32").config.vocab_size
    # ids past the table: refused before the forward reads outside it (no features cached)
    big = datastore(tmp_path / "big", [*docs_of(V), [1, 2, V + 3, 4]])
    code, err = run(capsys, eagle3(target, big, tmp_path))
    assert code == 2 and f"token id {V + 3}" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "e3_work" / "features.pt").exists() and not (tmp_path / "e3").exists()
    # a recorded vocabulary other than the target's
    code, err = run(capsys, eagle3(target, datastore(tmp_path / "v", docs_of(V), vocab_size=4 * V), tmp_path))
    assert code == 2 and f"{4 * V}-token vocabulary" in err and not (tmp_path / "e3").exists()
    # answered by another target (same vocabulary): refused, as answers folders are for eagle / vocab-draft
    code, err = run(capsys, eagle3(target, datastore(tmp_path / "o", docs_of(V), target=target_fingerprint(other)),
                                   tmp_path))
    assert code == 2 and "answered by --target" in err and not (tmp_path / "e3").exists()


def test_eagle3_writes_a_card_and_names_its_target(tiny_pair, tmp_path, capsys):
    from specdec.model.eagle3 import load_eagle3

    target, _ = tiny_pair
    model = load_model(target, "float32")
    V = model.config.vocab_size
    store = datastore(tmp_path / "s", docs_of(V), vocab_size=V, target=target_fingerprint(target))
    code, err = run(capsys, eagle3(target, store, tmp_path))
    assert code == 0, err
    out = tmp_path / "e3"
    card = (out / "README.md").read_text()
    assert "EAGLE-3" in card and "specdec train eagle3" in card
    assert json.loads((out / "config.json").read_text())["specdec_target"] == {"path": str(target), "vocab_size": V}
    load_eagle3(out, model)         # the loader ignores the key


def test_a_diverged_run_stops_and_writes_nothing(tiny_pair, tmp_path, capsys):
    target, _ = tiny_pair
    V = load_model(target, "float32").config.vocab_size
    code, err = run(capsys, eagle3(target, datastore(tmp_path / "s", docs_of(V)), tmp_path, "e3", "--lr", "1e30"))
    assert code == 2 and "diverged" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "e3").exists()
    from specdec.train.lm import check_loss

    with pytest.raises(ValueError, match="loss inf"):
        check_loss(torch.tensor(float("inf")), 4, tmp_path / "nothing.pt")


@pytest.mark.parametrize("change, field", [
    ({"eval_every": 0}, "eval_every"), ({"save_every": 0}, "save_every"), ({"max_steps": 0}, "max_steps"),
    ({"seq_len": 0}, "seq_len"), ({"batch_size": 0}, "batch_size"), ({"distill_temperature": 0}, "distill_temperature"),
    ({"lr": float("nan")}, "lr"), ({"lr": -1.0}, "lr"), ({"model": {}}, "model"),
    ({"model": {**TINY["model"], "num_attention_heads": 3}}, "model.num_attention_heads"),
])
def test_config_values_are_checked_when_loaded(tmp_path, change, field):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({**TINY, **change}))
    with pytest.raises(ValueError, match=f"c.json: {field}"):
        TrainConfig.load(path)


@pytest.mark.parametrize("text, message", [("{ not json", "not JSON"), ("[1, 2]", "JSON object")])
def test_a_config_that_is_not_an_object_names_the_file(tmp_path, text, message):
    path = tmp_path / "c.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"c.json: .*{message}"):
        TrainConfig.load(path)


def test_max_steps_zero_is_refused_on_the_command_line(tmp_path, capsys):
    code, err = run(capsys, ["train", "lm", "--config", str(tmp_path / "c.json"), "--out", str(tmp_path / "o"),
                             "--max-steps", "0"])
    assert code == 2 and "--max-steps" in err


def test_eval_file_turns(tmp_path):
    one = tmp_path / "one.jsonl"
    one.write_text('{"turns": "a single string"}\n')
    assert eval_texts(one) == ["a single string"]
    prompts_shaped = tmp_path / "prompts.jsonl"
    prompts_shaped.write_text('{"prompt": "Write a poem."}\n')
    with pytest.raises(ValueError, match="no evaluation turns"):
        eval_texts(prompts_shaped)


def test_prompts_with_an_eval_file_of_no_turns_is_refused(tmp_path, capsys):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "Write a poem."}\n')
    code, err = run(capsys, ["train", "prompts", "--out", str(tmp_path / "p"), "--count", "1", "--eval", str(bad)])
    assert code == 2 and "no evaluation turns" in err and not (tmp_path / "p").exists()


def test_answers_refuse_spec_bench_questions(tmp_path, capsys):
    q = json.loads(SPEC_BENCH.read_text().splitlines()[0])["turns"][0]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "x1", "prompt": "Write a haiku about a spoon."}) + "\n"
                       + json.dumps({"id": "sb0", "prompt": q}) + "\n")
    (tmp_path / "target").mkdir()
    code, err = run(capsys, ["train", "answers", "--target", str(tmp_path / "target"), "--prompts", str(prompts),
                             "--out", str(tmp_path / "a")])
    assert code == 2 and "overlap" in err and "'sb0'" in err and not (tmp_path / "a").exists()


@pytest.mark.parametrize("count", [1, 2, 7, 20, 61])
def test_prompt_count_is_exact(count):
    from tests.test_chat_train import tiny_material

    assert len(build_prompts(PromptConfig(count=count, seed=2), tiny_material(), ["Write a haiku."])) == count


def test_card_states_the_tokenizers_size_and_source(tmp_path):
    cfg = TrainConfig(model=TINY["model"], vocab_size=512)
    r = {"parameters": 1, "steps": 1, "tokens_seen": 1, "wall_time_s": 1.0, "validation_loss": 1.0, "test_loss": 1.0,
         "vocab_size": 16384, "tokenizer": "trained on the train split", "device": "some CPU"}
    card = model_card(tmp_path / "d", cfg, r, Path("models/target"), ["specdec train draft"])
    assert "16384 tokens, the target's (`models/target`)" in card and "512 tokens" not in card


def test_draft_card_and_config_from_a_real_run(tiny_pair, tmp_path):
    """`train draft` on the tiny target: the card's tokenizer row is the target's vocabulary, and
    config.json names the target (a key the loader ignores)."""
    target, _ = tiny_pair
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({**TINY, "max_steps": 1, "seq_len": 16, "batch_size": 2, "eval_batches": 1,
                               "corpus_limit_mb": 0.05, "warmup_steps": 1}))
    out = tmp_path / "d"
    assert main(["train", "draft", "--target", str(target), "--config", str(cfg), "--out", str(out),
                 "--work", str(tmp_path / "w")]) == 0
    V = load_model(out, "float32").config.vocab_size
    assert f"| tokenizer | byte-level BPE, {V} tokens, the target's" in (out / "README.md").read_text()
    assert json.loads((out / "config.json").read_text())["specdec_target"]["path"] == str(target)


class _Interrupt:
    def __reduce__(self):
        raise KeyboardInterrupt


def test_an_interrupted_checkpoint_leaves_no_temporary_file(tmp_path):
    ckpt = tmp_path / "checkpoint.pt"
    save_checkpoint({"a": torch.zeros(4)}, ckpt)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint({"a": torch.ones(1 << 16), "b": _Interrupt()}, ckpt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]
    assert torch.equal(torch.load(ckpt)["a"], torch.zeros(4))


class _PrefixDraft:
    """Predicts each next token exactly when its row starts at the sequence's first token (the
    draft that needs its context), else token 0."""
    def __init__(self, seq: torch.Tensor, V: int):
        self.seq, self.draft_vocab = seq, torch.arange(V)

    def eval(self):
        pass

    def train(self):
        pass

    def draft_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        B, W = tokens.shape
        out = torch.zeros(B, W, len(self.draft_vocab))
        for b in range(B):
            if torch.equal(tokens[b, :2], self.seq[:2]):
                nxt = torch.cat([self.seq[1:W + 1], self.seq[-1:]])[:W]
                out[b, torch.arange(W), nxt] = 1.0
            else:
                out[b, :, 0] = 1.0
        return out


def test_vocab_draft_agreement_reads_each_answer_with_its_whole_context():
    from specdec.train.vocab_draft import agreement

    seq = torch.arange(1, 41)
    data = FlatData(seq, None, torch.tensor([0]), torch.tensor([40]), torch.tensor([10]), torch.tensor([True]))
    assert agreement(_PrefixDraft(seq, 64), data) == 1.0
