"""Pooling fixes (async60): the server truncates a text input as offline and vLLM do (BOS kept),
classify() and score() take a PoolingParams where embed() does, and a SamplingParams given to
the embedding path is refused in one line."""

from __future__ import annotations

import asyncio
import shutil

import httpx
import pytest
import torch
import transformers

from conftest import make_checkpoint
from specdec import LLM, AsyncLLM, SamplingParams
from specdec.pooling import PoolingParams
from specdec.server import ServerConfig, build_app
from test_pooling import _classifier_folder, _logits, reference
from test_server import LiveServer

TEXT = "def add(a, b):\n    return a + b\n"


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    """A bare Qwen3Model (no LM head) written by transformers, its tokenizer adding BOS."""
    root = tmp_path_factory.mktemp("pool60")
    src = make_checkpoint(root / "src", arch="qwen3", hidden=64, layers=2, seed=4)
    transformers.AutoModel.from_pretrained(src, dtype=torch.float32).save_pretrained(root / "embed")
    for f in src.glob("tokenizer*"):
        shutil.copy(f, root / "embed" / f.name)
    return root / "embed"


def _left(folder, text: str, k: int) -> list[int]:
    """transformers' left truncation (vLLM's server tokenizer): the text's last tokens, BOS kept."""
    tok = transformers.AutoTokenizer.from_pretrained(folder, truncation_side="left")
    return tok(text, truncation=True, max_length=k)["input_ids"]


def test_server_truncates_text_as_offline_and_transformers(embedder):
    """/v1/embeddings and /pooling kept a text's last k ids (its BOS dropped); offline LLM.embed
    and vLLM keep the BOS. Token ids are cut to their last k as given, on both."""
    llm = LLM(str(embedder), max_model_len=64, dtype="float32")
    full = llm.tokenizer.encode(TEXT)
    k = 5
    want_ids = _left(embedder, TEXT, k)
    assert want_ids[0] == full[0] and want_ids != full[-k:] and len(want_ids) == k      # BOS kept
    offline = llm.embed(TEXT, truncate_prompt_tokens=k)[0]
    assert offline.prompt_token_ids == want_ids
    want = reference(embedder, want_ids)
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("emb",)))) as live, \
            httpx.Client(base_url=live.url, timeout=60) as http:
        for path, key in (("/v1/embeddings", "embedding"), ("/pooling", "data")):
            r = http.post(path, json={"input": TEXT, "truncate_prompt_tokens": k})
            assert r.status_code == 200, r.text
            text_vec = torch.tensor(r.json()["data"][0][key])
            torch.testing.assert_close(text_vec, torch.tensor(offline.outputs.embedding), atol=1e-6, rtol=0)
            torch.testing.assert_close(text_vec, want, atol=1e-5, rtol=0)
            assert r.json()["usage"]["prompt_tokens"] == k
            r = http.post(path, json={"input": full, "truncate_prompt_tokens": k})
            torch.testing.assert_close(torch.tensor(r.json()["data"][0][key]), reference(embedder, full[-k:]),
                                       atol=1e-5, rtol=0)
        r = http.post("/v1/embeddings", json={"input": TEXT, "truncate_prompt_tokens": -1})     # the context
        assert r.json()["data"][0]["embedding"] == pytest.approx(llm.embed(TEXT)[0].outputs.embedding, abs=1e-6)
        r = http.post("/v1/embeddings", json={"input": TEXT, "truncate_prompt_tokens": 65})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_classify_endpoint_truncates_text_as_offline(tmp_path):
    """/classify (and /pooling on a classifier) gave the probabilities of the last k ids without
    BOS; offline classify and transformers' left truncation keep it."""
    folder, hf = _classifier_folder(tmp_path, "clf", 3, 11)
    llm = LLM(str(folder), max_model_len=64)
    k = 4
    ids = _left(folder, TEXT, k)
    offline = llm.classify(TEXT, truncate_prompt_tokens=k)[0]
    assert offline.prompt_token_ids == ids
    want = torch.softmax(_logits(hf, ids), -1).tolist()
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("clf",)))) as live, \
            httpx.Client(base_url=live.url, timeout=60) as http:
        r = http.post("/classify", json={"input": TEXT, "truncate_prompt_tokens": k})
        assert r.status_code == 200, r.text
        assert r.json()["data"][0]["probs"] == pytest.approx(want, abs=1e-5)
        assert r.json()["data"][0]["probs"] == pytest.approx(offline.outputs.probs, abs=1e-6)
        r = http.post("/pooling", json={"input": TEXT, "truncate_prompt_tokens": k})
        assert r.json()["data"][0]["data"] == pytest.approx(want, abs=1e-5)


def test_classify_and_score_take_pooling_params_positionally(tmp_path):
    """classify(p, PoolingParams(...)) and score(a, b, PoolingParams(...)) read the params as
    truncate_prompt_tokens ("must be in [1, max_model_len]"); embed(p, PoolingParams(...)) is
    the README's call, so they take it there too."""
    folder, hf = _classifier_folder(tmp_path, "clf", 3, 12)
    llm = LLM(str(folder), max_model_len=64)
    raw = PoolingParams(use_activation=False)
    out = llm.classify(TEXT, raw)[0]
    assert out.outputs.probs == pytest.approx(_logits(hf, out.prompt_token_ids).tolist(), abs=1e-5)
    assert llm.classify([TEXT], [raw])[0].outputs.probs == out.outputs.probs
    cut = llm.classify(TEXT, PoolingParams(truncate_prompt_tokens=3))[0]
    assert cut.prompt_token_ids == _left(folder, TEXT, 3)
    with pytest.raises(TypeError, match="pooling_params given twice"):
        llm.classify(TEXT, raw, pooling_params=raw)
    with pytest.raises(ValueError, match="pooling_params must be a PoolingParams, got SamplingParams"):
        llm.classify(TEXT, SamplingParams())

    folder, hf = _classifier_folder(tmp_path, "ce", 1, 13)
    cross = LLM(str(folder), max_model_len=64)
    out = cross.score("what does add return", TEXT, raw)[0]
    assert out.outputs.score == pytest.approx(_logits(hf, out.prompt_token_ids)[0].item(), abs=1e-5)
    assert cross.score("what does add return", TEXT, 8)[0].prompt_token_ids == \
        transformers.AutoTokenizer.from_pretrained(folder)("what does add return", TEXT, truncation=True,
                                                            max_length=8)["input_ids"]


def test_sampling_params_on_the_embedding_path_is_a_clear_error(embedder):
    """embed / encode / AsyncLLM.encode with a SamplingParams raised AttributeError 'dimensions';
    the classifier path's one-line ValueError is given, and the engine keeps serving."""
    llm = LLM(str(embedder), max_model_len=64)
    message = "pooling_params must be a PoolingParams, got SamplingParams"
    for call in (lambda: llm.embed(TEXT, SamplingParams()), lambda: llm.encode(TEXT, SamplingParams()),
                 lambda: llm.embed([TEXT], pooling_params=[SamplingParams()])):
        with pytest.raises(ValueError, match=message):
            call()
    engine = AsyncLLM(llm=llm)

    async def encode(params) -> list:
        return [o async for o in engine.encode(TEXT, params, request_id="e")]

    try:
        with pytest.raises(ValueError, match=message):
            asyncio.run(encode(SamplingParams()))
        (out,) = asyncio.run(encode(PoolingParams()))
        assert out.outputs.embedding == pytest.approx(llm.embed(TEXT)[0].outputs.embedding, abs=1e-6)
    finally:
        engine.shutdown()
