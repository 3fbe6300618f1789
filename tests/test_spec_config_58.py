"""speculative_config against vLLM's current SpeculativeConfig (a tester's specconf58): no silent
default method, draft vocabulary sizes, specdec's own heads folders found by their config, vLLM's
newer keys, vLLM's field names on SpeculativeConfig(...), and vLLM 0.6's speculative flags in every
subcommand. On the bundled toy pair (models/)."""

from __future__ import annotations

import io
import json

import pytest

from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.cli import build_parser, fold_legacy_speculative, main
from specdec.defaults import BUNDLED_DRAFT, BUNDLED_TARGET, MODELS_DIR

from conftest import make_checkpoint

TARGET, DRAFT = str(BUNDLED_TARGET), str(BUNDLED_DRAFT)
EAGLE, MEDUSA = str(MODELS_DIR / "eagle"), str(MODELS_DIR / "medusa")
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _ids(llm):
    return llm.generate(["def fibonacci(n):"], GREEDY)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def plain():
    return _ids(LLM(model=TARGET, max_model_len=256, num_speculative_tokens=0))


def _one_line_error(capsys, argv) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    return err


# 1. neither method nor model: vLLM's error, not a silent ngram

def test_no_method_and_no_model_is_refused(capsys):
    with pytest.raises(ValueError, match="num_speculative_tokens was provided but without speculative model"):
        SpeculativeConfig.from_dict({"num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="no method and no model"):
        SpeculativeConfig.from_dict({})
    with pytest.raises(ValueError, match="without speculative model"):
        LLM(model=TARGET, max_model_len=256, speculative_config={"num_speculative_tokens": 3})
    err = _one_line_error(capsys, ["generate", "--model", TARGET, "--speculative-config", '{"num_speculative_tokens": 3}',
                                   "--max-tokens", "4", "def f(x):"])
    assert "without speculative model" in err
    # the ways vLLM names prompt lookup still select it
    assert SpeculativeConfig.from_dict({"model": "[ngram]", "num_speculative_tokens": 3}).method == "ngram"


# 2. a draft saved without tokenizer files runs with the target's tokenizer; a smaller vocabulary is refused

def test_draft_without_tokenizer_files_uses_the_targets(tmp_path, plain):
    for f in ("config.json", "model.safetensors"):
        (tmp_path / f).symlink_to(BUNDLED_DRAFT / f)
    llm = LLM(model=TARGET, max_model_len=256, speculative_config={"model": str(tmp_path), "num_speculative_tokens": 3})
    assert llm.spec.method == "draft_model" and _ids(llm) == plain


def test_draft_with_a_smaller_vocab_size_is_refused(tmp_path):
    vocab = json.loads((BUNDLED_TARGET / "config.json").read_text())["vocab_size"]
    small = make_checkpoint(tmp_path / "small", layers=1, hidden=32, tokenizer_from=BUNDLED_TARGET, vocab=vocab - 384)
    with pytest.raises(ValueError, match=f"vocab_size \\({vocab - 384}\\) is smaller than the target's \\({vocab}\\)"):
        LLM(model=TARGET, max_model_len=256, speculative_model=str(small), num_speculative_tokens=3)


# 3. specdec's own heads folders say which method they are

@pytest.mark.parametrize("folder,method", [(EAGLE, "eagle"), (MEDUSA, "medusa")])
def test_own_heads_folder_without_a_method_finds_it(plain, folder, method):
    assert SpeculativeConfig(model=folder).method == method
    llm = LLM(model=TARGET, max_model_len=256, speculative_config={"model": folder, "num_speculative_tokens": 3})
    assert llm.spec.method == method and _ids(llm) == plain
    assert SpeculativeConfig(model=MODELS_DIR / "smollm2-suffix").method == "suffix"


# 4. vLLM's current keys: taken at their defaults, a one-line error naming the key where specdec cannot honour them

CURRENT_DEFAULTS = {"rejection_sample_method": "standard", "draft_sample_method": "greedy", "parallel_drafting": False,
                    "use_local_argmax_reduction": False, "disable_eagle_block_drop": False,
                    "use_heterogeneous_vocab": False, "kv_cache_dtype": None, "attention_backend": None,
                    "moe_backend": None, "num_speculative_tokens_per_batch_size": None,
                    "index_share_for_mtp_iteration": None, "synthetic_acceptance_rates": None,
                    "synthetic_acceptance_length": None, "enable_adaptive_verification": False,
                    "dspark_draft_topk": None, "draft_load_config": None}


def test_current_vllm_keys_at_their_defaults_are_taken(plain, caplog):
    config = {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 3, **CURRENT_DEFAULTS}
    llm = LLM(model=TARGET, max_model_len=256, speculative_config=config)
    assert _ids(llm) == plain and "does not read" not in caplog.text
    assert LLM(model=TARGET, max_model_len=256, speculative_config={**config, "draft_sample_method": "probabilistic"})


@pytest.mark.parametrize("key,value", [("rejection_sample_method", "synthetic"), ("rejection_sample_method", "block"),
                                       ("parallel_drafting", True), ("use_heterogeneous_vocab", True),
                                       ("num_speculative_tokens_per_batch_size", [[1, 4, 2]]),
                                       ("draft_sample_method", "argmax"), ("kv_cache_dtype", "fp8"),
                                       ("synthetic_acceptance_length", 2.0), ("tensor_parallel_size", 2)])
def test_current_vllm_keys_specdec_cannot_honour_are_one_line(capsys, key, value):
    with pytest.raises(ValueError, match=f"speculative_config.{key}"):
        SpeculativeConfig.from_dict({"method": "ngram", key: value})
    err = _one_line_error(capsys, ["generate", "--model", TARGET, "--speculative-config",
                                   json.dumps({"method": "ngram", key: value}), "--max-tokens", "4", "def f(x):"])
    assert key in err and "unknown key" not in err


def test_speculative_config_takes_vllms_field_names(plain):
    spec = SpeculativeConfig(method="suffix", num_speculative_tokens=3, suffix_decoding_min_token_prob=0.5)
    assert spec.extra == {"suffix_decoding_min_token_prob": 0.5}
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=3, enforce_eager=True).extra == {"enforce_eager": True}
    spec = SpeculativeConfig(method="eagle", model=EAGLE, num_speculative_tokens=3, draft_tensor_parallel_size=1)
    assert _ids(LLM(model=TARGET, max_model_len=256, speculative_config=spec)) == plain
    with pytest.raises(TypeError, match="prompt_lookup_maxx"):
        SpeculativeConfig(method="ngram", prompt_lookup_maxx=3)
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=2"):
        SpeculativeConfig(method="ngram", draft_tensor_parallel_size=2)


# 5. vLLM 0.6's speculative flags, and value checks of the keys specdec ignores

def test_legacy_speculative_flags_in_generate_and_chat(capsys, monkeypatch):
    args = build_parser("generate").parse_args(["generate", "--model", TARGET, "--speculative-model", "[ngram]",
                                                "--ngram-prompt-lookup-max", "2", "--ngram-prompt-lookup-min", "1",
                                                "def f(x):"])
    fold_legacy_speculative(args)
    assert args.speculative_config == {"prompt_lookup_max": 2, "prompt_lookup_min": 1}
    assert main(["generate", "--model", TARGET, "--speculative-model", "[ngram]", "--ngram-prompt-lookup-max", "2",
                 "--max-tokens", "4", "--json", "def f(x):"]) == 0
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["chat", "--model", TARGET, "--speculative-model", "[ngram]", "--ngram-prompt-lookup-max", "2"]) == 0
    capsys.readouterr()
    err = _one_line_error(capsys, ["generate", "--model", TARGET, "--ngram-prompt-lookup-max", "2", "def f(x):"])
    assert "need --speculative-model or --speculative-config" in err


def test_bench_names_a_legacy_speculative_flag(capsys):
    err = _one_line_error(capsys, ["bench", "--model", TARGET, "--methods", "ngram",
                                   "--speculative-disable-by-batch-size", "3", "--limit-prompts", "1"])
    assert "--speculative-disable-by-batch-size" in err and "disable_by_batch_size" in err


def test_draft_tensor_parallel_flag_and_key_are_refused_alike(capsys):
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
    flag = _one_line_error(capsys, ["generate", "--model", TARGET, "--speculative-config", spec,
                                    "--speculative-draft-tensor-parallel-size", "2", "--max-tokens", "4", "def f(x):"])
    key = _one_line_error(capsys, ["generate", "--model", TARGET, "--speculative-config",
                                   json.dumps({"method": "ngram", "num_speculative_tokens": 3,
                                               "draft_tensor_parallel_size": 2}), "--max-tokens", "4", "def f(x):"])
    why = "specdec runs the drafter unsharded (1)"
    assert flag.endswith(why) and key.endswith(why) and "--speculative-draft-tensor-parallel-size 2" in flag
    assert main(["generate", "--model", TARGET, "--speculative-config", spec,
                 "--speculative-draft-tensor-parallel-size", "1", "--max-tokens", "4", "--json", "def f(x):"]) == 0


@pytest.mark.parametrize("key,value", [("max_model_len", "abc"), ("max_model_len", 0), ("enforce_eager", "yes"),
                                       ("disable_padded_drafter_batch", 7), ("revision", 3)])
def test_ignored_keys_are_type_checked(key, value):
    with pytest.raises(ValueError, match=f"speculative_config.{key}="):
        LLM(model=TARGET, max_model_len=256,
            speculative_config={"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 3, key: value})


def test_speculative_max_model_len_is_bounded_by_the_targets(capsys):
    with pytest.raises(ValueError, match="cannot be larger than the target's max_model_len \\(256\\)"):
        LLM(model=TARGET, max_model_len=256,
            speculative_config={"method": "ngram", "num_speculative_tokens": 3, "max_model_len": 512})
    err = _one_line_error(capsys, ["generate", "--model", TARGET, "--speculative-config", '{"method": "ngram"}',
                                   "--speculative-max-model-len", "abc", "--max-tokens", "4", "def f(x):"])
    assert "--speculative-max-model-len abc" in err
