"""Megatron-LM flags that have no meaning here, and the one-line answer to a flag nobody defines.

A Megatron-LM user's launch script carries flags this stack does not need: each is accepted with one line
saying why it changes nothing (`NOT_NEEDED`), or refused with the reason where running on would mislead
(`REFUSED`); none is silently ignored. A flag that is neither ours nor Megatron-LM's gets one line naming the
closest flags and the group they live in (`unknown_flag`), not argparse's usage dump.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence

from megatron_moe.config.fields import ConfigError

_FUSIONS = (
    "megatron-core's fused kernels are off in this stack's layer config (bias-GELU/SwiGLU, bias-dropout, masked "
    "softmax, RoPE and gradient-accumulation fusion), so there is nothing to turn off"
)
NOT_NEEDED: dict[str, tuple[bool, str]] = {
    # flag -> (takes a value, why it changes nothing here)
    "--use-mcore-models": (False, "the model is always megatron-core's GPTModel here"),
    "--no-masked-softmax-fusion": (False, _FUSIONS),
    "--no-bias-gelu-fusion": (False, _FUSIONS),
    "--no-bias-swiglu-fusion": (False, _FUSIONS),
    "--no-bias-dropout-fusion": (False, _FUSIONS),
    "--no-rope-fusion": (False, _FUSIONS),
    "--no-gradient-accumulation-fusion": (False, _FUSIONS),
    "--no-async-tensor-model-parallel-allreduce": (
        False,
        "megatron-core's linear layers overlap the TP all-reduce of the input gradient by themselves",
    ),
    "--distributed-backend": (True, "the platform layer picks it: nccl on a GPU, gloo on CPU"),
    "--use-torch-optimizer-for-cpu-offload": (False, "the optimizer is megatron-core's, on the device"),
    "--log-timers-to-tensorboard": (
        False,
        "the timers always go to TensorBoard here (iteration time; exposed and total communication per kind and "
        "per MoE layer)",
    ),
}
REFUSED: dict[str, tuple[bool, str]] = {
    "--vocab-file": (True, "the GPT-2 BPE tokenizer is not supported yet: a SentencePiece --tokenizer-model only"),
    "--merge-file": (True, "the GPT-2 BPE tokenizer is not supported yet: a SentencePiece --tokenizer-model only"),
    "--use-legacy-models": (False, "this stack builds megatron-core models only; drop --use-legacy-models"),
}


def accept_megatron_lm_flags(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(argv without the `NOT_NEEDED` flags and their values, one note per flag removed); a `REFUSED` flag
    raises ConfigError with its reason."""
    kept, notes = [], []
    args = list(argv)
    i = 0
    while i < len(args):
        flag, has_inline_value = args[i].split("=", 1)[0], "=" in args[i]
        if flag in REFUSED:
            raise ConfigError(f"{flag}: {REFUSED[flag][1]}")
        if flag in NOT_NEEDED:
            takes_value, why = NOT_NEEDED[flag]
            notes.append(f"{flag}: not needed here ({why}); accepted and ignored")
            i += 2 if takes_value and not has_inline_value else 1
            continue
        kept.append(args[i])
        i += 1
    return kept, notes


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
