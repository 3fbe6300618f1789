"""Embeddings (vLLM's pooling runner): a bare Qwen3 decoder saved by transformers' AutoModel (as
Qwen3-Embedding-style folders are) and a llama with sentence-transformers pooling files.
LLM.embed equals transformers' last hidden state pooled and normalized; through a real uvicorn
server, the official openai client's embeddings.create returns the same vectors (float and
base64), with OpenAI-style errors for bad input and 404s between the runners' endpoints."""

from __future__ import annotations

import base64
import json
import shutil
import struct

import httpx
import openai
import pytest
import torch
import transformers

from conftest import make_checkpoint
from specdec import LLM
from specdec.cli import main
from specdec.pooling import PoolingParams
from specdec.server import ServerConfig, build_app
from test_server import LiveServer

TEXTS = ["def add(a, b):", "class Point:", "import os"]


def reference(folder, ids: list[int], pooling: str = "LAST", normalize: bool = True) -> torch.Tensor:
    model = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        h = model(torch.tensor([ids])).last_hidden_state[0]
    vec = h[-1] if pooling == "LAST" else h[0] if pooling == "CLS" else h.mean(0)
    return torch.nn.functional.normalize(vec, dim=0) if normalize else vec


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    """A Qwen3 decoder saved as Qwen3Model (no LM head, weights without the "model." prefix),
    marked matryoshka with two sizes."""
    root = tmp_path_factory.mktemp("pooling")
    src = make_checkpoint(root / "src", arch="qwen3", hidden=128, layers=2, seed=1)
    base = transformers.AutoModel.from_pretrained(src, dtype=torch.float32)
    base.save_pretrained(root / "embed")
    for f in src.glob("tokenizer*"):
        shutil.copy(f, root / "embed" / f.name)
    cfg = json.loads((root / "embed" / "config.json").read_text())
    (root / "embed" / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [32, 64, 128]}))
    assert cfg["architectures"] == ["Qwen3Model"]
    return root / "embed"


def test_embed_equals_transformers_last_token(embedder):
    llm = LLM(str(embedder))
    assert llm.runner == "pooling"                     # a bare decoder folder: pooling by itself
    outs = llm.embed(TEXTS)
    for text, out in zip(TEXTS, outs):
        want = reference(embedder, out.prompt_token_ids)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, atol=1e-5, rtol=0)
        assert out.prompt_token_ids == llm.tokenizer.encode(text)
    short = llm.embed(TEXTS[0], PoolingParams(dimensions=32))[0].outputs.embedding
    want = torch.nn.functional.normalize(reference(embedder, outs[0].prompt_token_ids, normalize=False)[:32], dim=0)
    torch.testing.assert_close(torch.tensor(short), want, atol=1e-5, rtol=0)
    raw = llm.embed(TEXTS[0], PoolingParams(normalize=False))[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(raw), reference(embedder, outs[0].prompt_token_ids, normalize=False),
                               atol=1e-4, rtol=1e-5)
    # vLLM's truncation: a text tokenized from the left with its BOS kept, token ids their last k
    ids = outs[0].prompt_token_ids
    assert llm.embed(TEXTS[0], truncate_prompt_tokens=2)[0].prompt_token_ids == [ids[0], ids[-1]]
    assert llm.embed({"prompt_token_ids": ids}, truncate_prompt_tokens=2)[0].prompt_token_ids == ids[-2:]
    # a whole context is an input (pooling emits no token); -1 keeps what it holds, as vLLM
    n = llm.engine.max_model_len
    full = (llm.tokenizer.encode(" ".join(TEXTS)) * n)[:n + 5]
    assert len(llm.embed({"prompt_token_ids": full[:n]})[0].outputs.embedding) == 128
    assert llm.embed({"prompt_token_ids": full}, truncate_prompt_tokens=-1)[0].prompt_token_ids == full[-n:]
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be in"):
        llm.embed(TEXTS[0], truncate_prompt_tokens=n + 1)
    with pytest.raises(ValueError, match="needs runner='generate'"):
        llm.generate("hello")
    with pytest.raises(ValueError, match="dimensions=48: this model supports 32, 64, 128"):
        llm.embed("hello", PoolingParams(dimensions=48))


def test_sentence_transformers_pooling_and_convert(tiny_pair, tmp_path):
    """A generative llama with sentence-transformers files (mean pooling, Normalize) runs as an
    embedding model with convert="embed"; pooler_config overrides the files."""
    folder = shutil.copytree(tiny_pair[0], tmp_path / "st")
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    assert LLM(str(folder), num_speculative_tokens=0).runner == "generate"
    llm = LLM(str(folder), convert="embed", dtype="float32")
    assert (llm.pooler.pooling_type, llm.pooler.normalize) == ("MEAN", True)
    out = llm.embed(TEXTS[1])[0]
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), reference(folder, out.prompt_token_ids, "MEAN"),
                               atol=1e-5, rtol=0)
    cls = LLM(str(folder), runner="pooling", dtype="float32", pooler_config={"pooling_type": "cls", "normalize": False})
    out = cls.embed(TEXTS[1])[0]
    torch.testing.assert_close(torch.tensor(out.outputs.embedding),
                               reference(folder, out.prompt_token_ids, "CLS", normalize=False), atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="LLM.embed\\(\\) needs runner='pooling'"):
        LLM(str(folder), num_speculative_tokens=0).embed("hello")
    with pytest.raises(ValueError, match="speculative decoding needs runner='generate'"):
        LLM(str(folder), runner="pooling", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        LLM(str(folder), runner="pooling", pooler_config={"pooling_type": "weightedmean"})


@pytest.fixture(scope="module")
def server(embedder):
    llm = LLM(str(embedder), max_model_len=64)
    solo = {t: o.outputs.embedding for t, o in zip(TEXTS, llm.embed(TEXTS))}
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("embedder",)))) as live:
        live.solo = solo
        yield live


def test_openai_client_embeddings(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    res = client.embeddings.create(model="embedder", input=TEXTS)
    assert [d.index for d in res.data] == [0, 1, 2] and res.model == "embedder"
    for text, d in zip(TEXTS, res.data):
        assert d.embedding == pytest.approx(server.solo[text], abs=1e-6)
    assert res.usage.prompt_tokens == res.usage.total_tokens > 0
    # (asked for no format, the client asks for base64 and decodes it: the call above; asked for it, it
    # hands the string over)
    b64 = client.embeddings.create(model="embedder", input=TEXTS[0], encoding_format="base64")
    values = struct.unpack(f"<{len(server.solo[TEXTS[0]])}f", base64.b64decode(b64.data[0].embedding))
    assert values == pytest.approx(server.solo[TEXTS[0]], abs=1e-6)
    plain = client.embeddings.create(model="embedder", input=TEXTS[0], encoding_format="float")
    assert plain.data[0].embedding == pytest.approx(server.solo[TEXTS[0]], abs=1e-6)
    short = client.embeddings.create(model="embedder", input=TEXTS[0], dimensions=64)
    assert len(short.data[0].embedding) == 64
    assert sum(x * x for x in short.data[0].embedding) == pytest.approx(1.0, abs=1e-5)
    import httpx

    def prompt_tokens() -> float:
        text = httpx.get(server.url + "/metrics", timeout=60).text
        return float(next(line.split()[-1] for line in text.splitlines() if line.startswith("specdec:prompt_tokens_total")))

    before = prompt_tokens()
    ids = client.embeddings.create(model="embedder", input=[[5, 6, 7], [8]])
    assert len(ids.data) == 2 and ids.usage.prompt_tokens == 4
    assert prompt_tokens() == before + 4                  # counted as vLLM counts pooling requests


def test_embeddings_errors(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    cases = [({"input": []}, 400, "must not be empty"), ({"input": [[5, 10 ** 6]]}, 400, "outside the vocabulary"),
             ({"input": "x" * 1, "dimensions": 48}, 400, "supports 32, 64, 128"),
             ({"input": list(range(1, 100))}, 400, "maximum context length is 64"),
             ({"input": "hi", "model": "other"}, 404, "other")]
    for body, status, message in cases:
        with pytest.raises(openai.APIStatusError) as e:
            client.embeddings.create(**{"model": "embedder", **body})
        assert e.value.status_code == status and message in e.value.response.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="does not support the Completions API"):
        client.completions.create(model="embedder", prompt="hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="does not support the Chat Completions API"):
        client.chat.completions.create(model="embedder", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_a_generating_server_has_no_embeddings(tiny_pair):
    llm = LLM(str(tiny_pair[0]), num_speculative_tokens=0, max_model_len=64)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("tiny",)))) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.NotFoundError, match="does not support the Embeddings API"):
            client.embeddings.create(model="tiny", input="hi")
        import httpx

        r = httpx.post(live.url + "/v1/rerank", json={"query": "q", "documents": ["a"]}, timeout=60)
        assert r.status_code == 404 and "does not support the Score API" in r.json()["error"]["message"]


def test_command_line_flags(embedder, tiny_pair, capsys):
    assert main(["generate", "--model", str(embedder), "hello"]) == 2
    assert "needs runner='generate'" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny_pair[0]), "--runner", "pooling", "--pooler-config",
                 '{"pooling_type": "mean"}', "hello"]) == 2
    assert "needs runner='generate'" in capsys.readouterr().err


def test_serve_flags(tiny_pair):
    from specdec.server.cli import build_llm, parse_args

    args, unknown = parse_args(["--model", str(tiny_pair[0]), "--convert", "embed", "--override-pooler-config",
                       '{"pooling_type": "CLS"}', "--max-model-len", "64"])
    assert not unknown
    llm = build_llm(args)
    assert llm.runner == "pooling" and llm.pooler.pooling_type == "CLS" and llm.pooler.normalize


def test_batched_embeddings_equal_one_at_a_time(embedder):
    """LLM.embed runs its inputs together (a flat batch up to max_num_batched_tokens per forward);
    each vector equals the one its input gets alone, bit for bit."""
    llm = LLM(str(embedder), max_num_batched_tokens=24)
    texts = [f"{t} {i}" * (1 + i % 3) for i, t in enumerate(TEXTS * 4)]
    together = [o.outputs.embedding for o in llm.embed(texts)]
    alone = [llm.embed(t)[0].outputs.embedding for t in texts]
    assert together == alone


def test_score_is_the_cosine_of_embeddings(embedder):
    llm = LLM(str(embedder))
    vec = {t: torch.tensor(o.outputs.embedding) for t, o in zip(TEXTS, llm.embed(TEXTS))}
    cos = lambda a, b: torch.nn.functional.cosine_similarity(vec[a], vec[b], dim=0).item()   # noqa: E731
    one_to_many = llm.score(TEXTS[0], TEXTS)
    assert [o.outputs.score for o in one_to_many] == pytest.approx([cos(TEXTS[0], t) for t in TEXTS], abs=1e-6)
    assert one_to_many[0].outputs.score == pytest.approx(1.0, abs=1e-6)
    pairwise = llm.score(TEXTS[:2], TEXTS[1:])
    assert [o.outputs.score for o in pairwise] == pytest.approx([cos(TEXTS[0], TEXTS[1]), cos(TEXTS[1], TEXTS[2])],
                                                                abs=1e-6)
    with pytest.raises(ValueError, match="lists of the same length"):
        llm.score(TEXTS[:2], TEXTS)


def test_score_and_rerank_endpoints(server):
    import httpx

    want = {t: torch.tensor(v) for t, v in server.solo.items()}
    cos = lambda a, b: torch.nn.functional.cosine_similarity(want[a], want[b], dim=0).item()   # noqa: E731
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for path in ("/score", "/v1/score"):
            r = http.post(path, json={"model": "embedder", "text_1": TEXTS[0], "text_2": TEXTS[1:]})
            assert r.status_code == 200, r.text
            body = r.json()
            assert [d["score"] for d in body["data"]] == pytest.approx([cos(TEXTS[0], t) for t in TEXTS[1:]], abs=1e-6)
            assert body["object"] == "list" and body["usage"]["prompt_tokens"] > 0
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            r = http.post(path, json={"model": "embedder", "query": TEXTS[0], "documents": TEXTS, "top_n": 2})
            assert r.status_code == 200, r.text
            results = r.json()["results"]
            assert [x["index"] for x in results] == sorted(range(3), key=lambda i: -cos(TEXTS[0], TEXTS[i]))[:2]
            assert results[0]["document"]["text"] == TEXTS[results[0]["index"]]
        r = http.post("/v1/rerank", json={"model": "embedder", "query": TEXTS[0], "documents": TEXTS, "top_n": 0})
        assert r.status_code == 200 and len(r.json()["results"]) == 3          # vLLM's default 0: every document
        bad = [("/v1/score", {"text_1": TEXTS[:2], "text_2": TEXTS}, "same length"),
               ("/v1/score", {"text_1": "", "text_2": "x"}, "non-empty"),
               ("/v1/rerank", {"query": "q", "documents": []}, "non-empty"),
               ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n")]
        for path, body, message in bad:
            r = http.post(path, json=body)
            assert r.status_code == 400 and message in r.json()["error"]["message"], (path, r.text)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """A Qwen2ForSequenceClassification with three labels, written by transformers."""
    root = tmp_path_factory.mktemp("classify")
    src = make_checkpoint(root / "src", arch="qwen2", hidden=64, layers=2, seed=2)
    cfg = transformers.AutoConfig.from_pretrained(src)
    cfg.num_labels, cfg.id2label = 3, {0: "negative", 1: "neutral", 2: "positive"}
    cfg.label2id = {v: k for k, v in cfg.id2label.items()}
    cfg.pad_token_id = 0
    torch.manual_seed(3)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(src, config=cfg, dtype=torch.float32)
    with torch.no_grad():
        model.score.weight.normal_(0, 0.5)
    model.save_pretrained(root / "clf")
    for f in src.glob("tokenizer*"):
        shutil.copy(f, root / "clf" / f.name)
    return root / "clf", model.eval()


def test_classify_equals_transformers(classifier):
    folder, hf = classifier
    llm = LLM(str(folder))
    assert llm.runner == "pooling" and not llm.pooler.normalize         # a classifier: by itself
    outs = llm.classify(TEXTS)
    for out in outs:
        with torch.inference_mode():
            want = torch.softmax(hf(torch.tensor([out.prompt_token_ids])).logits[0], -1)
        assert out.outputs.probs == pytest.approx(want.tolist(), abs=1e-5) and out.outputs.num_classes == 3
    with pytest.raises(ValueError, match="needs one label"):
        llm.score(TEXTS[0], TEXTS[1])
    with pytest.raises(ValueError, match="has no LM head to generate with"):
        LLM(str(folder), runner="generate")
    with pytest.raises(ValueError, match="pooling_type LAST and normalize false"):
        LLM(str(folder), pooler_config={"pooling_type": "MEAN"}).classify("hi")


def test_classify_endpoint(classifier, server):
    import httpx

    folder, hf = classifier
    llm = LLM(str(folder), max_model_len=64)
    want = [o.outputs.probs for o in llm.classify(TEXTS)]
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("clf",)))) as live:
        r = httpx.post(live.url + "/classify", json={"model": "clf", "input": TEXTS}, timeout=60)
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        assert [d["probs"] for d in data] == [pytest.approx(p, abs=1e-6) for p in want]
        assert [d["label"] for d in data] == [["negative", "neutral", "positive"][max(range(3), key=p.__getitem__)]
                                              for p in want]
        r = httpx.post(live.url + "/v1/classify", json={"input": []}, timeout=60)
        assert r.status_code == 400
    r = httpx.post(server.url + "/classify", json={"input": "hi"}, timeout=60)   # an embedding model
    assert r.status_code == 404 and "Classification API" in r.json()["error"]["message"]


def test_cross_encoder_scores_and_reranks(tmp_path):
    """A sequence classifier with one label is a cross-encoder: score(query, document) reads the
    pair as one input through the tokenizer's pair template and returns the sigmoid of its head,
    as transformers' model on tokenizer(query, document) gives; /rerank orders by it."""
    import httpx

    src = make_checkpoint(tmp_path / "src", arch="qwen2", hidden=64, layers=2, seed=4)
    cfg = transformers.AutoConfig.from_pretrained(src)
    cfg.num_labels, cfg.pad_token_id = 1, 0
    torch.manual_seed(5)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(src, config=cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        hf.score.weight.normal_(0, 1.0)
    hf.save_pretrained(tmp_path / "ce")
    for f in src.glob("tokenizer*"):
        shutil.copy(f, tmp_path / "ce" / f.name)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "ce")
    llm = LLM(str(tmp_path / "ce"), max_model_len=64)
    outs = llm.score(TEXTS[0], TEXTS)
    for doc, out in zip(TEXTS, outs):
        ids = tok(TEXTS[0], doc)["input_ids"]
        assert out.prompt_token_ids == ids
        with torch.inference_mode():
            want = torch.sigmoid(hf(torch.tensor([ids])).logits[0, 0]).item()
        assert out.outputs.score == pytest.approx(want, abs=1e-5)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("ce",)))) as live:
        r = httpx.post(live.url + "/v1/rerank", json={"query": TEXTS[0], "documents": TEXTS}, timeout=60)
        assert r.status_code == 200, r.text
        order = sorted(range(3), key=lambda i: -outs[i].outputs.score)
        assert [x["index"] for x in r.json()["results"]] == order
        assert [x["relevance_score"] for x in r.json()["results"]] == pytest.approx(
            [outs[i].outputs.score for i in order], abs=1e-6)


def test_chat_messages_and_the_pooling_endpoint(server, embedder):
    """vLLM's extensions: /v1/embeddings takes a conversation (`messages`, through the chat
    template, no generation prompt by default); /pooling answers each input's pooled output."""
    import httpx

    llm = LLM(str(embedder))
    messages = [{"role": "user", "content": "def add(a, b):"}]
    ids = llm.chat_prompt(messages, add_generation_prompt=False)["prompt_token_ids"]
    want = llm.embed({"prompt_token_ids": ids})[0].outputs.embedding
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/v1/embeddings", json={"messages": messages})
        assert r.status_code == 200, r.text
        assert r.json()["data"][0]["embedding"] == pytest.approx(want, abs=1e-6)
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
        r = http.post("/v1/embeddings", json={"messages": messages, "input": "x"})
        assert r.status_code == 400 and "either input or messages" in r.json()["error"]["message"]
        r = http.post("/pooling", json={"input": TEXTS})
        assert r.status_code == 200, r.text
        assert [d["object"] for d in r.json()["data"]] == ["pooling"] * 3
        assert [d["data"] for d in r.json()["data"]] == [pytest.approx(server.solo[t], abs=1e-6) for t in TEXTS]


def test_invocations_on_an_embedding_model(server):
    """SageMaker's POST /invocations (vLLM's): `input` is an embeddings request, `text_1` a score."""
    r = httpx.post(server.url + "/invocations", json={"input": TEXTS[:2]}, timeout=60)
    assert r.status_code == 200 and r.json()["object"] == "list"
    got = [d["embedding"] for d in r.json()["data"]]
    assert got[0] == pytest.approx(server.solo[TEXTS[0]], abs=1e-5)
    assert got[1] == pytest.approx(server.solo[TEXTS[1]], abs=1e-5)
    r = httpx.post(server.url + "/invocations", json={"text_1": TEXTS[0], "text_2": TEXTS[1:]}, timeout=60)
    assert r.status_code == 200 and [d["object"] for d in r.json()["data"]] == ["score", "score"]
    r = httpx.post(server.url + "/invocations", json={"prompt": "hi"}, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == ("Cannot find suitable handler for request. Expected one of: "
                                            "EmbeddingRequest, ScoreRequest, RerankRequest")


def test_embedding_inputs_count_as_finished_requests(server):
    """vLLM's engine finishes a request per input: request_success_total{stop} grows by the inputs,
    requests_total by the one API request."""
    import re

    def value(name):
        text = httpx.get(server.url + "/metrics").text
        m = re.search(rf'^{re.escape(name)}{{[^}}]*finished_reason="stop"[^}}]*}} (\S+)$', text, re.MULTILINE) \
            if "success" in name else re.search(rf'^{re.escape(name)}{{[^}}]*outcome="stop"[^}}]*}} (\S+)$', text, re.MULTILINE)
        return float(m.group(1))
    before = value("specdec:request_success_total"), value("specdec:requests_total")
    assert httpx.post(server.url + "/v1/embeddings", json={"input": TEXTS}, timeout=60).status_code == 200
    after = value("specdec:request_success_total"), value("specdec:requests_total")
    assert (after[0] - before[0], after[1] - before[1]) == (len(TEXTS), 1)


def test_v2_rerank_needs_the_api_key_as_v1_does(embedder):
    """vLLM's key guards /v1, /v2 and /inference: /v2/rerank runs the model as /v1/rerank does."""
    import httpx

    llm = LLM(str(embedder), max_model_len=64)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("embedder",), api_key="sekrit"))) as live:
        body = {"model": "embedder", "query": TEXTS[0], "documents": TEXTS}
        for path in ("/v1/rerank", "/v2/rerank", "/inference/v1/generate"):
            r = httpx.post(live.url + path, json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
        r = httpx.post(live.url + "/v2/rerank", json=body, headers={"authorization": "Bearer sekrit"})
        assert r.status_code == 200 and len(r.json()["results"]) == 3


def _hidden(folder, ids: list[int]) -> torch.Tensor:
    model = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).last_hidden_state[0]


def test_sentence_transformers_dense_max_and_sqrt_mean(tiny_pair, tmp_path):
    """sentence-transformers folders as SentenceTransformer computes them: Pooling (max, and mean
    times sqrt(n) / n) -> Dense (W x + b, Tanh) -> Normalize; the Dense module's output size is the
    embedding's (a Dense module was skipped: a 64-d vector where the model gives 16; max and
    sqrt-mean fell back to the last token). Modules and modes it cannot run are refused."""
    folder = shutil.copytree(tiny_pair[0], tmp_path / "st")
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
               {"idx": 3, "name": "3", "path": "3_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "2_Dense").mkdir()
    hidden = json.loads((folder / "config.json").read_text())["hidden_size"]
    torch.manual_seed(0)
    w, b = torch.randn(16, hidden) * 0.2, torch.randn(16) * 0.1
    torch.save({"linear.weight": w, "linear.bias": b}, folder / "2_Dense" / "pytorch_model.bin")
    (folder / "2_Dense" / "config.json").write_text(json.dumps({
        "in_features": hidden, "out_features": 16, "bias": True,
        "activation_function": "torch.nn.modules.activation.Tanh"}))
    for mode in ("max_tokens", "mean_sqrt_len_tokens", "mean_tokens"):
        (folder / "1_Pooling" / "config.json").write_text(json.dumps({f"pooling_mode_{mode}": True}))
        out = LLM(str(folder), convert="embed", dtype="float32").embed(TEXTS[0])[0]
        h = _hidden(folder, out.prompt_token_ids)
        pooled = {"max_tokens": h.max(0).values, "mean_sqrt_len_tokens": h.sum(0) / len(h) ** 0.5,
                  "mean_tokens": h.mean(0)}[mode]
        want = torch.nn.functional.normalize(torch.tanh(pooled @ w.T + b), dim=0)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, atol=1e-5, rtol=0)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_weightedmean_tokens": True}))
    with pytest.raises(ValueError, match="pooling_mode_weightedmean_tokens is not supported"):
        LLM(str(folder), convert="embed")
    (folder / "modules.json").write_text(json.dumps(modules[:1] + [
        {"idx": 1, "name": "1", "path": "1_LayerNorm", "type": "sentence_transformers.models.LayerNorm"}]))
    with pytest.raises(ValueError, match="module LayerNorm is not supported"):
        LLM(str(folder), convert="embed")


def test_pooler_config_normalize_is_a_boolean(tiny_pair):
    """--pooler-config '{"normalize": "false"}' switched normalization on (any non-empty string)."""
    llm = LLM(str(tiny_pair[0]), runner="pooling", pooler_config={"pooling_type": "MEAN", "normalize": "false"})
    assert llm.pooler.normalize is False
    with pytest.raises(ValueError, match="normalize must be true or false, got 0"):
        LLM(str(tiny_pair[0]), runner="pooling", pooler_config={"normalize": 0})


def test_truncate_prompt_tokens_zero_is_refused_alike(server, embedder):
    """0 was refused by LLM.embed and ignored by /v1/embeddings (the `or` read it as unset); a
    prompt's own PoolingParams value wins over the call's, 0 included."""
    llm = LLM(str(embedder), max_model_len=64)
    for kw in ({"truncate_prompt_tokens": 0}, {"pooling_params": PoolingParams(truncate_prompt_tokens=0),
                                               "truncate_prompt_tokens": 3}):
        with pytest.raises(ValueError, match="truncate_prompt_tokens must be in"):
            llm.embed(TEXTS[0], **kw)
    r = httpx.post(server.url + "/v1/embeddings", json={"input": TEXTS[0], "truncate_prompt_tokens": 0}, timeout=60)
    assert r.status_code == 400 and "truncate_prompt_tokens" in r.json()["error"]["message"]


def _classifier_folder(tmp_path, name: str, labels: int, seed: int, **config) -> tuple:
    src = make_checkpoint(tmp_path / f"{name}-src", arch="qwen2", hidden=64, layers=2, seed=seed)
    cfg = transformers.AutoConfig.from_pretrained(src)
    cfg.num_labels, cfg.pad_token_id = labels, 0
    for k, v in config.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(src, config=cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        hf.score.weight.normal_(0, 1.0)
    hf.save_pretrained(tmp_path / name)
    for f in src.glob("tokenizer*"):
        shutil.copy(f, tmp_path / name / f.name)
    return tmp_path / name, hf


def _logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0]


def test_classifier_activations_follow_the_config(tmp_path):
    """vLLM's activations: problem_type regression gives the raw value, multi_label_classification a
    sigmoid per label (both were softmax / sigmoid by the label count); a cross-encoder's
    sentence-transformers activation_fn (Identity here) sets what score() returns; one it cannot
    run is refused at load."""
    folder, hf = _classifier_folder(tmp_path, "multi", 3, 6, problem_type="multi_label_classification")
    out = LLM(str(folder)).classify(TEXTS[0])[0]
    assert out.outputs.probs == pytest.approx(torch.sigmoid(_logits(hf, out.prompt_token_ids)).tolist(), abs=1e-5)
    folder, hf = _classifier_folder(tmp_path, "reward", 1, 7, problem_type="regression")
    out = LLM(str(folder)).classify(TEXTS[0])[0]
    assert out.outputs.probs == pytest.approx(_logits(hf, out.prompt_token_ids).tolist(), abs=1e-5)
    folder, hf = _classifier_folder(tmp_path, "ce", 1, 8,
                                    sentence_transformers={"activation_fn": "torch.nn.modules.linear.Identity"})
    llm = LLM(str(folder))
    out = llm.score(TEXTS[0], TEXTS[1])[0]
    assert out.outputs.score == pytest.approx(_logits(hf, out.prompt_token_ids)[0].item(), abs=1e-5)
    assert llm.classify(TEXTS[0])[0].outputs.probs == pytest.approx(
        torch.sigmoid(_logits(hf, llm.classify(TEXTS[0])[0].prompt_token_ids)).tolist(), abs=1e-5)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "sentence_transformers": {"activation_fn": "os.system"}}))
    with pytest.raises(ValueError, match="activation_fn 'os.system' is not supported"):
        LLM(str(folder))


def test_cross_encoder_truncation_keeps_the_query(tmp_path):
    """truncate_prompt_tokens on a pair cuts it as transformers' tokenizer(query, document,
    truncation=True, max_length=k) does (vLLM's): the longer text loses tokens, the query and the
    pair's special tokens stay (the last k tokens of the whole pair had left no query token)."""
    folder, hf = _classifier_folder(tmp_path, "ce", 1, 9)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    llm = LLM(str(folder), max_model_len=128)
    query, doc = "what does add return", "def add(a, b):\n    return a + b\n" * 4
    for k in (9, 16, 17, 40):
        out = llm.score(query, doc, truncate_prompt_tokens=k)[0]
        want = tok(query, doc, truncation=True, max_length=k)["input_ids"]
        assert out.prompt_token_ids == want and len(want) == k
        assert out.outputs.score == pytest.approx(torch.sigmoid(_logits(hf, want)[0]).item(), abs=1e-5)
    ids = llm.score({"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": list(range(10, 30))}, truncate_prompt_tokens=8)
    assert ids[0].prompt_token_ids == [5, 6, 7, 10, 11, 12, 13, 14]
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("ce",)))) as live:
        r = httpx.post(live.url + "/v1/rerank", json={"query": query, "documents": [doc], "truncate_prompt_tokens": 16},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["results"][0]["relevance_score"] == pytest.approx(
            llm.score(query, doc, truncate_prompt_tokens=16)[0].outputs.score, abs=1e-6)


def test_a_classifier_gives_no_embeddings(classifier):
    """vLLM's classifier answers classify and score: LLM.embed and /v1/embeddings returned its raw
    last-token state; /pooling takes no dimensions or normalize for it (they were dropped)."""
    folder, _ = classifier
    llm = LLM(str(folder), max_model_len=64)
    with pytest.raises(ValueError, match="sequence classifier"):
        llm.embed(TEXTS[0])
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("clf",)))) as live:
        r = httpx.post(live.url + "/v1/embeddings", json={"input": TEXTS[0]}, timeout=60)
        assert r.status_code == 404 and "sequence classifier" in r.json()["error"]["message"]
        r = httpx.post(live.url + "/pooling", json={"input": TEXTS[0], "dimensions": 2}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
        r = httpx.post(live.url + "/pooling", json={"input": TEXTS[0]}, timeout=60)
        assert r.status_code == 200 and r.json()["data"][0]["data"] == pytest.approx(llm.classify(TEXTS[0])[0].outputs.probs)
