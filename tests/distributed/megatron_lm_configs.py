"""Megatron-LM's MoE functional-test configs (tests/data/megatron_lm_moe_configs) as launch flags: as its CI
launches them (`argv_of`, on `world_of` ranks) and shrunk for 2 CPU steps (`cpu_argv`, degrees as written)."""

from __future__ import annotations

import pathlib
import re

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "tests/data/megatron_lm_moe_configs").glob("*.yaml"))
CPU_RUNS = (
    "gpt3_mcore_te_tp1_pp2_resume_torch_dist_reshard_2x1x4_te_8experts2parallel_dist_optimizer_1node",
    "gpt3_mcore_te_tp2_pp1_resume_torch_dist_te_8experts2parallel_dist_optimizer_1node",
    "gpt3_mcore_te_tp2_pp1_resume_torch_dist_te_8experts2parallel_multi_dist_optimizer_instances_1node",
    "gpt3_mcore_te_tp2_pp1_te_8experts2parallel_ddp_average_in_collective_1node",
    "gpt3_mcore_te_tp2_pp1_te_8experts2parallel_overlap_grad_reduce_param_gather_groupedGEMM_1node",
    "gpt3_mcore_te_tp2_pp1_te_a2a_ovlp_8experts_etp1_ep4_1node",  # --overlap-moe-expert-parallel-comm
    "gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_muon_1node",
    "gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_muon_param_layout_1node",
    "gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_optimizer_1node",
    "gpt3_moe_mcore_te_ep8_resume_torch_dist_muon_1node",
    "gpt3_moe_mcore_te_tp4_ep2_etp2_pp2_resume_torch_dist_dist_optimizer_1node",
)
"""Every config that passes the flag pass on the 4 ranks its CI ran (the `_1node` ones; none needs a GPU-only
feature): the shared 4-rank job trains each 2 steps. The 29 that pass on 8 ranks are not run (10 of them are
these configs' twins at twice the degrees)."""
CPU_SIZES = {
    "--num-layers": 2, "--hidden-size": 64, "--num-attention-heads": 4, "--seq-length": 64,
    "--max-position-embeddings": 64, "--ffn-hidden-size": 128, "--moe-ffn-hidden-size": 64, "--micro-batch-size": 1,
    "--global-batch-size": 8, "--train-iters": 2, "--eval-iters": 1, "--eval-interval": 1000,
}  # fmt: skip
"""Sizes shrunk for a CPU (each replaces the config's value where it has one)."""
NOT_ON_CPU = {
    "--transformer-impl": "local",  # transformer-engine runs on GPUs only
    "--bf16": False,  # torch's CPU bf16 GEMMs are slow; fp32
    "--exit-interval": None, "--exit-duration-in-mins": None, "--save-interval": None,
}  # fmt: skip
PATHS = {"--data-path", "--vocab-file", "--merge-file", "--save", "--load", "--tensorboard-dir", "--data-cache-path"}
MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256"]


def model_args(name: str) -> dict:
    return yaml.safe_load((ROOT / f"tests/data/megatron_lm_moe_configs/{name}.yaml").read_text())["MODEL_ARGS"]


def argv_of(args: dict) -> list[str]:
    """MODEL_ARGS as Megatron-LM's CI launches them: `true` a bare flag, `false` left out, a list its words;
    `${DATA_PATH}`-style paths replaced (no file is read: the flag pass without the data check)."""
    argv = []
    for flag, value in args.items():
        if value is True or value is False:
            argv += [flag] if value else []
            continue
        words = " ".join(map(str, value)) if isinstance(value, list) else str(value)
        words = re.sub(r"\$\{[A-Z_]+\}", "/data", words)
        argv += [flag, *(words[1:-1].split() if words.startswith("[") and words.endswith("]") else [words])]
    return argv


def world_of(name: str) -> int:
    """The GPUs its CI ran on: Megatron-LM's moe recipes (tests/test_utils/recipes) give one node of 8 (h100) or
    two GB200 nodes of 4, the `_1node` cases one GB200 node of 4."""
    return 4 if name.endswith("_1node") else 8


def cpu_argv(name: str) -> list[str]:
    """The config's flags for 2 CPU steps: its degrees and its other flags as written, sizes `CPU_SIZES`, the
    GPU-only kernels off (`NOT_ON_CPU`), mock data with Megatron-LM's NullTokenizer for its data and paths."""
    args = {flag: value for flag, value in model_args(name).items() if flag not in PATHS and flag != "--split"}
    args |= {flag: size for flag, size in CPU_SIZES.items() if flag in args or flag == "--train-iters"}
    layer_wise = args.get("--optimizer") == "muon" and args.get("--use-distributed-optimizer")
    args |= NOT_ON_CPU | ({"--bf16": True} if layer_wise else {})  # megatron-core 0.16.1 saves its state in bf16 only
    return [*argv_of({flag: value for flag, value in args.items() if value is not None}), *MOCK]
