"""Device and backend selection, memory figures and optional-kernel discovery."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import platform as pyplatform
import resource
import time
from collections.abc import Callable

import psutil
import torch


@dataclasses.dataclass(frozen=True)
class Platform:
    """Where this process computes and how it talks to its peers."""

    device: torch.device
    """`cuda:<local rank>` on a GPU machine, else `cpu`."""
    backend: str
    """torch.distributed backend: `nccl` with CUDA, else `gloo`."""

    @property
    def is_accelerator(self) -> bool:
        return self.device.type != "cpu"

    @property
    def pin_memory(self) -> bool:
        """Data loader batches in page-locked host memory: on an accelerator the batch's copy to the device then
        leaves without waiting for queued device work (`non_blocking`); on CPU there is no copy to speed up."""
        return self.is_accelerator

    @property
    def expert_chunk_bytes(self) -> int | None:
        """Largest [rows, F] activation of one run of experts in `GroupedMLP`; None = one run, 0 = one per expert.

        A GPU runs one grouped GEMM over all experts; on CPU every expert is its own run, which measured faster
        (docs/kernels.md says why, with the figures).
        """
        return None if self.is_accelerator else 0


def _has_cuda() -> bool:
    return torch.cuda.is_available() and os.environ.get("MEGATRON_MOE_FORCE_CPU", "0") != "1"


def current_platform() -> Platform:
    """The platform this process runs on (no side effects)."""
    if _has_cuda():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return Platform(device=torch.device("cuda", local_rank), backend="nccl")
    return Platform(device=torch.device("cpu"), backend="gloo")


def init_platform() -> Platform:
    """Select the device; on a CPU-only machine make megatron-core runnable and keep freed host memory.

    Idempotent: the CPU patches are applied once per process.
    """
    from megatron_moe.platform import upstream_fixes

    platform = current_platform()
    upstream_fixes.apply_all()
    bind_thread()
    if not platform.is_accelerator:
        from megatron_moe.platform import cpu_compat
        from megatron_moe.platform.host_memory import keep_freed_host_memory

        cpu_compat.apply_all()
        keep_freed_host_memory()
    return platform


def bind_thread() -> None:
    """The calling thread computes on this process's device (CUDA's current device is per thread); nothing on CPU."""
    platform = current_platform()
    if platform.is_accelerator:
        torch.cuda.set_device(platform.device)


def from_host(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a tensor on `device`. On an accelerator the copy leaves from pinned memory and does not
    wait for the device (a copy from pageable memory would wait for all queued work first)."""
    t = torch.tensor(values, dtype=dtype)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


def synchronize() -> None:
    """Wait for queued device work (timing); CPU work is already synchronous."""
    if current_platform().is_accelerator:
        torch.cuda.synchronize()


def memory_in_use_bytes() -> int:
    """Device memory allocated by tensors on GPU; resident set size on CPU."""
    if current_platform().is_accelerator:
        return torch.cuda.memory_allocated()
    return psutil.Process().memory_info().rss


def peak_memory_bytes() -> int:
    """Peak device memory allocated on GPU; peak resident set size on CPU."""
    if current_platform().is_accelerator:
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def kernels_in_use() -> dict[str, str]:
    """Which optional fused-kernel packages this process can use (for the startup log)."""
    accel = current_platform().is_accelerator

    def state(module: str) -> str:
        if importlib.util.find_spec(module) is None:
            return "not installed"
        return "in use" if accel else "installed, unused on CPU"

    return {
        "transformer_engine": state("transformer_engine"),
        "apex": state("apex"),
        "grouped_gemm": state("grouped_gemm"),
        "attention": "torch SDPA-free megatron-core DotProductAttention",
        "norm": "megatron_moe torch LayerNorm/RMSNorm (sequence-parallel aware)",
    }


PEAK_TFLOPS = {  # dense bf16/fp16 tensor-core peak per device, TFLOP/s (vendors' data sheets, no sparsity)
    "H200": 989.0,
    "H100 SXM": 989.0,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10": 125.0,
}


def device_name() -> str:
    """The accelerator's product name (e.g. "NVIDIA H100 80GB HBM3"), else the CPU's model name from
    /proc/cpuinfo (the processor type where that is missing): part of the cost profile's fingerprint."""
    if current_platform().is_accelerator:
        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as stream:
            for line in stream:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return pyplatform.processor() or pyplatform.machine() or "cpu"


GEMM_PROBES = 5
"""Timed GEMMs of the rate probe, after one untimed warm-up: the best one counts. A probe that shares its cores
with another process's start-up reads slow; the best of several seldom does (`PeakRate.remeasure` covers the
rest: training/flops.py `Mfu`)."""


@dataclasses.dataclass
class PeakRate:
    """The denominator of MFU: a device's FLOP/s and what that figure is."""

    flops_per_s: float
    what: str
    """"H100 SXM peak", "measured GEMM rate": the log names it."""
    remeasure: Callable[[], float] | None = None
    """Measures the rate again (a measured rate); None: a data-sheet figure, nothing to re-measure."""


def measure_gemm_rate(probes: int = GEMM_PROBES, n: int = 1024) -> float:
    """This device's fp32 GEMM rate, FLOP/s: an n^3 matmul, the best of `probes` after a warm-up."""
    a = torch.full((n, n), 0.5, device=current_platform().device)  # no random numbers: the RNG streams stay as they are
    best = float("inf")
    for probe in range(probes + 1):
        synchronize()
        started = time.perf_counter()
        a @ a
        synchronize()
        if probe > 0:  # the first one pays for the kernel's and the pages' first use
            best = min(best, time.perf_counter() - started)
    return 2 * n**3 / best


def peak_flops_per_s(dtype: torch.dtype) -> PeakRate:
    """The denominator of MFU and what it is: a known GPU's data-sheet peak for 16-bit (fp32 runs are held to
    it too, as Megatron-LM's MFU is), else this device's measured fp32 GEMM rate (`measure_gemm_rate`), which is
    what a CPU can reach, stated as such, and measured again when a run goes faster."""
    if current_platform().is_accelerator:
        name = torch.cuda.get_device_name()
        for model, tflops in PEAK_TFLOPS.items():
            if model in name:
                return PeakRate(tflops * 1e12, f"{name} peak")
    return PeakRate(measure_gemm_rate(), "measured GEMM rate", remeasure=measure_gemm_rate)
