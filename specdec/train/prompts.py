"""Training prompts that a chat model meets, made on this machine: `specdec train prompts`.

Families (and what they stand for): writing, roleplay, explain (STEM and humanities), advice,
reasoning, general_qa (short factual questions), code and code_snippet, summarize, context_qa
(one passage, or several retrieved-looking passages, then a question), extraction, translation
(German to English above all), math (word problems with random numbers) and self_instruct
(tasks the target writes itself after three examples from the other families).

Material: the templates and word lists of seeds.py, filled at random, and documents.py's text
(docstrings, package READMEs, stdlib functions, message catalogs, German man pages). The
builder is deterministic given its seed and the machine's files. Spec-Bench's questions are
never read for making prompts; `check_overlap` compares the result with them (exact, shared
13-grams, 8-gram near-duplicates) and drops any hit; the counts go into the data card.
"""

from __future__ import annotations

import random
import re
import string
from collections import Counter
from dataclasses import dataclass, field

from . import documents, seeds

FAMILY_WEIGHTS = {
    "writing": 0.09, "roleplay": 0.04, "explain": 0.09, "advice": 0.05, "reasoning": 0.03, "general_qa": 0.09,
    "code": 0.07, "code_snippet": 0.04, "summarize": 0.12, "context_qa": 0.10, "extraction": 0.03,
    "translation": 0.10, "math": 0.09, "self_instruct": 0.05,
}


@dataclass(frozen=True)
class PromptConfig:
    count: int = 8000
    seed: int = 0
    weights: dict = field(default_factory=lambda: dict(FAMILY_WEIGHTS))
    min_words: int = 60            # passages for summarize / context_qa / extraction
    max_words: int = 450
    max_doc_words: int = 650       # several passages together (context_qa)


@dataclass
class Material:
    passages: list
    functions: list
    pairs: dict                    # lang -> [(english, translation)]
    german: list                   # German sentences from man pages

    @classmethod
    def gather(cls, cfg: PromptConfig) -> "Material":
        return cls(documents.stdlib_passages(cfg.min_words, cfg.max_words)
                   + documents.package_passages(cfg.min_words, cfg.max_words),
                   documents.stdlib_functions(),
                   {lang: documents.catalog_pairs(lang) for lang in seeds.LANG_NAMES},
                   documents.man_sentences("de"))


def _fill(template: str, rng: random.Random, **given) -> str:
    """Fill {slots}: given values first, then numbers n1..n6, then the seeds list of that name."""
    nums = {"n1": rng.randint(2, 12), "n2": rng.randint(2, 9), "n3": rng.randint(12, 99), "n4": rng.randint(1, 9),
            "n5": rng.randint(2, 6), "n6": rng.choice([10, 15, 20, 25, 30, 40, 50, 60, 75])}
    values = {}
    for _, slot, _, _ in string.Formatter().parse(template):
        if slot is None or slot in values:
            continue
        if slot in given:
            values[slot] = given[slot]
        elif slot in nums:
            values[slot] = nums[slot]
        elif slot == "name2":
            values[slot] = rng.choice([n for n in seeds.NAME if n != values.get("name")])
        elif slot == "concept2":
            values[slot] = rng.choice([c for c in seeds.CONCEPT if c != values.get("concept")])
        else:
            values[slot] = rng.choice(getattr(seeds, slot.upper()))
    return template.format(**values)


def _term(text: str, title: str, rng: random.Random) -> str:
    """A word the passage repeats (not its title): what a question about the passage can name."""
    words = [w for w in re.findall(r"[A-Za-z_][A-Za-z_.]{4,}", text) if w.lower() not in title.lower()]
    common = [w for w, n in Counter(words).most_common(12) if n >= 2 and w.lower() not in _STOP]
    return rng.choice(common) if common else (rng.choice(words) if words else title)


_STOP = {"which", "there", "their", "these", "those", "about", "would", "should", "could", "other", "where",
         "after", "before", "being", "every", "value", "values", "using", "default", "argument", "arguments"}


def _doc_prompt(family: str, m: Material, cfg: PromptConfig, rng: random.Random) -> tuple[str, str]:
    p = rng.choice(m.passages)
    if family == "summarize":
        return _fill(rng.choice(seeds.SUMMARIZE), rng, doc=p.text), p.source
    if family == "extraction":
        return _fill(rng.choice(seeds.EXTRACTION), rng, doc=p.text), p.source
    question = _fill(rng.choice(seeds.DOC_QUESTIONS), rng, title=p.title, term=_term(p.text, p.title, rng))
    doc = p.text
    if rng.random() < 0.5:   # retrieval-style: the passage among others, each under its title
        others = rng.sample(m.passages, rng.randint(1, 3))
        parts = [(p.title, p.text)] + [(o.title, o.text) for o in others if o.title != p.title]
        rng.shuffle(parts)
        doc, words = "", 0
        for title, text in parts:
            if words + len(text.split()) > cfg.max_doc_words and doc:
                continue
            doc += f"{title} {text}\n"
            words += len(text.split())
        doc = doc.strip()
    template = rng.choice(seeds.CONTEXT_QA)
    return template.format(doc=doc, question=question, question_lc=question[0].lower() + question[1:]), p.source


def _translation(m: Material, rng: random.Random) -> tuple[str, str]:
    template = rng.choice(seeds.TRANSLATE)
    if "{lang_name}" in template:
        lang = rng.choice([lang for lang in seeds.LANG_NAMES if m.pairs.get(lang)] or ["de"])
        en, src = rng.choice(m.pairs[lang]) if m.pairs.get(lang) else ("", "")
        return template.format(lang_name=seeds.LANG_NAMES[lang], src=src, en=en), f"catalog:{lang}"
    if "{en}" in template or not m.german or rng.random() < 0.5:
        en, src = rng.choice(m.pairs["de"])
        return template.format(src=src, en=en), "catalog:de"
    return template.format(src=rng.choice(m.german), en=""), "man:de"


def _code_snippet(m: Material, rng: random.Random) -> tuple[str, str]:
    return _fill(rng.choice(seeds.CODE_ON_SNIPPET), rng, lang="Python", ext="python",
                 code=rng.choice(m.functions)), "stdlib:function"


_TEMPLATED = {"writing": seeds.WRITING, "roleplay": seeds.ROLEPLAY, "explain": seeds.EXPLAIN, "advice": seeds.ADVICE,
              "reasoning": seeds.REASONING, "general_qa": seeds.GENERAL_QA, "code": seeds.CODE, "math": seeds.MATH}


def make_prompt(family: str, m: Material, cfg: PromptConfig, rng: random.Random) -> tuple[str, str]:
    """(prompt text, source) for one prompt of `family`."""
    if family in _TEMPLATED:
        return _fill(rng.choice(_TEMPLATED[family]), rng), "seeds"
    if family in ("summarize", "context_qa", "extraction"):
        return _doc_prompt(family, m, cfg, rng)
    if family == "translation":
        return _translation(m, rng)
    if family == "code_snippet":
        return _code_snippet(m, rng)
    raise ValueError(f"unknown prompt family {family!r}")


def _shares(count: int, weights: dict) -> dict:
    """`count` split by weight, summing to `count` exactly (largest remainders; rounding each share
    gave count +- 1, and 0 for a count of 1)."""
    total = sum(weights.values())
    exact = {f: count * w / total for f, w in weights.items()}
    counts = {f: int(x) for f, x in exact.items()}
    for f in sorted(exact, key=lambda f: counts[f] - exact[f])[:count - sum(counts.values())]:
        counts[f] += 1
    return counts


def build_prompts(cfg: PromptConfig, material: Material, instructions: list[str] = ()) -> list[dict]:
    """`cfg.count` prompts, families drawn by weight, shuffled; each {"id", "family", "source", "prompt"}.
    `instructions`: self-instruct tasks (their share falls to the other families when empty)."""
    rng = random.Random(cfg.seed)
    weights = {f: w for f, w in cfg.weights.items() if w > 0 and (f != "self_instruct" or instructions)}
    rows, seen = [], set()

    def draw(family: str, n: int) -> int:
        made, tries = 0, 0
        while made < n and tries < 20 * n:
            tries += 1
            if family == "self_instruct":
                text, source = rng.choice(list(instructions)), "target"
            else:
                text, source = make_prompt(family, material, cfg, rng)
            if text in seen:
                continue
            seen.add(text)
            rows.append({"family": family, "source": source, "prompt": text})
            made += 1
        return made

    open_ = weights
    while len(rows) < cfg.count and open_:     # a family out of distinct prompts leaves its share to the others
        counts = _shares(cfg.count - len(rows), open_)
        open_ = {f: weights[f] for f, n in counts.items() if draw(f, n) == n}
    rng.shuffle(rows)
    return [{"id": f"p{i:06d}", **r} for i, r in enumerate(rows)]


def self_instruct_prompts(cfg: PromptConfig, material: Material, n: int) -> list[str]:
    """Prompts asking the target for a new task after three examples (short families only)."""
    rng = random.Random(cfg.seed + 1)
    short = ["writing", "roleplay", "explain", "advice", "reasoning", "general_qa", "code", "math"]
    out = []
    for _ in range(n):
        examples = [make_prompt(rng.choice(short), material, cfg, rng)[0] for _ in range(3)]
        out.append(seeds.SELF_INSTRUCT_HEAD.format(
            examples="\n".join(f"{i + 1}. {e}" for i, e in enumerate(examples))))
    return out


def clean_instruction(text: str) -> str | None:
    """The target's new task, or None when it is not one (too short or long, a list, a refusal)."""
    line = next((ln.strip() for ln in text.strip().splitlines() if ln.strip()), "")
    line = re.sub(r"^(\d+[.)]|[-*]|task:|new task:)\s*", "", line, flags=re.I).strip().strip('"')
    n = len(line.split())
    if not 4 <= n <= 60 or line.endswith(":") or line.lower().startswith(("here", "sure", "i ", "as an ai")):
        return None
    return line
