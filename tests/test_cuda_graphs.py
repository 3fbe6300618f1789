"""CUDA graphs of the target's decoding forwards (model/graphs.py), emulated on the CPU: the
static buffers, the padding into buckets, the capture-safety check and the engine's use of them.
On a GPU the same code captures real graphs (not run here)."""

from __future__ import annotations

import re

import pytest
import torch

from specdec import LLM, SamplingParams, kernels
from specdec.config import cuda_graph_sizes
from specdec.model import BlockManager, ForwardBatch, TreeAttention
from specdec.model import batch as batch_module
from specdec.model import graphs as graphs_module
from specdec.model.config import ModelConfig
from specdec.model.graphs import CaptureError, CudaGraphs
from specdec.model.llama import Transformer


@pytest.fixture
def pytorch_path(monkeypatch):
    """The GPU's path on the CPU: no C kernels, the padded attention, graphs emulated."""
    monkeypatch.setattr(kernels, "load", lambda: None)
    monkeypatch.setattr(batch_module, "PADDED", True)
    monkeypatch.setattr(graphs_module, "EMULATE", True)


def _model(**kw):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, **kw)
    return Transformer(cfg).eval().requires_grad_(False)


@pytest.mark.parametrize("window", [None, 6])
def test_graph_forwards_give_the_eager_padded_results(pytorch_path, window):
    """Decoding batches, a verification with unequal counts, a tree, rows past the graph's
    buckets (run eagerly): logits and features as the eager padded forward gives them; the
    second forward of a bucket replays its graph with new inputs (new tokens, positions, slots)."""
    model = _model(sliding_window=window, sliding_layers=(0, 2) if window else ())
    blocks = BlockManager(64, 16, 8, 32)
    kv = model.new_kv(blocks, spare=True)
    assert kv.spare_block == 64 and kv.k[0].shape[1] == 65
    for s in "abc":
        blocks.add(s)
        blocks.ensure(s, 300)
    g = torch.Generator().manual_seed(1)
    graphs = CudaGraphs(model, kv, batch_sizes=(1, 2, 4), row_sizes=(1, 2, 4), emulate=True)
    tree = TreeAttention.from_parents([-1, -1, 0])
    cases = [(list("abc"), [30, 50, 7], [0, 0, 0], None, None),        # prompts: 50 rows > 4, eager
             (list("abc"), [1, 1, 1], [30, 50, 7], None, None),
             (list("abc"), [1, 1, 1], [31, 51, 8], None, None),          # the same bucket: a replay
             (list("ab"), [3, 1], [32, 52], None, None),
             (list("abc"), [4, 2, 1], [32, 52, 9], [tree, None, None], [2, 2, 1]),
             (["c"], [2], [9], None, None)]
    with torch.inference_mode():
        for seqs, counts, starts, trees, logits in cases:
            tokens = torch.randint(0, 300, (sum(counts),), generator=g)
            batch = ForwardBatch.build(kv, seqs, counts, starts, trees, logits)
            state = [t.clone() for t in kv.k + kv.v]
            want = model(tokens, kv, batch, hidden=True)
            written = [t[:, :64].clone() for t in kv.k + kv.v]
            for t, t0 in zip(kv.k + kv.v, state):     # the graph's forward writes the same slots again
                t.copy_(t0)
            got = model(tokens, kv, batch, hidden=True, graphs=graphs)
            assert got.logits.shape == want.logits.shape and got.hidden.shape == want.hidden.shape
            assert torch.allclose(got.logits, want.logits, atol=1e-5) and torch.allclose(got.hidden, want.hidden, atol=1e-5)
            assert torch.equal(got.logits.argmax(-1), want.logits.argmax(-1))
            # the pool's blocks as the eager forward left them: padding rows wrote only the spare block
            assert all(torch.allclose(t[:, :64], w, atol=1e-5, equal_nan=True) for t, w in zip(kv.k + kv.v, written))
    assert graphs.stats["captured"] == 4 and graphs.stats["replayed"] == 1
    assert graphs.stats["eager: rows"] == 1
    other = model.new_kv(BlockManager(8, 16, 1, 8), spare=True)
    other.blocks.add("x")
    other.blocks.ensure("x", 4)
    with torch.inference_mode(), pytest.raises(ValueError, match="another KV cache"):
        model(torch.tensor([1]), other, ForwardBatch.build(other, ["x"], [1], [0]), graphs=graphs)
    graphs.max_graphs = 4           # no room for a fifth bucket: that forward runs eagerly
    with torch.inference_mode():
        batch = ForwardBatch.build(kv, ["a", "b"], [1, 1], [40, 60])
        assert graphs(torch.tensor([1, 2]), batch, True, False) is None and graphs.stats["eager: graph limit"] == 1
    assert sorted(graphs.graphs) == [(1, 2, 256, True, True), (2, 4, 256, True, True), (4, 1, 256, True, True),
                                     (4, 4, 256, True, True)]


def test_a_host_read_inside_the_forward_fails_the_capture(pytorch_path, monkeypatch):
    """What a CUDA graph cannot hold (a tensor read on the host inside the forward) fails the
    capture with a clear error instead of freezing a value into the graph."""
    model = _model()
    blocks = BlockManager(16, 16, 2, 8)
    kv = model.new_kv(blocks, spare=True)
    blocks.add("a")
    blocks.ensure("a", 20)
    graphs = CudaGraphs(model, kv, emulate=True)
    real = model._embed

    def embed_with_a_host_read(tokens, embeds):
        int(tokens.max())          # e.g. a bounds check on the host
        return real(tokens, embeds)

    monkeypatch.setattr(model, "_embed", embed_with_a_host_read)
    with torch.inference_mode(), pytest.raises(CaptureError, match="aten.(item|_local_scalar_dense) inside a captured forward"):
        model(torch.tensor([5]), kv, ForwardBatch.build(kv, ["a"], [1], [0]), graphs=graphs)


def test_engine_with_cuda_graphs_keeps_greedy_output(pytorch_path, tiny_pair):
    """LLM(compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"}) on the PyTorch path (graphs
    emulated): plain and speculative greedy outputs equal the eager engine's, and the decoding
    and verification forwards went through graphs."""
    prompts = ["def add(a, b):", "class Point:\n", "for i in range(10):\n    print(i)", "import os\n"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    spec = {"method": "draft_model", "model": str(tiny_pair[1]), "num_speculative_tokens": 3}
    outs, stats = [], []
    for graphs in (None, {"cudagraph_mode": "FULL_DECODE_ONLY"}):
        for config in ({"num_speculative_tokens": 0}, {"speculative_config": spec}):
            llm = LLM(model=tiny_pair[0], dtype="float32", max_num_seqs=4, max_num_batched_tokens=8,
                      compilation_config=graphs, **config)
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
            if graphs:
                stats.append(llm.engine.graphs.stats)
            else:
                assert llm.engine.graphs is None
    assert outs[0] == outs[2] and outs[1] == outs[3]
    assert all(s["replayed"] > 10 for s in stats), stats


def test_compilation_config_is_read_as_vllm_reads_it():
    assert cuda_graph_sizes(None, False, 16) is None
    assert cuda_graph_sizes(3, False, 16) is None                        # -O3: a level, no effect
    assert cuda_graph_sizes({"cudagraph_mode": "NONE", "level": 3}, False, 16) is None
    assert cuda_graph_sizes({"cudagraph_mode": "FULL_DECODE_ONLY"}, False, 16) == (1, 2, 4, 8, 16)
    assert cuda_graph_sizes('{"cudagraph_mode": "FULL_AND_PIECEWISE"}', False, 20) == (1, 2, 4, 8, 16, 24)
    assert cuda_graph_sizes({"cudagraph_mode": "FULL_DECODE_ONLY"}, True, 16) is None     # enforce_eager
    assert cuda_graph_sizes({"cudagraph_mode": "FULL", "cudagraph_capture_sizes": [1, 3, 64]}, False, 8) == (1, 3, 64)
    assert cuda_graph_sizes({"cudagraph_mode": "FULL", "max_cudagraph_capture_size": 4}, False, 64) == (1, 2, 4)
    for bad, msg in (({"cudagraph_mode": "FULLY"}, "cudagraph_mode"), ({"cudagraph_modes": "FULL"}, "unknown key"),
                     ({"cudagraph_mode": "FULL", "cudagraph_capture_sizes": [0]}, "positive"), ([1], "dict")):
        with pytest.raises(ValueError, match=msg):
            cuda_graph_sizes(bad, False, 16)


def test_cuda_graphs_on_the_cpu_are_refused_with_one_line(tiny_pair):
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        LLM(model=tiny_pair[0], num_speculative_tokens=0, compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"})


@pytest.mark.parametrize("options", [{"kv_cache_dtype": "int8"}, {"enable_prefix_caching": True},
                                     {"kv_cache_memory": 768 * 80, "max_model_len": 64}], ids=["int8-kv", "prefix-caching", "preemption"])
def test_cache_features_under_cuda_graphs(pytorch_path, tiny_pair, options):
    """An int8 cache (quantized writes from the graph), prefix caching (shared blocks read through
    the graph's table) and a pool small enough to preempt and recompute: greedy and seeded
    outputs as the eager engine's, ngram speculation on (suffix-free: its drafts depend only on
    the text)."""
    prompts = ["def add(a, b):\n    return a + b\n\ndef add(a, b):", "class Point:\n", "import os\nimport os\n",
               "def add(a, b):\n    return a + b\n\ndef sub(a, b):"]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    outs, engines = [], []
    for graphs in (None, {"cudagraph_mode": "FULL_DECODE_ONLY"}):
        llm = LLM(model=tiny_pair[0], dtype="float32", max_num_seqs=4, max_num_batched_tokens=16,
                  speculative_config=spec, compilation_config=graphs, **options)
        outs.append([[o.outputs[0].token_ids for o in llm.generate(prompts, p)] for p in params])
        engines.append(llm.engine)
    assert outs[0] == outs[1]
    assert engines[1].graphs.stats["replayed"] > 10
    if "kv_cache_memory" in options:
        assert engines[0].num_preemptions > 0 and engines[1].num_preemptions > 0


def test_graph_counters_reach_prometheus(pytorch_path, tiny_pair):
    """/metrics names how the target's forwards ran under CUDA graphs (emulated here)."""
    from prometheus_client import generate_latest

    from specdec.server.metrics import ServerMetrics

    llm = LLM(model=tiny_pair[0], dtype="float32", num_speculative_tokens=0, compilation_config={"cudagraph_mode": "FULL"})
    llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    text = generate_latest(ServerMetrics(llm.engine).registry).decode()
    counts = {m: float(v) for m, v in re.findall(
        r'specdec:cuda_graph_forwards_total\{engine="0",mode="([^"]+)",model_name="specdec"\} ([0-9.]+)', text)}
    # a prompt of <= 16 tokens and the decoding steps: all through graphs (2 buckets), none eager
    assert counts == {"captured": 2.0, "replayed": counts["replayed"]} and counts["replayed"] >= 4, counts
    assert 'mode="eager' not in text
    plain = LLM(model=tiny_pair[0], dtype="float32", num_speculative_tokens=0)
    assert "cuda_graph_forwards" not in generate_latest(ServerMetrics(plain.engine).registry).decode()


@pytest.mark.parametrize("window", [None, 6])
def test_graph_and_eager_padded_forwards_are_device_clean(pytorch_path, window):
    """Device-clean as a GPU needs, with the model and cache on the meta device standing in for a
    GPU: every op of a graph's forward (from its static inputs) takes tensors of the model's
    device only, and the eager padded forward mixes devices in no op (its plans are built on the
    host, then moved). A host tensor left inside the forward fails here as it would there."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Devices(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            devs = {t.device.type for t in torch.utils._pytree.tree_leaves((args, kwargs or {}))
                    if isinstance(t, torch.Tensor) and t.dim() > 0}
            self.ops.append((func.overloadpacket.__name__, devs))
            return func(*args, **(kwargs or {}))

    cfg = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, sliding_window=window,
                      sliding_layers=(0,) if window else ())
    with torch.device("meta"):
        model = Transformer(cfg)
    model.eval().requires_grad_(False)
    model.reset_rope("meta")
    blocks = BlockManager(64, 16, 8, 32)
    kv = model.new_kv(blocks, spare=True)
    for s in "ab":
        blocks.add(s)
        blocks.ensure(s, 100)
    graphs = CudaGraphs(model, kv, emulate=True)
    tree = TreeAttention.from_parents([-1, 0])
    with torch.inference_mode():
        for counts, trees in (([1, 1], None), ([3, 1], [tree, None]), ([2, 2], None)):
            batch = ForwardBatch.build(kv, ["a", "b"], counts, [20, 30], trees, [1, 1])
            tokens = torch.zeros(sum(counts), dtype=torch.long)
            key = graphs.key(batch, True, True)
            inputs = {k: v.to("meta") for k, v in graphs._host_inputs(tokens, batch, *key[:3])[0].items()}
            with Devices() as body:
                logits, hidden = graphs._body(inputs, key)
            assert logits.device.type == "meta" and hidden.device.type == "meta"
            assert body.ops and all(devs <= {"meta"} for _, devs in body.ops), \
                [op for op in body.ops if not op[1] <= {"meta"}][:5]
            with Devices() as eager:
                out = model(tokens.to("meta"), kv, batch, hidden=True)
            assert out.logits.shape == (2, 300)
            moves = {"to", "_to_copy", "copy_"}         # host -> device: what the plan's tensors take
            assert all(len(devs) < 2 for name, devs in eager.ops if name not in moves), \
                [op for op in eager.ops if len(op[1]) > 1 and op[0] not in moves][:5]
