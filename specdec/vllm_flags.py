"""vLLM's command-line flags that specdec accepts and does not use: which they are, which take
no value or several, and how the words of a command line are grouped into them (serve, run-batch,
generate, chat and bench share this; it imports nothing heavy, so generate stays light)."""

from __future__ import annotations

from .cli import _is_number

# vLLM's `serve` flags (v0.6 .. v0.11, engine and frontend) that specdec takes and ignores with a
# warning; the ones it honours are its own flags. A boolean's --no-X form is taken as X is.
VLLM_FLAGS = frozenset("""
    additional-config aggregate-engine-logging all2all-backend allowed-local-media-path allowed-media-domains
    api-server-count asc async-scheduling calculate-kv-scales  code-revision
    config-format cpu-offload-gb  
    data-parallel-address data-parallel-backend data-parallel-external-lb data-parallel-hybrid-lb
    data-parallel-multi-port-external-lb data-parallel-rank data-parallel-rpc-port 
    data-parallel-size-local data-parallel-start-rank dbo-decode-token-threshold dbo-prefill-token-threshold
    dcp decode-context-parallel-size  default-mm-loras 
    disable-async-output-proc disable-cascade-attn disable-chunked-mm-input disable-custom-all-reduce
    disable-frontend-multiprocessing disable-hybrid-kv-cache-manager
    disable-logprobs-during-spec-decoding disable-mm-preprocessor-cache disable-nccl-for-dp-synchronization
     distributed-executor-backend  dpa dpb dpl dpn dpp dpr
    enable-chunked-prefill enable-dbo enable-eplb enable-expert-parallel 
    enable-lora-bias enable-mm-embeds enable-multimodal-encoder-data-parallel
    enable-offline-docs enable-prompt-adapter enable-prompt-embeds enable-prompt-tokens-details enable-reasoning
    enable-sleep-mode enable-ssl-refresh
     engine-use-ray eplb-config eplb-log-balancedness eplb-step-interval
    eplb-window-size exclude-tools-when-tool-choice-none expert-placement-strategy external-parameters
    fully-sharded-loras  h11-max-header-count
    h11-max-incomplete-event-size headless hf-token ignore-patterns
    intial-incremental-detokenization-offset interleave-mm-strings io-processor-plugin 
    kv-events-config kv-sharing-fast-prefill kv-transfer-config limit-mm-per-prompt load-format 
    log-error-stack logits-processor-pattern logits-processors long-lora-scaling-factors long-prefill-token-threshold
    lora-extra-vocab-size mamba-block-size mamba-cache-dtype mamba-ssm-cache-dtype max-context-len-to-capture
     max-long-partial-prefills max-num-partial-prefills max-parallel-loading-workers
    max-prompt-adapter-token max-prompt-adapters max-seq-len-to-capture media-io-kwargs 
    mm-encoder-attn-backend mm-encoder-tp-mode mm-processor-cache-gb mm-processor-cache-type mm-processor-kwargs
    mm-shm-cache-max-object-size-mb model-impl model-loader-extra-config multi-step-stream-outputs
     num-lookahead-slots
    num-redundant-experts num-scheduler-steps override-attention-dtype
    override-neuron-config pipeline-parallel-size pp prefix-caching-hash-algo
    preemption-mode prompt-adapters pt-load-map-location qlora-adapter-name-or-path ray-workers-use-nsight
    safetensors-load-strategy scheduler-cls scheduler-delay-factor
    show-hidden-metrics-for-version shutdown-timeout skip-mm-profiling skip-tokenizer-init
    speculative-disable-mqa-scorer speculative-draft-tensor-parallel-size
    speculative-max-model-len speculative-model-quantization swap-space
    tokenizer-mode tokenizer-pool-extra-config tokenizer-pool-size tokenizer-pool-type
    tool-parser-plugin tool-server trust-remote-code
     use-tqdm-on-load use-v2-block-manager video-pruning-rate
    worker-cls  worker-use-ray
""".split())


# vLLM's switches among VLLM_FLAGS (store_true: they never take the next word as a value)
VLLM_SWITCHES = frozenset("""
    aggregate-engine-logging async-scheduling calculate-kv-scales data-parallel-external-lb data-parallel-hybrid-lb
    disable-async-output-proc disable-cascade-attn disable-chunked-mm-input disable-custom-all-reduce
    disable-frontend-multiprocessing disable-hybrid-kv-cache-manager disable-logprobs-during-spec-decoding
    disable-mm-preprocessor-cache disable-nccl-for-dp-synchronization speculative-disable-mqa-scorer enable-chunked-prefill
    enable-dbo enable-eplb enable-expert-parallel enable-lora-bias enable-mm-embeds
    enable-multimodal-encoder-data-parallel enable-offline-docs enable-prompt-adapter enable-prompt-embeds enable-prompt-tokens-details
    enable-reasoning enable-sleep-mode enable-ssl-refresh  engine-use-ray
    eplb-log-balancedness exclude-tools-when-tool-choice-none fully-sharded-loras headless interleave-mm-strings
    kv-sharing-fast-prefill multi-step-stream-outputs ray-workers-use-nsight skip-mm-profiling skip-tokenizer-init
    trust-remote-code use-tqdm-on-load use-v2-block-manager worker-use-ray
""".split())


# vLLM 0.6's StoreBoolean switches (nargs="?", const="True"): `--enable-chunked-prefill` alone or
# followed by true / false (any case), the only values StoreBoolean reads
OPTIONAL_BOOL_SWITCHES = frozenset({"enable-chunked-prefill", "multi-step-stream-outputs",
                                    "disable-logprobs-during-spec-decoding"})


def _switch(flag: str) -> bool:
    name = flag.split("=")[0].lstrip("-")
    return name in VLLM_SWITCHES or (name.startswith("no-") and name[3:] in VLLM_SWITCHES)


def bool_value(flag: str, word: str) -> bool:
    """Whether word is the true / false that one of OPTIONAL_BOOL_SWITCHES (`flag`, given without
    `=`) takes after it; any other word is not its value (a prompt after it stays the prompt)."""
    return "=" not in flag and " " not in flag and flag.lstrip("-") in OPTIONAL_BOOL_SWITCHES \
        and word.lower() in ("true", "false")


def drop_vllm_flags(words: list[str], own: set[str], own_valued: set[str] = frozenset()) -> tuple[list[str], list[str]]:
    """words without vLLM's flags that specdec does not use (VLLM_FLAGS, not among `own`), each
    with its value(s): a switch takes none (one of OPTIONAL_BOOL_SWITCHES a true / false after
    it), a several-valued flag every word up to the next flag, any other the next word unless it
    is a flag. The value of one of specdec's own options that take one (own_valued:
    `--server-args "--trust-remote-code ..."`) is never taken for a flag.
    -> (the rest, the flags dropped)."""
    kept, dropped, i = [], [], 0
    while i < len(words):
        word = words[i]
        if word in own_valued and i + 1 < len(words):         # its value, whatever it looks like
            kept += words[i:i + 2]
            i += 2
            continue
        if word.startswith("-") and " " not in word and not _is_number(word) and word.split("=")[0] not in own \
                and _is_vllm_flag(word):
            j = i + 1
            if j < len(words) and bool_value(word, words[j]):
                j += 1
            elif "=" not in word and not _switch(word):
                while j < len(words) and not (words[j].startswith("-") and not _is_number(words[j])):
                    j += 1
                    if not _takes_many(word):
                        break
            dropped.append(" ".join(words[i:j]))
            i = j
            continue
        kept.append(word)
        i += 1
    return kept, dropped


# vLLM's flags among VLLM_FLAGS that take several values (nargs="+"): every word up to the next flag
MULTI_VALUE_FLAGS = frozenset({"prompt-adapters", "long-lora-scaling-factors", "allowed-media-domains",
                               "ignore-patterns", "logits-processors"})


def _takes_many(flag: str) -> bool:
    return "=" not in flag and flag.lstrip("-") in MULTI_VALUE_FLAGS


def ignored_flags(unknown: list[str], own: list[str] = (),
                  bench: tuple[str | None, dict[str, set[str]]] | None = None) -> list[str]:
    """Group unknown words into flags with their values: a flag takes the next word as its
    value unless that word is itself a flag, a switch only a true / false (bool_value). A stray
    word without a flag, or a flag that is not one of VLLM_FLAGS, is an error (`own`: specdec's
    flags, for a did-you-mean; `bench`: the `specdec bench` subcommand and the others' flags, for
    bench_refusal)."""
    flags: list[str] = []
    for word in unknown:
        if word.startswith("-") and not _is_number(word):
            flags.append(word)
        elif flags and "=" not in flags[-1] and " " not in flags[-1] and \
                (not _switch(flags[-1]) or bool_value(flags[-1], word)):
            flags[-1] += " " + word
        else:
            raise ValueError(f"unexpected argument {word!r}")
    bad = [f.split(" ")[0].split("=")[0] for f in flags if not _is_vllm_flag(f)]
    if bad and bench is not None:
        bench_refusal(bad[0], *bench)
    if bad:
        import difflib

        names = [c for c in [*own, *(f"--{n}" for n in VLLM_FLAGS)] if c != bad[0]]
        close = difflib.get_close_matches(bad[0], names, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ValueError(f"unrecognized arguments: {' '.join(bad)} (neither specdec's flags nor vLLM's{hint})")
    return flags


# flags of vLLM's `bench throughput` / `bench latency` that specdec's do not take, with why where
# there is more to say than that (vllm/benchmarks/throughput.py and latency.py, add_cli_args)
VLLM_BENCH_FLAGS = {
    "throughput": {"backend": "it picks vLLM's engine: vllm, hf, mii or vllm-chat; specdec's always runs "
                              "specdec's LLM",
                   "async-engine": "specdec's runs the LLM class, not an async engine",
                   "disable-detokenize": "specdec's always detokenizes", "hf-max-batch-size": "",
                   "lora-path": "", "hf-subset": "", "hf-split": "", "dataset": "",
                   "profile": "`specdec bench serve --profile` profiles a server"},
    "latency": {"profile": "`specdec bench serve --profile` profiles a server",
                "disable-detokenize": "specdec's always detokenizes", "use-beam-search": ""},
}


def bench_flags(parser, words: list[str]) -> tuple[list[str], tuple]:
    """For an unknown flag of `specdec bench [SUB]` (parser: specdec's, words: the command line):
    that command's own flags (the did-you-mean's candidates) and (SUB, every other bench command's
    flags, "" naming the main bench's), ignored_flags' `bench`."""
    from .cli import _subcommands, _subparser, own_options

    def options(p) -> list[str]:
        return [s for a in p._actions for s in a.option_strings]

    bench = _subparser(parser, "bench")
    subs = _subcommands(bench)
    sub = words[1] if len(words) > 1 and words[1] in subs else None
    named = {"": set(options(bench)), **{name: set(own_options(p)[0]) for name, p in subs.items()}}
    here = named.pop(sub or "")
    return [*options(parser), *here], (sub, named)


def bench_refusal(flag: str, sub: str | None, elsewhere: dict[str, set[str]]) -> None:
    """The one-line refusal of a flag that `specdec bench SUB` lacks when it is vLLM's `bench SUB`
    flag, or another `specdec bench` subcommand's (elsewhere: that subcommand's name -> its flags,
    "" for the main bench): said as such instead of "neither specdec's nor vLLM's"."""
    name = f"specdec bench {sub}" if sub else "specdec bench"
    homes = " and ".join(f"`specdec bench{' ' + s if s else ''}`" for s, flags in elsewhere.items() if flag in flags)
    why = VLLM_BENCH_FLAGS.get(sub or "", {}).get(flag.lstrip("-"))
    if why is not None:
        raise ValueError(f"{flag} is vLLM's `bench {sub}` flag, which {name} does not take"
                         + (f" ({why})" if why else "") + (f"; it is also a flag of {homes}" if homes else ""))
    if homes:
        raise ValueError(f"{flag} is a flag of {homes}, not of {name}")


def _is_vllm_flag(flag: str) -> bool:
    name = flag.split(" ")[0].split("=")[0].lstrip("-")
    return name in VLLM_FLAGS or (name.startswith("no-") and name[3:] in VLLM_FLAGS)




_ALIASES = {"pp": "pipeline_parallel_size"}
# vLLM 0.6's flags for speculative_config keys that specdec takes only at values that change nothing:
# checked as the key is (config.VLLM_SPEC_KEYS), so the flag and the key are refused alike
SPECULATIVE_FLAG_KEYS = {"speculative-draft-tensor-parallel-size": "draft_tensor_parallel_size",
                         "speculative-max-model-len": "max_model_len",
                         "speculative-model-quantization": "quantization",
                         "speculative-disable-mqa-scorer": "disable_mqa_scorer"}


def check_refused(flags: list[str]) -> None:
    """Ignored flags whose value would change what vLLM runs in a way specdec cannot (the LLM's
    own rule, llm._VLLM_IGNORED: --pipeline-parallel-size 2, --tokenizer-mode mistral,
    --load-format dummy, --enable-sleep-mode): a one-line ValueError, as LLM(...) refuses them."""
    from .config import VLLM_SPEC_KEYS
    from .llm import _VLLM_IGNORED, _same

    for flag in flags:
        word, _, value = flag.replace("=", " ", 1).partition(" ")
        name = word.lstrip("-")
        if name.removeprefix("no-") in SPECULATIVE_FLAG_KEYS:
            parsed = (not name.startswith("no-")) if _switch(word) or value == "" else _parse_value(value)
            ok, why = VLLM_SPEC_KEYS[SPECULATIVE_FLAG_KEYS[name.removeprefix("no-")]]
            if not ok(parsed):
                raise ValueError(f"{word} {value}".strip() + f": {why}")
            continue
        negated = name.startswith("no-") and name[3:].replace("-", "_") in _VLLM_IGNORED
        key = _ALIASES.get(name, (name[3:] if negated else name).replace("-", "_"))
        if key not in _VLLM_IGNORED:
            continue
        _, accepted, why = _VLLM_IGNORED[key]
        if value == "" or (_switch(word) and not bool_value(word, value)):
            parsed = not negated
        else:
            parsed = _parse_value(value)
        ok = any(_same(parsed, a) for a in accepted) if isinstance(accepted, tuple) else accepted(parsed)
        if not ok:
            raise ValueError(f"{word} {value}".strip() + f": not supported: {why}")


def _parse_value(value: str):
    low = value.lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value
