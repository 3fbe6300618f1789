"""Review 63 (run-batch and Predicted Outputs): chat's use_beam_search checks and counts a
prediction as any chat request does (it skipped both: a malformed one got a 200, a good one no
completion_tokens_details); with best_of > n the prediction counts are the returned choices'
(they summed every candidate); and a non-UTF-8 `-i URL` is the `--input-file` line a local
file gets (it was a bare codec message)."""

from __future__ import annotations

import http.server
import json
import threading

import httpx
import openai
import pytest

from specdec import LLM
from specdec.cli import main
from specdec.prediction import common_subsequence

PROMPT = "def add(a, b):"
BAD = (({"type": "bogus"}, "prediction"), ({"type": "content"}, "prediction"),
       ({"type": "content", "content": [{"type": "image"}]}, "prediction.content"),
       ({"type": "content", "content": 5}, "prediction.content"))


@pytest.fixture(scope="module")
def live():
    """The bundled toy target (a trained tokenizer: a reply's text tokenizes back to its tokens)."""
    from specdec.defaults import BUNDLED_TARGET
    from specdec.server import ServerConfig, build_app
    from test_server import LiveServer

    llm = LLM(str(BUNDLED_TARGET), speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    config = ServerConfig(served_model_names=("m",), chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with LiveServer(build_app(llm, config)) as server:
        yield server, openai.OpenAI(base_url=server.url + "/v1", api_key="x"), llm.tokenizer


ASK = dict(model="m", messages=[{"role": "user", "content": PROMPT}], max_tokens=12, temperature=0)


def _counts(prediction: list[int], replies: list[list[int]]) -> tuple[int, int]:
    accepted = sum(common_subsequence(prediction, ids) for ids in replies)
    return accepted, len(prediction) * len(replies) - accepted


def test_beam_search_refuses_a_malformed_prediction(live):
    server, _, _ = live
    for bad, param in BAD:
        for beam in (False, True):
            r = httpx.post(server.url + "/v1/chat/completions",
                           json={**ASK, "prediction": bad, "use_beam_search": beam, "n": 2 if beam else 1})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (beam, r.text)


def test_beam_search_counts_the_prediction_over_its_beams(live):
    _, client, tokenizer = live
    beams = dict(ASK, n=2, extra_body={"use_beam_search": True, "return_token_ids": True})
    plain = client.chat.completions.create(**beams)
    assert plain.usage.completion_tokens_details is None
    text = plain.choices[0].message.content
    prediction = {"type": "content", "content": text + " zebra"}
    predicted = tokenizer.encode(text + " zebra", add_special_tokens=False)
    fast = client.chat.completions.create(**beams, prediction=prediction)
    replies = [c.model_extra["token_ids"] for c in fast.choices]
    assert replies == [c.model_extra["token_ids"] for c in plain.choices]        # the same beams
    details = fast.usage.completion_tokens_details
    got = (details.accepted_prediction_tokens, details.rejected_prediction_tokens)
    assert got == _counts(predicted, replies)
    assert got[0] >= len(predicted) - 2 and sum(got) == 2 * len(predicted)     # beam 0 holds (almost) all of it
    stream = client.chat.completions.create(**beams, prediction=prediction, stream=True,
                                            stream_options={"include_usage": True})
    last = list(stream)[-1].usage.completion_tokens_details
    assert (last.accepted_prediction_tokens, last.rejected_prediction_tokens) == got


def test_best_of_counts_the_prediction_of_the_returned_choice(live):
    _, client, tokenizer = live
    text = client.chat.completions.create(**ASK).choices[0].message.content
    predicted = tokenizer.encode(text, add_special_tokens=False)
    r = client.chat.completions.create(**{**ASK, "temperature": 0.8}, n=1, seed=1,
                                       prediction={"type": "content", "content": text},
                                       extra_body={"best_of": 3, "return_token_ids": True})
    (choice,) = r.choices
    details = r.usage.completion_tokens_details
    # the returned choice's counts (all three candidates' summed to 3 x the prediction before)
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == \
        _counts(predicted, [choice.model_extra["token_ids"]])
    assert r.usage.completion_tokens >= len(choice.model_extra["token_ids"])    # every candidate billed


def test_a_non_utf8_input_url_is_the_input_file_line(tmp_path, capsys):
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}})
    payload = line.encode()[:16] + b"\xff" + line.encode()[16:] + b"\n"

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/in.jsonl"
    try:
        # the model does not exist: the input is read (and refused) before it loads
        assert main(["run-batch", "-i", url, "-o", str(tmp_path / "o.jsonl"), "--model", str(tmp_path / "none")]) == 2
    finally:
        server.shutdown()
        server.server_close()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--input-file {url}: not UTF-8 text" in err, err
