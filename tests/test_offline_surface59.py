"""The offline API as vLLM code calls it (report offline59, items 3-6): CompletionOutput and
RequestOutput built with vLLM's constructor arguments, RequestOutput.add(); the engine's queue
time in RequestOutput.metrics; SamplingParams.from_optional, tokenization_kwargs and
mm_processor_kwargs, llm.model_config / supported_tasks / get_world_size(); detokenize=False
leaving every Logprob.decoded_token None."""

from __future__ import annotations

import logging

import pytest

from specdec import LLM, CompletionOutput, RequestOutput, SamplingParams
from specdec.metrics import RequestStats

CONV = [{"role": "user", "content": "def add(a, b):"}]
PROMPT = "def add(a, b):\n    return"


@pytest.fixture(scope="module")
def llm(tiny_pair):
    return LLM(str(tiny_pair[0]), num_speculative_tokens=0)


# -- 3: vLLM's constructors ------------------------------------------------------------------------

def test_completion_output_takes_vllms_order_and_keywords():
    c = CompletionOutput(0, "hi", [1, 2], -1.5, None)        # vLLM: (index, text, token_ids, cumulative_logprob, logprobs)
    assert c.cumulative_logprob == -1.5 and c.logprobs is None and c.finish_reason is None and not c.finished()
    c = CompletionOutput(0, "hi", [1, 2], -1.5, None, finish_reason="stop", stop_reason=7, lora_request=None,
                         kv_transfer_params={"k": 1})
    assert (c.finish_reason, c.stop_reason, c.lora_request, c.kv_transfer_params) == ("stop", 7, None, {"k": 1})
    assert c.finished()


def test_request_output_takes_vllms_order_and_keywords(caplog):
    c = CompletionOutput(0, "hi", [1, 2], None, None)
    r = RequestOutput("r1", "p", [5], None, [c], False)     # vLLM: (..., prompt_logprobs, outputs, finished)
    assert r.outputs == [c] and r.finished is False and r.prompt_logprobs is None
    assert r.encoder_prompt is None and r.encoder_prompt_token_ids is None and r.kv_transfer_params is None
    assert isinstance(r.metrics, RequestStats) and r.metrics is r.stats and r.num_cached_tokens == 0
    stats = RequestStats(cached_tokens=4)
    r = RequestOutput(request_id="r1", prompt="p", prompt_token_ids=[5], prompt_logprobs=None, outputs=[c],
                      finished=True, metrics=stats, lora_request=None, encoder_prompt=None,
                      encoder_prompt_token_ids=None)
    assert r.metrics is stats and r.num_cached_tokens == 4          # read from the metrics when not given
    with caplog.at_level(logging.WARNING, logger="specdec"):
        r = RequestOutput("r1", "p", [5], None, [c], True, num_cached_tokens=2, some_newer_field=1)
    assert r.num_cached_tokens == 2 and "some_newer_field" in caplog.text      # ignored, with a warning (vLLM's)


def test_request_output_add_aggregates_or_replaces():
    first = RequestOutput("r", "p", [5], None, [CompletionOutput(0, "a", [1], -1.0, None)], False)
    first.add(RequestOutput("r", "p", [5], None, [CompletionOutput(0, "b", [2], -2.0, None, finish_reason="stop"),
                                                   CompletionOutput(1, "x", [9], -0.5, None)], True), aggregate=True)
    a, b = first.outputs
    assert (a.text, a.token_ids, a.cumulative_logprob, a.finish_reason) == ("ab", [1, 2], -2.0, "stop")
    assert (b.index, b.text) == (1, "x") and first.finished
    new = CompletionOutput(0, "whole", [1, 2, 3], None, None)
    first.add(RequestOutput("r", "p", [5], None, [new], True), aggregate=False)
    assert first.outputs[0] is new


def test_engine_outputs_keep_their_fields(llm):
    """Every construction site in the engine (LLM.generate, llm_engine.step) fills the right fields."""
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=1, ignore_eos=True)
    out = llm.generate(PROMPT, params)[0]
    c = out.outputs[0]
    assert c.finish_reason == "length" and c.stop_reason is None and len(c.token_ids) == 4
    assert c.cumulative_logprob == pytest.approx(sum(e.logprob for e in c.logprobs))
    assert out.finished is True and out.metrics.output_tokens == 4 and out.prompt_logprobs is None
    eng = llm.llm_engine
    eng.add_request("s1", PROMPT, params)
    last = None
    while eng.has_unfinished_requests():
        last = next((o for o in eng.step() if o.request_id == "s1"), last)
    assert last.finished and last.outputs[0].token_ids == c.token_ids
    assert last.outputs[0].finish_reason == "length" and last.outputs[0].cumulative_logprob == c.cumulative_logprob


# -- 4: the queue time ------------------------------------------------------------------------------

def test_queue_time_reaches_the_outputs(tiny_pair):
    """One sequence at a time: the third prompt waits for the other two, and its output says so;
    the outputs' queue times are the engine's (the get_metrics histogram's sum)."""
    one = LLM(str(tiny_pair[0]), num_speculative_tokens=0, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = one.generate(["a", "b", "c"], params)
    waits = [o.metrics.queue_time_s for o in outs]
    assert waits[2] > 0
    hist = next(m for m in one.get_metrics() if m.name == "vllm:request_queue_time_seconds")
    assert sum(waits) == pytest.approx(hist.sum)
    eng = one.llm_engine                                       # the streamed outputs (RequestStream) too
    for rid in ("x", "y"):
        eng.add_request(rid, "a", params)
    final = {}
    while eng.has_unfinished_requests():
        final.update({o.request_id: o for o in eng.step() if o.finished})
    assert final["y"].metrics.queue_time_s > 0


# -- 5: vLLM's offline API -------------------------------------------------------------------------

def test_sampling_params_from_optional():
    p = SamplingParams.from_optional(n=None, temperature=None, top_p=None, presence_penalty=None,
                                     frequency_penalty=None, repetition_penalty=None, max_tokens=8, seed=3)
    assert (p.n, p.temperature, p.top_p, p.repetition_penalty, p.max_tokens, p.seed) == (1, 1.0, 1.0, 1.0, 8, 3)
    assert SamplingParams.from_optional(max_tokens=None).max_tokens is None      # None as the constructor takes it
    assert SamplingParams.from_optional(temperature=0.0).temperature == 0.0
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_optional(top_p=2.0)


def test_tokenization_kwargs_and_mm_processor_kwargs(llm):
    params = SamplingParams(temperature=0, max_tokens=2)
    whole = llm.generate(PROMPT, params)[0]
    for none in (None, {}):
        assert llm.generate(PROMPT, params, tokenization_kwargs=none)[0].prompt_token_ids == whole.prompt_token_ids
    cut = {"truncation": True, "max_length": 3}
    short = llm.generate(PROMPT, params, tokenization_kwargs=cut)[0]
    assert short.prompt_token_ids == llm.get_tokenizer()(PROMPT, **cut)["input_ids"]
    assert len(short.prompt_token_ids) == 3 < len(whole.prompt_token_ids) and short.prompt == PROMPT
    ids = {"prompt_token_ids": whole.prompt_token_ids}                   # token ids: left as they are
    assert llm.generate(ids, params, tokenization_kwargs=cut)[0].prompt_token_ids == whole.prompt_token_ids
    llm.llm_engine.add_request("t1", PROMPT, params, tokenization_kwargs=cut)
    outs = []
    while llm.llm_engine.has_unfinished_requests():
        outs += llm.llm_engine.step()
    assert outs[-1].prompt_token_ids == short.prompt_token_ids
    chat = llm.chat(CONV, params)[0]
    assert llm.chat(CONV, params, tokenization_kwargs={}, mm_processor_kwargs=None)[0].prompt_token_ids == \
        chat.prompt_token_ids
    assert llm.chat(CONV, params, mm_processor_kwargs={"num_crops": 4})[0].outputs[0].token_ids == \
        chat.outputs[0].token_ids
    short_chat = llm.chat(CONV, params, tokenization_kwargs={"truncation": True, "max_length": 4})[0]
    assert short_chat.prompt_token_ids == chat.prompt_token_ids[:4]      # no second BOS, cut as the tokenizer cuts
    with pytest.raises(ValueError, match="tokenization_kwargs must be a dict"):
        llm.generate(PROMPT, params, tokenization_kwargs=["truncation"])
    with pytest.raises(ValueError, match="mm_processor_kwargs must be a dict"):
        llm.chat(CONV, params, mm_processor_kwargs="x")


def test_model_config_supported_tasks_world_size(llm):
    assert llm.model_config.max_model_len == llm.llm_engine.model_config.max_model_len == llm.engine.max_model_len
    assert llm.supported_tasks == ("generate",)
    assert llm.get_world_size() == 1 and llm.get_world_size(include_dp=False) == 1


# -- 6: detokenize=False ---------------------------------------------------------------------------

def test_detokenize_false_leaves_decoded_token_none(llm):
    def names(out):
        sample = [lp.decoded_token for d in out.outputs[0].logprobs for lp in d.values()]
        prompt = [lp.decoded_token for d in out.prompt_logprobs if d is not None for lp in d.values()]
        return sample, prompt

    params = SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=1)
    sample, prompt = names(llm.generate(PROMPT, params)[0])
    assert all(isinstance(t, str) for t in sample + prompt)
    params.detokenize = False
    out = llm.generate(PROMPT, params)[0]
    assert out.outputs[0].text == "" and names(out) == ([None] * len(sample), [None] * len(prompt))
    eng = llm.llm_engine                                      # the streamed outputs (RequestStream)
    eng.add_request("d1", PROMPT, params)
    last = None
    while eng.has_unfinished_requests():
        last = next((o for o in eng.step() if o.request_id == "d1"), last)
    assert names(last) == ([None] * len(sample), [None] * len(prompt))
    assert [d.logprob for d in last.outputs[0].logprobs] == [d.logprob for d in out.outputs[0].logprobs]


def test_model_config_dtype_is_the_weights():
    """vLLM's ModelConfig.dtype is the model's: a bf16 folder reports bfloat16 (it reported the
    fp32 the CPU runs activations in)."""
    import torch

    from specdec.defaults import BUNDLED_TARGET

    llm = LLM(BUNDLED_TARGET, num_speculative_tokens=0)
    assert llm.model_config.dtype == torch.bfloat16 == llm.llm_engine.get_model_config().dtype


def test_an_unknown_architecture_lists_every_loadable_one():
    """The refusal's "supported:" list names what loads: MiMo and the multimodal folders whose
    language model runs alone too (they had been left out)."""
    from specdec.model.config import ModelConfig

    with pytest.raises(ValueError, match="unsupported architecture") as e:
        ModelConfig.from_hf({"architectures": ["FooForCausalLM"], "model_type": "foo"})
    assert "MiMoForCausalLM" in str(e.value) and "Qwen2_5_VLForConditionalGeneration" in str(e.value)


def test_request_output_keeps_its_kv_transfer_params():
    """vLLM's RequestOutput takes kv_transfer_params (it was dropped with an "ignoring extra
    arguments" warning); without it, the completions' are read."""
    c = CompletionOutput(0, "x", [1], None, None, kv_transfer_params={"c": 1})
    assert RequestOutput("r", "p", [1], None, [c], True, kv_transfer_params={"r": 2}).kv_transfer_params == {"r": 2}
    assert RequestOutput("r", "p", [1], None, [c], True).kv_transfer_params == {"c": 1}
