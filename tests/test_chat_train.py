"""Chat training data end to end on tiny parts: prompts, the overlap check, the target's
answers with features, and EAGLE / Medusa heads trained on them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from specdec import LLM, SamplingParams, kernels
from specdec.cli import main
from specdec.model import load_model
from specdec.model.heads import load_heads
from specdec.model.quant import QuantLinear
from specdec.tokenizer import Tokenizer
from specdec.train.answers import chat_ids, load_answer_shards
from specdec.train.chatdata import make_prompt_set
from specdec.train.documents import Passage, chunk
from specdec.train.headdata import FlatData
from specdec.train.overlap import check_overlap
from specdec.train.prompts import FAMILY_WEIGHTS, Material, PromptConfig, build_prompts, clean_instruction

TEXT = ("The scheduler keeps a queue of tasks and runs each task when its time comes. Tasks can be "
        "cancelled before they run, and the scheduler reports how many tasks are waiting in the queue.")


def tiny_material() -> Material:
    passages = [Passage(f"mod{i}", f"{TEXT} Part {i} of the notes on mod{i}.", f"stdlib:mod{i}.py") for i in range(6)]
    return Material(passages, ["def f(x):\n    return x + 1\n", "def g(a, b):\n    return a * b\n"],
                    {"de": [("The file was not found.", "Die Datei wurde nicht gefunden, bitte erneut versuchen.")],
                     "fr": [("Cannot open the file now.", "Impossible d'ouvrir le fichier maintenant, désolé.")]},
                    ["Dieses Programm zeigt den Inhalt einer Datei auf dem Bildschirm an."])


def test_prompts_cover_the_families_and_are_deterministic():
    cfg = PromptConfig(count=120, seed=3)
    a = build_prompts(cfg, tiny_material(), ["Write a haiku about a spoon."])
    assert a == build_prompts(cfg, tiny_material(), ["Write a haiku about a spoon."])
    assert {p["family"] for p in a} == set(FAMILY_WEIGHTS)
    assert len({p["prompt"] for p in a}) == len(a) and len(a) >= 100
    assert all(p["id"].startswith("p") and p["prompt"] for p in a)
    german = [p["prompt"] for p in a if p["prompt"].startswith("Translate German to English: ")]
    assert german and all(g.split(": ", 1)[1] in ("Die Datei wurde nicht gefunden, bitte erneut versuchen.",
                                                  "Dieses Programm zeigt den Inhalt einer Datei auf dem Bildschirm an.")
                          for g in german)
    assert not any(p["family"] == "self_instruct" for p in build_prompts(cfg, tiny_material()))


def test_overlap_check_drops_copies_of_evaluation_questions():
    evals = ["Where was the rugby cup held?",
             "Summarize: " + " ".join(f"word{i}" for i in range(40))]
    prompts = [{"id": "exact", "prompt": "where was the RUGBY cup held"},
               {"id": "contains", "prompt": "Tell me: where was the rugby cup held? Thanks."},
               {"id": "13gram", "prompt": "Give the gist. " + " ".join(f"word{i}" for i in range(10, 24))},
               {"id": "clean", "prompt": "Write a poem about the rugby cup."}]
    kept, report = check_overlap(prompts, evals)
    assert [p["id"] for p in kept] == ["clean"]
    assert report["dropped_exact"] == 2 and report["dropped_shared_13gram"] == 1
    assert set(report["dropped_ids"]) == {"exact", "contains", "13gram"}


def test_clean_instruction():
    assert clean_instruction("2. Write a letter to a friend about a trip.\nMore text") == \
        "Write a letter to a friend about a trip."
    assert clean_instruction("Sure, here is a task") is None
    assert clean_instruction("Task:") is None
    assert clean_instruction("Hi") is None


def test_chunk_joins_paragraphs_within_limits():
    paras = [" ".join(["w"] * 30)] * 5
    out = chunk(paras, 50, 70)
    assert all(50 <= len(c.split()) <= 70 for c in out) and len(out) == 2


@pytest.fixture(scope="module")
def answers(tiny_pair, tmp_path_factory):
    target, _ = tiny_pair
    root = tmp_path_factory.mktemp("chat")
    s = make_prompt_set(root / "prompts", PromptConfig(count=24, seed=1), None, 0, None, "test", tiny_material())
    assert s["prompts"] == 24 and "not checked for overlap" in (root / "prompts" / "README.md").read_text()
    rows = [json.loads(line) for line in (root / "prompts" / "prompts.jsonl").read_text().splitlines()]
    # short prompts: the tiny target's context is 256 tokens
    rows = [r for r in rows if len(r["prompt"]) < 120][:10]
    (root / "short.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc = main(["train", "answers", "--target", str(target), "--prompts", str(root / "short.jsonl"),
               "--out", str(root / "answers"), "--max-new-tokens", "12", "--batch", "3", "--per-shard", "2",
               "--dtype", "float32", "--stop-after", "2"])
    assert rc == 0 and len(list((root / "answers").glob("shard_*.pt"))) == 2
    assert main(["train", "answers", "--target", str(target), "--prompts", str(root / "short.jsonl"),
                 "--out", str(root / "answers"), "--max-new-tokens", "12", "--batch", "3", "--per-shard", "2",
                 "--dtype", "float32", "--backend", "specdec"]) == 0
    return target, root, rows


def test_both_backends_give_the_same_answers(answers, tmp_path):
    target, root, rows = answers
    assert main(["train", "answers", "--target", str(target), "--prompts", str(root / "short.jsonl"),
                 "--out", str(tmp_path / "hf"), "--max-new-tokens", "12", "--batch", "3", "--per-shard", "2",
                 "--dtype", "float32", "--backend", "transformers"]) == 0
    hf = load_answer_shards(sorted((tmp_path / "hf").glob("shard_*.pt")))
    ours = load_answer_shards(sorted((root / "answers").glob("shard_*.pt")))
    for k in ("prompt_lens", "greedy"):
        assert torch.equal(hf[k], ours[k]), k
    a, b = FlatData.from_answers(hf), FlatData.from_answers(ours)
    for i in range(b.num_sequences):      # greedy rows token for token (sampled rows draw differently)
        if ours["greedy"][i]:
            x, y = slice(int(a.starts[i]), int(a.ends[i])), slice(int(b.starts[i]), int(b.ends[i]))
            assert torch.equal(hf["tokens"][x], ours["tokens"][y])
            assert torch.allclose(hf["hidden"][x], ours["hidden"][y], atol=1e-2)


def test_a_shard_of_prompts_all_too_long_is_skipped(answers, tmp_path, capsys):
    target, root, rows = answers
    long = {"id": "long", "prompt": " ".join(["word"] * 1200)}          # > 900 tokens: skipped, not answered
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [long, long, *rows[:2]]))
    assert main(["train", "answers", "--target", str(target), "--prompts", str(tmp_path / "p.jsonl"),
                 "--out", str(tmp_path / "ans"), "--max-new-tokens", "4", "--per-shard", "2",
                 "--dtype", "float32", "--backend", "specdec"]) == 0
    captured = capsys.readouterr()
    assert "shard_00000.pt: all 2 prompts too long" in captured.err
    assert "run again" not in captured.out and "1 skipped" in captured.out      # the run is complete
    assert [p.name for p in sorted((tmp_path / "ans").glob("shard_*.pt"))] == ["shard_00001.pt"]
    assert load_answer_shards([tmp_path / "ans" / "shard_00001.pt"])["ids"] == [r["id"] for r in rows[:2]]


@pytest.mark.parametrize("backend", ["specdec", "transformers"])
def test_features_added_to_token_only_shards_are_the_answers_own(answers, backend, tmp_path, capsys):
    """`train features` on shards stripped of their features (what a GPU lease brings back) gives
    back the features the answers were made with: the same bits on specdec's C forward (however
    chunked), within fp16 rounding through transformers."""
    target, root, rows = answers
    shards = sorted((root / "answers").glob("shard_*.pt"))
    (tmp_path / "tokens").mkdir()
    for p in shards:
        d = torch.load(p)
        del d["hidden"]
        torch.save(d, tmp_path / "tokens" / p.name)
    assert main(["train", "features", "--target", str(target), "--data", str(tmp_path / "tokens"),
                 "--out", str(tmp_path / "feats"), "--dtype", "float32", "--backend", backend]) == 0
    for p in shards:
        want, got = torch.load(p), torch.load(tmp_path / "feats" / p.name)
        assert got.keys() == want.keys() and torch.equal(got["tokens"], want["tokens"])
        if backend == "specdec" and kernels.load() is not None:
            assert torch.equal(got["hidden"], want["hidden"]), p.name
        else:
            assert torch.allclose(got["hidden"].float(), want["hidden"].float(), atol=1e-2), p.name
    assert main(["train", "features", "--target", str(target), "--data", str(tmp_path / "none"),
                 "--out", str(tmp_path / "f2")]) == 2
    assert capsys.readouterr().err.strip().endswith("no shard_*.pt files")


def test_features_folder_records_what_it_holds(answers, tiny_pair, tmp_path, capsys):
    """`train features` records the target whose features it wrote (and the dtype, and each token
    shard it read): resuming with another target, dtype or token shard is one line, exit 2, and
    `train eagle` on the folder checks the features' target as it does an answers folder's."""
    from specdec.train.heads import check_answers_target
    from specdec.train.provenance import RunMismatch, target_fingerprint

    target, root, _ = answers
    other = tiny_pair[1]                      # the draft: same vocabulary, another model
    shards = sorted((root / "answers").glob("shard_*.pt"))[:2]
    (tmp_path / "tokens").mkdir()
    for p in shards:
        d = torch.load(p)
        del d["hidden"]
        torch.save(d, tmp_path / "tokens" / p.name)
    shutil.copy(root / "answers" / "config.json", tmp_path / "tokens")      # the answers' record, as it came
    feats = tmp_path / "feats"
    base = ["train", "features", "--data", str(tmp_path / "tokens"), "--out", str(feats), "--backend", "specdec"]
    assert main(base + ["--target", str(target), "--dtype", "float32"]) == 0
    rec = json.loads((feats / "config.json").read_text())
    assert rec["target"]["fingerprint"] == target_fingerprint(target)["fingerprint"] == rec["answers_target"]["fingerprint"]
    assert rec["features_dtype"] == "float32" and sorted(rec["sources"]) == [p.name for p in shards]
    assert rec["max_new_tokens"] == 12          # the answers' own settings carried over
    capsys.readouterr()
    assert main(base + ["--target", str(other), "--dtype", "float32"]) == 2
    assert "its features were made with --target" in capsys.readouterr().err
    assert main(base + ["--target", str(target), "--dtype", "bfloat16"]) == 2
    assert "--dtype float32 (this run: bfloat16)" in capsys.readouterr().err
    d = torch.load(tmp_path / "tokens" / shards[0].name)
    d["tokens"] = d["tokens"].flip(0)
    torch.save(d, tmp_path / "tokens" / shards[0].name)
    assert main(base + ["--target", str(target), "--dtype", "float32"]) == 2
    assert "holds the features of another" in capsys.readouterr().err
    check_answers_target(feats, target_fingerprint(target))
    with pytest.raises(RunMismatch, match="made by --target"):
        check_answers_target(feats, target_fingerprint(other))
    # features of one target over another's answers: allowed, said
    (tmp_path / "feats2").mkdir()
    assert main(["train", "features", "--data", str(tmp_path / "tokens"), "--out", str(tmp_path / "feats2"),
                 "--backend", "specdec", "--target", str(other), "--dtype", "float32"]) == 0
    assert "answered by --target" in capsys.readouterr().err


def test_answers_are_the_targets_own_with_its_features(answers):
    target, root, rows = answers
    paths = sorted((root / "answers").glob("shard_*.pt"))
    assert len(paths) == 5
    data = load_answer_shards(paths)
    assert data["ids"] == [r["id"] for r in rows]
    tok, model = Tokenizer(target), load_model(target, "float32")
    llm = LLM(model=target, dtype="float32", num_speculative_tokens=0)
    flat = FlatData.from_answers(data)
    greedy_rows = [i for i in range(len(rows)) if data["greedy"][i]]
    assert greedy_rows and not data["greedy"].all()      # both kinds of answer are there
    for i in greedy_rows:
        s, a, e = int(flat.starts[i]), int(flat.answer_starts[i]), int(flat.ends[i])
        assert data["tokens"][s:a].tolist() == chat_ids(tok, rows[i]["prompt"])
        out = llm.generate([{"prompt_token_ids": data["tokens"][s:a].tolist()}],
                           SamplingParams(temperature=0, max_tokens=12))[0]
        assert data["tokens"][a:e].tolist() == out.outputs[0].token_ids
        h = model(data["tokens"][s:e][None].long(), hidden=True).hidden
        assert torch.allclose(data["hidden"][s:e - 1].float(), h[0, :-1], atol=1e-2)
        assert not data["hidden"][e - 1].any()          # the last token's feature is never computed


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_heads_train_on_chat_answers(answers, kind, tmp_path):
    target, root, rows = answers
    out = tmp_path / kind
    # eagle: the chain unrolled 2 deep (training-time test), its per-depth accuracy in the report
    flags = ["--window", "8", "--batch", "2", "--unroll", "2"] if kind == "eagle" else ["--num-heads", "2", "--batch", "16"]
    rc = main(["train", kind, "--target", str(target), "--out", str(out), "--work", str(tmp_path / "w"),
               "--data", str(root / "answers"), "--data-kind", "chat", "--steps", "4", "--val-shards", "1",
               "--draft-vocab", "40", "--report-prompts", "2", *flags])
    assert rc == 0
    info = json.loads((out / "training.json").read_text())
    assert "chat self-distillation: 4 shards" in info["result"]["data"]
    assert info["result"]["speculation"]["tree4_greedy"]["mean_accepted_length"] >= 1.0
    if kind == "eagle":
        chain = info["result"]["chain_top1_accuracy"]
        assert info["config"]["unroll"] == 2 and len(chain) == 4 and chain[0] == info["result"]["top1_accuracy"]
        assert "chain depths trained | 2" in (out / "README.md").read_text()
    assert load_heads(out, load_model(target, "float32")).draft_vocab.numel() == 40
    spec = LLM(model=target, dtype="float32",
               speculative_config={"method": kind, "model": str(out), "num_speculative_tokens": 4})
    plain = LLM(model=target, dtype="float32", num_speculative_tokens=0)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": chat_ids(Tokenizer(target), r["prompt"])} for r in rows[:3]]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, greedy)] == \
        [o.outputs[0].token_ids for o in plain.generate(prompts, greedy)]


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_heads_fine_tune_from_trained_heads(answers, kind, tmp_path, capsys):
    """--init starts from a heads folder: with no steps the heads come back as they were (their
    draft vocabulary kept whatever --draft-vocab says), with steps they train on from there;
    heads of another shape or kind are refused in one line."""
    from safetensors.torch import load_file

    target, root, rows = answers
    flags = ["--window", "8", "--batch", "2"] if kind == "eagle" else ["--num-heads", "2", "--batch", "16"]
    common = ["train", kind, "--target", str(target), "--data", str(root / "answers"), "--data-kind", "chat",
              "--val-shards", "1", "--report-prompts", "0", *flags]
    assert main([*common, "--out", str(tmp_path / "a"), "--work", str(tmp_path / "wa"), "--steps", "3",
                 "--draft-vocab", "40"]) == 0
    assert main([*common, "--out", str(tmp_path / "same"), "--work", str(tmp_path / "ws"), "--steps", "0",
                 "--draft-vocab", "20", "--init", str(tmp_path / "a")]) == 0
    a, same = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("a", "same"))
    assert a.keys() == same.keys() and all(torch.equal(a[k], same[k]) for k in a)
    assert main([*common, "--out", str(tmp_path / "b"), "--work", str(tmp_path / "wb"), "--steps", "3",
                 "--init", str(tmp_path / "a")]) == 0
    b = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert torch.equal(b["draft_vocab"], a["draft_vocab"]) and a["draft_vocab"].numel() == 40
    trained = [k for k in a if a[k].is_floating_point() and not torch.equal(a[k], b[k])]
    assert trained and "decoder.lm_head.weight" not in trained      # EAGLE's LM-head rows stay the target's
    info = json.loads((tmp_path / "same" / "training.json").read_text())
    assert "started from the trained heads" in info["result"]["data"] and info["config"]["draft_vocab"] == 40
    spec = LLM(model=target, dtype="float32",
               speculative_config={"method": kind, "model": str(tmp_path / "b"), "num_speculative_tokens": 3})
    plain = LLM(model=target, dtype="float32", num_speculative_tokens=0)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": chat_ids(Tokenizer(target), r["prompt"])} for r in rows[:2]]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, greedy)] == \
        [o.outputs[0].token_ids for o in plain.generate(prompts, greedy)]
    capsys.readouterr()
    other = "medusa" if kind == "eagle" else "eagle"
    bad = [c if c != kind else other for c in common]
    bad = bad[:bad.index("--report-prompts") + 2] + (["--num-heads", "2"] if other == "medusa" else [])
    assert main([*bad, "--out", str(tmp_path / "c"), "--work", str(tmp_path / "wc"), "--steps", "1",
                 "--init", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "the method needs" in err
    if kind == "medusa":
        assert main([*common[:-4], "--num-heads", "3", "--batch", "16", "--out", str(tmp_path / "d"),
                     "--work", str(tmp_path / "wd"), "--steps", "1", "--init", str(tmp_path / "a")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--init" in err


def test_vocab_draft_distils_resumes_and_stays_lossless(answers, tmp_path):
    target, root, rows = answers
    common = ["train", "vocab-draft", "--target", str(target), "--data", str(root / "answers"), "--layers", "1",
              "--draft-vocab", "40", "--steps", "4", "--batch", "2", "--window", "48", "--val-shards", "1",
              "--precision", "fp32", "--report-prompts", "2"]
    assert main([*common, "--out", str(tmp_path / "a"), "--work", str(tmp_path / "wa"), "--stop-after", "2"]) == 0
    assert not (tmp_path / "a").exists()
    assert main([*common, "--out", str(tmp_path / "a"), "--work", str(tmp_path / "wa")]) == 0
    assert main([*common, "--out", str(tmp_path / "b"), "--work", str(tmp_path / "wb")]) == 0
    from safetensors.torch import load_file
    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not any("embed_tokens" in k for k in a) and a["lm_head.weight"].shape[0] == 40
    info = json.loads((tmp_path / "a" / "training.json").read_text())
    assert 0 <= info["result"]["greedy_top1_agreement"] <= 1
    assert info["result"]["speculation"]["tree4_greedy"]["mean_accepted_length"] >= 1.0
    spec = LLM(model=target, dtype="float32", speculative_model=str(tmp_path / "a"), num_speculative_tokens=3)
    plain = LLM(model=target, dtype="float32", num_speculative_tokens=0)
    prompts = [{"prompt_token_ids": chat_ids(Tokenizer(target), r["prompt"])} for r in rows[:3]]
    for params in (SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),):
        assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == \
            [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    sampled = spec.generate(prompts, SamplingParams(temperature=1.0, max_tokens=8, seed=0))
    assert all(o.stats.draft_tokens > 0 for o in sampled)
    # --init: fine-tuning starts from the trained draft (no steps: it comes back bit for bit, its
    # layer count and vocabulary kept whatever --layers / --draft-vocab say); with steps it moves
    init = [*common[:common.index("--layers")], *common[common.index("--draft-vocab") + 2:], "--init", str(tmp_path / "a")]
    assert main([*init, "--layers", "2", "--draft-vocab", "20", "--steps", "0", "--out", str(tmp_path / "same"),
                 "--work", str(tmp_path / "ws")]) == 0
    same = load_file(str(tmp_path / "same" / "model.safetensors"))
    assert same.keys() == a.keys() and all(torch.equal(a[k], same[k]) for k in a)
    info = json.loads((tmp_path / "same" / "training.json").read_text())
    assert info["config"]["layers"] == 1 and info["config"]["draft_vocab"] == 40
    assert main([*init, "--out", str(tmp_path / "c"), "--work", str(tmp_path / "wc")]) == 0
    c = load_file(str(tmp_path / "c" / "model.safetensors"))
    assert torch.equal(c["draft_vocab"], a["draft_vocab"]) and any(not torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("kind", ["eagle", "medusa", "vocab_draft"])
def test_heads_and_vocab_draft_run_on_a_packed_gguf_target(gguf_files, kind, tmp_path):
    """A packed GGUF target has no dense embedding or LM-head weights: heads and the vocab draft
    built for it still load, and greedy output stays the target's own."""
    from specdec.model.heads import save_heads
    from specdec.model.vocab_draft import save_vocab_draft
    from specdec.train.heads import HeadsConfig, build_heads
    from specdec.train.vocab_draft import VocabDraftConfig, init_draft

    path = str(gguf_files["llama_q"])
    dense = load_model(path, "float32", quantization="none")
    vocab = torch.arange(0, dense.config.vocab_size, 2)
    if kind == "vocab_draft":
        save_vocab_draft(init_draft(VocabDraftConfig(layers=1), dense, vocab), tmp_path / "d")
        spec = {"method": "draft_model", "model": str(tmp_path / "d"), "num_speculative_tokens": 3}
    else:
        save_heads(build_heads(HeadsConfig(kind=kind, num_heads=2), dense, vocab), tmp_path / "d")
        spec = {"method": kind, "model": str(tmp_path / "d"), "num_speculative_tokens": 3}
    plain = LLM(path, quantization="gguf")
    fast = LLM(path, quantization="gguf", speculative_config=spec)
    if kind != "medusa" and kernels.load() is not None:   # the drafter's matrices run as Q8_0 panels, as the target's
        p = fast.engine.proposer
        decoder = p.head.decoder if kind == "eagle" else p.model.decoder
        assert all(isinstance(m, QuantLinear) and m.qtype == "Q8_0" and m.prepared is not None
                   for m in (decoder.lm_head, decoder.model.layers[0].self_attn.qkv_proj, decoder.model.layers[0].mlp.down_proj))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for ids in ([0, 9, 17, 9, 17, 9], [0, 5, 6, 7, 8, 5, 6]):
        a = plain.generate({"prompt_token_ids": ids}, params)[0]
        b = fast.generate({"prompt_token_ids": ids}, params)[0]
        assert b.outputs[0].token_ids == a.outputs[0].token_ids and b.stats.draft_tokens > 0


def test_suffix_datastore_from_answers_is_lossless(answers, tmp_path):
    target, root, rows = answers
    assert main(["train", "suffix", "--data", str(root / "answers"), "--out", str(tmp_path / "store"),
                 "--val-shards", "1", "--depth", "16"]) == 0
    cfg = json.loads((tmp_path / "store" / "config.json").read_text())
    data = load_answer_shards(sorted((root / "answers").glob("shard_*.pt"))[1:], hidden=False)
    answer_tokens = int((data["offsets"][1:] - data["offsets"][:-1] - data["prompt_lens"]).sum())
    # every training answer, with the 3 prompt tokens before it (the assistant header)
    assert cfg["architectures"] == ["SpecdecSuffixDatastore"] and cfg["depth"] == 16
    assert cfg["num_tokens"] == answer_tokens + 3 * len(data["prompt_lens"])
    assert cfg["source"]["answers"] == len(data["prompt_lens"])
    # the target's vocabulary is recorded: a target of another one refuses the datastore
    assert cfg["vocab_size"] == json.loads((Path(target) / "config.json").read_text())["vocab_size"]
    assert cfg["source"]["target"]["path"] == str(Path(target).resolve())
    prompts = [{"prompt_token_ids": chat_ids(Tokenizer(target), r["prompt"])} for r in rows[:4]]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(model=target, dtype="float32", num_speculative_tokens=0)
    spec = LLM(model=target, dtype="float32", speculative_config={
        "method": "suffix", "model": str(tmp_path / "store"), "num_speculative_tokens": 3,
        "suffix_decoding_max_cached_requests": 0})
    outs = spec.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain.generate(prompts, greedy)]
    # the prompts answered in the training shards are answered the same way again: drafts are kept
    assert sum(o.stats.accepted_tokens for o in outs) > 0
    assert main(["train", "suffix", "--data", str(root / "answers"), "--out", str(tmp_path / "x"),
                 "--val-shards", "9"]) == 2       # one line, exit status 2 (as for every CLI error)


class _Recorder:
    """A proposer that drafts nothing and keeps the features the engine hands it (Committed.hidden)."""
    from specdec.proposers.base import ProposerCaps
    name, caps = "recorder", ProposerCaps(needs_hidden=True)

    def __init__(self):
        self.hidden: dict = {}

    def kv_bytes_per_slot(self):
        return 0

    def initialize_kv(self, blocks, target_kv):
        pass

    def lookahead_slots(self, k):
        return k

    def cached_upto(self, request_id):
        return None

    def add_request(self, request_id, ctx):
        self.hidden[request_id] = []

    def remove_request(self, request_id):
        pass

    def propose(self, items):
        return [None] * len(items)

    def update(self, items):
        for it in items:
            self.hidden[it.request_id].append(it.hidden.float().clone())


@pytest.mark.skipif(kernels.load() is None, reason="a GGUF target stays packed (bf16 KV cache by default) only with "
                                                  "specdec's kernels")
def test_stored_features_are_those_the_engine_feeds_a_proposer_on_a_packed_gguf(gguf_files, tmp_path, capsys):
    """On a GGUF-packed target the engine keeps a bf16 KV cache by default: `train answers` and
    `train features` compute over the same cache (--kv-cache-dtype auto), so the stored features
    are the hidden states the engine hands an EAGLE head at inference and greedy answers are the
    engine's. The cache dtype is recorded; a resume with another is one line, exit 2."""
    from specdec.engine import Engine, kv_cache_dtype_of

    gguf = str(gguf_files["llama_q"])
    target, tok = load_model(gguf, "float32"), Tokenizer(gguf)
    assert kv_cache_dtype_of(target, "auto") == torch.bfloat16      # what serving it keeps
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": str(i), "prompt": f"say {w} and {w} again"}) + "\n"
                                              for i, w in enumerate(["one", "two", "three", "four"])))
    common = ["train", "answers", "--target", gguf, "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "a"),
              "--max-new-tokens", "16", "--batch", "3", "--per-shard", "2", "--greedy-fraction", "1",
              "--dtype", "float32", "--backend", "specdec"]
    assert main(common) == 0
    assert json.loads((tmp_path / "a" / "config.json").read_text())["kv_cache_dtype"] == "bfloat16"
    shards = sorted((tmp_path / "a").glob("shard_*.pt"))
    data = load_answer_shards(shards)
    flat = FlatData.from_answers(data)
    rec = _Recorder()
    engine = Engine(target, tok, rec)
    for i in range(flat.num_sequences):
        s, a, e = int(flat.starts[i]), int(flat.answer_starts[i]), int(flat.ends[i])
        events = list(engine.generate(data["tokens"][s:a].tolist(), SamplingParams(temperature=0, max_tokens=e - a)))
        assert [t for ev in events for t in ev.token_ids] == data["tokens"][a:e].tolist()      # the engine's answer
        served = torch.cat(rec.hidden[list(rec.hidden)[-1]])           # features of every token but the last
        stored = data["hidden"][s:e - 1].float()
        # equal up to the shards' fp16 rounding (over a fp32 cache they differ by 0.3% in norm, 0.015 at most)
        torch.testing.assert_close(stored, served, rtol=2 ** -11, atol=1e-6)
    # `train features` over the same cache gives the answers' own features, and records it
    (tmp_path / "tokens").mkdir()
    for p in shards:
        d = torch.load(p)
        del d["hidden"]
        torch.save(d, tmp_path / "tokens" / p.name)
    feats = ["train", "features", "--target", gguf, "--data", str(tmp_path / "tokens"), "--out", str(tmp_path / "f"),
             "--dtype", "float32", "--backend", "specdec"]
    assert main(feats) == 0
    assert json.loads((tmp_path / "f" / "config.json").read_text())["features_kv_cache_dtype"] == "bfloat16"
    for p in shards:
        assert torch.equal(torch.load(tmp_path / "f" / p.name)["hidden"], torch.load(p)["hidden"]), p.name
    capsys.readouterr()
    assert main([*common, "--kv-cache-dtype", "float32"]) == 2
    assert "made with --kv-cache-dtype bfloat16 (this run: float32)" in capsys.readouterr().err
    assert main([*feats, "--kv-cache-dtype", "float32"]) == 2
    assert "made with --kv-cache-dtype bfloat16 (this run: float32)" in capsys.readouterr().err
    assert main([*common, "--kv-cache-dtype", "bfloat16"]) == 0 and main([*feats, "--kv-cache-dtype", "bfloat16"]) == 0
    assert main([*common[:-2], "--backend", "transformers", "--kv-cache-dtype", "bfloat16", "--out", str(tmp_path / "h")]) == 2
    assert "the transformers backend keeps its KV cache in --dtype" in capsys.readouterr().err
