"""Text found on this machine, as material for chat prompts: no hub, no downloads.

- passages: module docstrings of the standard library and the READMEs (package metadata
  descriptions) of installed distributions, cut into passages of a few paragraphs;
- code: functions from the standard library's source;
- translation pairs: gettext message catalogs (/usr/share/locale/<lang>/LC_MESSAGES/*.mo map
  English messages to their translations), and German prose from man pages (/usr/share/man/de).

Every source is optional: a machine without catalogs or man pages yields fewer prompts of those
kinds, never an error. Results are sorted, so a machine's material comes out in a fixed order.
"""

from __future__ import annotations

import ast
import gettext
import gzip
import re
import textwrap
import sysconfig
from dataclasses import dataclass
from email.parser import HeaderParser
from importlib import metadata
from pathlib import Path


@dataclass(frozen=True)
class Passage:
    title: str      # module or package name: what questions about the passage name
    text: str
    source: str     # where it came from, for the data card


def _paragraphs(text: str) -> list[str]:
    """Prose paragraphs: blank-line separated, whitespace collapsed, code and tables dropped."""
    text = re.sub(r"```.*?```", "\n\n", text, flags=re.S)
    out = []
    for para in re.split(r"\n\s*\n", text):
        lines = [ln.strip() for ln in para.strip().splitlines()]
        if not lines or sum(ln.startswith(("|", ">>>", "$ ", "    ", "..", "<", "[!")) for ln in lines) > len(lines) / 3:
            continue
        flat = " ".join(ln.lstrip("#*-= ").strip() for ln in lines if ln.strip("-=~*#` "))
        letters = sum(c.isalpha() for c in flat)
        if len(flat.split()) >= 8 and letters > 0.6 * len(flat) and "http" not in flat[:40]:
            out.append(flat)
    return out


def chunk(paragraphs: list[str], min_words: int, max_words: int) -> list[str]:
    """Consecutive paragraphs joined into passages of min_words..max_words words."""
    out, cur, n = [], [], 0
    for p in paragraphs:
        w = len(p.split())
        if w > max_words:
            p = " ".join(p.split()[:max_words])
            w = max_words
        if n + w > max_words and cur:
            if n >= min_words:
                out.append("\n\n".join(cur))
            cur, n = [], 0
        cur.append(p)
        n += w
    if n >= min_words:
        out.append("\n\n".join(cur))
    return out


def _stdlib_sources():
    """(path relative to the stdlib, source, its AST) of each standard-library module that
    parses, tests and tools left out, in path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel or "/test" in rel or rel.startswith(("test", "idlelib", "lib2to3")):
            continue
        try:
            src = path.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        yield rel, src, tree


def stdlib_passages(min_words: int = 60, max_words: int = 450) -> list[Passage]:
    out = []
    for rel, _, tree in _stdlib_sources():
        module = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        # the module's docstring, then those of its classes and functions long enough to summarise
        nodes = [(module, tree)] + [(f"{module}.{n.name}", n) for n in ast.walk(tree)
                                    if isinstance(n, (ast.ClassDef, ast.FunctionDef))]
        for name, node in nodes:
            doc = ast.get_docstring(node)
            if doc and len(doc.split()) >= min_words:
                out += [Passage(name, t, f"stdlib:{rel}") for t in chunk(_paragraphs(doc), min_words, max_words)]
    return out


def package_passages(min_words: int = 60, max_words: int = 450) -> list[Passage]:
    """READMEs of installed distributions (the long description in their metadata)."""
    out, seen = [], set()
    for dist in sorted(metadata.distributions(), key=lambda d: (d.metadata.get("Name") or "").lower()):
        name = dist.metadata.get("Name")
        if not name or name.lower() in seen:
            continue
        seen.add(name.lower())
        raw = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
        body = HeaderParser().parsestr(raw).get_payload() or dist.metadata.get("Description") or ""
        out += [Passage(name, t, f"metadata:{name}") for t in chunk(_paragraphs(str(body)), min_words, max_words)]
    return out


def stdlib_functions(min_lines: int = 5, max_lines: int = 30) -> list[str]:
    """Source of top-level functions and methods of the standard library, docstrings kept."""
    out = []
    for _, src, tree in _stdlib_sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and min_lines <= node.end_lineno - node.lineno + 1 <= max_lines:
                seg = ast.get_source_segment(src, node)
                if seg and "\t" not in seg:   # methods: the segment's first line lacks the indent
                    out.append(textwrap.dedent(" " * node.col_offset + seg))
    return out


def catalog_pairs(lang: str, locale_dir: Path = Path("/usr/share/locale"), min_words: int = 5) -> list[tuple[str, str]]:
    """(English, translation) sentence pairs from the gettext catalogs of `lang`."""
    pairs = set()
    for mo in sorted((locale_dir / lang / "LC_MESSAGES").glob("*.mo")):
        try:
            with open(mo, "rb") as f:
                catalog = gettext.GNUTranslations(f)._catalog
        except (OSError, UnicodeDecodeError, ValueError):
            continue
        for en, tr in catalog.items():
            if not (isinstance(en, str) and isinstance(tr, str) and en and tr):
                continue
            en, tr = en.strip(), tr.strip()
            if (len(tr.split()) >= min_words and "\n" not in tr and "\t" not in tr and not re.search(r"[%{}<>\\_]|--", tr)
                    and tr[0].isupper()):
                pairs.add((en, tr))
    return sorted(pairs)


def man_sentences(lang: str = "de", man_dir: Path = Path("/usr/share/man"), min_words: int = 8,
                  max_words: int = 40) -> list[str]:
    """Prose sentences from the man pages of `lang` (roff requests and escapes removed)."""
    out = set()
    for page in sorted((man_dir / lang).glob("man*/*.gz")):
        try:
            text = gzip.decompress(page.read_bytes()).decode("utf-8", "replace")
        except (OSError, EOFError):
            continue
        lines = [ln for ln in text.splitlines() if not ln.startswith((".", "'"))]
        prose = " ".join(lines)
        for esc, char in _ROFF_CHARS.items():
            prose = prose.replace(esc, char)
        prose = re.sub(r"\\f[BIRP]|\\\(..|\\\[[^]]*\]|\\[-e&]|\\\*\(..|\\.", "", prose)
        for s in re.split(r"(?<=[.!?])\s+(?=[A-ZÄÖÜ])", prose):
            s = " ".join(s.split())
            words = s.split()
            if (min_words <= len(words) <= max_words and s[0].isupper() and s[-1] in ".!?"
                    and not re.search(r"[\\/<>{}=_|]|--", s) and (lang != "de" or _GERMAN & set(words))):
                out.add(s)
    return sorted(out)


# groff's names for the letters of German text (\(:a is ä), in the three spellings man pages use
_ROFF_CHARS = {f"{pre}{name}{post}": char for name, char in
               ((":a", "ä"), (":o", "ö"), (":u", "ü"), (":A", "Ä"), (":O", "Ö"), (":U", "Ü"), ("ss", "ß"))
               for pre, post in (("\\(", ""), ("\\[", "]"), ("\\*(", ""))}
# a sentence from a German man page counts as German if it has one of these words
_GERMAN = {"der", "die", "das", "und", "ist", "nicht", "werden", "wird", "mit", "von", "den", "ein", "eine", "für", "auf"}
