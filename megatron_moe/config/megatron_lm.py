"""Megatron-LM flags that have no meaning here, and the one-line answer to a flag nobody defines.

In: a Megatron-LM launch script's argv; out, before parsing, one answer per flag this stack names otherwise or
does not need: `RENAMED` (read as our flags, one line says which), `NOT_NEEDED` (accepted, one line why),
`NOT_NEEDED_WITH` (accepted for the values that change nothing), `REFUSED` (with the reason), Megatron-LM's
tokenizer types (`TOKENIZER_TYPES_READ_AS`). An unknown flag gets the closest flags and their group
(`unknown_flag`). Invariant: no flag is silently ignored. The mapping table: docs/flags.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from megatron_moe.config.megatron_lm_unsupported import (
    REFUSED_FEATURE_FLAGS,
    REFUSED_VALUE_FLAGS,
    refused_prefix,
    refused_value,
)

_TIMERS = (
    "the timers always go to TensorBoard here (iteration time; exposed and total communication per kind and per MoE "
    "layer)"
)
_UPCYCLING = "upcycling a dense checkpoint into MoE is not supported yet; drop it"
_SYNC_SAVE = "saves are synchronous here (no async checkpoint worker); the checkpoint is the same"
_PARALLEL_CKPT = "dist_checkpointing's save and load parallelisation across DP; the checkpoint is the same"
_ROUTING_TRACE = (
    "routing traces are not written here; each MoE layer's loads, drops and entropy go to TensorBoard "
    "(--overlap-report adds the plans)"
)
_PROFILE = "nsys capture ranges are not emitted here: profile the whole run (nsys, or torch's profiler)"

RENAMED: dict[str, tuple[bool, tuple[str, ...]]] = {
    # flag -> (takes a value, our flags that mean the same; its value, if any, follows them)
    "--moe-shared-expert-intermediate-size": (True, ("--moe-shared-expert-ffn-hidden-size",)),
    "--use-rotary-position-embeddings": (False, ("--position-embedding-type", "rope")),
    "--muon-use-nesterov": (False, ("--muon-nesterov",)),  # Megatron-LM core_v0.16.1's name
    "--recompute-activations": (
        False,
        ("--recompute-granularity", "selective", "--recompute-modules", "core_attention"),
    ),
}
NOT_NEEDED: dict[str, tuple[bool, str]] = {
    # flag -> (takes a value, why it changes nothing here)
    "--use-mcore-models": (False, "the model is always megatron-core's GPTModel here"),
    "--no-persist-layer-norm": (
        False,
        "the norms are megatron_moe's torch LayerNorm/RMSNorm (or transformer-engine's linears' own); megatron-core "
        "reads persist_layer_norm only in apex's FusedLayerNorm, which this stack never builds",
    ),
    "--no-async-tensor-model-parallel-allreduce": (
        False,
        "megatron-core's linear layers overlap the TP all-reduce of the input gradient by themselves",
    ),
    "--distributed-backend": (True, "the platform layer picks it: nccl on a GPU, gloo on CPU"),
    "--use-torch-optimizer-for-cpu-offload": (False, "the optimizer is megatron-core's, on the device"),
    "--no-use-layer-wise-param-layout": (
        False,
        "Muon's layer-wise distributed optimizer is megatron-core 0.16.1's, the legacy path this flag selects in "
        "Megatron-LM (all parameters in DDP's buffers, updated ones all-gathered after the step); the same "
        "arithmetic as the precomputed layout, which only orders bf16 reductions otherwise",
    ),
    "--muon-use-syrk": (
        False,
        "a Triton kernel (GPU) for Newton-Schulz's Gram matrix X X^T; megatron-core 0.16.1's Muon computes the same "
        "matrix with a matmul",
    ),
    "--log-timers-to-tensorboard": (False, _TIMERS),
    "--timing-log-level": (True, _TIMERS),
    "--log-memory-to-tensorboard": (False, "mem-bytes (device memory, or resident set size on CPU) always goes there"),
    "--tensorboard-queue-size": (True, "the TensorBoard writer is flushed at every log interval"),
    "--use-checkpoint-opt_param-scheduler": (
        False,
        "the learning-rate schedule is always restored from the checkpoint (its flags must match it)",
    ),
    "--accumulate-allreduce-grads-in-fp32": (False, "under --bf16/--fp16 gradients are always reduced in fp32 here"),
    "--group-query-attention": (False, "--num-query-groups below --num-attention-heads turns it on by itself"),
    "--no-position-embedding": (
        False,
        "with --position-embedding-type rope (the default here) there is no learned position table",
    ),
    "--no-create-attention-mask-in-dataloader": (False, "the data loader never builds attention masks here"),
    "--manual-gc": (False, "Python's automatic garbage collection is kept; it changes no result"),
    # checkpoints: one format, written and checked one way
    "--async-save": (
        False,
        "a save is written, checksummed and swapped into place before training goes on; the checkpoint is the same",
    ),
    "--async-strategy": (True, _SYNC_SAVE),
    "--use-persistent-ckpt-worker": (False, _SYNC_SAVE),
    "--async-ckpt-use-cpu-shm": (False, _SYNC_SAVE),
    "--ckpt-fully-parallel-save": (False, _PARALLEL_CKPT),
    "--no-ckpt-fully-parallel-save": (False, _PARALLEL_CKPT),
    "--ckpt-fully-parallel-load": (False, _PARALLEL_CKPT),
    "--ckpt-assume-constant-structure": (False, "a save-time cache of dist_checkpointing's; the files are the same"),
    "--dist-ckpt-strictness": (
        True,
        "loading checks the checkpoint's tensors against the model itself: tensors it lacks are refused by name, "
        "tensors it holds beyond the model are left",
    ),
    "--dist-ckpt-optim-fully-reshardable": (
        False,
        "the optimizer state is saved reshardable across TP, PP, EP and DP here (tools/checkpoint resharding)",
    ),
    "--auto-detect-ckpt-format": (False, "torch_dist is the only checkpoint format here"),
    "--verify-integrity": (False, "every load verifies the checksums recorded at save"),
    "--no-use-tokenizer-model-from-checkpoint-args": (False, "the tokenizer is never read from a checkpoint here"),
    # run-time habits that change no result
    "--deterministic-mode": (
        False,
        "the CPU kernels here are deterministic; on a GPU set NCCL_ALGO=Ring, CUBLAS_WORKSPACE_CONFIG=:4096:8 and "
        "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 as Megatron-LM does (its CI configs set them)",
    ),
    "--manual-gc-interval": (True, "Python's automatic garbage collection is kept; it changes no result"),
    "--no-check-for-nan-in-loss-and-grad": (
        False,
        "the NaN check stays on: a NaN/inf loss or gradient stops the run naming the iteration and the first "
        "parameter hit (training on NaN weights would waste the run)",
    ),
    "--logging-level": (True, "the log is at INFO here; --verbose (or MEGATRON_MOE_VERBOSE=1) adds debug lines"),
    "--enable-experimental": (False, "no feature here is behind it"),
    "--no-mmap-bin-files": (
        False,
        "the .bin is memory-mapped here (megatron-core's IndexedDataset); the tokens are the same",
    ),
    "--empty-unused-memory-level": (True, "the caching allocator's cache is left alone; it changes no result"),
    "--check-weight-hash-across-dp-replicas-interval": (
        True,
        "not checked here: DP replicas start from one seed and apply the same reduced gradients",
    ),
    "--timing-log-option": (True, _TIMERS),
    "--straggler-minmax-count": (True, "the straggler detector is not built; the comm report names slow ranks"),
    "--te-rng-tracker": (False, "megatron-core's RNG tracker forks the same streams; TE's is needed for CUDA graphs"),
    "--attention-backend": (
        True,
        "the attention kernel follows --transformer-impl: transformer-engine picks its fastest backend (flash "
        "where it can, --use-flash-attn to insist), local runs megatron-core's unfused attention",
    ),
    "--cross-entropy-loss-fusion": (False, "megatron-core's fused cross entropy computes the same loss"),
    "--calculate-per-token-loss": (
        False,
        "every token counts in the loss here (no loss mask), so each micro-batch holds the same number of tokens "
        "and the per-token mean over the global batch is the mean of the micro-batches' means",
    ),
    "--profile": (False, _PROFILE),
    "--profile-ranks": (True, _PROFILE),
    "--profile-step-start": (True, _PROFILE),
    "--profile-step-end": (True, _PROFILE),
    # MoE
    "--moe-shared-expert-overlap": (
        False,
        "our MoE layer always runs the shared expert while the dispatch all-to-all is in flight",
    ),
    "--moe-router-fusion": (False, "transformer-engine's fused router; ours computes the same in fp32 torch ops"),
    "--moe-permute-fusion": (False, "transformer-engine's fused permutation; ours permutes with index ops, same rows"),
    "--moe-use-legacy-grouped-gemm": (
        False,
        "without transformer-engine megatron-core's layer (--moe-layer-impl mcore) uses its legacy GroupedMLP "
        "already; ours has its own grouped GEMM",
    ),
    "--moe-per-layer-logging": (
        False,
        "per-MoE-layer figures (aux and z loss, drops, loads, entropy) always go to TensorBoard here",
    ),
    "--moe-router-padding-for-fp8": (False, "no FP8 expert GEMMs here, so nothing to pad for"),
    "--moe-router-padding-for-quantization": (False, "no FP8/FP4 expert GEMMs here, so nothing to pad for"),
    "--overlap-dispatch-backward-with-experts-wgrad": (
        False,
        "weight gradients are deferred under the backward all-to-alls by --overlap-wgrad here (greedy, the "
        "default where EP > 1)",
    ),
    "--save-tokens-per-expert-interval": (True, _ROUTING_TRACE),
    "--moe-routing-trace-path": (True, _ROUTING_TRACE),
    "--moe-routing-trace-max-training-iters": (True, _ROUTING_TRACE),
    "--moe-routing-trace-capture-logits": (False, _ROUTING_TRACE),
    "--moe-routing-trace-capture-hidden-states": (False, _ROUTING_TRACE),
    "--moe-routing-trace-dump-weights": (False, _ROUTING_TRACE),
    "--moe-pad-experts-for-cuda-graph-inference": (False, "an inference option; this stack trains"),
}
NOT_NEEDED_WITH: dict[str, tuple[tuple[str, ...], str, str]] = {
    # flag -> (values that change nothing here, why, why any other value is refused)
    "--moe-router-dtype": (
        ("fp32",),
        "the router's logits, probabilities and combine weights are fp32 here whatever the model's dtype",
        "only fp32 routing is supported (always on)",
    ),
    "--recompute-method": (
        ("uniform",),
        "--recompute-granularity full recomputes megatron-core's uniform way, one layer at a time",
        "only uniform full recompute is supported (with --recompute-granularity full)",
    ),
    "--muon-scalar-optimizer": (
        ("adam",),
        "with Muon, megatron-core 0.16.1 steps the other parameters (embeddings, output layer, norms, biases) with "
        "its Adam(W)",
        "megatron-core 0.16.1 has no Lion: the parameters Muon does not take get Adam(W) (adam)",
    ),
    "--cross-entropy-fusion-impl": (
        ("native",),
        "megatron-core's cross entropy (native) computes the same loss",
        "transformer-engine's parallel cross entropy is not wired here",
    ),
    "--recompute-num-layers": (
        ("1",),
        "--recompute-granularity full recomputes megatron-core's uniform way, one layer at a time",
        "full recompute goes one layer at a time here; for less recompute name modules with "
        "--recompute-granularity selective --recompute-modules",
    ),
}
REFUSED: dict[str, tuple[bool, str]] = {
    "--use-legacy-models": (False, "this stack builds megatron-core models only; drop --use-legacy-models"),
    "--padded-vocab-size": (
        True,
        "the vocabulary is the tokenizer's, padded by --make-vocab-size-divisible-by; drop it",
    ),
    "--eod-mask-loss": (False, "masking the loss at document ends is not supported yet; drop it"),
    "--reset-position-ids": (False, "resetting position ids at document ends is not supported yet; drop it"),
    "--reset-attention-mask": (False, "per-document attention masks are not supported yet; drop it"),
    # MoE
    "--moe-extended-tp": (False, "deprecated in Megatron-LM too: use --expert-tensor-parallel-size"),
    "--moe-layer-recompute": (
        False,
        "deprecated in Megatron-LM too: name what to recompute with --recompute-granularity selective "
        "--recompute-modules (or --activation-policy arctic), or use --recompute-granularity full",
    ),
    "--moe-use-upcycling": (False, _UPCYCLING),
    "--moe-upcycling-granularity": (True, _UPCYCLING),
    "--moe-input-jitter-eps": (
        True,
        "input jitter is not supported; --moe-gate noisy adds noise to the router's logits instead",
    ),
    "--moe-apply-probs-on-input": (False, "weighting expert inputs by the router's probabilities is not supported yet"),
    **REFUSED_FEATURE_FLAGS,  # the features this stack does not have (megatron_lm_unsupported.py)
    # Multi-token prediction: what Megatron-LM's HEAD adds beyond megatron-core 0.16.1's MTP block
    "--mtp-use-repeated-layer": (False, "one MTP layer applied repeatedly is not in megatron-core 0.16.1; drop it"),
    "--mtp-detach-heads": (
        False,
        "detached MTP heads are not in megatron-core 0.16.1; drop it",
    ),
    "--mtp-standalone": (
        False,
        "a pipeline stage of its own for the MTP layers is not in megatron-core 0.16.1 (they sit on the last "
        "stage); drop it",
    ),
    "--mtp-hsm": (False, "MTP hidden-state mixing is not in megatron-core 0.16.1; drop it"),
    "--mtp-hybrid-override-pattern": (True, "for hybrid (Mamba) models, which this stack does not build; drop it"),
}


TOKENIZER_TYPES_READ_AS: dict[str, tuple[str, str]] = {
    # Megatron-LM's --tokenizer-type -> (ours, what differs)
    "GPTSentencePieceTokenizer": (
        "SentencePieceTokenizer",
        "the same tokenizer: the .model's pieces, eod = its eos, no BOS added",
    ),
    "Llama2Tokenizer": (
        "SentencePieceTokenizer",
        "the same vocabulary and eod, the .model's eos; Megatron-LM's Llama2Tokenizer also prepends BOS when it "
        "tokenizes text, which training does not do: it reads the tokens in --data-path's .bin, or --mock-data's",
    ),
}
"""Megatron-LM's tokenizer types that read a SentencePiece .model, read as ours with one line saying so."""
_NO_TOKENIZER = (
    "give the tokenizer your data was made with: SentencePieceTokenizer (a .model), GPT2BPETokenizer "
    "(--vocab-file, --merge-file) or HuggingFaceTokenizer (a tokenizer.json); with --mock-data any of them sets the "
    "vocabulary"
)
TOKENIZER_TYPES_REFUSED: dict[str, str] = {
    "TikTokenizer": (
        "not supported: its ids are tiktoken's ranks shifted past --tiktoken-num-special-tokens, which no "
        "tokenizer here reproduces; " + _NO_TOKENIZER
    ),
    "BertWordPieceLowerCase": "a BERT tokenizer; this stack trains GPT models: " + _NO_TOKENIZER,
    "BertWordPieceCase": "a BERT tokenizer; this stack trains GPT models: " + _NO_TOKENIZER,
    "MultimodalTokenizer": "multimodal models are not supported; " + _NO_TOKENIZER,
    "NullMultimodalTokenizer": "multimodal models are not supported; " + _NO_TOKENIZER,
    "SFTTokenizer": "fine-tuning data (chat templates) is not supported; " + _NO_TOKENIZER,
    "DeepSeekV2Tokenizer": "not supported; " + _NO_TOKENIZER + " (DeepSeek's own: its tokenizer.json)",
}
"""Megatron-LM's other tokenizer types: refused with the reason (a wrong vocabulary would train a wrong model)."""


def accept_megatron_lm_flags(argv: Sequence[str]) -> tuple[list[str], list[str], list[str]]:
    """(argv with Megatron-LM's flags answered: renamed ones replaced by ours, not-needed ones dropped with their
    values, its SentencePiece tokenizer types read as ours; one note per flag answered; one error per flag
    refused, with its reason)."""
    args, notes = read_as_pretrain_gpt(argv)
    kept, errors = [], []
    i = 0
    while i < len(args):
        flag, inline = args[i].split("=", 1) if "=" in args[i] else (args[i], None)
        takes_value = _takes_value(flag)
        value = inline if inline is not None or not takes_value else (args[i + 1] if i + 1 < len(args) else None)
        step = 2 if takes_value and inline is None else 1
        if flag in REFUSED or refused_prefix(flag) is not None:  # its bare words are its values (a list too)
            errors.append(f"{flag}: {REFUSED[flag][1]}" if flag in REFUSED else refused_prefix(flag))
            step = 1
            while inline is None and (takes_value or flag not in REFUSED) and i + step < len(args):
                if args[i + step].startswith("--"):
                    break
                step += 1
        elif refused_value(flag, value) is not None:
            errors.append(refused_value(flag, value))
        elif flag in RENAMED:
            ours = RENAMED[flag][1]
            kept += [*ours, *([value] if takes_value else [])]
            notes.append(f"{flag}: read as {' '.join(ours)}{' ' + value if takes_value else ''} (same meaning here)")
        elif flag in NOT_NEEDED:
            notes.append(f"{flag}: not needed here ({NOT_NEEDED[flag][1]}); accepted and ignored")
        elif flag in NOT_NEEDED_WITH:
            values, why, otherwise = NOT_NEEDED_WITH[flag]
            if value not in values:
                errors.append(f"{flag}={value}: {otherwise} (accepted: {', '.join(values)})")
            else:
                notes.append(f"{flag} {value}: not needed here ({why}); accepted and ignored")
        elif flag == "--tokenizer-type" and value in TOKENIZER_TYPES_READ_AS:
            ours, differs = TOKENIZER_TYPES_READ_AS[value]
            kept += [flag, ours]
            notes.append(f"{flag} {value}: read as {flag} {ours} ({differs})")
        elif flag == "--tokenizer-type" and value in TOKENIZER_TYPES_REFUSED:
            errors.append(f"{flag}={value}: {TOKENIZER_TYPES_REFUSED[value]}")
        else:
            kept.append(args[i])
            step = 1
        i += step
    return kept, notes, errors


def read_as_pretrain_gpt(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(argv, notes) with what Megatron-LM's pretrain_gpt.py means by flags left out or by a choice our MoE layer
    makes otherwise: no --tokenizer-type with --vocab-file and --merge-file is GPT2BPETokenizer (its default
    there); --moe-token-dispatcher-type allgather or flex in our layer is its all-to-all, which sends the same rows
    to the same experts (`DISPATCHERS_READ_AS_ALLTOALL`; megatron-core's layer, --moe-layer-impl mcore, keeps the
    flag; without --num-experts it is left to say it changes nothing)."""
    args, notes = list(argv), []
    given = {item.split("=", 1)[0] for item in args}
    if (
        "--tokenizer-type" not in given
        and {"--vocab-file", "--merge-file"} <= given
        and "--tokenizer-model" not in given
    ):
        args += ["--tokenizer-type", "GPT2BPETokenizer"]
        notes.append("--vocab-file, --merge-file without --tokenizer-type: GPT2BPETokenizer, pretrain_gpt.py's default")
    keep = _last_value(args, "--moe-layer-impl") == "mcore" or _last_value(args, "--num-experts") in (None, "0")
    dispatcher = _last_value(args, "--moe-token-dispatcher-type")
    if keep or dispatcher not in DISPATCHERS_READ_AS_ALLTOALL:
        return args, notes
    args = _without(args, "--moe-token-dispatcher-type", takes_value=True) + ["--moe-token-dispatcher-type=alltoall"]
    notes.append(
        f"--moe-token-dispatcher-type {dispatcher}: read as alltoall in our MoE layer "
        f"({DISPATCHERS_READ_AS_ALLTOALL[dispatcher]})"
    )
    for flag in FLEX_KERNEL_FLAGS if dispatcher == "flex" else ():
        if _last_value(args, flag) is not None:
            args = _without(args, flag, takes_value=True)
            notes.append(f"{flag}: not needed here (the flex dispatcher's kernels; tokens move by all-to-all)")
    return args, notes


DISPATCHERS_READ_AS_ALLTOALL = {
    "allgather": (
        "the same rows reach the same experts, only the transport differs; --moe-layer-impl mcore runs "
        "megatron-core's allgather"
    ),
    "flex": (
        "flex is megatron-core's dispatcher for DeepEP/HybridEP kernels, which move the same rows to the same "
        "experts; here torch.distributed's all-to-all moves them, overlapped by --overlap-wgrad and "
        "--moe-pipeline-degree"
    ),
}
"""Megatron-LM's dispatchers our MoE layer runs as its all-to-all (the same routing and results)."""
FLEX_KERNEL_FLAGS = ("--moe-flex-dispatcher-backend", "--moe-flex-dispatcher-num-sms")


def _without(args: list[str], flag: str, *, takes_value: bool) -> list[str]:
    """`args` without `flag` (`--flag value` or `--flag=value`, every time it is given)."""
    kept, skip = [], False
    for item in args:
        if skip:
            skip = False
        elif item == flag:
            skip = takes_value
        elif not item.startswith(flag + "="):
            kept.append(item)
    return kept


def _last_value(args: list[str], flag: str) -> str | None:
    """The value `flag` is given last in `args` (`--flag value` or `--flag=value`), or None."""
    value = None
    for item, following in zip(args, [*args[1:], None]):
        value = item.split("=", 1)[1] if item.startswith(flag + "=") else following if item == flag else value
    return value


def _takes_value(flag: str) -> bool:
    for table in (RENAMED, NOT_NEEDED, REFUSED):
        if flag in table:
            return table[flag][0]
    if flag in REFUSED_VALUE_FLAGS:
        return True
    return flag in NOT_NEEDED_WITH or flag == "--tokenizer-type"


def unknown_flag(parser: argparse.ArgumentParser, flag: str) -> str:
    """`unknown flag --x; did you mean --y? (...)` where a flag is close (`close_flags`), else `unknown flag --x`
    with the group whose flags start as it does (`--moe-...`), or --help: one line."""
    flag = flag.split("=", 1)[0]
    if not flag.startswith("-"):
        return f"unexpected argument {flag!r}: flags are --name value (a value without its flag?)"
    groups = {
        option: group.title
        for group in parser._action_groups  # argparse keeps a flag's group only here
        for action in group._group_actions
        for option in action.option_strings
        if option.startswith("--")
    }
    close = close_flags(flag, list(groups))
    if close:
        group = groups[close[0]]
        siblings = [option for option in close if groups[option] == group]
        return f"unknown flag {flag}; did you mean {close[0]}? (similar flags in group {group}: {', '.join(siblings)})"
    prefix = flag.lstrip("-").split("-")[0]
    near = [group for option, group in groups.items() if option.lstrip("-").split("-")[0] == prefix]
    if len(prefix) > 1 and near:
        group = max(set(near), key=near.count)
        return f"unknown flag {flag} (none is close; flags starting --{prefix}- are in group {group}: see --help)"
    return f"unknown flag {flag} (--help lists every flag by group)"


def close_flags(flag: str, known: Sequence[str], most: int = 3) -> list[str]:
    """Up to `most` of `known` that `flag` is a typo of: at most one edit per six letters (a letter missing,
    extra, changed or two swapped), or the same words with one word more or fewer; the fewest edits first, then
    those sharing its first word (a word more or fewer only after the same first word)."""
    name, words = flag.lstrip("-"), flag.lstrip("-").split("-")
    ranked = []
    for option in known:
        other = option.lstrip("-")
        edits = typo_distance(name, other, limit=max(1, len(name) // 6))
        other_words = other.split("-")
        one_word = abs(len(words) - len(other_words)) == 1 and min(len(words), len(other_words)) >= 2
        one_word = one_word and words[0] == other_words[0]  # --mtp-num-layers is no typo of --num-layers
        shorter, longer = sorted((words, other_words), key=len)
        if edits is None and one_word and any(longer[:i] + longer[i + 1 :] == shorter for i in range(len(longer))):
            edits = len(name) // 6 + 1
        if edits is not None:
            ranked.append((edits, other_words[0] != words[0], option))
    return [option for *_, option in sorted(ranked)[:most]]


def typo_distance(a: str, b: str, limit: int) -> int | None:
    """Edits (insert, delete, change, swap two neighbours) from `a` to `b`, or None above `limit`."""
    if abs(len(a) - len(b)) > limit:
        return None
    previous, row = None, list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        before, row = row, [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            row[j] = min(before[j] + 1, row[j - 1] + 1, before[j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                row[j] = min(row[j], previous[j - 2] + 1)
        previous = before
        if min(row) > limit:
            return None
    return row[-1] if row[-1] <= limit else None


def status_of(flag: str, ours: set[str]) -> str | None:
    """How this stack answers Megatron-LM's `flag` (`ours`: our parser's flags), as docs/flags.md lists it: `same`,
    `read as ...`, `not needed: ...`, `not needed with ...`, `refused: ...`; None for a flag nobody answers."""
    if flag in ours:
        return "same"
    if flag in FLEX_KERNEL_FLAGS:
        return (
            "with `--moe-token-dispatcher-type flex` in our layer: not needed (flex is read as our all-to-all, a "
            "line says so); with megatron-core's layer refused: the flex dispatcher (DeepEP, HybridEP) is not "
            "supported here"
        )
    if flag in RENAMED:
        return f"read as {' '.join(RENAMED[flag][1])}"
    if flag in NOT_NEEDED:
        return f"not needed: {NOT_NEEDED[flag][1]}"
    if flag in NOT_NEEDED_WITH:
        values, why, otherwise = NOT_NEEDED_WITH[flag]
        return f"not needed with {', '.join(values)}: {why}; other values refused ({otherwise})"
    if flag in REFUSED:
        return f"refused: {REFUSED[flag][1]}"
    refusal = refused_prefix(flag)
    return None if refusal is None else "refused: " + refusal.split(": ", 1)[1]
