"""torch.profiler over the engine's steps (vLLM's start_profile / stop_profile, --profiler-config,
VLLM_TORCH_PROFILER_DIR): offline, through a real server's routes and the CLI's config checks."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import httpx
import pytest

from specdec import LLM, SamplingParams
from specdec.profiler import ProfilerConfig, ProfilerNotEnabled
from specdec.server import ServerConfig, build_app
from test_server import LiveServer

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def _events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", errors="replace") as f:     # torch's Python tracer may write a name that is not UTF-8
        return json.load(f)["traceEvents"]


def _steps(path: str) -> list[str]:
    return [e["name"] for e in _events(path) if str(e.get("name", "")).startswith("specdec:step")]


@pytest.fixture(scope="module")
def profiled(tiny_pair, tmp_path_factory):
    target, draft = tiny_pair
    folder = tmp_path_factory.mktemp("traces")
    llm = LLM(str(target), speculative_model=str(draft), num_speculative_tokens=3, max_model_len=128,
              profiler_config={"profiler": "torch", "torch_profiler_dir": str(folder)})
    return llm, folder


def test_config_is_checked_as_vllm_does(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    assert ProfilerConfig.of(None) is None and ProfilerConfig.of({}) is None
    with pytest.raises(ValueError, match="torch_profiler_dir must be set"):
        ProfilerConfig.of({"profiler": "torch"})
    with pytest.raises(ValueError, match="only applicable"):
        ProfilerConfig.of({"torch_profiler_dir": str(tmp_path)})
    with pytest.raises(ValueError, match="needs a GPU"):
        ProfilerConfig.of({"profiler": "cuda"})
    with pytest.raises(ValueError, match="unknown key"):
        ProfilerConfig.of({"profiler": "torch", "torch_profiler_dir": str(tmp_path), "torch_profile_dir": "x"})
    with pytest.raises(ValueError, match="max_iterations"):
        ProfilerConfig.of({"profiler": "torch", "torch_profiler_dir": str(tmp_path), "max_iterations": -1})
    with pytest.raises(ValueError, match="not JSON"):
        ProfilerConfig.of("{profiler: torch}")
    # GPU-only fields are accepted as vLLM's; a relative folder is made absolute
    c = ProfilerConfig.of('{"profiler": "torch", "torch_profiler_dir": "traces", "ignore_frontend": true}')
    assert c.torch_profiler_dir == os.path.abspath("traces")
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path))
    monkeypatch.setenv("VLLM_TORCH_PROFILER_RECORD_SHAPES", "1")
    c = ProfilerConfig.of(None)
    assert c.profiler == "torch" and c.torch_profiler_dir == str(tmp_path) and c.torch_profiler_record_shapes


def test_not_enabled_is_a_clear_error(tiny_pair, monkeypatch):
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    llm = LLM(str(tiny_pair[0]), num_speculative_tokens=0, max_model_len=64)
    with pytest.raises(ProfilerNotEnabled, match="profiler_config"):
        llm.start_profile()
    with pytest.raises(ProfilerNotEnabled):
        llm.stop_profile()


def test_offline_trace_names_steps_and_phases(profiled):
    llm, folder = profiled
    prompts = ["def add(a, b):", "class Point:"]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    llm.start_profile()
    during = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    llm.stop_profile()
    assert during == before                    # recording changes nothing the engine computes
    trace = llm.engine.profiler.last_trace
    assert trace and Path(trace).parent == folder and trace.endswith(".pt.trace.json.gz")
    names = {e.get("name") for e in _events(trace)}
    assert len(_steps(trace)) >= 4
    assert {"schedule", "propose", "forward", "verify", "commit"} <= names
    table = (folder / "profiler_out_0.txt").read_text()
    assert "Self CPU" in table or table.startswith("no table: torch could not read back")
    assert not llm.engine.profiler.active and not llm.engine.profiler.ranges


def test_delay_and_max_iterations(tiny_pair, tmp_path):
    llm = LLM(str(tiny_pair[0]), num_speculative_tokens=0, max_model_len=128,
              profiler_config={"profiler": "torch", "torch_profiler_dir": str(tmp_path), "delay_iterations": 3,
                               "max_iterations": 4, "torch_profiler_use_gzip": False})
    llm.start_profile()
    assert llm.engine.profiler.active and not llm.engine.profiler.ranges     # waiting out the delay
    llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert not llm.engine.profiler.active          # stopped by itself after 4 recorded steps
    llm.stop_profile()                              # expected after the limit: nothing more happens
    trace = llm.engine.profiler.last_trace
    assert trace.endswith(".pt.trace.json") and len(_steps(trace)) == 4


def test_server_routes(tiny_pair, tmp_path):
    target, _ = tiny_pair
    plain = LLM(str(target), num_speculative_tokens=0, max_model_len=128)
    with LiveServer(build_app(plain, ServerConfig(served_model_names=("tiny",)))) as live:
        assert httpx.post(f"{live.url}/start_profile").status_code == 404   # only with a profiler config
    llm = LLM(str(target), num_speculative_tokens=0, max_model_len=128,
              profiler_config={"profiler": "torch", "torch_profiler_dir": str(tmp_path)})
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("tiny",)))) as live:
        assert httpx.post(f"{live.url}/start_profile").status_code == 200
        r = httpx.post(f"{live.url}/v1/completions", json={"model": "tiny", "prompt": "def add(a, b):",
                                                            "max_tokens": 8, "temperature": 0}, timeout=60)
        assert r.status_code == 200
        assert httpx.post(f"{live.url}/stop_profile", timeout=60).status_code == 200
        traces = sorted(tmp_path.glob("specdec-rank0.*.pt.trace.json.gz"))
        assert len(traces) == 1 and len(_steps(str(traces[0]))) >= 8
        # left recording when the server stops: the trace is written at shutdown, not lost
        assert httpx.post(f"{live.url}/start_profile").status_code == 200
        httpx.post(f"{live.url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=60)
    assert len(list(tmp_path.glob("specdec-rank0.*.pt.trace.json.gz"))) == 2


def test_cli_refuses_a_bad_config(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "specdec", "generate", "hi", "--model", "models/target",
                        "--profiler-config", '{"profiler": "torch"}'], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parent.parent, timeout=120)
    assert r.returncode != 0 and "torch_profiler_dir must be set" in r.stderr
    assert "Traceback" not in r.stderr


def test_bench_serve_profile(tiny_pair, tmp_path, capsys):
    """`specdec bench serve --profile` (vLLM's): the servers it starts record the measured requests
    into OUT/profile/<variant>; a running server without a profiler is one clear error."""
    from specdec.cli import main

    target, _ = tiny_pair
    rc = main(["bench", "serve", "--model", str(target), "--num-speculative-tokens", "0",
               "--server-args", "--max-model-len 128 --max-num-seqs 2", "--max-concurrency", "1",
               "--num-prompts", "2", "--output-len", "4", "--ignore-eos", "--warmup", "1", "--profile",
               "--out", str(tmp_path)])
    assert rc == 0
    (trace,) = (tmp_path / "profile" / "plain").glob("specdec-rank0.*.pt.trace.json.gz")
    assert len(_steps(str(trace))) >= 8          # two requests of 4 tokens, the warm-up's left out
    llm = LLM(str(target), num_speculative_tokens=0, max_model_len=128)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("tiny",)))) as live:
        rc = main(["bench", "serve", "--base-url", live.url, "--max-concurrency", "1", "--num-prompts", "2",
                   "--output-len", "4", "--warmup", "0", "--profile", "--out", str(tmp_path / "b")])
    assert rc != 0
    assert "has no /start_profile; start it with --profiler-config" in capsys.readouterr().err


def test_a_table_torch_cannot_read_back_is_no_error(tiny_pair, tmp_path, monkeypatch):
    """torch's Python tracer (with_stack) may leave event names that do not decode (a code object freed
    while recording): the trace is written, the table says so, stop_profile does not fail."""
    import torch.profiler

    llm = LLM(str(tiny_pair[0]), num_speculative_tokens=0, max_model_len=64,
              profiler_config={"profiler": "torch", "torch_profiler_dir": str(tmp_path)})

    def undecodable(self, *a, **k):
        raise UnicodeDecodeError("utf-8", b"\x93", 0, 1, "invalid start byte")

    monkeypatch.setattr(torch.profiler.profile, "key_averages", undecodable)
    llm.start_profile()
    llm.generate(["def add(a, b):"], GREEDY)
    llm.stop_profile()
    assert llm.engine.profiler.last_trace and os.path.getsize(llm.engine.profiler.last_trace) > 0
    assert (tmp_path / "profiler_out_0.txt").read_text().startswith("no table: torch could not read back")


def test_idle_steps_do_not_count(tiny_pair, tmp_path):
    """max_iterations / delay_iterations count steps that ran a forward: an idle engine's empty
    steps (a server between requests) neither use up the budget nor pass the delay."""
    llm = LLM(str(tiny_pair[0]), num_speculative_tokens=0, max_model_len=64,
              profiler_config={"profiler": "torch", "torch_profiler_dir": str(tmp_path), "max_iterations": 2,
                               "delay_iterations": 1})
    llm.start_profile()
    for _ in range(5):
        llm.engine.step()                      # nothing scheduled
    assert llm.engine.profiler.active and not llm.engine.profiler.ranges
    llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    trace = llm.engine.profiler.last_trace
    assert trace and len(_steps(trace)) == 2
    names = [e.get("name") for e in _events(trace)]
    assert names.count("forward") == 2
