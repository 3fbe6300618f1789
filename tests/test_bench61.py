"""bench fixes (tester report 61): the console prints only --percentile-metrics' sections, as
vLLM's process_one_metric; the speedup plot anchors llama.cpp's analytic curve at llama.cpp's own
plain decoding."""

from __future__ import annotations

import argparse

from specdec.bench import plots, serve
from specdec.bench.serve_report import console


def test_console_prints_only_the_selected_metrics():
    r = serve.RequestResult(ok=True, arrived=0.0, sent=0.0, chunks=[0.5, 0.6, 0.9], output_tokens=3, prompt_tokens=2)
    args = argparse.Namespace(burstiness=1.0, metric_percentiles=[50.0], percentile_metrics=("ttft", "e2el"),
                              save_detailed=False)
    point = serve.Measured(results=[r], wall=1.0).point(serve.Load(2.0, 1), {}, args)
    text = console({"settings": {"percentile_metrics": ["ttft", "e2el"]}, "variants": [{"name": "x", "points": [point]}]})
    assert "Mean TTFT (ms):" in text and "P50 E2EL (ms):" in text
    assert "TPOT" not in text and "Inter-token Latency" not in text and "ITL" not in text
    older = console({"variants": [{"name": "x", "points": [point]}]})       # a results.json written before: all four
    assert "Mean TPOT (ms):" in older and "Mean ITL (ms):" in older


def _speedup(x: float) -> dict:
    return {"median": x, "min": x, "max": x, "per_repeat": [x]}


def test_each_peer_familys_curve_sits_at_its_own_plain():
    methods = [{"family": "specdec", "method": "plain", "speedup_vs_plain": _speedup(1.0)},
               {"family": "llama.cpp", "method": "llamacpp_plain", "speedup_vs_plain": _speedup(1.5)}]
    assert plots._own_plain({"methods": methods}, "llama.cpp") == 1.5
    methods.append({"family": "transformers", "method": "hf_plain", "speedup_vs_plain": _speedup(0.3)})
    assert plots._own_plain({"methods": methods}, "llama.cpp") == 1.5
    assert plots._own_plain({"methods": methods}, "transformers") == 0.3


def test_a_draft_transformers_cannot_load_skips_the_assisted_peers_with_the_reason():
    """`specdec bench` on the default model with transformers installed: SmolLM2's bundled draft is
    specdec's reduced-vocabulary draft, which transformers cannot load; the assisted peers are
    skipped with that reason (the run had died with transformers' "Unrecognized model")."""
    from specdec.bench.peers import peer_variants
    from specdec.defaults import BUNDLED_TARGET, MODELS_DIR

    variants, skipped = peer_variants(["hf_plain", "hf_assisted_default"], [2], str(BUNDLED_TARGET),
                                      str(MODELS_DIR / "smollm2-draft"), "float32", "cpu", [0])
    assert [v.name for v in variants] == ["hf_plain"]
    assert [s.method for s in skipped] == ["hf_assisted_default"] and "reduced-vocabulary" in skipped[0].reason
