"""A tester's command-line findings (cli58): Ctrl-C during run-batch exits 130 cleanly (the engine
thread ended, every task awaited); bench serve's --num-prompts is exact, as vLLM's; its
variants are checked before any server starts; complete takes --config, as chat does."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
from test_server import LiveServer

from specdec.bench import serve
from specdec.cli import main
from specdec.llm import LLM
from specdec.server import ServerConfig, build_app

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "models" / "target"
BAD = ("Traceback", "terminate called", "Task was destroyed", "Event loop is closed")


def _batch(path: Path, n: int) -> str:
    """n completions: the first two of one token (their end is the sign that the engine runs), the
    rest of 400 tokens (still generating when the signal comes)."""
    rows = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": "toy", "prompt": "x" * (i % 7 + 1), "max_tokens": 1 if i < 2 else 400,
                      "ignore_eos": True}} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_run_batch_ctrl_c_while_generating_exits_130_without_a_traceback(tmp_path):
    src = _batch(tmp_path / "in.jsonl", 80)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for attempt in range(3):
        p = subprocess.Popen([sys.executable, "-m", "specdec", "run-batch", "-i", src, "-o", str(tmp_path / "out.jsonl"),
                              "--model", str(TARGET), "--served-model-name", "toy", "--max-num-seqs", "64",
                              "--enable-log-requests"],
                             cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        lines: queue.Queue = queue.Queue()
        reader = threading.Thread(target=lambda: [lines.put(x) for x in p.stderr] + [lines.put(None)], daemon=True)
        reader.start()
        err, deadline = [], time.monotonic() + 120
        while not any("Finished request" in x for x in err):      # a request ended: the engine is generating
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            assert line is not None, f"run-batch ended before the signal (rc {p.wait()}):\n{''.join(err)[-2000:]}"
            err.append(line)
        p.send_signal(signal.SIGINT)
        rc = p.wait(timeout=60)
        reader.join(10)
        while (line := lines.get_nowait() if not lines.empty() else None) is not None:
            err.append(line)
        text = "".join(err)
        assert rc == 130, (attempt, rc, text[-3000:])
        assert text.rstrip().endswith("interrupted") and not [b for b in BAD if b in text], (attempt, text[-3000:])
        assert not (tmp_path / "out.jsonl").exists()


def test_run_batch_ctrl_c_ends_the_engine_thread_and_every_task(tmp_path, monkeypatch):
    """In process, the signal at the first generated token: no engine thread left running (at
    interpreter exit one inside torch aborted the process) and no task left pending on the closed
    loop (each printed "Task was destroyed but it is pending")."""
    from specdec.server import serving

    steps, sent = serving.Generation.steps, []

    async def interrupting(self):
        async for item in steps(self):
            if not sent:
                sent.append(True)
                signal.raise_signal(signal.SIGINT)     # asyncio.run's handler: the main task cancelled
            yield item

    monkeypatch.setattr(serving.Generation, "steps", interrupting)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)       # asyncio.run installs its own
    before = {t for t in threading.enumerate() if t.name == "specdec-engine"}
    try:
        rc = main(["run-batch", "-i", _batch(tmp_path / "in.jsonl", 24), "-o", str(tmp_path / "out.jsonl"),
                   "--model", str(TARGET), "--served-model-name", "toy"])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert sent and rc == 130
    assert [t for t in threading.enumerate() if t.name == "specdec-engine" and t not in before] == []
    gc.collect()
    pending = [t for t in gc.get_objects() if isinstance(t, asyncio.Task) and not t.done() and t.get_loop().is_closed()]
    assert pending == []


@pytest.fixture(scope="module")
def live(tiny_pair):
    target, _ = tiny_pair
    llm = LLM(target, max_model_len=256, max_num_seqs=4)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("tiny",)))) as server:
        yield server


def test_bench_serve_num_prompts_given_is_exact(live, tmp_path, capsys):
    """vLLM's `bench serve --num-prompts N` sends N requests whatever the concurrency (it was
    raised to twice each load point's: 2 prompts at concurrency 1,4 sent 2 then 8)."""
    assert main(["bench", "serve", "--base-url", live.url, "--num-prompts", "2", "--max-concurrency", "1,4",
                 "--output-len", "2", "--warmup", "0", "--out", str(tmp_path)]) == 0
    points = json.loads((tmp_path / "results.json").read_text())["variants"][0]["points"]
    assert [(p["concurrency"], p["num_prompts"], p["completed"]) for p in points] == [(1, 2, 2), (4, 2, 2)]
    warnings = [x for x in capsys.readouterr().err.splitlines() if "warning" in x]
    assert len(warnings) == 1 and "--num-prompts 2 is below --max-concurrency 4" in warnings[0]


def test_bench_serve_num_prompts_left_out_is_sized_to_the_concurrency():
    inf = float("inf")
    assert [serve.point_size(serve.Load(inf, c), None) for c in (1, 16, 32, None)] == [32, 32, 64, 32]
    assert [serve.point_size(serve.Load(inf, c), 2) for c in (1, 32, None)] == [2, 2, 2]


def test_bench_serve_refuses_a_k_without_a_method_before_any_server_starts(tmp_path, capsys):
    """--model naming a model with no default method and a K > 0 variant: the server's one-line
    error at once (the plain variant's server was started and loaded first)."""
    for ks in ("0,3", None):                    # None: the default 0,4,auto
        rc = main(["bench", "serve", "--model", str(TARGET), *(["--num-speculative-tokens", ks] if ks else []),
                   "--num-prompts", "2", "--max-concurrency", "1", "--warmup", "0", "--out", str(tmp_path)])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1, err
        assert err[0].startswith("specdec: error: speculative K=") and "without speculative_model" in err[0]
        assert not list(tmp_path.glob("server-*.log"))          # no server started


@pytest.mark.parametrize("flags", [["--speculative-config", '{"model": "DRAFT"}'],
                                   ["--server-args", "--speculative-model DRAFT"],
                                   ["--server-args", "--speculative-config.model DRAFT"], []])
def test_variants_with_a_method_pass_the_check(flags):
    from specdec.bench.serve_cli import check_variants, variants
    from specdec.cli import build_parser

    model = [] if not flags else ["--model", str(TARGET)]        # no --model: the default model's method
    flags = [f.replace("DRAFT", str(ROOT / "models" / "draft")) for f in flags]
    args = build_parser("bench").parse_args(["bench", "serve", *model, "--num-speculative-tokens", "0,3", *flags])
    check_variants(variants(args))


def test_complete_takes_config(tmp_path, capsys):
    """vLLM expands --config for any subcommand; specdec complete refused it (chat took it)."""
    llm = LLM(str(TARGET), max_model_len=256, max_num_seqs=2)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("toy",)))) as server:
        api = server.url + "/v1"
        ref = openai.OpenAI(base_url=api, api_key="x", max_retries=0).completions.create(
            model="toy", prompt="class Point:", temperature=0, max_tokens=3, extra_body={"ignore_eos": True})
        config = tmp_path / "cl.yaml"
        config.write_text(f"url: {api}\nmax-tokens: 8\ntemperature: 0\nignore-eos: true\n")
        # the file's flags, and the command line's --max-tokens over the file's
        assert main(["complete", "--config", str(config), "-q", "class Point:", "--max-tokens", "3"]) == 0
        assert capsys.readouterr().out == ref.choices[0].text + "\n"
        config.write_text(f"url: {api}\nno-such-flag: 1\n")
        with pytest.raises(SystemExit) as e:
            main(["complete", "--config", str(config), "-q", "x"])
        assert e.value.code == 2 and "--no-such-flag" in capsys.readouterr().err
    assert main(["complete", "--config", str(tmp_path / "missing.yaml"), "-q", "x"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("specdec complete: error: --config") and "missing.yaml" in line


def test_a_cancelled_handler_cancels_its_work():
    """_unless_gone's work is cancelled with the handler that awaits it (server shutdown,
    run-batch's Ctrl-C): it had run on, its engine request and drain tasks left pending."""
    import asyncio

    from starlette.requests import Request

    from specdec.server.app import _unless_gone

    async def scenario():
        never = asyncio.Event()

        async def receive():                 # a client that neither sends nor leaves
            await never.wait()
        request = Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)
        state = {}

        async def work():
            try:
                await asyncio.sleep(3600)
            finally:
                state["ended"] = True
        handler = asyncio.ensure_future(_unless_gone(request, work()))
        await asyncio.sleep(0.05)
        handler.cancel()
        await asyncio.gather(handler, return_exceptions=True)
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return state, others
    state, others = asyncio.run(scenario())
    assert state == {"ended": True} and others == []


def test_bench_refuses_a_speculative_model_path_that_is_not_there(tmp_path):
    """A typo in --speculative-config's model is a one-line error (exit 2): it had been a
    skipped row in the results, with exit 0."""
    r = subprocess.run([sys.executable, "-m", "specdec", "bench", "--model", str(TARGET),
                        "--methods", "eagle", "--speculative-config", '{"eagle": {"model": "/nope/eagle"}}',
                        "--max-tokens", "4", "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 2 and "no such path: eagle's model '/nope/eagle'" in r.stderr, r.stderr[-800:]
