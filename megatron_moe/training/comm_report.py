"""What the communication timers report in training: TensorBoard scalars, the log line's figures, the
warning for an overlap option that hides nothing, and the timers' wire-time lines from the cost model's fits.

Every hidden share here is 1 - exposed / wire time (comm/timers.py): against the time the bytes that cross need
on the link, not against issued -> done spans, which count waiting for a slower peer as hidden.

`OVERLAP_OPTIONS` is the table of options that promise to hide communication: a description naming the
flags, when it is in force, and the kinds it should hide: overlap_wgrad (Lancet), the pipeline degrees (FSMoE's
chunked pipeline) and grad_reduce_schedule (FSMoE's gradient partition).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from megatron_moe.comm.timers import CommSummary, WireLine, hidden_share
from megatron_moe.config import RunConfig
from megatron_moe.overlap.cost_model import ClusterFits

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
        return cfg.moe.is_moe and cfg.moe.own_layer and moves and type(degree) is int and degree > 1

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


WIRE_FITS = {
    **dict.fromkeys(("a2a_dispatch", "a2a_dispatch_bwd", "a2a_combine", "a2a_combine_bwd"), ("a2a", "ep", 1)),
    **dict.fromkeys(("esp_ag", "esp_rs_bwd"), ("ag", "esp", 1)),  # esp_rs's backward is an all-gather
    **dict.fromkeys(("esp_rs", "esp_ag_bwd"), ("rs", "esp", 1)),
    "dp_grad_reduce": ("ar", "dp", 2),
}
"""Summary kind -> (the cost model's line, the group it was measured on, the ring factor f): the profile's n
counts the whole buffer of equal blocks (a2a: what this rank sends, its own block included; ag: the gathered
output; rs: the input; ar: the bytes reduced), of which f x (P - 1) / P crosses (overlap/profiler.py
`comm_calls`); so a byte that crosses costs beta x P / (f x (P - 1)). The other kinds have no line."""


def wire_lines(fits: ClusterFits | None) -> dict[str, WireLine]:
    """The timers' `WireLine` per summary kind from the cost model's fits (training/setup.py `cluster_fits`): the
    fitted start-up time and the fitted ms per byte converted to ms per crossing byte (`WIRE_FITS`). Kinds whose
    group had one rank, or no size in the profile's description, get none (the timers' estimate then)."""
    if fits is None:
        return {}
    lines = {}
    for kind, (fit_kind, group, factor) in WIRE_FITS.items():
        p = int(fits.cluster.get(group) or 0)
        if p > 1 and fit_kind in fits.fits:
            fit = fits[fit_kind]
            lines[kind] = WireLine(alpha_ms=fit.alpha, ms_per_byte=fit.beta * p / (factor * (p - 1)))
    return lines


class HiddenCheck:
    """Warns once per run for each overlap option in force that hides less than `min_hidden` of its kinds'
    communication over the first `window` steps (users' complaint #12: options that silently overlap nothing).
    Hidden is 1 - exposed / wire time: an option whose collectives are exposed for as long as they need the link,
    or longer (waiting for peers), hides nothing.
    """

    def __init__(self, cfg: RunConfig, *, window: int = 20, min_hidden: float = 0.05, options=OVERLAP_OPTIONS):
        self.window, self.min_hidden = window, min_hidden
        self._pending = [option for option in options if option.enabled(cfg)]
        self._steps = 0
        self._wire_ms = [0.0] * len(self._pending)
        self._exposed_ms = [0.0] * len(self._pending)
        self._skew_ms = [0.0] * len(self._pending)

    def observe(self, summary: CommSummary) -> list[str]:
        """Add one step; returns the warnings logged now (at the end of the window, at most once)."""
        if not self._pending:
            return []
        self._steps += 1
        for i, option in enumerate(self._pending):
            self._wire_ms[i] += sum(summary.wire_ms.get(kind, 0.0) for kind in option.hides)
            self._exposed_ms[i] += sum(summary.exposed_ms.get(kind, 0.0) for kind in option.hides)
            self._skew_ms[i] += sum(summary.skew_ms.get(kind, 0.0) for kind in option.hides)
        if self._steps < self.window:
            return []
        warnings = []
        for i, option in enumerate(self._pending):
            wire_ms, exposed_ms = self._wire_ms[i], self._exposed_ms[i]
            hidden = hidden_share(exposed_ms, wire_ms) if wire_ms > 0 else None  # None: nothing crossed
            if hidden is not None and hidden < self.min_hidden:
                warnings.append(
                    f"overlap option {option.description} hides nothing: {100 * hidden:.1f}% of "
                    f"{'+'.join(option.hides)} communication hidden over {self._steps} steps "
                    f"({exposed_ms:.1f} ms exposed against {wire_ms:.1f} ms on the link, "
                    f"{self._skew_ms[i]:.1f} ms of it skew: waiting for the last rank to arrive); "
                    f"expected at least {100 * self.min_hidden:.0f}%"
                )
        for warning in warnings:
            log.warning("%s", warning)
        self._pending = []  # once per run
        return warnings


SCALAR_FIGURES = ("comm_ms", "exposed_ms", "wire_ms", "skew_ms", "transfer_ms", "bytes", "wire_bytes", "calls")
"""The per-kind figures TensorBoard gets (comm/timers.py `CommSummary`)."""
HEADLINE_FIGURES = ("exposed_ms", "comm_ms")
"""The per-kind figures of the `comm/` group (exposed, and issued -> done); the others go to `comm_detail/`."""


def tensorboard_scalars(summary: CommSummary) -> dict[str, float]:
    """The dashboard's `comm/` group: `comm/total_exposed_ms`, `comm/total_wire_ms`, `comm/total_skew_ms`,
    `comm/total_transfer_ms`, `comm/hidden_frac` (1 - exposed / wire over every kind) and
    `comm/{exposed_ms,comm_ms}/<kind>`; the detail: `comm_detail/<figure>/<kind>` (the other `SCALAR_FIGURES`),
    `comm_layers/layer_NNN/<figure>/<kind>` and `comm_layers/layer_NNN/hidden_frac` (NNN the transformer layer's
    number from 1, as in `moe_layers/layer_NNN`). Every kind here; TensorBoard gets those the layout can have
    (training/tensorboard_tags.py)."""
    scalars: dict[str, float] = {
        "comm/total_exposed_ms": summary.total_exposed_ms,
        "comm/total_wire_ms": summary.total_wire_ms,
        "comm/total_skew_ms": summary.total_skew_ms,
        "comm/total_transfer_ms": summary.total_transfer_ms,
        "comm/hidden_frac": summary.hidden_frac,
    }
    for figure in SCALAR_FIGURES:
        group = "comm" if figure in HEADLINE_FIGURES else "comm_detail"
        for kind, value in getattr(summary, figure).items():
            scalars[f"{group}/{figure}/{kind}"] = value
    for layer, figures in sorted(summary.per_layer.items()):
        for figure, values in figures.items():
            for kind, value in values.items():
                scalars[f"comm_layers/layer_{layer:03d}/{figure}/{kind}"] = value
        exposed, wire = layer_exposed_and_wire(summary)[layer]
        scalars[f"comm_layers/layer_{layer:03d}/hidden_frac"] = hidden_share(exposed, wire)
    return scalars


def layer_exposed_and_wire(summary: CommSummary) -> dict[int, tuple[float, float]]:
    """MoE layer -> (exposed ms, wire ms) over its kinds (its all-to-alls, forward and backward)."""
    return {
        layer: (sum(figures["exposed_ms"].values()), sum(figures.get("wire_ms", {}).values()))
        for layer, figures in summary.per_layer.items()
    }


def wgrad_report(schedule, summary: CommSummary | None) -> str:
    """Lancet's schedule (`megatron_moe.overlap.wgrad_schedule.WgradSchedule`) with each backward all-to-all's hidden
    time as the timers measured it in this step (wire - exposed of a2a_combine_bwd / a2a_dispatch_bwd, at least 0,
    per MoE layer)."""
    if summary is None:
        return schedule.report()
    measured = {}
    for layer, figures in summary.per_layer.items():
        for kind in ("a2a_combine_bwd", "a2a_dispatch_bwd"):
            if kind in figures["wire_ms"]:
                hidden = figures["wire_ms"][kind] - figures["exposed_ms"].get(kind, 0.0)
                measured[f"L{layer}.{kind.removeprefix('a2a_').removesuffix('_bwd')}"] = max(0.0, hidden)
    return schedule.report(measured_hidden_ms=measured)
