"""The kernels a run's flags need and whether the machine has them: the checks the first pass makes with a cheap
probe, and the model builder makes again with the platform's own answers (the same lines).

In: a `RunConfig` and a `Kernels` (a GPU, transformer-engine, the grouped_gemm package). Out: `kernel_errors`
(one line per flag that needs a kernel the machine lacks, naming the flag, its value and what to use instead),
`uses_transformer_engine` (whether transformer-engine's modules are built), `cpu_stand_ins` (the lines for the GPU
kernels a CPU run replaces with the same arithmetic). `probe_kernels()` reads no module
and imports nothing heavy (no torch): a GPU device node, and whether the packages are installed.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_moe.config import RunConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class Kernels:
    """What the machine offers that a flag can need."""

    gpu: bool
    transformer_engine: bool
    """transformer_engine is installed (it runs only on a GPU)."""
    grouped_gemm: bool
    """the grouped_gemm package megatron-core's legacy GroupedMLP runs on."""


def probe_kernels() -> Kernels:
    """The first pass's answers, without importing torch: an NVIDIA device node that CUDA_VISIBLE_DEVICES does not
    hide, and the packages' import specs."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1")
    return Kernels(
        gpu=not hidden and bool(glob.glob("/dev/nvidia[0-9]*")),
        transformer_engine=importlib.util.find_spec("transformer_engine") is not None,
        grouped_gemm=importlib.util.find_spec("grouped_gemm") is not None,
    )


def uses_transformer_engine(cfg: RunConfig, kernels: Kernels) -> bool:
    """--transformer-impl as given, else transformer-engine where it is installed on a GPU; never without a GPU
    (a GPU script's CPU run builds megatron-core's local modules: `cpu_stand_ins`)."""
    impl = cfg.model.transformer_impl
    if not kernels.gpu:
        return False
    return kernels.transformer_engine if impl is None else impl == "transformer_engine"


def cpu_stand_ins(cfg: RunConfig, kernels: Kernels) -> list[str]:
    """One start-up line per GPU kernel the flags ask for that a machine without a GPU runs otherwise, with the
    same arithmetic: transformer-engine's modules (megatron-core's local ones: the same parameters under the same
    checkpoint keys) and its flash attention (megatron-core's local attention). On a GPU they are asked for, not
    stood in for: `kernel_errors` refuses a missing one."""
    if kernels.gpu:
        return []
    lines = []
    if cfg.model.transformer_impl == "transformer_engine":
        lines.append(
            "--transformer-impl transformer_engine: no GPU here, so megatron-core's local modules run this CPU run "
            "(the same model under the same checkpoint keys; on a GPU it needs the transformer_engine package)"
        )
    if cfg.model.use_flash_attn:
        lines.append(
            "--use-flash-attn: no GPU here, so megatron-core's local attention runs this CPU run (the same "
            "attention, unfused; on a GPU it needs transformer-engine)"
        )
    return lines


def kernel_errors(cfg: RunConfig, kernels: Kernels) -> list[str]:
    """One line per flag whose kernel this machine lacks (empty: every kernel the flags need is here)."""
    te_here = kernels.gpu and kernels.transformer_engine
    machine = "no GPU" if not kernels.gpu else "no transformer_engine"
    te = uses_transformer_engine(cfg, kernels)
    errors = []
    if cfg.model.transformer_impl == "transformer_engine" and not te_here and kernels.gpu:
        errors.append(
            f"--transformer-impl=transformer_engine: needs the transformer_engine package on a GPU (this machine "
            f"has {machine}); use --transformer-impl local"
        )
    if cfg.model.use_flash_attn and not (te and te_here) and kernels.gpu:
        errors.append(
            "--use-flash-attn: flash attention is transformer-engine's backend here (megatron-core's local "
            "attention has no flash kernel); use it on a GPU with transformer-engine, or drop --use-flash-attn"
        )
    cp = cfg.parallel.context_parallel_size
    if cp > 1 and not (te and te_here):
        errors.append(
            f"--context-parallel-size={cp} needs transformer-engine's attention on a GPU (megatron-core's local "
            f"attention has no context parallelism); install the gpu extra on a GPU machine, or use "
            f"--context-parallel-size 1"
        )
    moe = cfg.moe
    if moe.is_moe and not moe.own_layer and moe.moe_grouped_gemm and not (te and te_here) and not kernels.grouped_gemm:
        errors.append(
            "--moe-grouped-gemm: megatron-core's layer (--moe-layer-impl mcore) runs grouped GEMMs with "
            "transformer-engine on a GPU or with the grouped_gemm package, and this machine has neither; drop it "
            "(our layer, --moe-layer-impl megatron_moe, has its own grouped GEMM)"
        )
    return errors
