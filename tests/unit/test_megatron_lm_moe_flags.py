"""docs/flags.md lists every Megatron-LM MoE flag (HEAD's, vendored: tests/data/megatron_lm_flags.txt) with how
this stack answers it, and the list says what the code does."""

import pathlib

from megatron_moe.config import build_parser
from megatron_moe.config.megatron_lm import status_of

ROOT = pathlib.Path(__file__).resolve().parents[2]
MOE_RELEVANT = {
    "--num-experts", "--expert-model-parallel-size", "--expert-tensor-parallel-size",
    "--expert-tensor-parallel-num-weight-shards", "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute",
    "--overlap-dispatch-backward-with-experts-wgrad", "--use-grouped-gemm-for-shared-expert",
    "--save-tokens-per-expert-interval",
}  # fmt: skip
"""Megatron-LM's MoE flags beyond `--moe-*` and `--mtp-*` (expert parallelism, the MoE overlaps)."""


def megatron_lm_moe_flags() -> list[str]:
    lines = (ROOT / "tests/data/megatron_lm_flags.txt").read_text().splitlines()
    flags = [line for line in lines if line.startswith("--")]
    return [flag for flag in flags if flag.startswith(("--moe-", "--mtp-")) or flag in MOE_RELEVANT]


def docs_moe_list() -> dict[str, str]:
    text = (ROOT / "docs/flags.md").read_text()
    table = text[text.index("## Megatron-LM's MoE flags") :].split("\n## ")[0]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| `--")]
    return {row[0].strip("| `"): row[1].rstrip(" |") for row in rows}


def test_the_vendored_flag_list_is_megatron_lms():
    flags = megatron_lm_moe_flags()
    assert len(flags) == 82 and "--moe-router-topk" in flags and "--mtp-num-layers" in flags


def test_docs_list_every_megatron_lm_moe_flag_with_what_the_code_does():
    ours = set(build_parser()._option_string_actions)
    listed = docs_moe_list()
    assert list(listed) == megatron_lm_moe_flags()
    for flag, status in listed.items():
        expected = status_of(flag, ours)
        assert expected is not None and status == expected, (flag, status, expected)


def test_no_flag_of_ours_is_answered_as_a_megatron_lm_habit():
    """The tables answer flags before parsing: one that named a flag of ours (or a refused family its prefix)
    would shadow it."""
    from megatron_moe.config.megatron_lm import NOT_NEEDED, NOT_NEEDED_WITH, REFUSED, RENAMED
    from megatron_moe.config.megatron_lm_unsupported import refused_prefix

    ours = set(build_parser()._option_string_actions)
    tables = set(RENAMED) | set(NOT_NEEDED) | set(NOT_NEEDED_WITH) | set(REFUSED)
    assert not [flag for flag in ours if flag in tables or refused_prefix(flag)]
