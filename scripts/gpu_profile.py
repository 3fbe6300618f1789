"""Where a decoding step's time goes on a GPU: plain vs EAGLE chain vs suffix, batch 1, with and
without CUDA graphs of the target's forwards (engine stats and torch.profiler's kernel counts).

    python3 scripts/gpu_profile.py GGUF EAGLE_HEAD OUT [cuda|cpu]      (cpu: a rehearsal here)
"""
import json, sys, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from specdec import LLM, SamplingParams
from specdec.bench.spec_bench import chat_prompt, read_questions

gguf, head, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
device = sys.argv[4] if len(sys.argv) > 4 else "cuda"
cuda = device.startswith("cuda")


def sync() -> None:
    if cuda:
        torch.cuda.synchronize()



if not cuda:        # the rehearsal: graphs emulated (a CPU refuses real ones)
    from specdec.model import graphs as graphs_module
    graphs_module.EMULATE = True
GRAPHS = {"cudagraph_mode": "FULL_DECODE_ONLY"}
VARIANTS = (("plain", None, None), ("plain graphs", None, GRAPHS),
            ("suffix K=4 graphs", {"method": "suffix", "num_speculative_tokens": 4}, GRAPHS),
            ("eagle K=4 graphs", {"method": "eagle", "model": head, "num_speculative_tokens": 4}, GRAPHS),
            ("eagle K=4", {"method": "eagle", "model": head, "num_speculative_tokens": 4}, None),
            ("suffix K=4", {"method": "suffix", "num_speculative_tokens": 4}, None))


def profile_one(name: str, spec, graphs) -> dict:
    llm = LLM(gguf, dtype="float32", device=device, speculative_config=spec, num_speculative_tokens=0 if spec is None else None,
              compilation_config=graphs, enable_prefix_caching=False)
    p = chat_prompt(llm.tokenizer, read_questions()[0]["prompt"])
    g = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p}], g)
    sync(); t0 = time.perf_counter()
    o = llm.generate([{"prompt_token_ids": p}], g)[0]
    sync(); wall = time.perf_counter() - t0
    s = o.stats
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        llm.generate([{"prompt_token_ids": p}], g)
    ka = prof.key_averages()
    kernels = sum(e.count for e in ka if e.device_type == torch.autograd.DeviceType.CUDA)
    launches = sum(e.count for e in ka if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch"))
    syncs = sum(e.count for e in ka if "Synchronize" in e.key or e.key in ("cudaMemcpyAsync",))
    r = {"method": name, "wall_s": round(wall, 3), "tokens": s.output_tokens, "passes": s.target_forward_passes,
         "ms_per_pass": round(1000 * wall / s.target_forward_passes, 2), "draft_s": round(s.draft_time_s, 3),
         "target_s": round(s.target_time_s, 3), "kernels_per_pass": round(kernels / s.target_forward_passes),
         "launches": launches, "memcpy_or_sync": syncs}
    if llm.engine.graphs is not None:
        r["graphs"] = dict(llm.engine.graphs.stats)
    (out / f"profile_{name.replace(' ', '_').replace('=', '')}.txt").write_text(ka.table(sort_by="self_cpu_time_total", row_limit=30))
    del llm
    return r


rows = []
for name, spec, graphs in VARIANTS:
    try:
        r = profile_one(name, spec, graphs)
    except Exception as e:      # a variant failing (a first run of CUDA graphs) must not lose the others
        import traceback
        r = {"method": name, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    rows.append(r)
    print(json.dumps({k: v for k, v in r.items() if k != "traceback"}), flush=True)
    (out / "profile.json").write_text(json.dumps(rows, indent=1))     # after each: a timeout keeps what ran
