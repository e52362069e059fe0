"""Lancet's operator partition planner (section 5), as pure code: which layers run in batch pieces, and how many.

Legend: B = micro-batch size (the axis the pieces split), k = pieces, p = piece index (0..k-1), r = a MoE layer's
FSMoE pipeline degree (chunks, `megatron_moe.overlap.degrees.plan_degrees`), j = chunk index, n = tokens this rank
runs through an operator, G = the most layers one range may span (Lancet's iota), K = the most pieces (rho).

What is planned (what the executor runs): a *range* [first, last] of a stage's layers (global numbers from 1) whose
input [S, B, H] is split along B into k pieces (`piece_batches`) and concatenated after `last`; layers outside every
range run whole (k = 1). One piece's work in one layer, forward, as instructions on two resources, compute and
link (the all-to-alls), and the counts exchange on the EP group's planning twin (p: not behind the link's queue):

    dense layer:  attn (c) -> mlp (c)
    MoE layer:    attn (c) -> route (c) -> counts (p, host read) -> dispatch_1..r (l)  | stage ends
                  experts_1 (c) -> combine_1 (l) -> ... experts_r (c) -> combine_r (l)  | stage ends
                  unroute (c) -> the next layer ...

with each compute time from the fitted line of its kind (`cost_model.DENSE_KINDS`, n = the piece's tokens; the
experts per chunk from `cost_model.chunk_times` on the piece's `LayerSizes`, the ESP all-gather / reduce-scatter
counted as compute, the chunk overhead lines on the first chunk) and each link time from the "a2a" line (bytes: the
layer's `n_a2a` x the piece's share of B, / r per chunk; counts: one int64 per expert). The pieces interleave by
stage (Lancet 5.3): stage s of piece 0, of piece 1, ..., then stage s + 1; a stage is what a piece runs until it
has issued an asynchronous communication. `simulate` is Lancet's timeline: an instruction starts at the latest of
its dependencies' ends and the end of the previous instruction on its resource in that order; the host read of
the counts also holds the next compute instruction (the host waits for it). P(i, n, k) is forward plus backward.

Backward mirrors the forward: each piece's instructions in reverse (unroute', combine'_r..1 | experts'_j ->
dispatch'_j ... | route', attn'), the pieces in reverse (autograd runs nodes in reverse creation order), the
stages of each piece in reverse; a dense operator's backward on its `_bwd` line; the experts on "gemm_bwd" at the
layer's backward degree, their weight gradients ("gemm_dw") after the last chunk unless Lancet defers them. With
`defer_wgrad` (--overlap-wgrad) the weight-gradient share of every deferred operator (`DW_SHARE` of a dense `_bwd`
line; all of the experts' dW when `experts_defer_wgrad`) leaves the timeline as a pool that fills the compute's
idle time inside the same range first (Lancet's dW under the backward all-to-alls): backward = makespan +
max(0, pool - idle).

`plan_partition` is the DP T(n) = min_i { T(i) + min_k P(i, n, k) } over the stage's layers (a group is one layer,
i >= n - G), k in 1..min(K, B); a range takes k >= 2 only where that is predicted to save `MIN_GAIN` of the same
range run whole, so the plan is never predicted slower than no partition. Where and why this deviates from Lancet:
docs/cost-model.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from megatron_moe.config.fields import require
from megatron_moe.config.parallel_dims import ParallelDims
from megatron_moe.config.rules import PIECES_FLAG, RANGE_FLAG
from megatron_moe.overlap.cost_model import (
    MIN_GAIN,
    ClusterFits,
    LayerSizes,
    Schedule,
    chunk_times,
    overhead_ms,
    weight_grad_ms,
)
from megatron_moe.overlap.degrees import experts_defer_wgrad, layer_sizes

if TYPE_CHECKING:
    from megatron_moe.config import RunConfig

COMPUTE, LINK, PLAN = "compute", "link", "plan"
"""The resources: the compute, the link (the EP group's all-to-alls, in order), and the planning twin of the EP
group that carries the counts exchange beside them (`comm.make_planning_groups`)."""
MAX_PIECES = 8
"""K: Lancet's rho (the paper never saw more than 4 pieces win)."""
MAX_RANGE = 4
"""G: the most layers one range spans (Lancet's iota): a long pipeline gains nothing more, the DP stays small."""
DW_SHARE = 0.5
"""The weight-gradient share of a dense operator's backward line (its dW GEMMs do the dX GEMMs' multiply-adds)."""
COUNT_BYTES = 8
"""One expert's token count in the count exchange (int64)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageModel:
    """What the planner knows of one pipeline stage: its layers and one micro-batch's sizes on this rank."""

    layers: tuple[int, ...]
    """The stage's layer numbers (global, from 1), in order."""
    moe: tuple[bool, ...]
    """Per layer: a MoE layer (else a dense MLP)."""
    micro_batch: int
    """B: the pieces split it (k <= B)."""
    tokens: int
    """Tokens of one micro-batch on this rank (n of the dense lines at k = 1)."""
    sizes: LayerSizes
    """One MoE layer's whole-micro-batch sizes (`degrees.layer_sizes`); a piece's are scaled by its share of B."""
    num_experts: int = 1
    """E: the count exchange's length."""
    degrees: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    """MoE layer -> (forward r, backward r) as solved (`plan_degrees`); 1 for a layer not named."""
    defer_wgrad: bool = False
    """Lancet's queue defers the dense operators' weight gradients (--overlap-wgrad)."""
    experts_defer_wgrad: bool = False
    """... and the experts' (`degrees.experts_defer_wgrad`)."""

    def __post_init__(self):
        require(len(self.layers) == len(self.moe) >= 1, "stage layers", self.layers, "one MoE flag per layer, >= 1")
        require(self.micro_batch >= 1, "--micro-batch-size", self.micro_batch, "an integer >= 1")
        require(self.tokens >= self.micro_batch, "stage tokens", self.tokens, f">= B = {self.micro_batch}")

    def degree(self, layer: int, direction: str, unchunked: bool) -> int:
        return 1 if unchunked else self.degrees.get(layer, (1, 1))[0 if direction == "forward" else 1]


@dataclasses.dataclass(frozen=True)
class Instr:
    """One instruction of the simulated timeline."""

    name: str
    resource: str
    """COMPUTE or LINK."""
    ms: float
    deps: tuple[int, ...] = ()
    """Indices (in the schedule) of the instructions it waits for."""
    holds_host: bool = False
    """A host read: the next compute instruction in the schedule waits for it too."""


def simulate(schedule: Sequence[Instr]) -> list[tuple[float, float]]:
    """(start, end) of each instruction (Lancet 5.3): start = max(its dependencies' ends, the previous instruction
    of its resource in schedule order, a host read's end for the next compute instruction)."""
    free = {COMPUTE: 0.0, LINK: 0.0, PLAN: 0.0}
    host = 0.0
    spans: list[tuple[float, float]] = []
    for instr in schedule:
        start = max([free[instr.resource], *(spans[d][1] for d in instr.deps)])
        if instr.resource == COMPUTE:
            start, host = max(start, host), 0.0
        end = start + instr.ms
        spans.append((start, end))
        free[instr.resource] = end
        if instr.holds_host:
            host = max(host, end)
    return spans


def overlap_ms(schedule: Sequence[Instr], spans: Sequence[tuple[float, float]]) -> float:
    """Link time that runs while the compute is busy (each resource's spans are disjoint: two sorted sweeps)."""
    busy = {r: sorted(s for i, s in zip(schedule, spans) if i.resource == r and s[1] > s[0]) for r in (COMPUTE, LINK)}
    total, c = 0.0, 0
    computes = busy[COMPUTE]
    for start, end in busy[LINK]:
        while c < len(computes) and computes[c][1] <= start:
            c += 1
        j = c
        while j < len(computes) and computes[j][0] < end:
            total += max(0.0, min(end, computes[j][1]) - max(start, computes[j][0]))
            j += 1
    return total


def piece_batches(micro_batch: int, pieces: int) -> list[int]:
    """The pieces' batch sizes as torch.tensor_split gives them: the first B % k one larger."""
    require(1 <= pieces <= micro_batch, PIECES_FLAG, pieces, f"pieces in [1, B = {micro_batch}]")
    return [micro_batch // pieces + (1 if p < micro_batch % pieces else 0) for p in range(pieces)]


@dataclasses.dataclass
class _Piece:
    """One piece's instructions in its own order, each stage a list of (instr, local deps); built, then placed."""

    stages: list[list[tuple[Instr, tuple[int, ...]]]] = dataclasses.field(default_factory=lambda: [[]])
    count: int = 0

    def add(self, instr: Instr, deps: tuple[int, ...] | None = None) -> int:
        """Append; `deps` are local indices (None: the previous instruction). Returns the local index."""
        deps = (self.count - 1,) if deps is None and self.count else deps or ()
        self.stages[-1].append((instr, deps))
        self.count += 1
        return self.count - 1

    def end_stage(self) -> None:
        self.stages.append([])


@dataclasses.dataclass(frozen=True)
class _Costs:
    """The lines and sizes one piece's instructions are timed with."""

    fits: ClusterFits
    stage: StageModel
    share: float
    """The piece's share of B."""
    direction: str

    def dense(self, kind: str) -> float:
        """The operator's time on this piece; backward less the deferred dW share (unroute has no weights)."""
        line = self.fits[kind if self.direction == "forward" else f"{kind}_bwd"]
        ms = max(line.alpha, 0.0) + self.stage.tokens * self.share * max(line.beta, 0.0)
        return ms - self.dense_dw(kind)

    def dense_dw(self, kind: str) -> float:
        """The deferred weight-gradient share of a dense operator's backward (0 unless deferred)."""
        if self.direction == "forward" or not self.stage.defer_wgrad or kind == "unroute":
            return 0.0
        line = self.fits[f"{kind}_bwd"]
        return DW_SHARE * (max(line.alpha, 0.0) + self.stage.tokens * self.share * max(line.beta, 0.0))

    def sizes(self) -> LayerSizes:
        s = self.stage.sizes
        return dataclasses.replace(
            s,
            n_a2a=s.n_a2a * self.share,
            n_ag=s.n_ag * self.share,
            n_rs=s.n_rs * self.share,
            n_exp=s.n_exp * self.share,
        )

    def a2a(self, nbytes: float) -> float:
        line = self.fits["a2a"]
        return 0.0 if nbytes <= 0 else max(line.alpha, 0.0) + nbytes * max(line.beta, 0.0)


def _moe_forward(piece: _Piece, costs: _Costs, layer: int, r: int) -> None:
    sizes = costs.sizes()
    t = chunk_times(costs.fits, sizes, r, "forward")
    piece.add(Instr(f"L{layer}.route", COMPUTE, costs.dense("route")))
    if sizes.ep > 1:
        counts = costs.a2a(costs.stage.num_experts * COUNT_BYTES)
        piece.add(Instr(f"L{layer}.counts", PLAN, counts, holds_host=True))
    dispatch = [piece.add(Instr(f"L{layer}.dispatch.{j}", LINK, t.a2a)) for j in range(r)]
    piece.end_stage()
    combine = []
    overhead = overhead_ms(costs.fits, sizes, r, "forward")
    for j in range(r):
        ms = t.exp + t.ag + t.rs + (overhead if j == 0 else 0.0)  # its compute order: after experts_{j-1}
        experts = piece.add(Instr(f"L{layer}.experts.{j}", COMPUTE, ms), (dispatch[j],))
        combine.append(piece.add(Instr(f"L{layer}.combine.{j}", LINK, t.a2a), (experts,)))
    piece.end_stage()
    piece.add(Instr(f"L{layer}.unroute", COMPUTE, costs.dense("unroute")), tuple(combine))


def _moe_backward(piece: _Piece, costs: _Costs, layer: int, r: int) -> float:
    """The layer's backward instructions; returns the weight-gradient ms it defers to the pool."""
    sizes = costs.sizes()
    t = chunk_times(costs.fits, sizes, r, "backward")
    piece.add(Instr(f"L{layer}.unroute'", COMPUTE, costs.dense("unroute")))
    combine = [piece.add(Instr(f"L{layer}.combine'.{j}", LINK, t.a2a)) for j in range(r)]
    piece.end_stage()
    dispatch, overhead = [], overhead_ms(costs.fits, sizes, r, "backward")
    for j in range(r):
        ms = t.exp + t.ag + t.rs + (overhead if j == 0 else 0.0)
        experts = piece.add(Instr(f"L{layer}.experts'.{j}", COMPUTE, ms), (combine[j],))
        dispatch.append(piece.add(Instr(f"L{layer}.dispatch'.{j}", LINK, t.a2a), (experts,)))
    dw = weight_grad_ms(costs.fits, sizes)
    if not costs.stage.experts_defer_wgrad:
        piece.add(Instr(f"L{layer}.experts_dw", COMPUTE, dw), (experts,))  # while the last dX is on the wire
    piece.end_stage()
    piece.add(Instr(f"L{layer}.route'", COMPUTE, costs.dense("route")), tuple(dispatch))
    return costs.dense_dw("route") + (dw if costs.stage.experts_defer_wgrad else 0.0)


def _piece(fits: ClusterFits, stage: StageModel, span: range, share: float, direction: str, unchunked: bool):
    """One piece's instructions over the layers at `span` (indices into stage.layers), and its deferred dW ms."""
    costs, piece, pool = _Costs(fits, stage, share, direction), _Piece(), 0.0
    order = span if direction == "forward" else reversed(span)
    for i in order:
        layer, is_moe = stage.layers[i], stage.moe[i]
        r = stage.degree(layer, direction, unchunked) if is_moe else 1
        if direction == "forward":
            piece.add(Instr(f"L{layer}.attn", COMPUTE, costs.dense("attn")))
            if is_moe:
                _moe_forward(piece, costs, layer, r)
            else:
                piece.add(Instr(f"L{layer}.mlp", COMPUTE, costs.dense("mlp")))
            continue
        if is_moe:
            pool += _moe_backward(piece, costs, layer, r)
        else:
            piece.add(Instr(f"L{layer}.mlp'", COMPUTE, costs.dense("mlp")))
            pool += costs.dense_dw("mlp")
        piece.add(Instr(f"L{layer}.attn'", COMPUTE, costs.dense("attn")))
        pool += costs.dense_dw("attn")
    return piece, pool


def interleave(pieces: Sequence[tuple[int, _Piece]]) -> list[Instr]:
    """Lancet 5.3's order: stage s of every (index, piece) in the given order, then stage s + 1; local
    dependencies become schedule indices, and each instruction is named with its piece's index ("@p")."""
    schedule: list[Instr] = []
    where: list[dict[int, int]] = [{} for _ in pieces]
    local = [0] * len(pieces)
    for s in range(max(len(p.stages) for _, p in pieces)):
        for p, (index, piece) in enumerate(pieces):
            for instr, deps in piece.stages[s] if s < len(piece.stages) else ():
                where[p][local[p]] = len(schedule)
                name = f"{instr.name}@{index}"
                schedule.append(dataclasses.replace(instr, name=name, deps=tuple(where[p][d] for d in deps)))
                local[p] += 1
    return schedule


@dataclasses.dataclass(frozen=True, kw_only=True)
class RangeTimes:
    """P(i, n, k) and its parts, ms."""

    forward: float
    backward: float
    """Makespan plus the deferred dW the compute's idle time does not absorb."""
    a2a: float
    """Link time (forward and backward)."""
    hidden: float
    """Link time under compute (forward and backward)."""

    @property
    def total(self) -> float:
        return self.forward + self.backward


def range_schedule(
    fits: ClusterFits, stage: StageModel, first: int, last: int, pieces: int, direction: str, *, unchunked=False
) -> tuple[list[Instr], float]:
    """The interleaved schedule of layers `first`..`last` (global numbers) in `pieces` pieces, and the dW ms it
    defers (backward with `defer_wgrad`)."""
    lo, hi = stage.layers.index(first), stage.layers.index(last)
    require(lo <= hi, RANGE_FLAG, f"{first}-{last}", "FIRST <= LAST within the stage's layers")
    batches = piece_batches(stage.micro_batch, pieces)
    built = [_piece(fits, stage, range(lo, hi + 1), b / stage.micro_batch, direction, unchunked) for b in batches]
    order = [(p, piece) for p, (piece, _) in enumerate(built)]
    return interleave(order if direction == "forward" else order[::-1]), math.fsum(pool for _, pool in built)


def range_times(
    fits: ClusterFits, stage: StageModel, first: int, last: int, pieces: int, *, unchunked: bool = False
) -> RangeTimes:
    """P(i, n, k): the simulated forward and backward of the range in `pieces` pieces (module docstring)."""
    out = {}
    a2a = hidden = 0.0
    for direction in ("forward", "backward"):
        schedule, pool = range_schedule(fits, stage, first, last, pieces, direction, unchunked=unchunked)
        spans = simulate(schedule)
        makespan = max((end for _, end in spans), default=0.0)
        idle = makespan - math.fsum(i.ms for i in schedule if i.resource == COMPUTE)
        out[direction] = makespan + max(0.0, pool - idle)
        a2a += math.fsum(i.ms for i in schedule if i.resource == LINK)
        hidden += overlap_ms(schedule, spans)
    return RangeTimes(forward=out["forward"], backward=out["backward"], a2a=a2a, hidden=hidden)


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
