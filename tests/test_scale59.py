"""Scale-out fixes (tester report 59): a TP=2 row's logits do not depend on its batch; replicas
get absolute paths and a failed start names the replica's own error; a script without the
`__main__` guard is told to add it; a stopped TP group answers new requests 503.

TP tests start a worker process each (a few seconds on 2 cores); the Ray test starts a local
cluster (marked `ray`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import openai
import pytest

from specdec import LLM, SamplingParams

from conftest import make_checkpoint

# > kernels.MAX_ROWS (64) prompt rows in one step: there F.linear's result for a row depends on the
# rows beside it (hidden 256: MKL's blocking then differs from a lone row's)
PROMPTS = ["def add(a, b):" + " x" * i for i in range(8)] + ["import os\n" * 6] * 4


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("wide") / "target", seed=0, layers=2, hidden=256)


@pytest.mark.tp
def test_tp2_rows_do_not_depend_on_their_batch(wide):
    kw = dict(model=str(wide), dtype="float32", num_speculative_tokens=0, enable_prefix_caching=False)
    greedy = SamplingParams(temperature=0, max_tokens=3, logprobs=3, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, n=2, seed=5, max_tokens=6, ignore_eos=True)

    def logprobs(out):
        return [[v.logprob for v in step.values()] for step in out.outputs[0].logprobs]

    tp1 = LLM(**kw)
    want = [[c.token_ids for c in o.outputs] for o in tp1.generate(PROMPTS, sampled, use_tqdm=False)]
    tp2 = LLM(**kw, tensor_parallel_size=2)
    try:
        batched = tp2.generate(PROMPTS, greedy, use_tqdm=False)
        assert sum(len(o.prompt_token_ids) for o in batched) > 64
        assert logprobs(tp2.generate(PROMPTS[:1], greedy, use_tqdm=False)[0]) == logprobs(batched[0])
        assert [[c.token_ids for c in o.outputs] for o in tp2.generate(PROMPTS, sampled, use_tqdm=False)] == want
    finally:
        tp2.shutdown()


def test_replicas_get_absolute_paths_and_keep_the_served_name(tiny_pair, tmp_path, monkeypatch):
    from specdec.server.replicas import application

    (tmp_path / "models").mkdir()
    os.symlink(tiny_pair[0], tmp_path / "models" / "target")
    (tmp_path / "chat.jinja").write_text("{{ messages[0]['content'] }}")
    monkeypatch.chdir(tmp_path)
    spec = json.dumps({"method": "draft_model", "model": "models/target", "num_speculative_tokens": 2})
    app = application(["models/target", "--replicas", "1", "--chat-template", "chat.jinja",
                       "--speculative-config", spec, "--tokenizer=models/target"])
    argv = app._bound_deployment.init_args[0]
    model = str(tmp_path / "models" / "target")
    assert argv[0] == model and f"--tokenizer={model}" in argv
    assert argv[argv.index("--chat-template") + 1] == str(tmp_path / "chat.jinja")
    assert json.loads(argv[argv.index("--speculative-config") + 1])["model"] == model
    assert argv[-2:] == ["--served-model-name", "models/target"]      # clients still ask for "models/target"

    from specdec.server.cli import parse_args      # the replica's reading of it
    args, _ = parse_args(argv)
    assert args.model == model and args.served_model_name == ["models/target"]


@pytest.mark.ray
def test_a_replica_that_cannot_load_names_its_own_error(tiny_pair, tmp_path):
    """The model's config passes the driver's check; its weights are missing, which only the
    replica finds: the one error line is the replica's CheckpointError, not Ray's generic one."""
    folder = tmp_path / "noweights"
    folder.mkdir()
    for f in tiny_pair[0].iterdir():
        if f.suffix != ".safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "specdec", "serve", "--model", str(folder), "--replicas", "1",
                        "--replica-cpus", "1", "--port", "8751"], capture_output=True, text=True, env=env,
                       timeout=300)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and last.startswith("specdec: error: the replicas did not start: CheckpointError: "), \
        r.stderr[-2000:]
    assert "no model.safetensors" in last


@pytest.mark.tp
def test_a_script_without_the_main_guard_is_told_to_add_it(tiny_pair, tmp_path):
    script = tmp_path / "offline.py"
    script.write_text(f"from specdec import LLM\nllm = LLM(model={str(tiny_pair[0])!r}, tensor_parallel_size=2)\n"
                      f"print('built')\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode != 0 and last.startswith("specdec.distributed.leader.TensorParallelError: "), r.stderr[-2000:]
    assert 'if __name__ == "__main__":' in last and str(script) in last


@pytest.mark.tp
def test_a_stopped_tp_group_answers_new_requests_503(tiny_pair):
    import httpx

    from specdec.server import ServerConfig, build_app
    from test_server import LiveServer

    llm = LLM(model=tiny_pair[0], dtype="float32", num_speculative_tokens=0, tensor_parallel_size=2)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("tp",)))) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        # ignore_eos: the random tiny model's first token may be EOS on another CPU (CI's ran to 1 token)
        first = client.completions.create(model="tp", prompt="def f(x):", max_tokens=2, extra_body={"ignore_eos": True})
        assert first.usage.completion_tokens == 2
        worker = llm.target.leader.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(5)
        deadline = time.monotonic() + 10
        while (health := httpx.get(live.url + "/health")).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        # /health's reason reads as the requests' (it had come quoted, as a repr)
        assert health.json()["error"]["message"].startswith("the engine cannot serve: tensor-parallel group of 2")
        with pytest.raises(openai.APIStatusError) as caught:
            client.completions.create(model="tp", prompt="def f(x):", max_tokens=2)
        e = caught.value
        assert e.status_code == 503 and e.body["type"] == "service_unavailable", e.body
        assert e.body["message"].startswith("the engine cannot serve: tensor-parallel group of 2 ranks stopped")
        client.close()
