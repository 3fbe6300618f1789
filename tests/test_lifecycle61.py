"""Server lifecycle against `vllm serve` (tester life61): a persistent engine fault kills the engine
(/health 503, new requests 503, the server exits), --root-path is the app's (both path forms answer),
bad TLS files and VLLM_HTTP_TIMEOUT_KEEP_ALIVE fail before the model loads, dev mode's /server_info,
and the start-up lines logged before the model loads."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import httpx
import pytest
from serve_helpers import wait_listening
from test_server import LiveServer

from specdec import LLM
from specdec.defaults import BUNDLED_TARGET
from specdec.server import ServerConfig, build_app
from specdec.server.cli import uvicorn_config

BODY = {"model": "toy", "prompt": "def f(x):", "max_tokens": 4}


def _llm() -> LLM:
    return LLM(BUNDLED_TARGET, num_speculative_tokens=0, max_model_len=128)


def test_a_step_failing_twice_in_a_row_kills_the_engine_one_failure_does_not(monkeypatch):
    llm = _llm()
    real, broken = llm.engine.step, []

    def step():
        if broken:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real()

    monkeypatch.setattr(llm.engine, "step", step)
    app = build_app(llm, ServerConfig(served_model_names=("toy",)))
    with LiveServer(app) as server:
        def post():
            return httpx.post(server.url + "/v1/completions", json=BODY, timeout=60)

        for _ in range(2):               # a failure, then a step that works: transient, the engine goes on
            broken.append(1)
            assert post().status_code == 500
            broken.clear()
            assert post().status_code == 200
            assert httpx.get(server.url + "/health").status_code == 200
        broken.append(1)                 # a persistent fault: the step after a failed one fails too
        r = post()
        assert r.status_code == 500 and "illegal memory access" in r.json()["error"]["message"]
        assert httpx.get(server.url + "/health").status_code == 200
        assert post().status_code == 500
        for path in ("/health", "/ping"):
            r = httpx.get(server.url + path)
            assert r.status_code == 503 and "the engine is dead" in r.json()["error"]["message"], r.text
        broken.clear()                   # dead stays dead: no request reaches the engine again
        r = post()
        assert r.status_code == 503 and "illegal memory access" in r.json()["error"]["message"]
        r = httpx.post(server.url + "/pause", params={"mode": "keep"})
        assert r.status_code == 503 and "the engine is dead" in r.json()["error"]["message"], r.text
        assert not app.state.service.worker.thread.is_alive()
    # one failure is fatal when it leaves the engine inconsistent: its requests cannot be aborted
    broken.append(1)
    monkeypatch.setattr(llm.engine, "abort", lambda rid: 1 / 0)
    app = build_app(llm, ServerConfig(served_model_names=("toy",)))
    with LiveServer(app) as server:
        assert httpx.post(server.url + "/v1/completions", json=BODY, timeout=60).status_code == 500
        assert httpx.get(server.url + "/health").status_code == 503


def test_requests_that_fail_on_their_own_do_not_kill_the_engine(monkeypatch):
    """A step fails while a poisoned request runs (a fault of that request's, not the engine's):
    the client retries it, so two steps fail in a row, yet the probe after them computes and the
    server goes on; so does one more poisoned request later, however long the server was idle
    (the regression tester's openai-client retry had killed the server)."""
    llm = _llm()
    real_add, real_step, real_abort, poisoned = llm.engine.add_request, llm.engine.step, llm.engine.abort, set()

    def add(prompt, *a, **kw):
        req = real_add(prompt, *a, **kw)
        if 7777 in prompt:
            poisoned.add(req.request_id)
        return req

    def abort(rid):
        poisoned.discard(rid)
        return real_abort(rid)

    def step():
        if poisoned:
            raise RuntimeError("a request's own fault")
        return real_step()

    for name, fn in (("add_request", add), ("step", step), ("abort", abort)):
        monkeypatch.setattr(llm.engine, name, fn)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("toy",)))) as server:
        bad = {**BODY, "prompt": [7777, 9]}
        for _ in range(3):                                   # a client and its two retries
            assert httpx.post(server.url + "/v1/completions", json=bad, timeout=60).status_code == 500
        assert httpx.get(server.url + "/health").status_code == 200
        assert httpx.post(server.url + "/v1/completions", json=BODY, timeout=60).status_code == 200


SERVE = textwrap.dedent("""
    import os, sys
    import specdec.engine as E
    import specdec.server.cli as C
    step, build = E.Engine.step, C.build_llm
    def failing(self):
        if os.path.exists(sys.argv[1]):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return step(self)
    def loading(args):
        print("[model loading]", file=sys.stderr, flush=True)
        return build(args)
    E.Engine.step, C.build_llm = failing, loading
    from specdec.cli import main
    sys.exit(main(["serve", sys.argv[2], "--port", "0", "--served-model-name", "toy", "--api-key", "secret"]))
""")


def test_a_dead_engine_shuts_the_server_down_and_startup_is_logged_before_loading(tmp_path):
    broken, log = tmp_path / "BREAK", tmp_path / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", None)
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", SERVE, str(broken), str(BUNDLED_TARGET)], stdout=out,
                                stderr=subprocess.STDOUT, env=env)
    try:
        url = wait_listening(proc, log)
        port = url.rsplit(":", 1)[1]
        text = log.read_text()
        before = text[:text.index("[model loading]")]
        assert f"serving model {BUNDLED_TARGET}" in before and "specdec server version" in before
        assert "non-default args: {" in before and "'api_key': '***'" in before and "secret" not in text
        assert f"Starting specdec server on http://127.0.0.1:{port}" in before
        after = text[text.index("[model loading]"):]           # then what the engine runs (vLLM logs it)
        assert "engine: " in after and "dtype torch.bfloat16; plain decoding" in after      # the folder's weights
        broken.touch()
        auth = {"Authorization": "Bearer secret"}
        for _ in range(2):
            assert httpx.post(url + "/v1/completions", json=BODY, headers=auth, timeout=60).status_code == 500
        assert proc.wait(timeout=60) == 1          # vLLM's watchdog: the server went down by itself
        assert "the engine is dead" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_root_path_is_the_apps_both_path_forms_answer():
    config = ServerConfig(served_model_names=("toy",), root_path="/proxy", api_key="k")
    app = build_app(_llm(), config)
    key = {"Authorization": "Bearer k"}
    with LiveServer(app, uvicorn_config(app, config, "warning")) as server:
        for path in ("/v1/models", "/proxy/v1/models"):
            assert httpx.get(server.url + path, headers=key).json()["data"][0]["id"] == "toy", path
            assert httpx.get(server.url + path).status_code == 401, path
        docs = httpx.get(server.url + "/docs").text
        assert "'/proxy/openapi.json'" in docs
        schema = httpx.get(server.url + "/proxy/openapi.json")
        assert schema.status_code == 200 and schema.json()["servers"] == [{"url": "/proxy"}]
        assert httpx.get(server.url + "/proxy/health").status_code == 200


def _serve_fails(capsys, monkeypatch, flags) -> str:
    """specdec serve's one-line error (status 2), reached before the model would load."""
    from specdec.cli import main
    from specdec.server import cli

    def build_llm(args):
        raise AssertionError("the model started loading")

    monkeypatch.setattr(cli, "build_llm", build_llm)
    assert main(["serve", str(BUNDLED_TARGET), "--port", "0", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_bad_tls_files_and_keep_alive_fail_before_the_model_loads(tmp_path, capsys, monkeypatch):
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a certificate")
    made = {}
    for name in ("a", "b"):
        key, cert = tmp_path / f"{name}.key", tmp_path / f"{name}.crt"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"],
                       check=True, capture_output=True)
        made[name] = (str(key), str(cert))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("garbage\n")
    (key, cert), (other_key, _) = made["a"], made["b"]
    cases = [(["--ssl-keyfile", key, "--ssl-certfile", str(garbage)], f"--ssl-certfile {garbage}: not a PEM certificate"),
             (["--ssl-keyfile", str(garbage), "--ssl-certfile", cert], f"--ssl-keyfile {garbage}: not a PEM private key"),
             (["--ssl-keyfile", other_key, "--ssl-certfile", cert],
              f"--ssl-keyfile {other_key}: not the key of --ssl-certfile {cert}"),
             (["--ssl-keyfile", key, "--ssl-certfile", cert, "--ssl-ca-certs", str(garbage)],
              f"--ssl-ca-certs {garbage}: not PEM CA certificates"),
             (["--ssl-keyfile", key, "--ssl-certfile", cert, "--ssl-ciphers", "NO-SUCH-CIPHER"], "--ssl-ciphers")]
    for flags, says in cases:
        assert says in _serve_fails(capsys, monkeypatch, flags)
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "abc")
    assert "VLLM_HTTP_TIMEOUT_KEEP_ALIVE must be a whole number of seconds" in _serve_fails(capsys, monkeypatch, [])
    # an encrypted key is uvicorn's to unlock (it asks for the passphrase): the early check asks nothing
    from specdec.server.cli import _check_tls

    locked = tmp_path / "locked.key"
    subprocess.run(["openssl", "pkey", "-in", key, "-out", str(locked), "-aes256", "-passout", "pass:secret"],
                   check=True, capture_output=True)
    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("asked for a passphrase"))
    _check_tls(str(locked), cert, None, None)


def test_server_info_in_dev_mode():
    llm = _llm()
    for dev in (False, True):
        config = ServerConfig(served_model_names=("toy",), dev_mode=dev, api_key="secret-key")
        with LiveServer(build_app(llm, config)) as server:
            r = httpx.get(server.url + "/server_info")
            if not dev:
                assert r.status_code == 404
                continue
            info = r.json()
            assert set(info) == {"vllm_config", "vllm_env", "system_env"}
            assert isinstance(info["vllm_config"], str) and str(BUNDLED_TARGET) in info["vllm_config"]
            config = httpx.get(server.url + "/server_info?config_format=json").json()["vllm_config"]
            assert config["model_config"]["model"] == str(BUNDLED_TARGET)
            assert config["model_config"]["max_model_len"] == 128
            assert config["scheduler_config"]["max_num_seqs"] == llm.engine.config.max_num_seqs
            assert config["server_config"]["served_model_names"] == ["toy"]
            assert "secret-key" not in r.text and "api_key" not in config["server_config"]
            assert info["system_env"]["torch_version"] and info["system_env"]["specdec_version"]
            assert httpx.get(server.url + "/server_info?config_format=yaml").status_code == 400
