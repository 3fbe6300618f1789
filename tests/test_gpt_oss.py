"""gpt-oss (GptOssForCausalLM): attention sinks, biases on q/k/v/o, the router and the experts, the
clamped SwiGLU, a sliding window in every other layer and YaRN (untruncated), as a Hugging Face
folder (unquantized, and with MXFP4 experts as OpenAI ships them) and a GGUF file (llama.cpp's
gpt-oss names; F32, and MXFP4 experts), against transformers; every speculative method against
plain decoding; tensor parallelism. The tiny model: 4 experts, 2 per token, a 6-token window in
layer 0, gate/up biases large enough that swiglu_limit's clamps (7, which llama.cpp's files
cannot change) bite."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T, quants
from safetensors.numpy import load_file, save_file

from gguf_helpers import write_gguf
from specdec.model import load_model, save_model
from specdec.model.checkpoint import CheckpointError, mxfp4_blocks
from specdec.model.llama import MoE
from arch_checks import (IDS, NO_KERNELS, arch_files, cached_logits, check_packed_batch_equals_solo,  # noqa: F401
                         check_rows_bit_identical, check_tensor_parallel_equals_tp1, reference, without_kernels,
                         test_f32_gguf_equals_the_checkpoint, test_greedy_output_equals_transformers_generate,
                         test_logits_match_transformers, test_speculative_greedy_equals_plain,
                         test_speculative_greedy_equals_plain_padded_attention)

CONFIG = {}


def _mxfp4_folder(hf, out):
    """hf with its experts in OpenAI's MXFP4 layout (gate_up_proj_blocks [E, 2F, D / 32, 16]: rows
    in gate/up interleaved order, two values a byte with the low nibble first; _scales E8M0), as
    gguf-py quantizes them (ggml's blocks: the exponent byte, then value j in the low nibble of
    byte j and value j + 16 in its high one)."""
    shutil.copytree(hf, out)
    sd, packed = load_file(str(hf / "model.safetensors")), {}
    for name, v in sd.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            packed[name] = v
            continue
        w = v.transpose(0, 2, 1)                                           # [E, rows, in]
        rows = quants.quantize(np.ascontiguousarray(w.reshape(-1, w.shape[-1])), T.MXFP4).reshape(*w.shape[:2], -1)
        blocks, scales = mxfp4_blocks(torch.from_numpy(rows))
        packed[name + "_blocks"], packed[name + "_scales"] = blocks.numpy(), scales.numpy()
    save_file(packed, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("gpt_oss")
    out = arch_files(root, "gpt_oss", CONFIG)
    out["mxfp4"] = _mxfp4_folder(out["hf"], root / "mxfp4")
    out["mxfp4_gguf"] = write_gguf(out["hf"], root / "mxfp4.gguf",
                                   qtypes=lambda n, ndim: T.MXFP4 if "_exps." in n else T.F32)
    return out


def test_config_reads_and_writes_gpt_oss(files, tmp_path):
    model = load_model(files["hf"], "float32")
    cfg = model.config
    assert (cfg.model_type, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.moe_layers,
            cfg.sliding_window, cfg.sliding_layers, cfg.hidden_act, cfg.swiglu_limit, cfg.attn_sinks, cfg.o_bias,
            cfg.mlp_bias, cfg.attention_bias) == \
        ("gpt_oss", 4, 2, 128, (0, 1), 6, (0,), "swiglu_oai", 7.0, True, True, True, True)
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["truncate"] is False
    assert all(isinstance(layer.mlp, MoE) and layer.mlp.gate.bias is not None for layer in model.model.layers)
    assert load_model(files["f32"]).config.replace(rms_norm_eps=cfg.rms_norm_eps) == cfg
    save_model(model, tmp_path / "saved", torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(reference(tmp_path / "saved")(IDS).logits, reference(files["hf"])(IDS).logits)
    assert load_model(tmp_path / "saved", "float32").config == cfg


def test_sinks_clamps_and_window_matter(files, monkeypatch):
    """Without the sinks, without the clamps, or with the window left open, the logits leave
    transformers' (so the agreement elsewhere, on both forwards, is not by accident). On the
    PyTorch path, whose modules are changed here (the C forward reads the config's limit)."""
    without_kernels(monkeypatch, False)
    tokens = torch.randint(0, 200, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = reference(files["hf"])(tokens[None]).logits[0]
        model = load_model(files["hf"], "float32")
        assert (cached_logits(model, tokens, [(0, 17), (17, 18), (18, 40)]) - ref).abs().max() < 1e-4
        for change in ("sinks", "clamps", "window"):
            model = load_model(files["hf"], "float32")
            for layer in model.model.layers:
                if change == "sinks":
                    layer.self_attn.sinks.data.fill_(-1e4)
                elif change == "window":
                    layer.self_attn.window = None
                else:
                    for expert in layer.mlp.experts:
                        expert.limit = 1e4
            assert (cached_logits(model, tokens, [(0, 17), (17, 18), (18, 40)]) - ref).abs().max() > 1e-3, change


@NO_KERNELS
def test_c_forward_rows_are_bit_identical_however_chunked_and_batched(files):
    """forward.c runs gpt-oss whole (sinks in its attention's softmax, the biases, the clamped
    SwiGLU): a token's logits are the same bits however chunked and batched, the experts dense
    and packed MXFP4 alike."""
    check_rows_bit_identical(load_model(files["hf"], "float32"), 24)
    packed = load_model(files["mxfp4"], "float32")
    assert packed.c_view(packed.new_cache(1, 8)) is not None
    check_rows_bit_identical(packed, 24)


def test_mxfp4_experts_load_as_transformers_dequantizes_them(files):
    """OpenAI's MXFP4 folder: logits equal transformers' (Mxfp4Config(dequantize=True)); the same
    experts from a GGUF with MXFP4 ffn_*_exps tensors are the same parameters, bit for bit."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    ours = load_model(files["mxfp4"], "float32", quantization="none")
    theirs = AutoModelForCausalLM.from_pretrained(files["mxfp4"], dtype=torch.float32,
                                                  quantization_config=Mxfp4Config(dequantize=True)).eval()
    with torch.no_grad():
        expected = theirs(IDS).logits[0]
        torch.testing.assert_close(ours(IDS).logits[0], expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(cached_logits(ours, IDS[0], [(0, 5), (5, 12)]), expected, atol=1e-4, rtol=1e-4)
        plain = reference(files["hf"])(IDS).logits[0]
        assert (plain - expected).abs().max() > 1e-4         # the 4-bit experts differ from the fp32 ones
    a, b = dict(ours.named_parameters()), dict(load_model(files["mxfp4_gguf"], quantization="none").named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        if ".experts." in name and name.endswith("weight"):
            assert torch.equal(a[name], b[name]), name
        else:
            torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-6, msg=name)


@NO_KERNELS
def test_packed_mxfp4_experts(files):
    """llama.cpp's MXFP4 experts stay packed (qgemm.c multiplies them: FP4 values by a byte
    table, int8 activations, as Q8_0): logits near the dequantized model's; greedy output four at
    once with speculation equals plain decoding one at a time."""
    model = load_model(files["mxfp4_gguf"], quantization="gguf")
    expert = model.model.layers[0].mlp.experts[0]
    assert type(expert.gate_up_proj).__name__ == "QuantLinear" and expert.gate_up_proj.qtype == "MXFP4"
    assert expert.gate_up_proj.bias is not None and expert.gate_up_proj.prepared is not None
    with torch.no_grad():
        ref = load_model(files["mxfp4_gguf"], quantization="none")(IDS).logits[0]
        assert (cached_logits(model, IDS[0], [(0, 5), (5, 12)]) - ref).abs().max() < 0.1 * ref.abs().max()
    check_packed_batch_equals_solo(files["mxfp4_gguf"])


def test_bf16_mxfp4_folder_greedy_equals_transformers(files):
    """The dtype a real checkpoint runs in: bf16 weights (MXFP4 values are exact in bf16)."""
    from specdec import LLM, SamplingParams
    from transformers import AutoModelForCausalLM, Mxfp4Config

    theirs = AutoModelForCausalLM.from_pretrained(files["mxfp4"], dtype=torch.float32,
                                                  quantization_config=Mxfp4Config(dequantize=True)).eval()
    with torch.no_grad():
        expected = theirs.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=12, do_sample=False,
                                   eos_token_id=theirs.config.vocab_size, pad_token_id=0)[0, IDS.shape[1]:].tolist()
    llm = LLM(str(files["mxfp4"]), dtype="float32", num_speculative_tokens=0, quantization="none")
    out = llm.generate({"prompt_token_ids": IDS[0].tolist()}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert out[0].outputs[0].token_ids == expected
    bf16 = load_model(files["mxfp4"], "bfloat16", quantization="none")
    experts = bf16.model.layers[0].mlp.experts[0].gate_up_proj.weight
    assert experts.dtype == torch.bfloat16
    assert torch.equal(experts.float(), load_model(files["mxfp4"], "float32", quantization="none")
                       .model.layers[0].mlp.experts[0].gate_up_proj.weight)


@NO_KERNELS
def test_mxfp4_folder_experts_stay_packed(files):
    """OpenAI's MXFP4 folder, loaded as it comes: the experts stay MXFP4 (converted to ggml's
    rows: the same bytes as llama.cpp's file of the same weights), bf16 elsewhere; greedy output
    four at once with speculation equals plain decoding one at a time."""
    from specdec import LLM, SamplingParams

    folder, gguf = load_model(files["mxfp4"], "bfloat16"), load_model(files["mxfp4_gguf"], quantization="gguf")
    for a, b in zip(folder.model.layers, gguf.model.layers):
        for ea, eb in zip(a.mlp.experts, b.mlp.experts):
            for mat in ("gate_up_proj", "down_proj"):
                qa, qb = getattr(ea, mat), getattr(eb, mat)
                assert type(qa).__name__ == "QuantLinear" and qa.qtype == "MXFP4"
                assert torch.equal(qa.qweight, qb.qweight) and torch.equal(qa.bias, qb.bias)
    assert folder.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    prompts = [{"prompt_token_ids": IDS[0, :n].tolist()} for n in (3, 12, 7, 9)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(str(files["mxfp4"]), num_speculative_tokens=0, max_num_seqs=1)
             .generate(prompts, params)]
    llm = LLM(str(files["mxfp4"]), speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4},
              max_num_seqs=4, max_num_batched_tokens=8)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain


def test_other_quantized_folders_are_refused(files, tmp_path):
    folder = shutil.copytree(files["hf"], tmp_path / "gptq")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "gptq", "bits": 4}}))
    with pytest.raises(CheckpointError, match="names gptq but no matrix in the folder has its tensors"):
        load_model(folder)      # GPTQ folders are read (tests/test_hf_quant.py): this one has no GPTQ tensors


@pytest.mark.tp
def test_tensor_parallel_equals_tp1(files):
    """Each rank's query heads with their sinks; o_proj's and the experts' down biases added once
    (rank 0's), the router whole; packed MXFP4 experts split on block boundaries."""
    check_tensor_parallel_equals_tp1(files["hf"])
    check_tensor_parallel_equals_tp1(files["mxfp4"])


def test_server_reads_harmony_by_itself(files):
    """A gpt_oss model's server splits harmony replies without --reasoning-parser (vLLM does too);
    the tiny model writes no channels, so its reply is all answer, streamed alike."""
    import openai

    from specdec import LLM
    from specdec.server import ServerConfig, build_app
    from test_server import LiveServer

    llm = LLM(str(files["hf"]), dtype="float32", num_speculative_tokens=0, max_model_len=128)
    app = build_app(llm, ServerConfig(served_model_names=("gpt-oss",)))
    assert app.state.service.config.reasoning_parser == "openai_gptoss"
    with LiveServer(app) as server:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        try:
            kw = dict(model="gpt-oss", messages=[{"role": "user", "content": "def f(x):"}], max_tokens=12, temperature=0)
            msg = c.chat.completions.create(**kw).choices[0].message
            assert msg.content and not (msg.model_extra or {}).get("reasoning_content")
            streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(stream=True, **kw)
                               if ch.choices)
            assert streamed == msg.content
            with pytest.raises(openai.BadRequestError):
                c.chat.completions.create(reasoning_effort="extreme", **kw)
        finally:
            c.close()


def test_reasoning_effort_reaches_the_chat_template(files):
    """OpenAI's reasoning_effort is the template's reasoning_effort (gpt-oss's template writes it
    into its system message as "Reasoning: low")."""
    from specdec import LLM
    from specdec.server import ServerConfig, build_app
    from specdec.server.protocol import ChatCompletionRequest

    template = "Reasoning: {{ reasoning_effort | default('medium') }}\n{% for m in messages %}{{ m['content'] }}{% endfor %}"
    llm = LLM(str(files["hf"]), dtype="float32", num_speculative_tokens=0, max_model_len=128)
    service = build_app(llm, ServerConfig(served_model_names=("gpt-oss",), chat_template=template)).state.service
    ask = lambda **kw: service._chat_text(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw))  # noqa: E731
    assert ask().startswith("Reasoning: medium") and ask(reasoning_effort="low").startswith("Reasoning: low")
    assert ask(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"}).startswith("Reasoning: high")


def test_eagle3_speculator_on_gpt_oss(files, tmp_path):
    """vLLM's usual gpt-oss deployment drafts with an EAGLE-3 speculator (the speculators
    library's layout): features from the target's layers, greedy output equal to plain, four
    requests batched (an untrained head: its drafts are rarely kept, the plumbing is what counts)."""
    from safetensors.torch import save_file as save_torch

    from specdec import LLM, SamplingParams

    cfg = json.loads((files["hf"] / "config.json").read_text())
    D, V, H, KV, HD, FF = cfg["hidden_size"], cfg["vocab_size"], 4, 2, 16, 128
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g) * 0.05  # noqa: E731
    w = {"fc.weight": rand(D, 2 * D), "norm.weight": torch.ones(D), "lm_head.weight": rand(V, D) * 8,
         "d2t": torch.zeros(V, dtype=torch.long), "t2d": torch.ones(V, dtype=torch.bool),
         "layers.0.self_attn.q_proj.weight": rand(H * HD, 2 * D), "layers.0.self_attn.k_proj.weight": rand(KV * HD, 2 * D),
         "layers.0.self_attn.v_proj.weight": rand(KV * HD, 2 * D), "layers.0.self_attn.o_proj.weight": rand(D, H * HD),
         "layers.0.mlp.gate_proj.weight": rand(FF, D), "layers.0.mlp.up_proj.weight": rand(FF, D),
         "layers.0.mlp.down_proj.weight": rand(D, FF)}
    w.update({f"layers.0.{n}.weight": torch.ones(D) for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")})
    head = tmp_path / "speculator"
    head.mkdir()
    save_torch(w, str(head / "model.safetensors"))
    layer = {"model_type": "llama", "hidden_size": D, "intermediate_size": FF, "num_attention_heads": H,
             "num_key_value_heads": KV, "head_dim": HD, "num_hidden_layers": 1, "rms_norm_eps": 1e-5,
             "rope_theta": 10000.0, "max_position_embeddings": 256, "hidden_act": "silu", "vocab_size": V}
    (head / "config.json").write_text(json.dumps({
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": V,
        "norm_before_residual": False, "transformer_layer_config": layer,
        "eagle_aux_hidden_state_layer_ids": [0, 1]}))
    prompts = [{"prompt_token_ids": IDS[0, :n].tolist()} for n in (3, 12, 7, 9)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(str(files["hf"]), dtype="float32", num_speculative_tokens=0,
                                                  max_num_seqs=1).generate(prompts, params)]
    llm = LLM(str(files["hf"]), dtype="float32", max_num_seqs=4,
              speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain


def test_vllms_quantization_mxfp4(files, tmp_path, capsys):
    """vLLM's --quantization mxfp4 on gpt-oss's folder: the experts as auto keeps them; a folder
    or GGUF file it does not fit gets one line (the CLI: exit 2)."""
    from specdec import kernels
    from specdec.cli import main

    if kernels.load() is not None:       # kernels here: the experts stay packed
        packed = load_model(files["mxfp4"], "float32", quantization="mxfp4")
        assert type(packed.model.layers[0].mlp.experts[0].down_proj).__name__ == "QuantLinear"
    with pytest.raises(CheckpointError, match="quantization='mxfp4' needs a folder quantized with it"):
        load_model(files["hf"], quantization="mxfp4")
    with pytest.raises(CheckpointError, match="quantization='mxfp4' is for Hugging Face folders"):
        load_model(files["mxfp4_gguf"], quantization="mxfp4")
    code = main(["generate", "--model", str(files["mxfp4"]), "--quantization", "mxfp4", "--num-speculative-tokens", "0",
                 "--max-tokens", "4", "--json", "def f(x):"])
    assert code == 0 and json.loads(capsys.readouterr().out)["stats"]["output_tokens"] == 4
    assert main(["generate", "--model", str(files["hf"]), "--quantization", "mxfp4", "--max-tokens", "4", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "quantization='mxfp4' needs a folder quantized with it" in err[0]


def test_cli_chat_splits_harmony(files, capsys, monkeypatch):
    """`specdec generate --chat` and `specdec chat` on gpt-oss: the reply detokenized with its
    special tokens and split as the server splits it (the tiny model writes no channels, so all
    of it is the answer, on stdout; the JSON names its reasoning too)."""
    import io

    from specdec import LLM, SamplingParams
    from specdec.cli import main
    from specdec.server.reasoning import split_harmony

    argv = ["--model", str(files["hf"]), "--num-speculative-tokens", "0", "--max-tokens", "8", "--temperature", "0"]
    assert main(["generate", *argv, "--chat", "--json", "hi there"]) == 0
    result = json.loads(capsys.readouterr().out)
    llm = LLM(str(files["hf"]), num_speculative_tokens=0)
    raw = llm.tokenizer.decode(result["token_ids"], skip_special_tokens=False)
    assert (result["reasoning"], result["text"]) == split_harmony(raw)
    assert result["text"] == llm.generate(llm.chat_prompt([{"role": "user", "content": "hi there"}]),
                                          SamplingParams(temperature=0, max_tokens=8,
                                                         skip_special_tokens=False))[0].outputs[0].text
    monkeypatch.setattr("sys.stdin", io.StringIO("hi there\n/exit\n"))
    assert main(["chat", *argv]) == 0
    assert capsys.readouterr().out == result["text"] + "\n"


@pytest.fixture(scope="module")
def harmony_llm(tmp_path_factory):
    """A tiny gpt-oss whose tokenizer has harmony's special tokens; a grammar makes it write the
    format (llguidance matches the special tokens by name), so replies are real token streams."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer

    from conftest import make_checkpoint, make_tokenizer
    from specdec import LLM

    root = tmp_path_factory.mktemp("harmony")
    make_tokenizer(root / "tok")
    tok = HFTokenizer.from_file(str(root / "tok" / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(m, special=True) for m in
                            ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>")])
    tok.save(str(root / "tok" / "tokenizer.json"))
    return LLM(str(make_checkpoint(root / "hf", arch="gpt_oss", tokenizer_from=root / "tok")), num_speculative_tokens=0)


def test_harmony_replies_from_real_token_streams(harmony_llm):
    """Replies the model writes token by token (special tokens detokenized as text for the
    parser), through the server's ChatFormat streamed and not: the analysis as reasoning_content,
    the final channel as content, a call to=functions.NAME as a tool call with its arguments."""
    from specdec import SamplingParams
    from specdec.config import StructuredOutputsParams
    from specdec.server.responses import ChatFormat, ChoiceResult
    from specdec.server.tools import plan_tools

    tools = plan_tools([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
                       "auto", None, True, "openai")
    answer = ('start: <|channel|> "analysis" <|message|> /[a-z]{3,6}/ <|end|> <|start|> "assistant" <|channel|> "final" '
              '<|message|> /[a-z ]{3,8}/')
    call = ('start: <|channel|> "analysis" <|message|> /[a-z]{3,6}/ <|end|> <|start|> "assistant to=functions.get_weather" '
            '<|channel|> "commentary " <|constrain|> "json" <|message|> "{\\"city\\": \\"" /[a-z]{2,5}/ "\\"}"')
    for grammar, plan in ((answer, None), (call, tools)):
        params = SamplingParams(temperature=0, max_tokens=160, skip_special_tokens=False,
                                structured_outputs=StructuredOutputsParams(grammar=grammar))
        pieces = [e.text for e in harmony_llm.engine.generate([5, 6, 7], params)]
        text = "".join(pieces)
        assert text.startswith("<|channel|>analysis<|message|>") and text.count("<|message|>") == 2
        thought = text.split("<|message|>")[1].split("<|end|>")[0]
        body = text.split("<|message|>")[2]
        msg = ChatFormat(harmony_llm.tokenizer, False, tools=plan, reasoning="openai_gptoss").choice(
            ChoiceResult(0, [text], finish_reason="stop"))
        assert msg["message"]["reasoning_content"] == thought
        fmt, streamed = ChatFormat(harmony_llm.tokenizer, False, tools=plan, reasoning="openai_gptoss"), {}
        for i, piece in enumerate(pieces):
            d = fmt.delta(0, piece, [], 0, "stop" if i == len(pieces) - 1 else None, None)
            for key, value in (d or {}).get("delta", {}).items():
                streamed[key] = streamed.get(key, [] if key == "tool_calls" else "") + value
        assert streamed.get("reasoning_content") == thought
        if plan is None:
            assert msg["message"]["content"] == body == streamed["content"] and msg["finish_reason"] == "stop"
        else:
            [c] = msg["message"]["tool_calls"]
            assert c["function"] == {"name": "get_weather", "arguments": body} and body.startswith('{"city": "')
            assert msg["message"]["content"] is None and msg["finish_reason"] == "tool_calls"
            assert [s["function"] for s in streamed["tool_calls"]] == [c["function"]] and "content" not in streamed
