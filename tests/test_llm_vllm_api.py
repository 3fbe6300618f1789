"""The offline LLM API as vLLM users call it: vLLM's constructor arguments that mean nothing here
are accepted, its methods and import paths exist (llm_engine, reset_prefix_cache, get_metrics,
encode, chat's and beam_search's signatures, BeamSearchParams, TextPrompt / TokensPrompt), the
default seed is 0 (vLLM V1's), and bad inputs are one-line errors naming the argument."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from specdec import LLM, SamplingParams

CONV = [{"role": "user", "content": "def add(a, b):"}]
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
SAMPLED = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_pair):
    return LLM(str(tiny_pair[0]), num_speculative_tokens=0)


@pytest.fixture(scope="module")
def spec_llm(tiny_pair):
    return LLM(str(tiny_pair[0]), speculative_model=str(tiny_pair[1]), num_speculative_tokens=3)


# -- D2: the default seed -------------------------------------------------------------------------

def test_default_seed_is_zero_and_samples_reproduce_across_instances(tiny_pair, llm):
    """vLLM's V1 engine seeds with 0 when no seed is given: two runs of the same script (two
    fresh LLMs here) sample the same text; seed=None stays unseeded."""
    assert llm.seed == 0
    fresh = LLM(str(tiny_pair[0]), num_speculative_tokens=0)
    a = [o.outputs[0].token_ids for o in fresh.generate(["def", "class"], SAMPLED)]
    again = LLM(str(tiny_pair[0]), num_speculative_tokens=0)
    assert [o.outputs[0].token_ids for o in again.generate(["def", "class"], SAMPLED)] == a
    unseeded = [LLM(str(tiny_pair[0]), num_speculative_tokens=0, seed=None) for _ in range(2)]
    runs = [[o.outputs[0].token_ids for o in u.generate(["def", "class"], SAMPLED)] for u in unseeded]
    assert runs[0] != runs[1]


def test_seeded_requests_never_share_draws(tiny_pair):
    """Under the LLM's seed, request i's n choices draw from streams no other request uses: the
    same prompt twice with n=2 gives four different samples (request i's choice 1 was request
    i+1's choice 0 when requests were seeded seed + i)."""
    llm = LLM(str(tiny_pair[0]), num_speculative_tokens=0, seed=0)
    outs = llm.generate(["def", "def"], SamplingParams(temperature=1.0, max_tokens=12, n=2, ignore_eos=True))
    samples = [c.token_ids for o in outs for c in o.outputs]
    assert len({tuple(s) for s in samples}) == 4


def test_llm_seed_is_checked(tiny_pair):
    with pytest.raises(ValueError, match="seed must be an integer"):
        LLM(str(tiny_pair[0]), seed="0")


def test_server_seed_defaults_to_zero():
    """`specdec serve`'s --seed is 0 unless given (vLLM V1's default): unseeded requests are
    seeded in arrival order, so a run reproduces while two requests still differ."""
    from specdec.server.cli import build_parser, server_config

    assert server_config(build_parser().parse_args([])).seed == 0
    assert server_config(build_parser().parse_args(["--seed", "7"])).seed == 7


# -- D3: vLLM's arguments, methods and import paths --------------------------------------------

def test_vllm_constructor_arguments_are_accepted(tiny_pair, caplog):
    target = str(tiny_pair[0])
    with caplog.at_level(logging.WARNING, logger="specdec.llm"):
        LLM(target, num_speculative_tokens=0, trust_remote_code=False, tokenizer_mode="auto", revision=None,
            swap_space=4, cpu_offload_gb=0, disable_log_stats=True, load_format="auto")
    assert not caplog.records                       # vLLM's defaults: nothing to say
    with caplog.at_level(logging.WARNING, logger="specdec.llm"):
        LLM(target, num_speculative_tokens=0, trust_remote_code=True, tokenizer_mode="slow", revision="main",
            tokenizer_revision="main", download_dir="/tmp", swap_space=0, cpu_offload_gb=2,
            disable_custom_all_reduce=True, disable_log_stats=False, enable_chunked_prefill=False,
            load_format="safetensors", hf_token=True, disable_async_output_proc=True)
    assert len(caplog.records) == 1                 # one warning naming them
    assert "trust_remote_code=True" in caplog.text and "enable_chunked_prefill=False" in caplog.text


@pytest.mark.parametrize("kwargs, message", [
    ({"tokenizer_mode": "mistral"}, "tokenizer_mode"), ({"tokenizer_mode": "nonsense"}, "tokenizer_mode"),
    ({"load_format": "dummy"}, "load_format"), ({"pipeline_parallel_size": 2}, "pipeline_parallel_size"),
    ({"trust_remote_code": "yes"}, "trust_remote_code"), ({"swap_space": -1}, "swap_space"),
    ({"skip_tokenizer_init": True}, "skip_tokenizer_init")])
def test_vllm_arguments_specdec_cannot_honour_are_refused(tiny_pair, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_pair[0]), num_speculative_tokens=0, **kwargs)


def test_unknown_keyword_is_a_type_error(tiny_pair):
    with pytest.raises(TypeError, match="foo_bar"):
        LLM(str(tiny_pair[0]), foo_bar=1)


def test_vllms_import_paths_for_outputs_and_output_kind():
    """vLLM's `from vllm.sampling_params import RequestOutputKind` and `from vllm.outputs import
    RequestOutput, CompletionOutput` port by their module names."""
    import specdec
    from specdec.outputs import CompletionOutput, RequestOutput
    from specdec.sampling_params import RequestOutputKind

    assert RequestOutputKind is specdec.RequestOutputKind
    assert RequestOutput is specdec.RequestOutput and CompletionOutput is specdec.CompletionOutput


def test_seed_minus_one_is_no_seed_and_true_logprobs_are_one(tiny_pair):
    """vLLM's SamplingParams: seed -1 is None (fresh draws each request; it was a fixed seed), and
    logprobs / prompt_logprobs True mean 1 (they were refused)."""
    assert SamplingParams(seed=-1).seed is None
    sp = SamplingParams(seed=5)
    sp.seed = -1
    assert sp.seed is None
    assert SamplingParams(logprobs=True).logprobs == 1 and SamplingParams(prompt_logprobs=True).prompt_logprobs == 1
    llm = LLM(str(tiny_pair[0]), num_speculative_tokens=0, seed=None)
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=-1)
    assert len({tuple(llm.generate("def", params)[0].outputs[0].token_ids) for _ in range(3)}) > 1
    out = llm.generate("def", SamplingParams(temperature=0, max_tokens=3, logprobs=True, prompt_logprobs=True))[0]
    assert len(out.outputs[0].logprobs) == 3 and len(out.prompt_logprobs) == len(out.prompt_token_ids)


def test_truncate_prompt_tokens_keeps_a_text_prompts_bos():
    """vLLM tokenizes a text prompt with truncation=True, max_length=k on a truncation_side="left"
    tokenizer: the text's last tokens after its BOS (specdec cut the ids, BOS and all); token ids
    keep their last k; k above max_model_len is vLLM's ValueError."""
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained("models/target", truncation_side="left")
    llm = LLM("models/target", max_model_len=64, num_speculative_tokens=0)
    text = "hello world foo"
    ids = llm.get_tokenizer().encode(text)
    assert ids[0] == llm.get_tokenizer().bos_token_id and len(ids) == 4
    for k in (1, 2, 3, 10):
        params = SamplingParams(temperature=0, max_tokens=1, truncate_prompt_tokens=k)
        want = hf.encode(text, truncation=True, max_length=k)
        assert want[0] == ids[0] and llm.generate(text, params)[0].prompt_token_ids == want, k
        assert llm.generate({"prompt": text}, params)[0].prompt_token_ids == want
        assert llm.generate({"prompt_token_ids": ids}, params)[0].prompt_token_ids == ids[-k:]
    engine = llm.llm_engine
    engine.add_request("t", text, SamplingParams(temperature=0, max_tokens=1, truncate_prompt_tokens=2))
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[0].prompt_token_ids == [ids[0], ids[-1]]
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens value \(65\) is greater than max_model_len \(64\)"):
        llm.generate(text, SamplingParams(max_tokens=1, truncate_prompt_tokens=65))
    with pytest.raises(ValueError, match="greater than max_model_len"):
        llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, truncate_prompt_tokens=65))


@pytest.mark.parametrize("which", ["llm", "spec_llm"])
def test_min_tokens_bans_eos_with_ignore_eos_too(which, request):
    """vLLM's min_tokens bans every stop token id, EOS included, whatever ignore_eos says (EOS
    came through with ignore_eos=True), plainly and under speculation."""
    llm = request.getfixturevalue(which)
    eos = min(llm.engine.eos_ids)
    params = SamplingParams(temperature=0, max_tokens=5, min_tokens=3, ignore_eos=True, logit_bias={eos: 100})
    out = llm.generate("Hello", params)[0].outputs[0]
    assert eos not in out.token_ids[:3] and out.token_ids[3:] == [eos, eos]


def test_llm_engine(llm):
    engine = llm.llm_engine
    assert engine.get_tokenizer() is llm.get_tokenizer()
    assert engine.max_model_len == llm.engine.max_model_len        # the engine's own attributes
    assert engine.has_unfinished_requests() is False and engine.get_num_unfinished_requests() == 0


def test_reset_prefix_cache_drops_cached_blocks(tiny_pair):
    llm = LLM(str(tiny_pair[0]), num_speculative_tokens=0, block_size=4)
    prompt = {"prompt_token_ids": list(range(1, 30))}
    greedy = SamplingParams(temperature=0, max_tokens=4)
    first = llm.generate(prompt, greedy)[0]
    cached = llm.generate(prompt, greedy)[0]
    assert cached.num_cached_tokens > 0
    assert llm.reset_prefix_cache() is True
    again = llm.generate(prompt, greedy)[0]
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == cached.outputs[0].token_ids
    assert llm.llm_engine.reset_prefix_cache() is True


def test_reset_prefix_cache_refuses_while_requests_hold_blocks(tiny_pair):
    llm = LLM(str(tiny_pair[0]), num_speculative_tokens=0, block_size=4)
    events = llm.stream({"prompt_token_ids": list(range(1, 30))}, SamplingParams(temperature=0, max_tokens=8))
    next(events)
    assert llm.reset_prefix_cache() is False
    list(events)
    assert llm.reset_prefix_cache() is True


def test_get_metrics(spec_llm):
    before = {m.name: m for m in spec_llm.get_metrics() if not m.labels.get("finished_reason")}
    spec_llm.generate(["def", "class"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    metrics = spec_llm.get_metrics()
    by_name = {m.name: m for m in metrics if not m.labels.get("finished_reason")}
    assert by_name["vllm:generation_tokens"].value - before["vllm:generation_tokens"].value == 12
    assert by_name["vllm:prompt_tokens"].value > before["vllm:prompt_tokens"].value
    assert by_name["vllm:spec_decode_num_drafts"].value > 0
    assert by_name["vllm:spec_decode_num_draft_tokens"].value >= by_name["vllm:spec_decode_num_accepted_tokens"].value
    assert sum(by_name["vllm:spec_decode_num_accepted_tokens_per_pos"].values) == \
        by_name["vllm:spec_decode_num_accepted_tokens"].value
    assert by_name["vllm:num_requests_running"].value == 0
    success = {m.labels["finished_reason"]: m.value for m in metrics if m.name == "vllm:request_success"}
    assert success["length"] >= 2


def test_encode_runs_the_pooling_task(tiny_pair, llm):
    pooled = LLM(str(tiny_pair[0]), convert="embed")
    enc = pooled.encode(["def add", "class"])
    assert [o.outputs.embedding for o in enc] == [o.outputs.embedding for o in pooled.embed(["def add", "class"])]
    assert all(o.outputs.data.tolist() == o.outputs.embedding for o in enc)        # vLLM's PoolingOutput.data
    with pytest.raises(ValueError, match="pooling_task"):
        pooled.encode("def", pooling_task="token_embed")
    with pytest.raises(ValueError, match="runner"):
        llm.encode("def")


def test_chat_takes_vllms_positional_order_and_content_format(llm):
    params = SamplingParams(temperature=0, max_tokens=4)
    by_name = llm.chat(CONV, params, chat_template=TEMPLATE)[0]
    positional = llm.chat(CONV, params, False, None, TEMPLATE)[0]      # messages, params, use_tqdm, lora, template
    assert positional.prompt == by_name.prompt and positional.outputs[0].token_ids == by_name.outputs[0].token_ids
    for fmt in ("auto", "string"):     # the template prints content: auto gives it the text
        out = llm.chat(CONV, params, chat_template=TEMPLATE, chat_template_content_format=fmt)[0]
        assert out.outputs[0].token_ids == by_name.outputs[0].token_ids
    # forced "openai": the list of parts reaches the template (as vLLM's; tests/test_vllm_flags.py)
    parts = llm.chat(CONV, params, chat_template=TEMPLATE, chat_template_content_format="openai")[0]
    assert "'type': 'text'" in parts.prompt
    with pytest.raises(ValueError, match="chat_template_content_format"):
        llm.chat(CONV, params, chat_template=TEMPLATE, chat_template_content_format="xml")


def test_beam_search_takes_vllms_arguments(llm):
    from specdec.sampling_params import BeamSearchParams

    prompts = [{"prompt_token_ids": [0, 5, 6, 7]}, {"prompt_token_ids": [0, 9, 17]}, "def"]
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    whole = llm.beam_search(prompts, params)
    for kwargs in ({"use_tqdm": True}, {"lora_request": None}, {"concurrency_limit": 1}, {"concurrency_limit": 2}):
        outs = llm.beam_search(prompts, params, **kwargs)
        assert [[b.tokens for b in o.sequences] for o in outs] == [[b.tokens for b in o.sequences] for o in whole]
    with pytest.raises(ValueError, match="concurrency_limit"):
        llm.beam_search(prompts, params, concurrency_limit=0)
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search(prompts, SamplingParams())


def test_text_and_tokens_prompts(llm):
    from specdec import TextPrompt as Top
    from specdec.inputs import TextPrompt, TokensPrompt

    assert Top is TextPrompt
    greedy = SamplingParams(temperature=0, max_tokens=4)
    ids = llm.tokenizer.encode("def add")
    text, tokens = llm.generate([TextPrompt(prompt="def add"), TokensPrompt(prompt_token_ids=ids)], greedy)
    assert text.outputs[0].token_ids == tokens.outputs[0].token_ids
    assert text.prompt == "def add" and tokens.prompt is None and tokens.prompt_token_ids == ids


# -- D5: bad inputs are one-line errors naming the argument ---------------------------------------

@pytest.mark.parametrize("prompt", [5, None, 3.5])
def test_prompts_of_a_wrong_type(llm, prompt):
    with pytest.raises(TypeError, match="prompts must be"):
        llm.generate(prompt)


@pytest.mark.parametrize("prompt, message", [
    ({"prompt": None}, "'prompt' must be a string"), ({"prompt": 5}, "'prompt' must be a string"),
    ({"prompt_token_ids": None}, "prompt_token_ids must be a list of integers"),
    ({"prompt_token_ids": "abc"}, "prompt_token_ids must be a list of integers"),
    ({"prompt_token_ids": ["a"]}, "prompt_token_ids must be integers"),
    ({"prompt_token_ids": [0, 38.7]}, "prompt_token_ids must be integers, got 38.7"),
    ({"prompt_token_ids": [True, False]}, "prompt_token_ids must be integers, got True"),
    ({"prompt_token_ids": np.array([0.0, 5.0])}, "prompt_token_ids must be integers"),
    ({"prompt_token_ids": torch.tensor([[0, 5]])}, "one-dimensional"),
    ({"prompt_token_ids": [1], "prompt": 5}, "'prompt' must be a string"),
    ({"text": "hi"}, "a prompt must be")])
def test_bad_prompts(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, SamplingParams(max_tokens=2))


def test_numpy_and_torch_ids_become_ints(llm):
    greedy = SamplingParams(temperature=0, max_tokens=4)
    ids = [0, 5, 6, 7]
    ref = llm.generate({"prompt_token_ids": ids}, greedy)[0]
    for given in (np.array(ids), torch.tensor(ids), [np.int64(i) for i in ids], [torch.tensor(i) for i in ids],
                  tuple(ids)):
        out = llm.generate({"prompt_token_ids": given}, greedy)[0]
        assert out.prompt_token_ids == ids and all(type(t) is int for t in out.prompt_token_ids)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_sampling_params_of_a_wrong_type(llm):
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams"):
        llm.generate("def", {"temperature": 0})
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams"):
        llm.generate(["def", "class"], [SamplingParams(), {"temperature": 0}])


def test_bad_chat_messages(llm):
    with pytest.raises(ValueError, match="not a mix"):
        llm.chat([CONV, {"role": "user", "content": "hi"}], chat_template=TEMPLATE)
    with pytest.raises(ValueError, match="'role'"):
        llm.chat([{"content": "Hi"}], chat_template=TEMPLATE)
    with pytest.raises(ValueError, match="'role'"):
        llm.chat([[{"role": None, "content": "Hi"}]], chat_template=TEMPLATE)


@pytest.mark.parametrize("value", ["64", 64.0, True])
def test_max_model_len_of_a_wrong_type(tiny_pair, value):
    with pytest.raises(ValueError, match="max_model_len must be an integer"):
        LLM(str(tiny_pair[0]), max_model_len=value)


def test_sleep_mode_is_refused_clearly(tiny_pair):
    """vLLM's sleep mode (GPU memory freed between RL rollouts; its CPU backend refuses it): asking
    for it is one ValueError, never an unknown-keyword TypeError; sleep() / wake_up() say so."""
    with pytest.raises(ValueError, match="enable_sleep_mode=True is not supported: specdec has no sleep mode"):
        LLM(str(tiny_pair[0]), enable_sleep_mode=True)
    llm = LLM(str(tiny_pair[0]), enable_sleep_mode=False, num_speculative_tokens=0, max_model_len=64)
    assert llm.is_sleeping() is False
    for call in (llm.sleep, llm.wake_up):
        with pytest.raises(ValueError, match="sleep mode is not enabled"):
            call()
