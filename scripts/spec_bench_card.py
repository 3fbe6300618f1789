"""Write a method's Spec-Bench figures (from `specdec bench --prompts spec-bench` results.json)
into a model card, replacing an earlier "## Spec-Bench" section:

    python scripts/spec_bench_card.py bench/smollm2/results.json "eagle K=8" models/smollm2-eagle/README.md
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from specdec.bench.spec_bench import method_card_table


def main(results_path: str, method: str, card_path: str) -> int:
    results = json.loads(Path(results_path).read_text())
    table = method_card_table(results, method)
    if table.count("\n") < 2:
        print(f"{results_path}: no per-category results for {method!r}", file=sys.stderr)
        return 2
    mach = results["machine"]
    section = (f"## Spec-Bench\n\n`{method}` on Spec-Bench questions (first turn through the chat template), "
               f"measured by\n```\n{results['command']}\n```\non {mach['cpu']} ({mach['cores']} cores, load average "
               f"{mach['load_average']} at the start: timings are only indicative on a shared machine; tau and "
               f"acceptance do not depend on timing).\n\n{table}\n")
    card = Path(card_path).read_text()
    card = re.sub(r"## Spec-Bench\n.*?(?=\n## |\Z)", "", card, flags=re.S).rstrip() + "\n\n" + section
    Path(card_path).write_text(card)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
