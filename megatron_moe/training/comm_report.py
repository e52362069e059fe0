"""What the communication timers report in training: TensorBoard scalars, the log line's figures, and the
warning for an overlap option that hides nothing.

`OVERLAP_OPTIONS` is the table of options that promise to hide communication: a description naming the
flags, when it is in force, and the kinds it should hide: overlap_wgrad (Lancet), the pipeline degrees (FSMoE's
chunked pipeline) and grad_reduce_schedule (FSMoE's gradient partition).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from megatron_moe.comm.timers import CommSummary
from megatron_moe.config import RunConfig

log = logging.getLogger("megatron_moe")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OverlapOption:
    """An option that should hide communication under computation."""

    description: str
    """Names the flags, as the warning shows them."""
    enabled: Callable[[RunConfig], bool]
    """True when the option is in force in this run."""
    hides: tuple[str, ...]
    """Summary kinds (comm/timers.py `SUMMARY_KINDS`) it should hide."""


def _shared_expert_overlaps(cfg: RunConfig) -> bool:
    shared = cfg.moe.moe_shared_expert_ffn_hidden_size or 0
    return cfg.moe.own_layer and shared > 0 and cfg.parallel.expert_model_parallel_size > 1


def _wgrad_overlaps(cfg: RunConfig) -> bool:
    return cfg.moe.is_moe and cfg.moe.wgrad_policy(cfg.parallel.expert_model_parallel_size) != "off"


def _pipelines(flag: str) -> Callable[[RunConfig], bool]:
    """An explicit pipeline degree > 1 (`flag`: the MoEConfig field) with an all-to-all to pipeline. auto is not
    judged here: its degrees are the solver's, known after set-up (logged there)."""

    def enabled(cfg: RunConfig) -> bool:
        degree = getattr(cfg.moe, flag)
        moves = cfg.parallel.expert_model_parallel_size > 1
        return cfg.moe.is_moe and cfg.moe.own_layer and moves and degree.isdigit() and int(degree) > 1

    return enabled


OVERLAP_OPTIONS: tuple[OverlapOption, ...] = (
    OverlapOption(
        description="--overlap-wgrad greedy/all-under-next-a2a with --expert-model-parallel-size > 1 (weight-gradient "
        "GEMMs run under the backward all-to-alls)",
        enabled=_wgrad_overlaps,
        hides=("a2a_dispatch_bwd", "a2a_combine_bwd"),
    ),
    OverlapOption(
        description="--moe-shared-expert-ffn-hidden-size > 0 with --expert-model-parallel-size > 1 "
        "(the shared expert runs under the dispatch all-to-all)",
        enabled=_shared_expert_overlaps,
        hides=("a2a_dispatch",),
    ),
    OverlapOption(
        description="--moe-pipeline-degree > 1 with --expert-model-parallel-size > 1 (each chunk's all-to-alls run "
        "under the experts of the chunk before)",
        enabled=_pipelines("moe_pipeline_degree"),
        hides=("a2a_dispatch", "a2a_combine"),
    ),
    OverlapOption(
        description="--moe-bp-pipeline-degree > 1 with --expert-model-parallel-size > 1 (each backward chunk's "
        "all-to-alls run under the input gradients of the chunk before)",
        enabled=_pipelines("moe_bp_pipeline_degree"),
        hides=("a2a_dispatch_bwd", "a2a_combine_bwd"),
    ),
)


class HiddenCheck:
    """Warns once per run for each overlap option in force that hides less than `min_hidden` of its kinds'
    communication over the first `window` steps (users' complaint #12: options that silently overlap nothing).
    """

    def __init__(self, cfg: RunConfig, *, window: int = 20, min_hidden: float = 0.05, options=OVERLAP_OPTIONS):
        self.window, self.min_hidden = window, min_hidden
        self._pending = [option for option in options if option.enabled(cfg)]
        self._steps = 0
        self._comm_ms = [0.0] * len(self._pending)
        self._exposed_ms = [0.0] * len(self._pending)

    def observe(self, summary: CommSummary) -> list[str]:
        """Add one step; returns the warnings logged now (at the end of the window, at most once)."""
        if not self._pending:
            return []
        self._steps += 1
        for i, option in enumerate(self._pending):
            self._comm_ms[i] += sum(summary.comm_ms.get(kind, 0.0) for kind in option.hides)
            self._exposed_ms[i] += sum(summary.exposed_ms.get(kind, 0.0) for kind in option.hides)
        if self._steps < self.window:
            return []
        warnings = []
        for option, comm_ms, exposed_ms in zip(self._pending, self._comm_ms, self._exposed_ms):
            hidden = 1.0 - exposed_ms / comm_ms if comm_ms > 0 else None
            if hidden is not None and hidden < self.min_hidden:
                warnings.append(
                    f"overlap option {option.description} hides nothing: {100 * hidden:.1f}% of "
                    f"{'+'.join(option.hides)} communication hidden over {self._steps} steps "
                    f"({exposed_ms:.1f} of {comm_ms:.1f} ms exposed); expected at least {100 * self.min_hidden:.0f}%"
                )
        for warning in warnings:
            log.warning("%s", warning)
        self._pending = []  # once per run
        return warnings


def tensorboard_scalars(summary: CommSummary) -> dict[str, float]:
    """`comm/<figure>/<kind>`, `comm/layer_NNN/<figure>/<kind>` (figures: comm_ms, exposed_ms, bytes, calls; NNN
    the transformer layer's number from 1, as in `moe/layer_NNN`) and `comm/hidden_frac`."""
    scalars: dict[str, float] = {"comm/hidden_frac": summary.hidden_frac}
    for figure in ("comm_ms", "exposed_ms", "bytes", "calls"):
        for kind, value in getattr(summary, figure).items():
            scalars[f"comm/{figure}/{kind}"] = value
    for layer, figures in sorted(summary.per_layer.items()):
        for figure, values in figures.items():
            for kind, value in values.items():
                scalars[f"comm/layer_{layer:03d}/{figure}/{kind}"] = value
        exposed, total = layer_exposed_and_comm(summary)[layer]
        scalars[f"comm/layer_{layer:03d}/hidden_frac"] = max(0.0, 1.0 - exposed / total) if total > 0 else 0.0
    return scalars


def layer_exposed_and_comm(summary: CommSummary) -> dict[int, tuple[float, float]]:
    """MoE layer -> (exposed ms, comm ms) over its kinds (its all-to-alls, forward and backward)."""
    return {
        layer: (sum(figures["exposed_ms"].values()), sum(figures["comm_ms"].values()))
        for layer, figures in summary.per_layer.items()
    }


def wgrad_report(schedule, summary: CommSummary | None) -> str:
    """Lancet's schedule (`megatron_moe.overlap.wgrad_schedule.WgradSchedule`) with each backward all-to-all's hidden
    time as the timers measured it in this step (comm - exposed of a2a_combine_bwd / a2a_dispatch_bwd, per MoE
    layer)."""
    if summary is None:
        return schedule.report()
    measured = {}
    for layer, figures in summary.per_layer.items():
        for kind in ("a2a_combine_bwd", "a2a_dispatch_bwd"):
            if kind in figures["comm_ms"]:
                hidden = figures["comm_ms"][kind] - figures["exposed_ms"].get(kind, 0.0)
                measured[f"L{layer}.{kind.removeprefix('a2a_').removesuffix('_bwd')}"] = max(0.0, hidden)
    return schedule.report(measured_hidden_ms=measured)
