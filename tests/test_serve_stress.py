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


def test_short_stress_run_with_lora_adapters(tiny_pair, tmp_path):
    """The same storm with two LoRA adapters and one slot (max_loras=1): valid requests name the
    base model or an adapter at random, so adapter requests wait for the slot while others run;
    still no 5xx, every greedy output (tool calls and Responses too) equals its solo one under
    its own model, nothing left running or held."""
    import pytest

    pytest.importorskip("peft")
    from specdec.server.lora import LoRAModulePath
    from test_lora import make_adapter

    target, draft = tiny_pair
    modules = tuple(LoRAModulePath(n, str(make_adapter(target, tmp_path / n, seed))) for n, seed in (("a", 1), ("b", 2)))
    llm = LLM(target, speculative_model=str(draft), num_speculative_tokens="auto", max_model_len=256, max_num_seqs=6,
              enable_lora=True, max_loras=1)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("tiny",), lora_modules=modules))) as live:
        report = stress.run(live.url, clients=16, seconds=6, max_tokens=24, loras=("a", "b"))
    result = report.to_dict()
    assert report.ok(), result
    assert result["actions"].get("lora", 0) > 0 and result["actions"].get("greedy", 0) > 0
    assert not any(int(code) >= 500 for code in result["status"])


def test_the_stress_client_splits_events_at_newlines_only():
    """A chunk's JSON text may hold U+2028, U+0085 or \\x0b raw (a toy model writes any byte): SSE
    lines end at LF only, where httpx's aiter_lines also splits those (a CI run failed so)."""
    import asyncio
    import json

    import httpx

    from specdec.bench.stress import _sse_lines

    body = "".join(f"data: {json.dumps({'text': t}, ensure_ascii=False)}\r\n\r\n" for t in ("a\u2028b", "c\x85d\x0be"))
    response = httpx.Response(200, content=body.encode())

    async def lines():
        return [line async for line in _sse_lines(response)]
    got = [json.loads(line[6:])["text"] for line in asyncio.run(lines()) if line.startswith("data: ")]
    assert got == ["a\u2028b", "c\x85d\x0be"]
