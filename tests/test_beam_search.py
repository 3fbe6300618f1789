"""Beam search (vLLM's LLM.beam_search): on a tiny fp32 llama with no end-of-sequence token the
beams and their scores equal transformers' own beam search (generate(num_beams=...)); with one,
vLLM's rules (which specdec follows) and transformers' differ, so that case is checked against
vLLM's rules only (tests/test_beam_fixes.py shows a difference)."""

from __future__ import annotations

import pytest
import torch
import transformers

from specdec import LLM
from specdec.beam_search import BeamSearchParams

PROMPTS = [[0, 9, 17, 33, 42], [0, 5, 6, 7], [0, 30, 31, 32, 33, 34]]


@pytest.fixture(scope="module")
def models(tiny_pair):
    target = tiny_pair[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    return LLM(str(target), dtype="float32", num_speculative_tokens=0), hf


def hf_beams(hf, prompt, width, max_tokens, length_penalty=1.0):
    """transformers' beam search with no end-of-sequence token (its generation_config's left out)."""
    config = transformers.GenerationConfig(num_beams=width, num_return_sequences=width, do_sample=False,
                                           max_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0,
                                           length_penalty=length_penalty, early_stopping=False)
    config.output_scores = config.return_dict_in_generate = True
    ids = torch.tensor([prompt])
    with torch.inference_mode():        # (the mask given: pad id 0 is also the BOS every prompt starts with)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return [s.tolist() for s in out.sequences], out.sequences_scores.tolist()


@pytest.mark.parametrize("width", [2, 4])
def test_beams_equal_transformers_without_eos(models, width):
    """No end-of-sequence token: every beam is max_tokens long, ranked by cumulative
    log-probability, as transformers ranks them."""
    llm, hf = models
    params = BeamSearchParams(beam_width=width, max_tokens=6, ignore_eos=True)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, out in zip(PROMPTS, outs):
        seqs, scores = hf_beams(hf, prompt, width, 6)
        assert [b.tokens for b in out.sequences] == seqs
        # transformers' score: sum of the output's log-probabilities / output length ** length_penalty
        assert [b.cum_logprob / 6 for b in out.sequences] == pytest.approx(scores, abs=1e-4)
        assert all(b.finish_reason == "length" for b in out.sequences)


def test_beams_with_eos_and_length_penalty(models):
    """With the model's EOS: beams that end are set aside, the rest go on; the final ranking
    divides by len ** length_penalty (vLLM's rule, over prompt and output tokens)."""
    llm, _ = models
    eos = llm.tokenizer.eos_token_ids
    params = BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=0.5)
    out = llm.beam_search({"prompt_token_ids": PROMPTS[1]}, params)[0]
    assert len(out.sequences) == 3
    scores = []
    for b in out.sequences:
        n = len(b.tokens) - (1 if b.tokens[-1] in eos else 0)
        scores.append(b.cum_logprob / n ** 0.5)
        assert b.tokens[:len(PROMPTS[1])] == PROMPTS[1]
        out_ids = b.tokens[len(PROMPTS[1]):]
        assert b.cum_logprob == pytest.approx(sum(lp[t].logprob for lp, t in zip(b.logprobs, out_ids)), abs=1e-5)
        assert b.text == llm.tokenizer.decode(b.tokens)       # vLLM's: special tokens and the EOS kept
    assert scores == sorted(scores, reverse=True)


def test_beam_search_checks(models):
    llm, _ = models
    with pytest.raises(ValueError, match="beam_width must be >= 1"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError):
        llm.beam_search({"prompt_token_ids": list(range(1, 10 ** 4))}, BeamSearchParams(2, 4))


def test_beams_that_fill_the_context_finish_there(tiny_pair):
    """A beam that reaches max_model_len cannot be extended: it finishes ("length") and is ranked
    with the rest, as vLLM's loop completes it; the other prompts' beams are kept (the search
    used to fail there with a ValueError from the step, losing every prompt's results)."""
    llm = LLM(str(tiny_pair[0]), dtype="float32", num_speculative_tokens=0, max_model_len=16)
    long, short = {"prompt_token_ids": [0] + list(range(1, 13))}, {"prompt_token_ids": PROMPTS[1]}  # 13, 4 tokens
    params = BeamSearchParams(beam_width=2, max_tokens=8, ignore_eos=True)
    outs = llm.beam_search([long, short], params)
    assert [(len(b.tokens), b.finish_reason) for b in outs[0].sequences] == [(16, "length")] * 2
    capped = llm.beam_search(long, BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))[0]
    assert [b.tokens for b in outs[0].sequences] == [b.tokens for b in capped.sequences]
    assert [b.tokens for b in outs[1].sequences] == [b.tokens for b in llm.beam_search(short, params)[0].sequences]
    assert [len(b.tokens) for b in outs[1].sequences] == [12, 12]


def test_a_prompt_that_cannot_fit_is_refused_before_any_step(tiny_pair, monkeypatch):
    """Only what can never run is refused up front: a prompt that leaves no room for a token."""
    llm = LLM(str(tiny_pair[0]), dtype="float32", num_speculative_tokens=0, max_model_len=16)
    steps = []
    monkeypatch.setattr(llm, "generate", lambda *a, **k: steps.append(1))
    with pytest.raises(ValueError, match="prompt is too long"):
        llm.beam_search([{"prompt_token_ids": PROMPTS[1]}, {"prompt_token_ids": list(range(1, 17))}],
                        BeamSearchParams(beam_width=2, max_tokens=4))
    assert not steps


def test_prefix_caching_and_speculation_change_no_beam(tiny_pair, near_draft, models):
    """Beams share their prefixes through the prefix cache, and a speculative LLM scores each
    one-token step as plain decoding does: the same beams either way."""
    llm, _ = models
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    want = [[b.tokens for b in o.sequences] for o in llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)]
    cached = LLM(str(tiny_pair[0]), dtype="float32", num_speculative_tokens=0, enable_prefix_caching=True)
    spec = LLM(str(tiny_pair[0]), dtype="float32", speculative_model=str(near_draft), num_speculative_tokens=3)
    for other in (cached, spec):
        got = other.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
        assert [[b.tokens for b in o.sequences] for o in got] == want
    assert cached.engine.blocks.prefix_caching


def test_server_use_beam_search(models):
    """vLLM's `use_beam_search` on /v1/completions through the official client: the n choices of
    a prompt are its n beams (LLM.beam_search's, best first, the prompt left out of the text)."""
    import openai

    from specdec.server import ServerConfig, build_app
    from test_server import LiveServer

    llm, _ = models
    want = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS[:2]],
                           BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True))
    with LiveServer(build_app(llm, ServerConfig(served_model_names=("tiny",)))) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        res = client.completions.create(model="tiny", prompt=PROMPTS[:2], n=3, max_tokens=5, temperature=0,
                                        extra_body={"use_beam_search": True, "ignore_eos": True})
        texts = [c.text for c in sorted(res.choices, key=lambda c: c.index)]
        assert texts == [llm.tokenizer.decode(b.tokens[len(p):], skip_special_tokens=True)
                         for p, o in zip(PROMPTS, want) for b in o.sequences]
        assert res.usage.completion_tokens == 2 * 3 * 5
        messages = [{"role": "user", "content": "def add(a, b):"}]
        ids = llm.chat_prompt(messages)["prompt_token_ids"]
        beams = llm.beam_search({"prompt_token_ids": ids}, BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True))
        chat = client.chat.completions.create(model="tiny", messages=messages, n=2, max_tokens=5, temperature=0,
                                              extra_body={"use_beam_search": True, "ignore_eos": True})
        assert [c.message.content for c in chat.choices] == [
            llm.tokenizer.decode(b.tokens[len(ids):], skip_special_tokens=True) for b in beams[0].sequences]
        # vLLM's completions do not stream beams: a streamed request gets the whole body as one event
        streamed = list(client.completions.create(model="tiny", prompt=PROMPTS[:2], n=3, max_tokens=5, stream=True,
                                                  extra_body={"use_beam_search": True, "ignore_eos": True}))
        assert len(streamed) == 1 and [c.text for c in streamed[0].choices] == texts
        for extra in ({"guided_choice": ["a", "b"]}, {"guided_regex": "(["}, {"response_format": {"type": "json_object"}}):
            with pytest.raises(openai.BadRequestError, match="structured outputs"):   # was answered, unconstrained
                client.completions.create(model="tiny", prompt="hi", n=2, max_tokens=4,
                                          extra_body={"use_beam_search": True, **extra})
