"""Micro-benchmarks that fit the cost model's lines (`megatron_moe.overlap.cost_model`) on the running cluster.

FSMoE section 6.2 ("performance model"): each collective at several message sizes and torch.matmul at several
shapes, t = alpha + n * beta fitted by least squares. Here, per kind:
- "a2a": all_to_all_single over the EP group, n = bytes each rank sends;
- "ag" / "rs": the ESP group's all-gather (n = bytes of the output) and reduce-scatter (n = bytes of the input),
  timed in their gloo form (`comm.profiling.esp_traffic`: one all_to_all_single of those bytes, plus the local
  sum of the reduce-scatter; on NCCL not yet the native collectives the layer uses for equal blocks);
- "ar": all_reduce over the data-parallel group (the gradient all-reduce), n = bytes reduced;
- "gemm": torch.matmul of [M, K] x [K, N], n = M * N * K multiply-adds.
A kind whose group has one rank (no EP, no ESP, no DP) is not measured: its fit is 0 (the model never uses it).

Each call runs between world barriers with the device synchronized before and after, timed on the host clock;
one warm-up call per size, then `repeats` timed calls, reduced per size by the median (or `usual_mode`:
tools/bench_link.py's estimator of gloo's usual, half-rate mode, restated here); every rank's figure goes into
one fixed-shape table whose MAX over the world (`comm.profiling.agree_profile`) every rank fits, so all ranks
hold the same lines. `load_or_measure` reuses a saved profile (JSON, `ClusterFits.save`) whose cluster
description (world size, group sizes, host names, backend, device, link, the settings) equals this run's, on
every rank or on none (agreed), else measures and rank 0 saves it; fits, R^2 and points are logged.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_moe.comm.core import group_size
from megatron_moe.comm.profiling import (
    agree_profile,
    esp_traffic,
    gather_host_names,
    profile_all_reduce,
    profile_all_to_all,
    profile_barrier,
)
from megatron_moe.config.fields import require
from megatron_moe.overlap.cost_model import FIT_KINDS, ClusterFits, LayerSizes, LinearFit, fit_linear
from megatron_moe.platform import current_platform, synchronize

log = logging.getLogger(__name__)

STATISTICS = ("median", "usual_mode")
KIB = 1 << 10


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfileSettings:
    """What the micro-benchmarks measure (small enough for CPU CI by default; FSMoE used 1-24 MiB messages and
    2^19..12 x 2^19-element GEMMs, 5 runs each)."""

    comm_bytes: tuple[int, ...] = (256 * KIB, 512 * KIB, 768 * KIB, 1024 * KIB)
    """Message sizes per rank (rounded down to whole float32 elements split evenly over the group)."""
    gemm_shapes: tuple[tuple[int, int, int], ...] = ((128, 256, 256), (256, 256, 256), (384, 256, 256), (512, 256, 256))
    """(M, N, K) of each GEMM: [M, K] x [K, N]."""
    repeats: int = 5
    """Timed calls per size, after one warm-up call."""
    statistic: str = "median"
    """How the calls of one size are reduced: one of `STATISTICS`."""

    def validate(self) -> None:
        require(len(set(self.comm_bytes)) >= 2, "comm_bytes", self.comm_bytes, "2 or more distinct sizes")
        require(min(self.comm_bytes) >= 64, "comm_bytes", self.comm_bytes, "sizes >= 64 bytes")
        works = {m * n * k for m, n, k in self.gemm_shapes}
        require(len(works) >= 2, "gemm_shapes", self.gemm_shapes, "2 or more shapes of distinct M * N * K")
        require(self.repeats >= 1, "repeats", self.repeats, "an integer >= 1, e.g. 5")
        require(self.statistic in STATISTICS, "statistic", self.statistic, f"one of {STATISTICS}")

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "gemm_shapes": [list(s) for s in self.gemm_shapes]}


def layer_profile_settings(sizes: LayerSizes, *, hidden_size: int, ffn_hidden_size: int) -> ProfileSettings:
    """Micro-benchmarks at the sizes the solver asks about for one MoE layer: messages of one chunk at degrees 1,
    2, 4, 8 of the layer's all-to-all (or all-gather under ESP alone), and the experts' fc1 GEMM on as many rows
    (width `ffn_hidden_size` / ESP). Used by the training set-up and tools/bench_pipeline.py."""
    whole = max(sizes.n_a2a, sizes.n_ag, 64 * KIB)
    comm_bytes = tuple(sorted({max(int(whole) // r, 4 * KIB) for r in (1, 2, 4, 8)}))
    rows = max(int(whole) // (hidden_size * 4), 64)
    width = ffn_hidden_size // sizes.esp
    gemm_shapes = tuple((max(rows // r, 16), width, hidden_size) for r in (1, 2, 4, 8))
    return ProfileSettings(comm_bytes=comm_bytes, gemm_shapes=gemm_shapes)


@dataclasses.dataclass(frozen=True)
class ProfileGroups:
    """The process groups whose traffic is measured (None: the kind is not measured)."""

    ep: Any = None
    """All-to-all: the expert-model-parallel group."""
    esp: Any = None
    """All-gather / reduce-scatter: the expert-tensor-parallel (ESP) group."""
    dp: Any = None
    """Gradient all-reduce: the data-parallel group."""

    @classmethod
    def from_parallel_state(cls) -> ProfileGroups:
        """megatron-core's groups of this run (its parallel state must be initialized)."""
        from megatron.core import parallel_state as ps

        return cls(
            ep=ps.get_expert_model_parallel_group(),
            esp=ps.get_expert_tensor_parallel_group(),
            dp=ps.get_data_parallel_group(),
        )

    def sizes(self) -> dict[str, int]:
        return {name: _size(getattr(self, name)) for name in ("ep", "esp", "dp")}


def _size(group) -> int:
    return 0 if group is None else group_size(group)


def usual_mode(times: list[float]) -> float:
    """tools/bench_link.py's `usual_mode` (restated: the library does not import tools): the median of the
    slowest cluster of at least 2 calls within 10% of each other (all calls if none is)."""
    clusters = [[y for y in times if abs(y - x) <= 0.1 * x] for x in sorted(times, reverse=True)]
    return statistics.median(next((c for c in clusters if len(c) >= 2), times))


def describe_cluster(groups: ProfileGroups, settings: ProfileSettings, link: str | None = None) -> dict:
    """What a saved profile must match to be reused: world size, group sizes, every rank's host name, backend,
    device type, the link (e.g. "tc 1 Gbit/s", given by the caller), the settings. As JSON reads it back (lists,
    not tuples), so that it compares equal to a saved one."""
    return _as_json(
        {
            "world": dist.get_world_size(),
            **groups.sizes(),
            "hosts": gather_host_names(socket.gethostname()),
            "backend": dist.get_backend(),
            "device": current_platform().device.type,
            "link": link,
            "settings": settings.to_json(),
        }
    )


def _as_json(value):
    return json.loads(json.dumps(value))


def _timed_ms(call: Callable[[], Any], repeats: int, statistic: str) -> float:
    """One warm-up call, then `repeats` calls each between world barriers, device synchronized: the statistic."""
    times = []
    for i in range(repeats + 1):
        profile_barrier()
        synchronize()
        start = time.perf_counter()
        call()
        synchronize()
        if i > 0:
            times.append(1000.0 * (time.perf_counter() - start))
    return statistics.median(times) if statistic == "median" else usual_mode(times)


def _comm_calls(kind: str, group, nbytes: int, device) -> tuple[int, Callable[[], Any]]:
    """(the bytes actually moved, the call) for one message size of `kind`."""
    p = group_size(group)
    numel = max(1, nbytes // 4 // p) * p
    buffer = torch.ones(numel, dtype=torch.float32, device=device)
    scratch = torch.empty_like(buffer)
    if kind == "a2a":
        return numel * 4, lambda: profile_all_to_all(buffer, scratch, group)
    if kind == "ar":
        return numel * 4, lambda: profile_all_reduce(buffer, group)
    return numel * 4, lambda: esp_traffic(kind, buffer, scratch, group)


def _gemm_call(shape: tuple[int, int, int], device) -> tuple[int, Callable[[], Any]]:
    m, n, k = shape
    a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
    return m * n * k, lambda: torch.matmul(a, b)


def _kind_group(kind: str, groups: ProfileGroups):
    return {"a2a": groups.ep, "ag": groups.esp, "rs": groups.esp, "ar": groups.dp}.get(kind)


def measure_fits(groups: ProfileGroups, settings: ProfileSettings, *, cluster: dict | None = None) -> ClusterFits:
    """Run the micro-benchmarks on every rank (all must call it) and fit one line per kind, the same on all."""
    settings.validate()
    device = current_platform().device
    width = max(len(settings.comm_bytes), len(settings.gemm_shapes))
    table = torch.zeros(len(FIT_KINDS), width, dtype=torch.float64)  # ms per (kind, size), this rank's
    sizes: dict[str, list[int]] = {}
    for row, kind in enumerate(FIT_KINDS):
        if kind == "gemm":
            calls = [_gemm_call(shape, device) for shape in settings.gemm_shapes]
        elif _size(_kind_group(kind, groups)) > 1:
            calls = [_comm_calls(kind, _kind_group(kind, groups), n, device) for n in settings.comm_bytes]
        else:
            continue  # no such collective on this cluster: a zero fit (every rank has the same group sizes)
        sizes[kind] = [n for n, _ in calls]
        for col, (_, call) in enumerate(calls):
            table[row, col] = _timed_ms(call, settings.repeats, settings.statistic)
    agreed = agree_profile(table.to(device)).cpu().tolist()
    fits = {}
    for row, kind in enumerate(FIT_KINDS):
        if kind not in sizes:
            fits[kind] = LinearFit(alpha=0.0, beta=0.0)
            continue
        fits[kind] = fit_linear(zip(sizes[kind], agreed[row][: len(sizes[kind])]))
    return ClusterFits(fits=fits, cluster=dict(cluster or {}))


def log_fits(fits: ClusterFits, source: str) -> None:
    """The fits, R^2 and points, one line per kind (rank 0: every rank holds the same)."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    log.info("cost-model profile (%s), t = alpha + n * beta in ms:", source)
    for kind in FIT_KINDS:
        fit = fits[kind]
        points = ", ".join(f"({n:.0f}, {ms:.4g})" for n, ms in fit.points) or "not measured"
        log.info("  %-4s alpha %.4g beta %.4g R^2 %.6f points %s", kind, fit.alpha, fit.beta, fit.r2, points)


def _saved_matches(path: str | None, description: dict) -> bool:
    if path is None:
        return False
    try:
        return ClusterFits.load(path).cluster == description
    except (OSError, ValueError, KeyError):
        return False


def load_or_measure(
    path: str | None,
    groups: ProfileGroups,
    settings: ProfileSettings = ProfileSettings(),
    *,
    link: str | None = None,
) -> tuple[ClusterFits, bool]:
    """The cluster's fits and whether they were measured now: a saved profile at `path` whose description matches
    this run (on every rank) is loaded, else every rank measures and rank 0 saves to `path` (None: not saved).
    Every rank of the world must call it."""
    description = describe_cluster(groups, settings, link)
    missing = torch.tensor([0.0 if _saved_matches(path, description) else 1.0], dtype=torch.float64)
    if agree_profile(missing.to(current_platform().device)).item() == 0:
        fits = ClusterFits.load(path)
        log_fits(fits, f"loaded from {path}")
        return fits, False
    fits = measure_fits(groups, settings, cluster=description)
    if path is not None and dist.get_rank() == 0:
        fits.save(path)
    profile_barrier()  # the file is complete before any rank goes on (a later run's ranks read it)
    log_fits(fits, f"measured, saved to {path}" if path is not None else "measured")
    return fits, True
