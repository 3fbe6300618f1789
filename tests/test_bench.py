"""`specdec bench`: a smoke run on tiny checkpoints, and the pieces it is built from.

Timings are never asserted: only that every number is there, and that greedy outputs agree.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdec.bench import cli as bench_cli
from specdec.bench.harness import Scenario, rotated, sampling_params
from specdec.bench.prompts import BUNDLED, Prompt, read_rows
from specdec.bench.run import select_methods
from specdec.bench.summary import greedy_comparison, predicted_speedup
from specdec.bench.variant import Run, Variant
from specdec.cli import main
from specdec.metrics import RequestStats
from specdec.proposers import REGISTRY
from specdec.train.data import split_of

METHOD_KEYS = {"name", "family", "method", "k", "settings", "tokens_per_second", "speedup_vs_plain",
               "speedup_vs_hf_plain", "acceptance_rate", "mean_accepted_length", "per_position_acceptance",
               "target_forward_ms", "draft_token_ms", "c", "predicted_speedup", "greedy_match", "mean_k"}


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)     # a training job shares this machine


@pytest.fixture
def prompts_file(tmp_path) -> Path:
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "def add(a, b):\n", "id": "add"}, {"prompt": "for i in range(10):\n", "max_tokens": 6}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _bench(tmp_path, *flags) -> tuple[int, dict, Path]:
    out = tmp_path / "out"
    rc = main(["bench", "--repeats", "1", "--max-tokens", "8", "--out", str(out), *flags])
    results = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else None
    return rc, results, out


def test_smoke_run_writes_results_and_greedy_outputs_agree(tiny_pair, prompts_file, tmp_path):
    target, draft = tiny_pair
    rc, results, out = _bench(tmp_path, "--model", str(target), "--speculative-model", str(draft),
                              "--methods", "draft_model,ngram,hf_assisted", "--num-speculative-tokens", "2,auto",
                              "--temperature", "0,1", "--prompts", str(prompts_file))
    assert rc == 0
    for name in ("results.json", "results.md", "speedup_p_t0.png", "acceptance_p_t0.png", "speedup_p_t1.png"):
        assert (out / name).is_file(), name
    assert [s["name"] for s in results["scenarios"]] == ["p_t0", "p_t1"]
    greedy, sampled = results["scenarios"]
    names = [m["name"] for m in greedy["methods"]]
    assert names == ["plain", "draft_model K=2", "draft_model K=auto", "ngram K=2", "ngram K=auto",
                     "hf_plain", "hf_assisted K=2"]
    for m in greedy["methods"]:
        assert METHOD_KEYS <= set(m), m["name"]
        assert m["tokens_per_second"]["min"] <= m["tokens_per_second"]["median"] <= m["tokens_per_second"]["max"]
        assert m["output_tokens"] > 0
    for m in greedy["methods"]:
        if m["family"] == "specdec":
            assert m["greedy_match"]["identical"], m
        else:
            assert m["greedy_match"] is not None     # peers are compared too (reported, not asserted)
    spec = {m["name"]: m for m in greedy["methods"]}
    assert spec["draft_model K=2"]["draft_tokens"] > 0 and spec["draft_model K=2"]["c"] is not None
    assert len(spec["draft_model K=2"]["per_position_acceptance"]) == 2
    assert spec["hf_assisted K=2"]["draft_tokens"] > 0     # the probe saw transformers' drafts
    assert all(m["greedy_match"] is None for m in sampled["methods"])
    table = (out / "results.md").read_text()
    assert "| draft_model | 2 |" in table and "hf_assisted (transformers)" in table
    assert results["command"].startswith("specdec bench ") and results["machine"]["cores"]


@pytest.mark.parametrize("quantization, kinds", [("none", "float32"), ("gguf", "Q4_0+Q4_1+Q4_K+Q8_0")])
def test_quantization_reaches_the_benchmarked_model(gguf_files, prompts_file, tmp_path, quantization, kinds):
    """--quantization none benchmarks the dequantized weights (it was parsed and then ignored)."""
    rc, results, _ = _bench(tmp_path, "--model", str(gguf_files["llama_q"]), "--quantization", quantization,
                            "--methods", "plain", "--temperature", "0", "--prompts", str(prompts_file), "--no-peers")
    assert rc == 0 and results["roofline"]["dtype"] == kinds
    assert f"--quantization {quantization}" in results["command"]


def test_a_method_without_its_model_is_skipped_not_fatal(tiny_pair, prompts_file, tmp_path):
    target, _ = tiny_pair
    rc, results, _ = _bench(tmp_path, "--model", str(target), "--methods", "draft_model,layer_skip",
                            "--num-speculative-tokens", "1", "--temperature", "0", "--no-peers",
                            "--prompts", str(prompts_file))
    assert rc == 0
    assert [m["name"] for m in results["scenarios"][0]["methods"]] == ["plain", "layer_skip K=1"]
    assert [(s["method"], s["k"]) for s in results["skipped"]] == [("draft_model", 1)]
    assert "model" in results["skipped"][0]["reason"]


def test_bad_flags_are_one_line_errors(tiny_pair, prompts_file, tmp_path, capsys):
    target, _ = tiny_pair
    rc, _, _ = _bench(tmp_path, "--model", str(target), "--methods", "nope", "--prompts", str(prompts_file))
    assert rc == 2 and "unknown nope" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--num-speculative-tokens", "0", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        main(["bench", "--top-p", "0", "--out", str(tmp_path)])


def test_out_and_spec_bench_flags_are_checked_before_the_run(tiny_pair, prompts_file, tmp_path, capsys, monkeypatch):
    """A --out that cannot be a folder, and --limit-per-category / --categories without
    --prompts spec-bench, are one-line errors before any model loads."""
    import specdec.bench.run

    def never(*args, **kwargs):
        raise AssertionError("the benchmark ran")
    monkeypatch.setattr(specdec.bench.run, "run_benchmark", never)
    target, _ = tiny_pair
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for flags, message in ((["--out", str(a_file)], "--out"), (["--out", str(a_file / "sub")], "--out"),
                           (["--out", str(tmp_path / "o"), "--limit-per-category", "1"], "--limit-per-category"),
                           (["--out", str(tmp_path / "o"), "--categories", "qa"], "--categories")):
        rc = main(["bench", "--model", str(target), "--prompts", str(prompts_file), *flags])
        err = capsys.readouterr().err
        assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, (flags, err)


def test_top_p_reaches_the_sampled_runs_only():
    prompts = [Prompt("a", "a", [1, 2], 4), Prompt("b", "b", [3], 4)]
    sampled = sampling_params(Scenario("x", 0.7, prompts, top_p=0.95), seed=5)
    assert [(p.top_p, p.seed, p.temperature) for p in sampled] == [(0.95, 5, 0.7), (0.95, 6, 0.7)]
    assert {p.top_p for p in sampling_params(Scenario("x", 0.0, prompts, top_p=0.95), seed=5)} == {1.0}


def test_ignore_eos_reaches_every_method(tiny_pair, prompts_file, tmp_path):
    from specdec.bench.peers import _sampling_kwargs

    prompts = [Prompt("a", "x", [1, 2], 5), Prompt("b", "y", [3], 6)]
    assert all(p.ignore_eos for p in sampling_params(Scenario("x", 0.7, prompts, ignore_eos=True), seed=0))
    kw = _sampling_kwargs(sampling_params(Scenario("x", 0.0, prompts, ignore_eos=True), seed=0)[0], [2])
    assert kw["eos_token_id"] is None and kw["min_new_tokens"] == 5          # transformers' generate
    target, _ = tiny_pair
    rc, results, out = _bench(tmp_path, "--model", str(target), "--methods", "ngram,hf_plain", "--num-speculative-tokens", "2",
                              "--temperature", "0.7", "--prompts", str(prompts_file), "--ignore-eos")
    assert rc == 0 and "--ignore-eos" in results["command"]
    (scenario,) = results["scenarios"]
    assert scenario["ignore_eos"] and "exactly" in (out / "results.md").read_text()
    assert {m["name"] for m in scenario["methods"]} >= {"plain", "ngram K=2", "hf_plain"}
    for m in scenario["methods"]:                 # every prompt ran to its max tokens: 8 and 6
        assert m["output_tokens"] == 14, m["name"]


def test_method_selection_follows_the_registry():
    spec, hf, lc, skipped = select_methods(None, peers=["transformers"])
    assert spec == list(REGISTRY) and hf[0] == "hf_plain" and lc == [] and not skipped
    spec, hf, lc, _ = select_methods(["ngram", "hf_prompt_lookup", "llamacpp_prompt_lookup"], peers=["transformers", "llamacpp"])
    assert spec == ["ngram"] and hf == ["hf_plain", "hf_prompt_lookup"]
    assert lc == ["llamacpp_plain", "llamacpp_prompt_lookup"]          # a family's plain decoding always runs
    assert select_methods(["hf_assisted"], peers=[])[1] == []
    assert select_methods(None, peers=["llamacpp"])[1:3] == ([], ["llamacpp_plain", "llamacpp_prompt_lookup"])


def test_k_and_temperature_lists():
    assert bench_cli._ks("1,2,auto,2") == [1, 2, "auto"]
    assert bench_cli._temps("0,1,0") == [0.0, 1.0]


def test_analytic_speedup():
    assert predicted_speedup(0.0, 4, 0.0) == pytest.approx(1.0)
    assert predicted_speedup(1.0, 4, 0.0) == pytest.approx(5.0)
    # alpha 0.8, K 4, c 0.1: (1 - 0.8^5) / 0.2 / 1.4
    assert predicted_speedup(0.8, 4, 0.1) == pytest.approx((1 - 0.8 ** 5) / 0.2 / 1.4)


def _run(tokens):
    return Run(tokens, 0.1, RequestStats(output_tokens=len(tokens)), 1)


def test_greedy_mismatch_is_reported_with_its_position():
    ref = [[_run([1, 2, 3]), _run([4, 5])]]
    other = [[_run([1, 2, 3]), _run([4, 6, 7])], [_run([1, 2]), _run([4, 6, 7])]]
    g = greedy_comparison(other, ref, ["a", "b"])
    assert not g["identical"] and g["mismatched_prompts"] == 2
    by_prompt = {m["prompt"]: m for m in g["mismatches"]}
    assert (by_prompt["a"]["first_difference"], by_prompt["a"]["repeats_differing"]) == (2, 1)
    assert by_prompt["a"]["got_token"] is None          # it stopped early: no token to compare
    assert (by_prompt["b"]["first_difference"], by_prompt["b"]["expected_token"], by_prompt["b"]["got_token"]) == (1, 5, 6)
    assert by_prompt["b"]["repeats_differing"] == 2
    assert greedy_comparison(ref, ref, ["a", "b"])["identical"]


def test_logit_gap_labels_a_clear_choice_as_no_tie(tiny_pair):
    from specdec.bench.diagnose import logit_gap
    from specdec.model import load_model

    model = load_model(tiny_pair[0], "float32", "cpu")
    prompt = [5, 6, 7]
    logits = model(torch.tensor([prompt])).logits[0, -1]
    best, worst = int(logits.argmax()), int(logits.argmin())
    d = logit_gap(model, prompt, [best], 0, worst)
    assert d["logit_gap"] > 0 and not d["near_tie"]
    assert logit_gap(model, prompt, [best], 0, best)["near_tie"]


def test_interleaving_rotates_every_variant_through_every_slot():
    vs = [Variant(str(i), "specdec", "plain", 0, None) for i in range(3)]
    firsts = {rotated(vs, s)[0].name for s in range(3)}
    assert firsts == {"0", "1", "2"}


def test_bundled_prompts_come_from_the_test_split():
    code, repeat = read_rows(BUNDLED / "code.jsonl"), read_rows(BUNDLED / "repeat.jsonl")
    assert len(code) >= 15 and len(repeat) >= 8
    for row in code + repeat:
        assert split_of(row["id"].split(":", 1)[0]) == "test", row["id"]
    assert all("renamed to" in r["prompt"] for r in repeat)


def test_probe_counts_drafts_and_leaves_the_model_as_it_was(tiny_pair):
    from transformers import AutoModelForCausalLM

    from specdec.bench.peers import Probe

    target = AutoModelForCausalLM.from_pretrained(tiny_pair[0]).eval()
    with Probe(target) as probe:
        target.generate(input_ids=torch.tensor([[5, 6, 7, 5, 6]]), max_new_tokens=6, do_sample=False,
                        prompt_lookup_num_tokens=2)
    stats, timed = probe.stats(6)
    assert stats.target_forward_passes == len(probe.steps) >= 1 and timed == len(probe.forward_s) - 1
    assert "_get_candidate_generator" not in vars(target)
    assert not target._forward_hooks and not target._forward_pre_hooks


def test_compilation_config_reaches_every_specdec_engine(tiny_pair, prompts_file, tmp_path, monkeypatch):
    """`specdec bench -O '{"cudagraph_mode": ...}'`: each specdec variant's engine replays its own
    CUDA graphs (emulated here, on the GPU's PyTorch path); greedy outputs stay plain's; the
    command and config name it."""
    from specdec import kernels
    from specdec.model import batch as batch_module
    from specdec.model import graphs as graphs_module

    monkeypatch.setattr(kernels, "_chosen", [(None, "off (the GPU's path, emulated)")])
    monkeypatch.setattr(batch_module, "PADDED", True)
    monkeypatch.setattr(graphs_module, "EMULATE", True)
    replays = []
    real_call = graphs_module.CudaGraphs.__call__

    def counted(self, *a, **k):
        out = real_call(self, *a, **k)
        replays.append(id(self))
        return out

    monkeypatch.setattr(graphs_module.CudaGraphs, "__call__", counted)
    rc, results, _ = _bench(tmp_path, "--model", str(tiny_pair[0]), "--no-peers", "--methods", "ngram",
                            "--num-speculative-tokens", "2", "--prompts", str(prompts_file),
                            "-O", '{"cudagraph_mode": "FULL_DECODE_ONLY"}')
    assert rc == 0 and results["config"]["cuda_graphs"] and "--compilation-config" in results["command"]
    assert len(set(replays)) == 2            # plain's engine and ngram's, each its own graphs
    assert all(m["greedy_match"]["identical"] for m in results["scenarios"][0]["methods"] if m["name"] != "plain")
