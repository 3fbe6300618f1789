"""Model cards and bench tables name what their numbers are: the heads' card the drafts the engine
runs (specdec/train/headreport.card), results.md tau as tokens per target forward."""
from pathlib import Path

from specdec.bench.spec_bench import method_card_table, tables
from specdec.train.headreport import card
from specdec.train.heads import HeadsConfig


def _report(sizes):
    spec = {"prompts": 20, "what": "test-split function headers", "max_tokens": 64}
    for n in sizes:
        spec[f"tree{n}_greedy"] = {"mean_accepted_length": 1.0 + n / 10, "accepted_per_step": n / 10}
    return {"trainable_parameters": 10, "draft_vocab_coverage": 0.9, "data": "d", "steps": 1,
            "wall_time_s": 36.0, "top1_accuracy": 0.5, "sampled_top1_accuracy": 0.4, "speculation": spec}


def test_eagle_chain_rows_name_their_depth():
    # a topk-1 chain drafts K tokens (its depth defaults to K, as vLLM's EAGLE chains), so a 16-node
    # row is a chain 16 deep; the card had said "at most 8 deep" for every size
    text = card(Path("models/eagle"), Path("models/target"), HeadsConfig(kind="eagle"), _report((4, 16)), ["cmd"])
    assert "| 4 nodes (topk 1: a chain, 4 deep), greedy | 1.4 |" in text
    assert "| 16 nodes (topk 1: a chain, 16 deep), greedy | 2.6 |" in text
    assert "at most 8" not in text
    assert "| draft | tokens per target forward |" in text


def test_eagle_tree_and_medusa_rows():
    tree = card(Path("e"), Path("t"), HeadsConfig(kind="eagle", default_topk=4), _report((8,)), ["cmd"])
    assert "| 8 nodes (topk 4: an EAGLE-2 tree), greedy | 1.8 |" in tree
    r = _report((8,)) | {"top1_accuracy_per_head": [0.5], "sampled_top1_accuracy_per_head": [0.4]}
    assert "| 8 nodes, greedy | 1.8 |" in card(Path("m"), Path("t"), HeadsConfig(kind="medusa"), r, ["cmd"])


def test_results_md_tau_is_tokens_per_forward_not_mean_accepted_length():
    # results.json's mean_accepted_length is vLLM's 1 + accepted / drafts (1.69 here); the table's
    # tau is tokens per target forward (1.52): the header had called it "mean accepted length"
    m = {"name": "suffix K=2", "speedup_vs_plain": {"median": 1.1}, "num_drafts": 10, "tokens_per_forward": 1.5189,
         "mean_accepted_length": 1.6929, "per_position_acceptance": [0.5], "acceptance_rate": 0.445,
         "greedy_match": {"identical": True}}
    scenario = {"temperature": 0, "categories": {"overall": {"num_prompts": 2, "methods": [m]}}}
    md = tables(scenario)
    assert "| suffix K=2 | 1.10x / 1.52 |" in md
    assert "mean accepted length" not in md and "tokens per target forward" in md
    card_md = method_card_table({"scenarios": [scenario]}, "suffix K=2")
    assert "tau (tokens per target forward)" in card_md and "| 0 | overall | 2 | 1.52 | 0.445 | 1.10x | yes |" in card_md


def test_written_cards_keep_their_licence_and_label_tokens_per_forward():
    """A retrained heads card carries the licence and base-model lines the bundled cards have, and
    the pair's quality section calls its figure tokens per target forward (as results.md does),
    not vLLM's mean accepted length (1 + accepted / drafts)."""
    from specdec.train.report import quality_section

    text = card(Path("models/eagle"), Path("models/target"), HeadsConfig(kind="eagle"), _report((4,)), ["cmd"])
    assert "Licence: Apache-2.0" in text and "Base model: `models/target`" in text
    run = {"acceptance_rate": 0.5, "mean_accepted_length": 2.5}
    r = {"target": {"validation_loss": 1, "test_loss": 1}, "draft": {"validation_loss": 2, "test_loss": 2}, "k": 4,
         "greedy": run, "temperature_1": run, "ast_parse_share": 0.5, "functions": 10, "max_tokens": 8,
         "dtype": "bfloat16"}
    section = quality_section(r, "cmd")
    assert "tokens per target forward 2.5" in section and "mean accepted length" not in section
