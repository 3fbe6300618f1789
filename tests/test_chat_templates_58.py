"""A tokenizer folder with several named chat templates (transformers 5's dict): the content format
is read from the template a request renders (tool_use with tools, as vLLM and transformers), and
`specdec chat` refuses a folder with named templates but no default before its prompt."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from specdec import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("{% for m in messages %}<|{{ m['role'] }}|>\n{% for p in m['content'] %}{{ p['text'] }}{% endfor %}"
         "<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}


def _folder(tmp_path, templates) -> Path:
    folder = tmp_path / "m"
    shutil.copytree(ROOT / "models" / "target", folder)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    default = cfg.pop("chat_template")
    cfg["chat_template"] = [{"name": n, "template": default if t is None else t} for n, t in templates.items()]
    cfg_path.write_text(json.dumps(cfg))
    return folder


def test_the_tool_use_templates_content_format_is_read_with_tools(tmp_path):
    """The tool_use template loops over content parts, the default reads strings: with tools the
    user's text reaches the prompt (it vanished: the format was read off the default template)."""
    llm = LLM(str(_folder(tmp_path, {"default": None, "tool_use": "TOOLS\n" + PARTS})), num_speculative_tokens=0)
    out = llm.chat([{"role": "user", "content": "def fib(n):"}], SamplingParams(max_tokens=1, temperature=0),
                   tools=[TOOL])
    assert out[0].prompt.startswith("TOOLS\n<|user|>\ndef fib(n):<|end|>"), out[0].prompt
    plain = llm.chat([{"role": "user", "content": "def fib(n):"}], SamplingParams(max_tokens=1, temperature=0))
    assert "def fib(n):" in plain[0].prompt and not plain[0].prompt.startswith("TOOLS")


def test_chat_refuses_named_templates_without_a_default(tmp_path):
    folder = _folder(tmp_path, {"rag": None})
    r = subprocess.run([sys.executable, "-m", "specdec", "chat", "--model", str(folder), "--max-tokens", "2"],
                       input="hi\n", capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 2, (r.returncode, r.stdout[-500:], r.stderr[-500:])
    assert "chat template" in r.stderr.lower()
