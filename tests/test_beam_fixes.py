"""Beam search as vLLM's, a tester's six findings: truncate_prompt_tokens and the usual request
checks on /v1/completions' beam path, chat echo with beams, the transformers equality scoped to
no EOS (with one, vLLM's rules, which specdec follows, pick other beams than transformers'),
BeamSearchSequence shaped as vLLM's, and multi_modal_data refused rather than dropped."""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import httpx
import pytest
import torch
import transformers

from specdec import LLM, SamplingParams
from specdec.beam_search import BeamSearchParams, BeamSearchSequence
from specdec.logprobs import Logprob

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.fixture(scope="module")
def llm(tiny_pair):
    return LLM(str(tiny_pair[0]), dtype="float32", num_speculative_tokens=0, max_model_len=64)


@pytest.fixture(scope="module")
def server(llm):
    from specdec.server import ServerConfig, build_app
    from test_server import LiveServer

    with LiveServer(build_app(llm, ServerConfig(served_model_names=("tiny",)))) as live:
        with httpx.Client(base_url=live.url + "/v1", timeout=60) as http:
            yield http


def _beam(body: dict) -> dict:
    return {"model": "tiny", "n": 2, "use_beam_search": True, "temperature": 0, **body}


def test_completions_beam_search_truncates_the_prompt(llm, server):
    """Finding 1: truncate_prompt_tokens keeps the prompt's last k tokens on the beam path too
    (it searched the whole prompt, and refused one longer than the context)."""
    ids = [0] + list(range(5, 75))                       # 71 tokens, a 64-token context
    r = server.post("/completions", json=_beam({"prompt": ids, "max_tokens": 4, "ignore_eos": True,
                                                "truncate_prompt_tokens": 20}))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 20
    want = llm.beam_search({"prompt_token_ids": ids[-20:]}, BeamSearchParams(2, 4, ignore_eos=True))[0]
    assert [c["text"] for c in r.json()["choices"]] == [
        llm.tokenizer.decode(b.tokens[20:], skip_special_tokens=True) for b in want.sequences]
    short = server.post("/completions", json=_beam({"prompt": "class Point", "max_tokens": 3,
                                                    "truncate_prompt_tokens": 2}))
    assert short.status_code == 200 and short.json()["usage"]["prompt_tokens"] == 2


@pytest.mark.parametrize("extra", [{"suffix": "x"}, {"stream_options": {"include_usage": True}}, {"top_p": 7},
                                   {"logit_bias": {"99999": 5}}])
def test_completions_beam_search_makes_the_usual_checks(server, extra):
    """Finding 2: what a completion request is refused for, it is refused for with beam search,
    with the same message (the beam path was answering these with 200)."""
    body = {"model": "tiny", "prompt": "def", "max_tokens": 3, **extra}
    plain = server.post("/completions", json=body)
    beam = server.post("/completions", json=_beam(body))
    assert plain.status_code == beam.status_code == 400, beam.text
    assert beam.json()["error"]["message"] == plain.json()["error"]["message"]


def test_chat_beam_search_echoes_the_last_message(llm, server):
    """Finding 3: chat's echo puts the last message (an assistant one the reply continues) before
    every choice, beams included, as vLLM's chat does (it was dropped)."""
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "def "}]
    body = {"model": "tiny", "messages": messages, "echo": True, "add_generation_prompt": False,
            "continue_final_message": True, "max_tokens": 3, "ignore_eos": True, "temperature": 0}
    r = server.post("/chat/completions", json={**body, "n": 2, "use_beam_search": True})
    assert r.status_code == 200, r.text
    plain = server.post("/chat/completions", json={**body, "n": 1}).json()
    assert plain["choices"][0]["message"]["content"].startswith("def ")
    ids = llm.chat_prompt(messages, add_generation_prompt=False, continue_final_message=True)["prompt_token_ids"]
    want = llm.beam_search({"prompt_token_ids": ids}, BeamSearchParams(2, 3, ignore_eos=True))[0]
    assert [c["message"]["content"] for c in r.json()["choices"]] == [
        "def " + llm.tokenizer.decode(b.tokens[len(ids):], skip_special_tokens=True) for b in want.sequences]
    assert r.json()["usage"]["completion_tokens"] == 2 * 3         # the echo is not counted


def _eos_likely(target: Path, folder: Path, eos: int) -> Path:
    """The target with its EOS row of the LM head made likely, so that beams end on EOS."""
    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    with torch.no_grad():
        w = model.get_output_embeddings().weight
        w[eos] = w[130] + w[104]
    model.save_pretrained(folder)
    for f in target.iterdir():
        if f.is_file() and not f.name.startswith(("model", "config")):
            shutil.copy(f, folder / f.name)
    return folder


@torch.inference_mode()
def _vllm_rules(hf, prompt, width, max_tokens, eos, length_penalty=1.0):
    """vLLM's LLM.beam_search on transformers' logits: each beam's 2 x width likeliest, EOS beams
    set aside, the width best live on; the end ranked by cum / len(prompt + output, EOS not
    counted) ** length_penalty."""
    def score(b):
        return b[1] / (len(b[0]) - (b[0][-1] == eos)) ** length_penalty
    live, done = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        grown = []
        for toks, cum in live:
            logp = torch.log_softmax(hf(torch.tensor([toks])).logits[0, -1].float(), -1)
            for lp, t in zip(*logp.topk(2 * width)):
                (done if t.item() == eos else grown).append((toks + [t.item()], cum + lp.item()))
        live = sorted(grown, key=score, reverse=True)[:width]
    return [t for t, _ in sorted(done + live, key=score, reverse=True)[:width]]


def test_with_eos_the_beams_are_vllms_not_transformers(tiny_pair, tmp_path):
    """Finding 4: the README said the beams equal transformers' generate(num_beams=...); that holds
    only with no EOS (tests/test_beam_search.py). With one, specdec's beams are vLLM's rules' and
    here differ from transformers': the README says so."""
    text = " ".join(README.read_text().split())
    claim = text[text.index("Beam search is vLLM's offline call"):]
    claim = claim[:claim.index("The server takes vLLM's `use_beam_search`")]
    sentence = next(s for s in re.split(r"(?<=\.)\s", claim) if "generate(num_beams" in s)
    assert re.search(r"no end-of-sequence|ignore_eos", sentence), sentence
    assert "transformers uses the output's length" in claim

    eos = LLM(str(tiny_pair[0]), dtype="float32", num_speculative_tokens=0).tokenizer.eos_token_ids[0]
    folder = _eos_likely(tiny_pair[0], tmp_path / "eosy", eos)
    llm = LLM(str(folder), dtype="float32", num_speculative_tokens=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt, width, max_tokens = [0, 9, 17, 33, 42], 3, 8
    mine = [b.tokens for b in llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(width, max_tokens))[0].sequences]
    assert any(t[-1] == eos for t in mine)                     # EOS came up
    assert mine == _vllm_rules(hf, prompt, width, max_tokens, eos)
    config = transformers.GenerationConfig(num_beams=width, num_return_sequences=width, do_sample=False,
                                           max_new_tokens=max_tokens, eos_token_id=eos, pad_token_id=0,
                                           early_stopping=False)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    theirs = [s[:s.index(eos, len(prompt)) + 1] if eos in s[len(prompt):] else s for s in (x.tolist() for x in out)]
    assert mine != theirs


def test_beam_search_sequence_is_vllms(llm):
    """Finding 5: vLLM's fields in vLLM's order; logprobs one {token id: Logprob} per output token
    (the chosen one among them; they were floats); text is tokenizer.decode(tokens), special tokens
    and the EOS kept (it skipped them and dropped the EOS)."""
    assert [f.name for f in dataclasses.fields(BeamSearchSequence)] == [
        "tokens", "logprobs", "lora_request", "cum_logprob", "text", "finish_reason", "stop_reason"]
    prompt = llm.chat_prompt([{"role": "user", "content": "def add(a, b):"}])["prompt_token_ids"]
    seqs = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(2, 4))[0].sequences
    for seq in seqs:
        out = seq.tokens[len(prompt):]
        assert len(seq.logprobs) == len(out)
        for step, tok in zip(seq.logprobs, out):
            assert type(step) is dict and len(step) >= 4             # the step's 2 x width candidates
            assert isinstance(step[tok], Logprob)
            assert step[tok].decoded_token == llm.tokenizer.decode([tok])
        assert seq.cum_logprob == pytest.approx(sum(s[t].logprob for s, t in zip(seq.logprobs, out)), abs=1e-5)
        assert seq.text == llm.tokenizer.decode(seq.tokens)
        assert seq.text != llm.tokenizer.decode(seq.tokens, skip_special_tokens=True)   # the template's tokens
        assert seq.lora_request is None and seq.stop_reason is None


def test_multi_modal_data_is_refused(llm):
    """Finding 6: as vLLM, a prompt's multi_modal_data on a model that reads none is a one-line
    ValueError (it was dropped, the text answered alone); mm_processor_kwargs without data, and
    keys vLLM does not read, are ignored as vLLM ignores them."""
    params = SamplingParams(max_tokens=2, temperature=0)
    for prompt in ({"prompt": "hi", "multi_modal_data": {"image": "cat.png"}},
                   {"prompt_token_ids": [0, 5, 6], "multi_modal_data": {"image": "cat.png"}}):
        with pytest.raises(ValueError, match="is not a multimodal model") as e:
            llm.generate(prompt, params)
        assert "\n" not in str(e.value)
        with pytest.raises(ValueError, match="is not a multimodal model"):
            llm.beam_search(prompt, BeamSearchParams(2, 2))
    want = llm.generate("hi", params)[0].outputs[0].token_ids
    for prompt in ({"prompt": "hi", "multi_modal_data": {}}, {"prompt": "hi", "mm_processor_kwargs": {"x": 1}},
                   {"prompt": "hi", "cache_salt": "s"}):
        assert llm.generate(prompt, params)[0].outputs[0].token_ids == want
