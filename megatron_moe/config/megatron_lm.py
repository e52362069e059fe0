"""Megatron-LM flags that have no meaning here, and the one-line answer to a flag nobody defines.

In: a Megatron-LM launch script's argv; out, before parsing, one answer per flag this stack names otherwise or
does not need: `RENAMED` (read as our flags, one line says which), `NOT_NEEDED` (accepted, one line why),
`NOT_NEEDED_WITH` (accepted for the values that change nothing), `REFUSED` (with the reason), Megatron-LM's
tokenizer types (`TOKENIZER_TYPES_READ_AS`). An unknown flag gets the closest flags and their group
(`unknown_flag`). Invariant: no flag is silently ignored. The mapping table: docs/flags.md.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence

_TIMERS = (
    "the timers always go to TensorBoard here (iteration time; exposed and total communication per kind and per MoE "
    "layer)"
)
_DEEPEP = (
    "DeepEP's dispatch kernels are not supported: tokens move by torch.distributed all-to-all "
    "(--moe-token-dispatcher-type alltoall), overlapped by --overlap-wgrad and --moe-pipeline-degree"
)
_UPCYCLING = "upcycling a dense checkpoint into MoE is not supported yet; drop it"

RENAMED: dict[str, tuple[bool, tuple[str, ...]]] = {
    # flag -> (takes a value, our flags that mean the same; its value, if any, follows them)
    "--moe-shared-expert-intermediate-size": (True, ("--moe-shared-expert-ffn-hidden-size",)),
    "--use-rotary-position-embeddings": (False, ("--position-embedding-type", "rope")),
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
    "--moe-pad-experts-for-cuda-graph-inference": (False, "an inference option; this stack trains"),
    "--delay-wgrad-compute": (
        False,
        "weight gradients are deferred under the backward all-to-alls by --overlap-wgrad here (greedy, the "
        "default where EP > 1)",
    ),
}
NOT_NEEDED_WITH: dict[str, tuple[tuple[str, ...], str, str]] = {
    # flag -> (values that change nothing here, why, why any other value is refused)
    "--moe-router-dtype": (
        ("fp32",),
        "the router's logits, probabilities and combine weights are fp32 here whatever the model's dtype",
        "only fp32 routing is supported (always on)",
    ),
    "--rotary-percent": (("1.0", "1"), "RoPE covers the whole head here", "partial rotary is not supported yet"),
    "--recompute-method": (
        ("uniform",),
        "--recompute-granularity full recomputes megatron-core's uniform way, one layer at a time",
        "only uniform full recompute is supported (with --recompute-granularity full)",
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
    "--vocab-size": (True, "the vocabulary is the tokenizer's, padded by --make-vocab-size-divisible-by; drop it"),
    "--padded-vocab-size": (
        True,
        "the vocabulary is the tokenizer's, padded by --make-vocab-size-divisible-by; drop it",
    ),
    "--kv-channels": (
        True,
        "an attention head is --hidden-size / --num-attention-heads wide here; drop it (set those two instead)",
    ),
    "--qk-layernorm": (False, "query/key layer norm is not supported yet; drop it"),
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
    "--moe-enable-deepep": (False, _DEEPEP),
    "--moe-deepep-num-sms": (True, _DEEPEP),
    "--overlap-moe-expert-parallel-comm": (
        False,
        "overlap between two micro-batches is not supported; here the all-to-alls are hidden inside each "
        "micro-batch by --overlap-wgrad and --moe-pipeline-degree (both on by default where EP > 1)",
    ),
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
    "NullTokenizer": "not supported (ids typed as numbers, the vocabulary from --vocab-size); " + _NO_TOKENIZER,
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
    kept, notes, errors = [], [], []
    args = list(argv)
    i = 0
    while i < len(args):
        flag, inline = args[i].split("=", 1) if "=" in args[i] else (args[i], None)
        takes_value = _takes_value(flag)
        value = inline if inline is not None or not takes_value else (args[i + 1] if i + 1 < len(args) else None)
        step = 2 if takes_value and inline is None else 1
        if flag in REFUSED:
            errors.append(f"{flag}: {REFUSED[flag][1]}")
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


def _takes_value(flag: str) -> bool:
    for table in (RENAMED, NOT_NEEDED, REFUSED):
        if flag in table:
            return table[flag][0]
    return flag in NOT_NEEDED_WITH or flag == "--tokenizer-type"


def unknown_flag(parser: argparse.ArgumentParser, flag: str) -> str:
    """`unknown flag --x; did you mean --y? (flags of group G: --y, --z)`: one line."""
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
    close = difflib.get_close_matches(flag, list(groups), n=3, cutoff=0.6)
    if not close:
        return f"unknown flag {flag} (--help lists every flag by group)"
    group = groups[close[0]]
    siblings = [option for option in close if groups[option] == group]
    return f"unknown flag {flag}; did you mean {close[0]}? (similar flags in group {group}: {', '.join(siblings)})"
