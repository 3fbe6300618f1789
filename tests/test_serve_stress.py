"""The stress run, short (scripts/serve_stress.py runs it for ten minutes): 16 streaming
clients with random disconnects, bad requests and tool calls against a speculative server on the tiny
pair: no 5xx, every greedy completion equals its solo output, nothing left running or held."""

from __future__ import annotations

from specdec.bench import stress
from specdec.llm import LLM
from specdec.server import ServerConfig, build_app
from test_server import LiveServer


def test_short_stress_run(tiny_pair):
    target, draft = tiny_pair
    llm = LLM(target, speculative_model=str(draft), num_speculative_tokens="auto", max_model_len=256, max_num_seqs=6)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("tiny",)))) as live:
        report = stress.run(live.url, clients=16, seconds=6, max_tokens=24)
    result = report.to_dict()
    assert report.ok(), result
    # every client finishes its first action, and the seeded clients' first actions (seeds 0..15)
    # already include each of these, so this holds however slow the machine
    assert all(result["actions"].get(a, 0) > 0 for a in ("greedy", "leave", "bad", "tools", "responses"))
    assert not any(int(code) >= 500 for code in result["status"])
    assert result["end_metrics"]["kv_cache_usage_perc"] == 0
