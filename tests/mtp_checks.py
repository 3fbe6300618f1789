"""Shared by the test modules of families that ship MTP layers (GLM-4.5, DeepSeek-V3): an MTP
layer in DeepSeek's layout written into a copy of a checkpoint, and the check of the `mtp`
head against its definition computed with transformers' own decoder layer; forward.c's chains
against the PyTorch chains."""

from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import load_file, save_file

from specdec import LLM, SamplingParams
from specdec.model import ForwardBatch, load_model
from specdec.model.mtp import load_mtp
from arch_checks import IDS


def add_mtp_layer(src, folder, L: int, hidden: int, seed: int = 11) -> dict:
    """A copy of checkpoint `src` in `folder` with an MTP layer at index L (model.layers.{L}.*:
    enorm, hnorm, eh_proj, shared_head, embed_tokens, and a decoder layer of the same kind as
    layer L - 1, perturbed) and num_nextn_predict_layers 1. Returns the layer's weights."""
    shutil.copytree(src, folder)
    sd = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    p, last = f"model.layers.{L}.", f"model.layers.{L - 1}."
    extra = {p + k[len(last):]: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in sd.items() if k.startswith(last)}
    D = hidden
    extra.update({p + "enorm.weight": 1 + 0.1 * torch.randn(D, generator=g),
                  p + "hnorm.weight": 1 + 0.1 * torch.randn(D, generator=g),
                  p + "eh_proj.weight": torch.randn(D, 2 * D, generator=g) * 0.1,
                  p + "shared_head.norm.weight": 1 + 0.1 * torch.randn(D, generator=g),
                  p + "shared_head.head.weight": sd["lm_head.weight"].clone(),
                  p + "embed_tokens.weight": sd["model.embed_tokens.weight"].clone()})
    save_file({**sd, **{k: v.contiguous() for k, v in extra.items()}}, str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    return extra


def check_mtp_layer_matches_transformers(hf, mtp_folder, w: dict, layer_cls, L: int, n_experts: int) -> None:
    """The `mtp` head of mtp_folder over a sequence (whole, and paged in chunks) against its
    definition with transformers' decoder layer `layer_cls` at index L (its experts stacked as
    the module holds them) and RoPE, hf being transformers' model of the checkpoint: RMS-normed
    embedding of token t + 1 (zeroed at position 0) and feature of token t, eh_proj over their
    concatenation, the layer, shared_head's norm and head."""
    p = f"model.layers.{L}."
    layer = layer_cls(hf.config, L).eval()
    sd = {k[len(p):]: v for k, v in w.items() if k[len(p):].startswith(
        ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")) and ".experts." not in k}
    sd["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([w[p + f"mlp.experts.{e}.{n}_proj.weight"] for n in ("gate", "up")])
                                                  for e in range(n_experts)])
    sd["mlp.experts.down_proj"] = torch.stack([w[p + f"mlp.experts.{e}.down_proj.weight"] for e in range(n_experts)])
    missing, unexpected = layer.load_state_dict(sd, strict=False)
    assert not missing and not unexpected

    def rms(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + hf.config.rms_norm_eps) * w[p + name]

    model = load_model(mtp_folder, "float32")
    head = load_mtp(mtp_folder, model)
    ids = torch.randint(2, model.config.vocab_size, (21,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        feats = hf(ids[None], output_hidden_states=True).hidden_states[-1][0][:-1]
        embeds = hf.model.embed_tokens(ids[1:])
        T = feats.shape[0]
        e = rms(embeds, "enorm.weight") * (torch.arange(T) != 0)[:, None]
        x = torch.cat([e, rms(feats, "hnorm.weight")], -1) @ w[p + "eh_proj.weight"].T
        pos = torch.arange(T)[None]
        out = layer(x[None], position_embeddings=hf.model.rotary_emb(x[None], pos), attention_mask=None,
                    position_ids=pos)
        out = (out[0] if isinstance(out, tuple) else out)[0]
        ref_logits = rms(out, "shared_head.norm.weight") @ w[p + "shared_head.head.weight"].T
        whole = head(feats[None], embeds[None])
        torch.testing.assert_close(whole.hidden[0], out, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(whole.logits[0], ref_logits, atol=1e-4, rtol=1e-4)
        cache = head.decoder.new_cache(batch=1)
        parts = []
        for a, b in ((0, 7), (7, 8), (8, T)):
            parts.append(head(feats[a:b], embeds[a:b], cache, ForwardBatch.build(cache, [0], [b - a], [a])).logits)
            cache.set_length(0, b)
        torch.testing.assert_close(torch.cat(parts), ref_logits, atol=1e-4, rtol=1e-4)


def check_c_chain_equals_pytorch_chain(folder, monkeypatch, k: int = 3) -> None:
    """An MTP layer's greedy chains drafted by forward.c's eagle_chain (its norms, eh_proj and
    layer in one call per chain) are the PyTorch chain's, step by step, for four prompts at once."""
    from specdec.proposers.eagle import EagleProposer

    prompts = [{"prompt_token_ids": IDS[0, :n].tolist()} for n in (3, 12, 7, 9)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    propose, chain_ok = EagleProposer.propose, EagleProposer._c_chain_ok

    def run(c_chain: bool) -> list:
        seen = []

        def spy(self, items):
            out = propose(self, items)
            assert (self.c_chain is not None) == c_chain
            seen.append([d.tokens.tolist() for d in out])
            return out

        monkeypatch.setattr(EagleProposer, "propose", spy)
        monkeypatch.setattr(EagleProposer, "_c_chain_ok", chain_ok if c_chain else lambda self: None)
        llm = LLM(model=str(folder), dtype="float32", max_num_seqs=4,
                  speculative_config={"method": "mtp", "num_speculative_tokens": k})
        llm.generate(prompts, params)
        return seen

    c, torch_chain = run(True), run(False)
    assert sum(len(t) for step in c for t in step) > 0
    assert c == torch_chain


def check_mtp_gguf(path, hf, monkeypatch, packed: bool) -> None:
    """A GGUF file whose block L is the MTP layer of folder `hf` (llama.cpp's nextn layout): the
    target leaves the block out and the mtp method reads it. F32 (packed False): the head's
    logits equal the folder's head's. Packed: forward.c runs the head's layer and its chains
    (eh_proj packed too), equal to the PyTorch chains. Both: greedy speculation equals plain
    decoding of the file."""
    from specdec import kernels

    target = load_model(path)
    head = load_mtp(path, target)
    if not packed:
        ref_model = load_model(hf, "float32")
        ref = load_mtp(hf, ref_model)
        ids = torch.randint(2, target.config.vocab_size, (15,), generator=torch.Generator().manual_seed(8))
        with torch.no_grad():
            feats = ref_model(ids[None], hidden=True).hidden[0][:-1]
            embeds = ref_model.model.embed_tokens(ids[1:])
            torch.testing.assert_close(head(feats[None], embeds[None]).logits, ref(feats[None], embeds[None]).logits,
                                       atol=1e-4, rtol=1e-4)
    elif kernels.load() is not None:
        assert head.decoder.c_view(head.decoder.new_cache(1, 8)) is not None
        check_c_chain_equals_pytorch_chain(path, monkeypatch)
    prompts = [{"prompt_token_ids": IDS[0, :n].tolist()} for n in (3, 12, 7)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(model=str(path), num_speculative_tokens=0).generate(prompts, params)]
    llm = LLM(model=str(path), max_num_seqs=3, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
