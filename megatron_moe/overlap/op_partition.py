"""Lancet's operator partition planner (section 5), as pure code: which layers run in batch pieces, and how many.

Inputs: the cluster's fits and a `piece_schedule.StageModel` (`stage_model` builds it from a run's flags), with
optional forced pieces or ranges (--moe-partition-pieces / --moe-partition-range). Output: a `PartitionPlan`
(ranges [first, last] in k >= 2 pieces, in layer order; every other layer runs whole; the predicted times).
Method: the DP T(n) = min_i { T(i) + min_k P(i, n, k) } over the stage's layers (i >= n - G), k in 1..min(K, B),
P from `piece_schedule.range_times`. Invariant: a range takes k >= 2 only where that is predicted to save `MIN_GAIN`
of the same range run whole, so a plan is never predicted slower than no partition. Deviations from Lancet:
docs/cost-model.md; the simulation's derivation: docs/internals/overlap.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from megatron_moe.config.fields import require
from megatron_moe.config.parallel_dims import ParallelDims
from megatron_moe.config.rules import PIECES_FLAG
from megatron_moe.overlap.cost_model import (
    MIN_GAIN,
    ClusterFits,
    Schedule,
)
from megatron_moe.overlap.degrees import experts_defer_wgrad, layer_sizes

if TYPE_CHECKING:
    from megatron_moe.config import RunConfig

from megatron_moe.overlap.piece_schedule import (
    COMPUTE,
    LINK,
    PLAN,
    Instr,
    RangeTimes,
    StageModel,
    overlap_ms,
    piece_batches,
    range_schedule,
    range_times,
    simulate,
)

__all__ = [  # the planner, and the simulation it plans on (piece_schedule.py), as one entry
    "COMPUTE",
    "LINK",
    "MAX_PIECES",
    "MAX_RANGE",
    "PLAN",
    "Instr",
    "PartitionPlan",
    "PartitionRange",
    "RangeTimes",
    "StageModel",
    "cannot_plan",
    "overlap_ms",
    "partition_report",
    "piece_batches",
    "plan_partition",
    "range_schedule",
    "range_times",
    "simulate",
    "stage_model",
]

MAX_PIECES = 8
"""K: Lancet's rho (the paper never saw more than 4 pieces win)."""
MAX_RANGE = 4
"""G: the most layers one range spans (Lancet's iota): a long pipeline gains nothing more, the DP stays small."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PartitionRange:
    """One range of the plan: layers `first`..`last` in `pieces` pieces."""

    first: int
    last: int
    pieces: int
    unchunked: bool = False
    """Its MoE layers run at r = 1 (predicted faster in pieces than the solved degrees)."""
    predicted_ms: float = 0.0
    """Forward + backward of the range as planned."""
    whole_ms: float = 0.0
    """The same range unpartitioned (k = 1, the solved degrees)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PartitionPlan:
    """The ranges chosen for a stage and the model's times of one micro-batch, forward + backward, ms."""

    ranges: tuple[PartitionRange, ...]
    """Partitioned ranges only (k >= 2), in layer order; every other layer runs whole."""
    predicted_ms: dict[str, float]
    """"partitioned" (as planned) / "unpartitioned" (every layer whole)."""
    a2a_ms: dict[str, float]
    """The all-to-all time (link) forward and backward: "partitioned" / "unpartitioned"."""
    hidden_ms: dict[str, float]
    """The part of it under compute: "partitioned" / "unpartitioned"."""
    why: str = ""
    """Why nothing is partitioned, where that was decided before the DP (no lines, B = 1, no MoE layer)."""

    def as_tuples(self) -> list[tuple[int, int, int]]:
        """[(first, last, k), ...]: what the executor runs."""
        return [(r.first, r.last, r.pieces) for r in self.ranges]

    def report(self) -> str:
        """A few lines for the start-up summary and the overlap report."""
        return partition_report(self)


def _times(fits, stage, lo: int, hi: int, k: int) -> tuple[RangeTimes, bool]:
    """min over the solved degrees and (k >= 2, a MoE layer chunked) r = 1 of P: (times, unchunked)."""
    first, last = stage.layers[lo], stage.layers[hi]
    best = range_times(fits, stage, first, last, k), False
    chunked = any(stage.moe[i] and stage.degrees.get(stage.layers[i], (1, 1)) != (1, 1) for i in range(lo, hi + 1))
    if k > 1 and chunked:
        flat = range_times(fits, stage, first, last, k, unchunked=True)
        if flat.total < best[0].total:
            best = flat, True
    return best


def _unpartitioned(fits, stage) -> RangeTimes:
    return _sum([range_times(fits, stage, layer, layer, 1) for layer in stage.layers])


def _sum(parts: Sequence[RangeTimes]) -> RangeTimes:
    return RangeTimes(
        forward=math.fsum(p.forward for p in parts),
        backward=math.fsum(p.backward for p in parts),
        a2a=math.fsum(p.a2a for p in parts),
        hidden=math.fsum(p.hidden for p in parts),
    )


def _plan(totals: dict, parts: list, why: str = "") -> PartitionPlan:
    return PartitionPlan(
        ranges=tuple(parts),
        predicted_ms={name: t.total for name, t in totals.items()},
        a2a_ms={name: t.a2a for name, t in totals.items()},
        hidden_ms={name: t.hidden for name, t in totals.items()},
        why=why,
    )


def cannot_plan(fits: ClusterFits, stage: StageModel) -> str:
    """Why no range can be partitioned ("" where one can)."""
    if fits.missing_dense():
        return f"the cost profile has no {'/'.join(fits.missing_dense())} lines (saved before them: re-profile)"
    if stage.micro_batch < 2:
        return "micro-batch size 1: nothing to split along the batch"
    if not any(stage.moe) or stage.sizes.ep <= 1 or stage.sizes.n_a2a <= 0:
        return "no all-to-all in this stage to hide"
    return ""


def plan_partition(
    fits: ClusterFits,
    stage: StageModel,
    *,
    max_pieces: int = MAX_PIECES,
    max_range: int = MAX_RANGE,
    min_gain: float = MIN_GAIN,
    pieces: int | None = None,
    ranges: Sequence[tuple[int, int]] | None = None,
) -> PartitionPlan:
    """Lancet's DP over the stage's layers (module docstring): T(n) = min over i in [n - G, n - 1] of T(i) + best
    P(i + 1..n, k), k in 1..min(K, B), where k >= 2 counts only if it saves `min_gain` of the range run whole (ties
    to fewer layers, then fewer pieces). `pieces` (the flag's N) fixes k (1: nothing partitioned); `ranges` (the
    flag's FIRST-LAST list, clipped to the stage) fixes the spans, each taking the best k (or `pieces`, then
    without the gain rule: the user asked for it)."""
    require(isinstance(max_pieces, int) and max_pieces >= 1, PIECES_FLAG, max_pieces, "an integer >= 1, e.g. 8")
    require(isinstance(max_range, int) and max_range >= 1, "max_range", max_range, "an integer >= 1, e.g. 4")
    require(0 <= min_gain < 1, "min_gain", min_gain, "a fraction in [0, 1), e.g. 0.05")
    require(pieces is None or pieces >= 1, PIECES_FLAG, pieces, "auto or an integer >= 1 (1: off)")
    why = cannot_plan(fits, stage)
    if why or pieces == 1:
        whole = _sum([]) if fits.missing_dense() else _unpartitioned(fits, stage)
        return _plan({"partitioned": whole, "unpartitioned": whole}, [], why or f"{PIECES_FLAG} 1")
    top = min(max_pieces if pieces is None else pieces, stage.micro_batch)
    ks = range(2, top + 1) if pieces is None else (top,)
    allowed = _spans(stage, max_range, ranges)
    whole = [range_times(fits, stage, layer, layer, 1) for layer in stage.layers]
    if pieces is not None and ranges is not None:  # both given: as the user asked, whatever it is predicted to save
        return _as_given(fits, stage, whole, sorted(allowed), top)
    n_layers = len(stage.layers)
    best: list[tuple[float, list, list[RangeTimes]]] = [(0.0, [], [])] + [(math.inf, [], [])] * n_layers
    for n in range(1, n_layers + 1):
        for lo in range(n - 1, -1, -1):  # shorter ranges first: ties keep them
            if lo < n - 1 and (lo, n - 1) not in allowed:
                continue
            base_ms, base_parts, base_times = best[lo]
            ks_here = ks if (lo, n - 1) in allowed else ()
            choice = _best_choice(fits, stage, whole[lo:n], lo, n - 1, ks_here, min_gain)
            if base_ms + choice[0] < best[n][0]:
                best[n] = (base_ms + choice[0], base_parts + ([choice[1]] if choice[1] else []), base_times + choice[2])
    _, parts, chosen = best[n_layers]
    return _plan({"partitioned": _sum(chosen), "unpartitioned": _sum(whole)}, parts)


def _best_choice(fits, stage, run: list[RangeTimes], lo: int, hi: int, ks, gain: float, *, forced: bool = False):
    """(ms, the PartitionRange or None, its times) of layers lo..hi: whole (k = 1, the sum of `run`), or the best
    k in `ks` saving `gain` of that (`forced`: the best k in `ks` whatever it saves)."""
    whole_ms = math.fsum(t.total for t in run)
    choice = (whole_ms, None, run)
    for k in ks:
        times, unchunked = _times(fits, stage, lo, hi, k)
        if (forced and choice[1] is None) or (times.total <= (1 - gain) * whole_ms and times.total < choice[0]):
            first, last = stage.layers[lo], stage.layers[hi]
            span = PartitionRange(
                first=first, last=last, pieces=k, unchunked=unchunked, predicted_ms=times.total, whole_ms=whole_ms
            )
            choice = (times.total, span, [times])
    return choice


def _as_given(fits, stage, whole: list[RangeTimes], spans: list[tuple[int, int]], pieces: int) -> PartitionPlan:
    """Every given span in `pieces` pieces, every other layer whole."""
    parts, chosen, i = [], [], 0
    for lo, hi in spans:
        chosen += whole[i:lo]
        _, span, times = _best_choice(fits, stage, whole[lo : hi + 1], lo, hi, (pieces,), 0.0, forced=True)
        parts.append(span)
        chosen += times
        i = hi + 1
    chosen += whole[i:]
    return _plan({"partitioned": _sum(chosen), "unpartitioned": _sum(whole)}, parts)


def _spans(stage: StageModel, max_range: int, ranges: Sequence[tuple[int, int]] | None) -> set[tuple[int, int]]:
    """The (lo, hi) index spans the DP may partition: every span of at most `max_range` layers, or the given ranges
    (a layer outside them runs whole)."""
    n_layers = len(stage.layers)
    if ranges is None:
        return {(lo, hi) for lo in range(n_layers) for hi in range(lo, min(lo + max_range, n_layers))}
    index = {layer: i for i, layer in enumerate(stage.layers)}
    given = set()
    for first, last in ranges:
        inside = [index[layer] for layer in range(first, last + 1) if layer in index]
        if inside:
            given.add((inside[0], inside[-1]))
    return given


def partition_report(plan: PartitionPlan) -> str:
    """The plan in a few lines: the ranges, the predicted micro-batch time and the all-to-all time hidden."""
    pred, a2a, hidden = plan.predicted_ms, plan.a2a_ms, plan.hidden_ms
    if plan.ranges:
        ranges = ", ".join(
            f"L{r.first}-{r.last} x{r.pieces}{' (r = 1)' if r.unchunked else ''} "
            f"{r.predicted_ms:.2f} ms (whole {r.whole_ms:.2f})"
            for r in plan.ranges
        )
    else:
        ranges = f"none ({plan.why or 'no range predicted to gain'})"
    saved = pred["unpartitioned"] - pred["partitioned"]
    share = saved / pred["unpartitioned"] if pred["unpartitioned"] > 0 else 0.0
    return "\n".join(
        [
            f"operator partition (Lancet), ranges: {ranges}",
            f"  predicted forward + backward of a micro-batch: {pred['partitioned']:.2f} ms "
            f"(unpartitioned {pred['unpartitioned']:.2f}, {share:.1%} saved)",
            f"  all-to-all hidden: {hidden['partitioned']:.2f} of {a2a['partitioned']:.2f} ms "
            f"(unpartitioned {hidden['unpartitioned']:.2f} of {a2a['unpartitioned']:.2f})",
        ]
    )


def stage_model(cfg: RunConfig, layers: Sequence[int], schedules: dict[int, Schedule] | None = None) -> StageModel:
    """The `StageModel` of a run's stage holding `layers` (global numbers), with the solved degrees (`plan_degrees`;
    None: r = 1): the sizes `degrees.layer_sizes` uses, tokens = micro-batch x seq-length / ((TP under SP) x CP)."""
    pattern = cfg.moe.layer_pattern(cfg.model.num_layers)
    b = cfg.training.micro_batch_size
    tokens = b * cfg.model.seq_length // ParallelDims.from_config(cfg.parallel).token_split
    degrees = {n: (s.forward, s.backward) for n, s in (schedules or {}).items()}
    return StageModel(
        layers=tuple(layers),
        moe=tuple(bool(pattern[n - 1]) for n in layers),
        micro_batch=b,
        tokens=tokens,
        sizes=layer_sizes(cfg),
        num_experts=cfg.moe.layer_config(cfg.model).num_experts,
        degrees=degrees,
        defer_wgrad=cfg.moe.wgrad_policy(cfg.parallel.expert_model_parallel_size) != "off",
        experts_defer_wgrad=experts_defer_wgrad(cfg),
    )
