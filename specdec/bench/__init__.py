"""`specdec bench`: specdec's methods side by side with transformers' peers, with plots.

cli.py (flags) -> harness.py (warm-up, interleaved repeats) over variants from methods.py
(specdec engines sharing one target) and peers.py (transformers generate), then summary.py
(medians, speedups, c, the analytic prediction, greedy equality) and report.py (JSON, markdown,
PNG). make_prompts.py writes the committed prompt sets in bench/prompts/.
"""
