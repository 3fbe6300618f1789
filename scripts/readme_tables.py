"""Print the README's condensed benchmark tables from a `specdec bench` results.json.

    python scripts/readme_tables.py bench/results/results.json
"""

import json
import sys


def _ratio(s, digits=2, suffix="x"):
    return "–" if not s else f"{s['median']:.{digits}f}{suffix}"


def tables(results: dict) -> str:
    out = []
    for s in results["scenarios"]:
        out.append(f"\n**{s['prompt_set']} prompts, temperature {s['temperature']:g}**\n")
        out.append("| method | K | tokens/s | × specdec plain | × plain, decode phase | × HF plain | α | tokens/step | greedy = plain |")
        out.append("|---|---|---|---|---|---|---|---|---|")
        for m in s["methods"]:
            k = "–" if m["k"] in (None, 0) else str(m["k"])
            if m["k"] in (None, "auto") and m["num_drafts"]:
                k += f" (mean {m['mean_k']:.1f})"
            name = m["name"].split(" K=")[0] + (" (transformers)" if m["family"] == "transformers" else "")
            g = m.get("greedy_match")
            greedy = "n/a (sampled)" if g is None else ("yes" if g["identical"] else f"NO ({g['mismatched_prompts']} prompts)")
            alpha = "–" if m["acceptance_rate"] is None else f"{m['acceptance_rate']:.3f}"
            out.append(f"| {name} | {k} | {_ratio(m['tokens_per_second'], 1, '')} | {_ratio(m['speedup_vs_plain'])} | "
                       f"{_ratio(m.get('decode_speedup_vs_plain'))} | {_ratio(m['speedup_vs_hf_plain'])} | {alpha} | "
                       f"{m['mean_accepted_length']:.2f} | {greedy} |")
    return "\n".join(out)


if __name__ == "__main__":
    print(tables(json.load(open(sys.argv[1] if len(sys.argv) > 1 else "bench/results/results.json"))))
