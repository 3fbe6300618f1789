"""`specdec train lm | draft`: argument parsing and dispatch for the training jobs."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from .flags import (check_folder, check_shards, int_range, layer_list, non_negative_float, non_negative_int,
                    positive_float, positive_int, unit_float)

KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8")   # engine.KV_CACHE_DTYPES (parsing imports no torch)
SELFDISTILL_DATA = "runs/selfdistill"      # medusa / eagle: made here when missing (another --data must exist)


def add_parser(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser("train", help="train the bundled models (tokenizer, LM, draft, heads)")
    tsub = train.add_subparsers(dest="train_cmd", required=True)

    lm = tsub.add_parser("lm", help="pretrain a Llama-architecture LM from scratch on the stdlib corpus")
    lm.add_argument("--config", required=True, help="JSON training config (see configs/)")
    lm.add_argument("--out", required=True, help="Hugging Face folder to write")
    lm.add_argument("--tokenizer", help="use this folder's tokenizer instead of training one")
    _common(lm)

    draft = tsub.add_parser("draft", help="distil a small draft from a target (KL to its soft labels)")
    draft.add_argument("--target", required=True, help="the target's Hugging Face folder")
    draft.add_argument("--config", required=True)
    draft.add_argument("--out", required=True)
    draft.add_argument("--init", help="start from this draft checkpoint (e.g. pretrained with `train lm`)")
    _common(draft)

    for kind, text in (("medusa", "train Medusa heads on a frozen target (self-distillation)"),
                       ("eagle", "train an EAGLE head on a frozen target (self-distillation)")):
        h = tsub.add_parser(kind, help=text)
        h.add_argument("--target", default="models/target", help="the target's Hugging Face folder")
        h.add_argument("--out", required=True, help="heads folder to write")
        h.add_argument("--work", help="checkpoint folder (default: runs/<out name>)")
        h.add_argument("--data", default=SELFDISTILL_DATA,
                       help=f"self-distillation data folder (selfdistill: filled if empty, reused; made if missing only as the "
                            f"default {SELFDISTILL_DATA}; chat: the answers folder)")
        h.add_argument("--data-kind", choices=("selfdistill", "chat"), default="selfdistill",
                       help="selfdistill: the toy target continues corpus prompts; chat: `specdec train answers` shards")
        h.add_argument("--steps", type=non_negative_int, help="optimizer steps in all (0 with --init: the heads as they were)")
        h.add_argument("--batch", type=positive_int)
        h.add_argument("--lr", type=positive_float)
        h.add_argument("--draft-vocab", type=positive_int, help="draft vocabulary size (most frequent tokens)")
        h.add_argument("--shards", type=positive_int,
                       help="selfdistill: shards of 32 x 256 tokens to make (48); chat: answer shards to train on (all)")
        h.add_argument("--val-shards", type=positive_int, help="shards held out for validation (4)")
        if kind == "medusa":
            h.add_argument("--num-heads", type=positive_int)
            h.add_argument("--freeze-lm-head", action="store_true", default=None,
                           help="keep the heads' shared LM head at the target's rows (trained, it drifts toward "
                                "the far heads' guesses)")
        else:
            h.add_argument("--window", type=positive_int, help="pairs per training row")
        h.add_argument("--threads", type=positive_int)
        h.add_argument("--device", default="cpu", help="where the heads train (cpu, cuda)")
        h.add_argument("--stop-after", type=positive_int, help="stop (checkpointed) after this many steps of this run")
        h.add_argument("--report-prompts", type=non_negative_int, default=20,
                       help="held-out prompts (function headers, or validation chat prompts) for the card's acceptance "
                            "numbers (0: skip); those too long for the target's context are passed over, with a warning")
        h.add_argument("--noise", type=non_negative_float, help="eagle: input feature noise (fraction of the rms)")
        h.add_argument("--precision", choices=("fp32", "bf16", "auto"), help="training matmuls (default fp32)")
        h.add_argument("--eval-every", type=non_negative_int, help="log validation top-1 accuracy every N steps (0: never)")
        h.add_argument("--soft-labels", action="store_true", default=None,
                       help="token loss against the target's distribution (its LM head on the stored features)")
        h.add_argument("--token-weight", type=non_negative_float, help="eagle: token loss weight (default 0.1)")
        h.add_argument("--unroll", type=positive_int, help="eagle: chain depths trained (1: teacher forcing only; "
                       "2+: the later depths on the head's own predicted features)")
        h.add_argument("--prompt-loss", action="store_true", default=None, help="chat data: train on prompt positions too")
        h.add_argument("--init-from-target", action="store_true", default=None,
                       help="eagle: start the decoder layer from the target's last layer")
        h.add_argument("--init", help="start from these trained heads (a heads folder: fine-tuning on new data); "
                       "their draft vocabulary is kept")

    vd = tsub.add_parser("vocab-draft", help="distil a draft over a draft vocabulary from a chat target's answers")
    vd.add_argument("--target", required=True)
    vd.add_argument("--data", required=True, help="answers folder from `specdec train answers`")
    vd.add_argument("--out", required=True)
    vd.add_argument("--work", help="checkpoint folder (default: runs/<out name>)")
    for flag, kind in (("--layers", positive_int), ("--draft-vocab", positive_int), ("--steps", non_negative_int),
                       ("--batch", positive_int), ("--window", int_range(2)), ("--lr", positive_float),
                       ("--hard-weight", non_negative_float), ("--shards", positive_int), ("--val-shards", positive_int),
                       ("--threads", positive_int)):
        vd.add_argument(flag, type=kind)
    vd.add_argument("--precision", choices=("auto", "bf16", "fp32"))
    vd.add_argument("--init", help="start from this trained draft (a `train vocab-draft` folder: fine-tuning on new "
                    "data); its layers and draft vocabulary are kept")
    vd.add_argument("--device", default="cpu", help="where the draft trains (cpu, cuda)")
    vd.add_argument("--stop-after", type=positive_int, help="stop (checkpointed) after this many steps of this run")
    vd.add_argument("--report-prompts", type=non_negative_int, default=20,
                    help="validation prompts for the card's acceptance (0: skip; those too long for the target's context "
                         "are passed over, with a warning)")

    pr = tsub.add_parser("prompts", help="chat training prompts made on this machine (no downloads), checked against Spec-Bench")
    pr.add_argument("--out", required=True, help="folder for prompts.jsonl and its data card")
    pr.add_argument("--count", type=positive_int, default=8000)
    pr.add_argument("--seed", type=int, default=0)
    pr.add_argument("--target", help="model folder that writes the self-instruct tasks (none: no self-instruct)")
    pr.add_argument("--self-instruct", type=non_negative_int, default=1500, help="how many tasks to ask the target for")
    pr.add_argument("--eval", default="spec-bench", help='evaluation questions to exclude ("spec-bench", a file, or "none")')
    pr.add_argument("--threads", type=positive_int, default=1)

    an = tsub.add_parser("answers", help="the target's answers to the prompts, with its features (resumable shards)")
    an.add_argument("--target", required=True)
    an.add_argument("--prompts", required=True, help="prompts.jsonl from `specdec train prompts`")
    an.add_argument("--out", required=True, help="shard folder")
    an.add_argument("--limit", type=positive_int, help="answer only the first N prompts")
    an.add_argument("--eval", default="spec-bench", help='evaluation questions the prompts must not overlap, checked '
                    'as `train prompts` does ("spec-bench", a file, or "none"): an overlapping prompt is refused')
    an.add_argument("--max-new-tokens", type=positive_int, default=256)
    an.add_argument("--batch", type=positive_int, default=48)
    an.add_argument("--per-shard", type=positive_int, default=96)
    an.add_argument("--greedy-fraction", type=unit_float, default=0.5, help="share of the answers decoded greedily")
    an.add_argument("--dtype", default="bfloat16")
    an.add_argument("--backend", choices=("auto", "transformers", "specdec"), default="auto",
                    help="specdec: its own runtime, the weights as served (6x transformers' rate for the Q4_1 SmolLM2 "
                         "on a 2-core AMD EPYC Zen 3: 151 against 25 answer tokens/s, 32 rows, one thread); transformers: padded "
                         "batches, a GGUF target dequantized, so on a quantized file the answers and features are the "
                         "dequantized model's, not the packed weights' as served (greedy answers: 4 of 8 identical on the "
                         "Q4_1 SmolLM2 at 48 tokens); auto (default): specdec on the CPU, transformers on a GPU")
    an.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                    help="the KV cache the answers and features are computed over (specdec backend; recorded, and a "
                         "resume must match): auto (default) = the engine's default for this target (bf16 for a "
                         "GGUF-packed target on the CPU, else the model's activations' dtype), so the features are those served")
    an.add_argument("--threads", type=positive_int, default=1)
    an.add_argument("--device", default="cpu", help="where the target runs (cpu, cuda)")
    an.add_argument("--stop-after", type=positive_int, help="write at most this many new shards")

    fe = tsub.add_parser("features", help="add the target's features to answer shards that lack them "
                                             "(tokens only, e.g. brought back from a GPU lease)")
    fe.add_argument("--target", required=True)
    fe.add_argument("--data", required=True, help="folder of answer shards (shard_*.pt) without features")
    fe.add_argument("--out", required=True, help="folder for the shards with features (resumable)")
    fe.add_argument("--dtype", default="float32")
    fe.add_argument("--backend", choices=("auto", "transformers", "specdec"), default="auto",
                    help="as for `train answers` (auto: specdec on the CPU, transformers on a GPU; transformers: "
                         "a GGUF target's dequantized model's features)")
    fe.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                    help="as for `train answers` (auto: the engine's default for this target)")
    fe.add_argument("--threads", type=positive_int, default=1)
    fe.add_argument("--device", default="cpu", help="where the target runs (cpu, cuda)")

    sx = tsub.add_parser("suffix", help="index the target's answers as a datastore for method \"suffix\" (nothing is trained)")
    sx.add_argument("--data", required=True, help="answers folder from `specdec train answers`")
    sx.add_argument("--out", required=True, help="datastore folder")
    sx.add_argument("--shards", type=positive_int, help="training shards to index (default: all)")
    sx.add_argument("--val-shards", type=non_negative_int, default=1, help="the first shards, left out (the heads' validation)")
    sx.add_argument("--depth", type=int_range(1, 64), default=32, help="longest match the index resolves (tokens)")

    e3 = tsub.add_parser("eagle3", help="train an EAGLE-3 head (vLLM's layout) on a frozen target's own answers")
    e3.add_argument("--target", help="the target: a .gguf, a folder holding one, or a Hugging Face folder "
                                     "(default: the default model)")
    e3.add_argument("--data", required=True, help="a suffix datastore folder (`specdec train suffix`): its documents")
    e3.add_argument("--out", required=True, help="head folder to write")
    e3.add_argument("--work", help="checkpoint and feature folder (default: runs/<out name>)")
    for name, kind, text in (("steps", positive_int, "optimizer steps"), ("batch", positive_int, "rows per step"),
                             ("window", int_range(4), "pairs per row (>= 4)"), ("lr", positive_float, "peak learning rate"),
                             ("unroll", positive_int, "chain depths trained (training-time test)"),
                             ("draft-vocab", positive_int, "draft vocabulary size"),
                             ("max-tokens", positive_int, "feature positions taken from the documents"),
                             ("val-docs", positive_int, "documents held out (48; fewer than the datastore holds)"),
                             ("intermediate-size", positive_int, "the head's MLP width"),
                             ("threads", positive_int, "torch threads"), ("seed", int, "seed")):
        e3.add_argument(f"--{name}", type=kind, help=text)
    e3.add_argument("--feature-layers", type=layer_list, help="comma-separated target layers (default: 2, L // 2, L - 3)")
    e3.add_argument("--precision", choices=("fp32", "bf16", "auto"))
    e3.add_argument("--stop-after", type=positive_int, help="stop (checkpointed) after this many steps of this run")
    e3.add_argument("--device", default="cpu", help="where the target's pass and the training run (cpu, cuda)")

    rep = tsub.add_parser("report", help="quality of a target/draft pair on the test split; written into the model cards")
    rep.add_argument("--target", default="models/target")
    rep.add_argument("--draft", default="models/draft")
    rep.add_argument("--k", type=positive_int, default=4)
    rep.add_argument("--functions", type=positive_int, default=50)
    rep.add_argument("--max-tokens", type=positive_int, default=128)
    rep.add_argument("--threads", type=positive_int)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--work", help="checkpoint folder (default: runs/<out name>)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=positive_int, help="torch threads (overrides the config)")
    p.add_argument("--max-steps", type=positive_int, help="override the config's max_steps")
    p.add_argument("--stop-after", type=positive_int, help="stop (checkpointed) after this many steps of this run")


def _check_target(path: str) -> Path:
    from ..model.gguf import find_gguf

    target = Path(path)
    if not (target / "config.json").is_file() and find_gguf(target) is None:
        raise ValueError(f"--target {target}: not a model folder (no config.json) nor a GGUF file")
    return target


def _check_tokenizer(flag: str, path: str | Path) -> Path:
    """A tokenizer given as an input (--tokenizer, or the --target's own) loads as specdec.LLM loads a
    model's (a tokenizer.json folder, a GGUF): one is never trained into it (a draft on a tokenizer of
    its own would not fit the target)."""
    from ..tokenizer import Tokenizer, TokenizerError

    p = check_folder(flag, path) if not Path(path).is_file() else Path(path)
    try:
        Tokenizer(p)
    except TokenizerError as e:
        hint = "; specdec reads tokenizer.json, not tokenizer.model: save it as one with transformers' " \
            "AutoTokenizer" if (p / "tokenizer.model").is_file() else ""
        raise ValueError(f"{flag} {path}: no tokenizer specdec reads ({e}){hint}") from None
    return p


def _check_device(device: str) -> None:
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device}: not a device (cpu, cuda, cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device here (torch {torch.__version__})")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device}: training runs on cpu or cuda")


def run(args: argparse.Namespace) -> int:
    if getattr(args, "device", None) is not None:
        _check_device(args.device)
    if args.train_cmd == "report":
        return _report(args)
    if args.train_cmd in ("prompts", "answers", "features"):
        return _chat_data(args)
    if args.train_cmd == "vocab-draft":
        return _vocab_draft(args)
    if args.train_cmd == "suffix":
        return _suffix(args)
    if args.train_cmd in ("medusa", "eagle"):
        return _heads(args)
    if args.train_cmd == "eagle3":
        return _eagle3(args)
    from .lm import TrainConfig, train

    cfg = TrainConfig.load(args.config, threads=args.threads, max_steps=args.max_steps)
    out = Path(args.out)
    work = Path(args.work) if args.work else Path("runs") / out.name
    command = "specdec " + " ".join(shlex.quote(a) for a in args.command_line)
    if args.train_cmd == "lm":
        tok = _check_tokenizer("--tokenizer", args.tokenizer) if args.tokenizer else None
        result = train(cfg, out, work, tokenizer_dir=tok, device=args.device, command=command,
                       stop_after=args.stop_after)
    else:
        target = _check_tokenizer("--target", _check_target(args.target))
        init = check_folder("--init", args.init) if args.init else None
        result = train(cfg, out, work, tokenizer_dir=target, teacher_dir=target, device=args.device,
                       command=command, stop_after=args.stop_after, init_dir=init)
    if result["finished"]:
        print(f"wrote {out}: validation loss {result['validation_loss']}, test loss {result['test_loss']}")
    else:
        print(f"stopped at step {result['step']}; run the same command again to resume")
    return 0


def _eagle3(args: argparse.Namespace) -> int:
    from ..defaults import default_model
    from .eagle3 import Eagle3Config, check_source, train_eagle3

    keys = ("steps", "batch", "window", "lr", "unroll", "draft_vocab", "max_tokens", "val_docs", "intermediate_size",
            "threads", "seed", "precision", "feature_layers")
    cfg = Eagle3Config(**{k: getattr(args, k) for k in keys if getattr(args, k) is not None})
    check_source(check_folder("--data", args.data, "datastore folder"), cfg.val_docs)
    out = Path(args.out)
    work = Path(args.work) if args.work else Path("runs") / out.name
    command = "specdec " + " ".join(shlex.quote(a) for a in args.command_line)
    result = train_eagle3(cfg, args.target or default_model()[0], Path(args.data), out, work, command,
                          stop_after=args.stop_after, device=args.device)
    if result["finished"]:
        print(f"wrote {out}: top-1 agreement with the target by chain depth {result['chain_top1_by_depth']}")
    else:
        print(f"stopped at step {result['step']}; run the same command again to resume")
    return 0


def _suffix(args: argparse.Namespace) -> int:
    from .suffix import build, summary

    check_shards("--data", args.data, args.val_shards)
    command = "specdec " + " ".join(shlex.quote(a) for a in args.command_line)
    info = build(Path(args.data), Path(args.out), args.shards, args.val_shards, args.depth, command)
    print(f"wrote {args.out}: " + summary(info))
    return 0


def _report(args: argparse.Namespace) -> int:
    import json

    import torch

    from .report import run_report, write_into_cards

    if args.threads:
        torch.set_num_threads(args.threads)
    r = run_report(Path(args.target), Path(args.draft), args.k, args.functions, args.max_tokens)
    command = "specdec " + " ".join(shlex.quote(a) for a in args.command_line)
    write_into_cards(r, command, Path(args.target), Path(args.draft))
    print(json.dumps(r, indent=1))
    return 0


def _heads(args: argparse.Namespace) -> int:
    from .heads import HeadsConfig, train_heads

    fields = {"steps": args.steps, "batch": args.batch, "lr": args.lr, "draft_vocab": args.draft_vocab,
              "shards": args.shards, "val_shards": args.val_shards, "threads": args.threads,
              "data_kind": args.data_kind, "noise": getattr(args, "noise", None), "precision": args.precision,
              "eval_every": args.eval_every, "prompt_loss": args.prompt_loss,
              "soft_labels": args.soft_labels, "token_weight": getattr(args, "token_weight", None),
              "init_from_target": getattr(args, "init_from_target", None), "unroll": getattr(args, "unroll", None),
              "num_heads": getattr(args, "num_heads", None), "window": getattr(args, "window", None),
              "freeze_lm_head": getattr(args, "freeze_lm_head", None), "init": args.init}
    cfg = HeadsConfig(kind=args.train_cmd, **{k: v for k, v in fields.items() if v is not None})
    target = _check_target(args.target)
    if args.init:
        check_folder("--init", args.init)
    if cfg.data_kind == "chat":
        check_shards("--data", args.data, cfg.val_shards)
    elif args.data != SELFDISTILL_DATA or Path(args.data).exists():     # only the default is made when missing
        check_folder("--data", args.data, f"folder (self-distillation data are made in a folder that exists, or in the "
                                          f"default {SELFDISTILL_DATA})")
    out = Path(args.out)
    command = "specdec " + " ".join(shlex.quote(a) for a in args.command_line)
    r = train_heads(cfg, target, out, Path(args.work) if args.work else Path("runs") / out.name, Path(args.data),
                    command=command, stop_after=args.stop_after, report_prompts=args.report_prompts,
                    device=args.device)
    if r["finished"]:
        print(f"wrote {out}: " + json.dumps({k: v for k, v in r.items() if k != "finished"}))
    else:
        print(f"stopped at step {r['step']}; run the same command again to resume")
    return 0


def _chat_data(args: argparse.Namespace) -> int:
    import torch

    from .chatdata import make_prompt_set

    torch.set_num_threads(args.threads)
    command = "specdec " + " ".join(shlex.quote(a) for a in args.command_line)
    if args.train_cmd == "prompts":
        from .prompts import PromptConfig

        ev = _eval_file(args.eval)
        s = make_prompt_set(Path(args.out), PromptConfig(count=args.count, seed=args.seed),
                            Path(args.target) if args.target else None, args.self_instruct, ev, command)
        print(json.dumps({k: s[k] for k in ("prompts", "families")}))
        return 0
    from ..tokenizer import Tokenizer
    from .answers import AnswerConfig, read_prompts, write_shards

    if args.train_cmd == "features":
        from .answers import add_features, check_features_folder
        from .provenance import target_fingerprint

        paths = sorted(Path(args.data).glob("shard_*.pt"))
        if not paths:
            raise ValueError(f"--data {args.data}: no shard_*.pt files")
        target = target_fingerprint(args.target)
        check_features_folder(Path(args.out), paths, target, args.dtype, log=lambda s: None,   # before the model loads
                              kv_cache_dtype=args.kv_cache_dtype)
        done = add_features(_answer_model(args), paths, Path(args.out), target=target, dtype=args.dtype,
                            kv_cache_dtype=args.kv_cache_dtype)
        print(f"{len(done)} shards with features in {args.out}")
        return 0
    from .answers import check_answers_folder, skipped_shards
    from .provenance import target_fingerprint

    prompts = read_prompts(Path(args.prompts))[:args.limit]
    if not prompts:
        raise ValueError(f"--prompts {args.prompts}: no prompts")
    _check_eval_overlap(prompts, args.prompts, args.eval)
    cfg = AnswerConfig(max_new_tokens=args.max_new_tokens, batch=args.batch, per_shard=args.per_shard,
                       greedy_fraction=args.greedy_fraction, threads=args.threads, kv_cache_dtype=args.kv_cache_dtype)
    target = target_fingerprint(args.target)
    check_answers_folder(Path(args.out), prompts, cfg, target, log=lambda s: None)   # before the model loads
    paths = write_shards(_answer_model(args), Tokenizer(args.target), prompts, Path(args.out), cfg,
                         stop_after=args.stop_after, target=target)
    skipped = len(skipped_shards(Path(args.out), prompts, cfg.per_shard))      # all their prompts too long: done
    total = -(-len(prompts) // cfg.per_shard)
    print(f"{len(paths)}/{total} shards in {args.out}" + (f", {skipped} skipped: all prompts too long" if skipped else "")
          + ("" if len(paths) + skipped == total else "; run again to continue"))
    return 0


def _eval_file(name: str) -> Path | None:
    from .chatdata import SPEC_BENCH

    ev = {"spec-bench": SPEC_BENCH, "none": None}.get(name, Path(name))
    if ev is not None and not ev.is_file():
        raise ValueError(f"--eval {name}: no such file")
    if ev is not None:       # before any prompt is made: a file of no turns checks nothing
        from .overlap import eval_texts
        eval_texts(ev)
    return ev


def _check_eval_overlap(prompts: list[dict], path: str, eval_name: str) -> None:
    """`train answers` on a prompts file `train prompts` did not write (or did, with --eval none): the
    same contamination check, refusing what it would have dropped (heads trained on the benchmark's
    own questions would overstate their acceptance there)."""
    from .overlap import check_overlap, eval_texts

    ev = _eval_file(eval_name)
    if ev is None:
        return
    _, report = check_overlap(prompts, eval_texts(ev))
    bad = report["dropped_ids"]
    if bad:
        raise ValueError(f"--prompts {path}: {len(bad)} prompts overlap the evaluation questions of {ev} (first: id "
                         f"{bad[0]!r}; exact {report['dropped_exact']}, shared 13-gram {report['dropped_shared_13gram']}, "
                         f"8-gram near duplicate {report['dropped_near_duplicate_8gram']}): remove them (`specdec train "
                         "prompts` drops them), or --eval none to answer them anyway")


def _answer_model(args: argparse.Namespace):
    """The target as `train answers` / `train features` run it: specdec's runtime or transformers'
    (a GGUF target dequantized: on a quantized file, another function than the packed one served)."""
    from ..model import load_model

    backend = args.backend if args.backend != "auto" else ("specdec" if args.device == "cpu" else "transformers")
    if backend == "transformers" and args.kv_cache_dtype not in ("auto", args.dtype):
        raise ValueError(f"--kv-cache-dtype {args.kv_cache_dtype}: the transformers backend keeps its KV cache in "
                         f"--dtype ({args.dtype}); use --backend specdec for another")
    if backend == "specdec":
        return load_model(args.target, args.dtype, args.device)
    import transformers

    from ..model.checkpoint import resolve_dtype
    from ..model.gguf import find_gguf
    if find_gguf(args.target) is not None:      # a GGUF target: dequantized, then transformers' names
        from ..model.export import to_transformers
        model = to_transformers(load_model(args.target, "float32", quantization="none"), resolve_dtype(args.dtype))
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.target, dtype=resolve_dtype(args.dtype))
    return model.to(args.device).eval()


def _vocab_draft(args: argparse.Namespace) -> int:
    from .vocab_draft import VocabDraftConfig, train_vocab_draft

    names = ("layers", "draft_vocab", "steps", "batch", "window", "lr", "hard_weight", "shards", "val_shards",
             "threads", "precision", "init")
    cfg = VocabDraftConfig(**{k: getattr(args, k) for k in names if getattr(args, k) is not None})
    _check_target(args.target)
    if args.init:
        check_folder("--init", args.init)
    check_shards("--data", args.data, cfg.val_shards)
    out = Path(args.out)
    command = "specdec " + " ".join(shlex.quote(a) for a in args.command_line)
    r = train_vocab_draft(cfg, Path(args.target), Path(args.data), out,
                          Path(args.work) if args.work else Path("runs") / out.name, command=command,
                          stop_after=args.stop_after, report_prompts=args.report_prompts, device=args.device)
    if r["finished"]:
        print(f"wrote {out}: " + json.dumps({k: v for k, v in r.items() if k != "finished"}))
    else:
        print(f"stopped at step {r['step']}; run the same command again to resume")
    return 0
