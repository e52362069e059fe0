"""Lancet's pipeline simulation of a range of layers run in batch pieces (section 5.3), as pure code.

Legend: B = micro-batch size, k = pieces, p = piece index, r = a MoE layer's FSMoE pipeline degree, n = tokens.
Inputs: the cluster's fits, a `StageModel` (one pipeline stage: its layers, sizes, degrees, what Lancet defers),
a range `first`..`last` and k. Outputs: `range_schedule` (the interleaved instructions on COMPUTE / LINK / PLAN),
`simulate` (each instruction's start and end), `range_times` -> `RangeTimes` (P(i, n, k): forward, backward, link
time, link time hidden), `paired_times` (batch-level overlap: a forward beside another micro-batch's backward).
Invariant: an instruction starts at the latest of its dependencies' ends and the end of the previous instruction
on its resource; a host read also holds the next compute instruction. The instruction lists per layer kind and
the backward's dW pool: docs/internals/overlap.md ("The operator partition").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from megatron_moe.config.fields import require
from megatron_moe.config.rules import PIECES_FLAG, RANGE_FLAG
from megatron_moe.overlap.cost_model import (
    ClusterFits,
    LayerSizes,
    chunk_times,
    overhead_ms,
    weight_grad_ms,
)

if TYPE_CHECKING:
    pass

COMPUTE, LINK, PLAN = "compute", "link", "plan"
"""The resources: the compute, the link (the EP group's all-to-alls, in order), and the planning twin of the EP
group that carries the counts exchange beside them (`comm.make_planning_groups`)."""
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
    """P(i, n, k): the simulated forward and backward of the range in `pieces` pieces (docs/internals/overlap.md)."""
    out = {}
    a2a = hidden = 0.0
    for direction in ("forward", "backward"):
        schedule, pool = range_schedule(fits, stage, first, last, pieces, direction, unchunked=unchunked)
        spans = simulate(schedule)
        out[direction] = _makespan(schedule, pool, spans)
        a2a += math.fsum(i.ms for i in schedule if i.resource == LINK)
        hidden += overlap_ms(schedule, spans)
    return RangeTimes(forward=out["forward"], backward=out["backward"], a2a=a2a, hidden=hidden)


def paired_times(fits: ClusterFits, stage: StageModel) -> tuple[float, float, float]:
    """Batch-level overlap (moe/handover.py) on this stage: (one micro-batch's forward alone, its backward alone,
    one micro-batch's forward beside another's backward), ms. The pair is the two whole micro-batches' stages
    interleaved, forward first: the stages end where the MoE layer hands over (its dispatch and its combine in
    flight, `MoELayer.stages`), which is where the executor switches between the two."""
    span = range(len(stage.layers))
    forward, _ = _piece(fits, stage, span, 1.0, "forward", unchunked=False)
    backward, pool = _piece(fits, stage, span, 1.0, "backward", unchunked=False)
    alone = [_makespan(interleave([(0, piece)]), extra) for piece, extra in ((forward, 0.0), (backward, pool))]
    return alone[0], alone[1], _makespan(interleave([(0, forward), (1, backward)]), pool)


def _makespan(schedule: Sequence[Instr], pool: float, spans: Sequence[tuple[float, float]] | None = None) -> float:
    """The schedule's end plus the deferred dW the compute's idle time does not absorb."""
    spans = simulate(schedule) if spans is None else spans
    makespan = max((end for _, end in spans), default=0.0)
    idle = makespan - math.fsum(i.ms for i in schedule if i.resource == COMPUTE)
    return makespan + max(0.0, pool - idle)
