"""Megatron-LM's 52 MoE functional-test training configs (vendored: tests/data/megatron_lm_moe_configs/SOURCE)
through our flag pass as written, only the data and tokenizer paths replaced, on the world size their CI ran:
each passes, or is refused only by flags of features docs/flags.md lists as not supported here."""

import pathlib
import re
from collections.abc import Sequence

import pytest
import yaml

from megatron_moe.config import ConfigError, ConfigErrors, parse_and_validate
from megatron_moe.config.kernels import Kernels
from megatron_moe.config.megatron_lm_unsupported import unsupported_flags
from tests.distributed.megatron_lm_configs import CONFIGS, CPU_RUNS, ROOT, argv_of, cpu_argv, model_args, world_of

PASSING = 40
"""Configs that pass the flag pass as written (the issue's target was 40: the rest need Megatron-FSDP, FP8,
offloading, CUDA graphs or the TE op fuser)."""
CONSEQUENCES = {
    # a refused flag -> the errors that follow from setting it aside (Megatron-LM reads them with it)
    "--pipeline-model-parallel-layout": {"--pipeline-model-parallel-size"},  # uneven stages: PP need not divide
}
MEGATRON_LM_REFUSES_TOO = {
    "gpt_grpo_tp8tp4_pp1_ep8ep2_dp8_throughputtest": {"--min-lr"},  # megatron-core's scheduler asserts min <= max
}


CI_KERNELS = Kernels(gpu=True, transformer_engine=True, grouped_gemm=True)
"""Megatron-LM's CI containers: GPUs, transformer-engine and grouped_gemm (the kernel checks run as there)."""


def refusals(path: pathlib.Path, extra: Sequence[str] = ()) -> list[str]:
    written = yaml.safe_load(path.read_text())["MODEL_ARGS"]
    try:
        parse_and_validate([*argv_of(written), *map(str, extra)], world_of(path.stem), kernels=CI_KERNELS)
    except ConfigErrors as error:
        return list(error.errors)
    except ConfigError as error:
        return [str(error)]
    return []


def flag_of(line: str) -> tuple[str, str | None]:
    """(the flag an error line refuses, its value where the line names one)."""
    named = re.match(r"(?:unknown flag |argument )?(--[a-z0-9-_]+)(?:=(\S+?):|:| )", line)
    assert named, line
    value = named.group(2) or (re.search(r"invalid choice: '([^']+)'", line) or [None, None])[1]
    return named.group(1), value


def not_supported_in_docs() -> set[str]:
    """The flags (`--x`, `--x=value`, `--prefix-*`) docs/flags.md's "Not supported here" table names."""
    text = (ROOT / "docs/flags.md").read_text()
    table = text[text.index("## Not supported here") :].split("\n## ")[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| feature")]
    return {flag for row in rows for flag in re.findall(r"`(--[a-z0-9-_]+(?:=[a-z0-9_]+|\*)?)`", row.split("|")[2])}


def test_docs_list_the_features_refused_by_name_both_ways():
    assert not_supported_in_docs() == unsupported_flags()


def test_each_config_passes_or_is_refused_only_for_a_feature_not_supported_here():
    listed = not_supported_in_docs() | {"--tokenizer-type=TikTokenizer"}  # refused with the tokenizers to use
    passing, report = [], {}
    for path in CONFIGS:
        lines = refusals(path)
        if not lines:
            passing.append(path.stem)
            continue
        following = set().union(*(CONSEQUENCES.get(flag_of(line)[0], set()) for line in lines))
        for line in lines:
            flag, value = flag_of(line)
            if flag in following:
                continue
            allowed = {flag, f"{flag}={value}"} & listed
            allowed = allowed or any(flag.startswith(p[:-1]) for p in listed if p.endswith("*"))
            assert allowed or flag in MEGATRON_LM_REFUSES_TOO.get(path.stem, ()), (path.stem, line)
        report[path.stem] = sorted({flag_of(line)[0] for line in lines})
    assert len(CONFIGS) == 52
    assert len(passing) == PASSING, (passing, report)


@pytest.mark.parametrize(
    ("line", "flag"),
    [
        ("unknown flag --mscale (--help lists every flag by group)", ("--mscale", None)),
        ("argument --moe-router-dtype: invalid choice: 'fp8' (choose", ("--moe-router-dtype", "fp8")),
        ("--optimizer=sgd: optimizers other than Adam and Muon", ("--optimizer", "sgd")),
        ("--use-megatron-fsdp: Megatron-FSDP", ("--use-megatron-fsdp", None)),
    ],
)  # fmt: skip
def test_flag_of_reads_each_kind_of_refusal(line, flag):
    assert flag_of(line) == flag


def test_the_cpu_runs_keep_their_degrees_and_pass_the_first_pass_shrunk():
    """The shared 4-rank job trains these 2 steps (tests/distributed/test_megatron_lm_flags.py): every config that
    passes on 4 ranks as written."""
    assert set(CPU_RUNS) == {path.stem for path in CONFIGS if world_of(path.stem) == 4 and not refusals(path)}
    degrees = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--expert-model-parallel-size")
    for name in CPU_RUNS:
        assert world_of(name) == 4 and not refusals(ROOT / f"tests/data/megatron_lm_moe_configs/{name}.yaml"), name
        cfg = parse_and_validate(
            cpu_argv(name), 4, kernels=Kernels(gpu=False, transformer_engine=False, grouped_gemm=False)
        )
        p, written = cfg.parallel, model_args(name)
        ours = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size)
        assert ours == tuple(int(written.get(flag, 1)) for flag in degrees), name
        assert cfg.training.train_iters == 2 and cfg.data.mock_data and cfg.model.hidden_size == 64
