"""FasterMoE's dynamic shadowing: the most loaded experts' weights go to the tokens instead of the tokens to them.

Legend: G = EP group size, E = experts (global), L = local experts (E / G), K = shadowed experts this forward,
H = hidden, F = this rank's expert width (2F for SwiGLU's gate and up rows), R = rows.

In: the [G, E] routed counts every rank gathered in the layer's one counts exchange. `ShadowPolicy.choose` picks
the same experts on every rank ("auto": FasterMoE's greedy policy on the fitted lines, `greedy_shadows`); the
layer wraps them in a `ShadowPlan`, the splits' `Shadowing`: their rows stay out of the dispatch (`ShadowSplit`),
their weights are broadcast from the owner after the dispatch (`ShadowBroadcast`), the rows run through them
under the combine (`shadow_forward`), and in backward their weight gradients are reduced (summed) to the owner.
Invariants: every rank issues the same collectives in the same order; the owner's gradient is whole before DDP
hears of it (returned to autograd, or added to the owner's deferred dW closure through the store passed to its
node, `WithShadowGrads`). Not shadowed: one EP rank, capacity, ESP, custom experts, hooks needing the rows.
The steps, the latency model and its deviations from the paper: docs/internals/moe.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_moe import comm
from megatron_moe.activations.engine import SAVE_ALL
from megatron_moe.moe.dispatch import Shadowing
from megatron_moe.moe.experts import FFNExperts, GroupedMLP
from megatron_moe.moe.ordering import expert_counts, make_row_map
from megatron_moe.moe.weight_grad import RUN_NOW
from megatron_moe.platform import from_host, to_host

OFF, AUTO = "off", "auto"


@dataclasses.dataclass(frozen=True)
class ShadowCosts:
    """One MoE layer's figures for the "auto" policy: the cluster's fitted lines and the layer's sizes."""

    fits: object
    """overlap/cost_model.py `ClusterFits` (lines a2a, gemm, gemm_bwd, gemm_dw)."""
    macs_per_row: int
    """Multiply-adds of one row through one expert's forward (H x F x 2, SwiGLU 3)."""
    row_bytes: int
    """Bytes of one dispatched row (H x the element size)."""
    weight_bytes: int
    """Bytes of one expert's weights (weight1 and weight2), what a broadcast and a reduce move."""


def loads(counts_GE: Sequence[Sequence[int]]) -> list[int]:
    """Rows routed to each expert over the EP group [E]."""
    return [sum(column) for column in zip(*counts_GE)]


def by_load(counts_GE: Sequence[Sequence[int]]) -> list[int]:
    """Experts from the most loaded down; ties: the lower index (the same order on every rank)."""
    total = loads(counts_GE)
    return sorted(range(len(total)), key=lambda e: (-total[e], e))


def rank_rows(counts_GE: Sequence[Sequence[int]], shadowed: set[int], local: int) -> list[int]:
    """Rows each EP rank's experts compute [G]: its own experts' rows from every rank, less the shadowed ones',
    plus its own rows of every shadowed expert."""
    g_size = len(counts_GE)
    out = []
    for w in range(g_size):
        owned = [e for e in range(w * local, (w + 1) * local) if e not in shadowed]
        out.append(sum(counts_GE[g][e] for g in range(g_size) for e in owned) + sum(counts_GE[w][e] for e in shadowed))
    return out


def a2a_rows(counts_GE: Sequence[Sequence[int]], shadowed: set[int], local: int) -> list[int]:
    """Per EP rank, the larger of the rows it sends (its own block included: the a2a line's n) and the rows it
    receives, over the experts not shadowed [G]."""
    g_size, num_experts = len(counts_GE), len(counts_GE[0])
    kept = [e for e in range(num_experts) if e not in shadowed]
    sent = [sum(counts_GE[w][e] for e in kept) for w in range(g_size)]
    received = [sum(counts_GE[g][e] for g in range(g_size) for e in kept if e // local == w) for w in range(g_size)]
    return [max(s, r) for s, r in zip(sent, received)]


def predicted_ms(counts_GE: Sequence[Sequence[int]], shadowed: set[int], local: int, costs: ShadowCosts) -> float:
    """FasterMoE's layer time T(S) on the fitted lines (docs/internals/moe.md)."""
    fits, g_size = costs.fits, len(counts_GE)
    macs = [rows * costs.macs_per_row for rows in rank_rows(counts_GE, shadowed, local)]
    compute = sum(max(fits[kind].time_ms(n) for n in macs) for kind in ("gemm", "gemm_bwd", "gemm_dw"))
    a2a = fits["a2a"]
    moved = 4 * a2a.time_ms(max(a2a_rows(counts_GE, shadowed, local)) * costs.row_bytes)
    crossing = costs.weight_bytes * g_size / (g_size - 1)
    return compute + moved + len(shadowed) * 2 * a2a.time_ms(crossing)


def greedy_shadows(counts_GE: Sequence[Sequence[int]], local: int, costs: ShadowCosts) -> tuple[int, ...]:
    """FasterMoE's policy: the most loaded experts, each while T falls; the first that does not lower it stops."""
    shadowed: set[int] = set()
    best = predicted_ms(counts_GE, shadowed, local, costs)
    for e in by_load(counts_GE):
        t = predicted_ms(counts_GE, shadowed | {e}, local, costs)
        if t >= best:
            break
        shadowed.add(e)
        best = t
    return tuple(sorted(shadowed))


class ShadowPolicy:
    """Which experts one MoE layer shadows, from the agreed [G, E] counts: "off", "auto" (`greedy_shadows` on
    `costs`; off until the training set-up gives them) or N (the N most loaded)."""

    def __init__(self, mode: str | int, local: int, costs: ShadowCosts | None = None):
        self.mode, self.local, self.costs = mode, local, costs

    @property
    def active(self) -> bool:
        """Whether the layer gathers the [G, E] counts and may shadow."""
        return self.mode != OFF

    def choose(self, counts_GE: Sequence[Sequence[int]]) -> tuple[int, ...]:
        if self.mode == OFF or (self.mode == AUTO and self.costs is None):
            return ()
        if self.mode == AUTO:
            return greedy_shadows(counts_GE, self.local, self.costs)
        return tuple(sorted(by_load(counts_GE)[: self.mode]))


@dataclasses.dataclass(frozen=True)
class ShadowSplit:
    """One forward's shadowing: which experts, and how the expert-major send buffer splits."""

    experts: tuple[int, ...]
    """Shadowed global experts, ascending (the broadcasts' and the reduces' order on every rank)."""
    counts: list[int]
    """This rank's rows per global expert in the send buffer [E] (the layer's row map)."""
    local: int
    """L: expert e lives on EP rank e // L, local index e % L."""

    @property
    def sent_counts(self) -> list[int]:
        """The dispatch's counts [E]: the shadowed experts' rows stay here."""
        shadowed = set(self.experts)
        return [0 if e in shadowed else c for e, c in enumerate(self.counts)]

    @property
    def shadow_counts(self) -> list[int]:
        """Rows of each shadowed expert computed here [K]."""
        return [self.counts[e] for e in self.experts]

    def split(self, rows_RH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows to dispatch, in expert order without the shadowed; rows computed here, in `experts` order)."""
        parts = torch.split(rows_RH, self.counts)
        shadowed = set(self.experts)
        sent = [part for e, part in enumerate(parts) if e not in shadowed]
        return torch.cat(sent) if sent else rows_RH[:0], torch.cat([parts[e] for e in self.experts])

    def merge(self, sent_RH: torch.Tensor, shadow_RH: torch.Tensor) -> torch.Tensor:
        """The inverse of `split`: both results back in the send buffer's expert-major order."""
        sent = torch.split(sent_RH, self.sent_counts)  # E parts, the shadowed experts' empty
        shadow = dict(zip(self.experts, torch.split(shadow_RH, self.shadow_counts)))
        return torch.cat([shadow.get(e, part) for e, part in enumerate(sent)])


def _owner(split: ShadowSplit, e: int, group) -> tuple[int, int]:
    """(expert e's owner as a global rank, e's local index there)."""
    return dist.get_global_rank(group, e // split.local), e % split.local


def _flat(w1_FH: torch.Tensor, w2_HF: torch.Tensor) -> torch.Tensor:
    return torch.cat([w1_FH.reshape(-1), w2_HF.reshape(-1)])


class ShadowBroadcast:
    """The shadowed experts' weights on their way from the owners (step 3); `wait()` gives them [K, ...]."""

    def __init__(self, experts: FFNExperts, split: ShadowSplit, group, layer: int | None):
        self.split, self.group = split, group
        w1, w2 = experts.weight1, experts.weight2
        self.shapes = (w1.shape[1:], w2.shape[1:])
        size = w1[0].numel() + w2[0].numel()
        me = dist.get_rank()
        self.buffers, self.works = [], []
        for e in split.experts:
            owner, index = _owner(split, e, group)
            mine = owner == me
            buffer = _flat(w1[index].detach(), w2[index].detach()) if mine else w1.new_empty(size)
            self.buffers.append(buffer)
            self.works.append(comm.shadow_broadcast(buffer, owner, group, layer=layer))

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        for work in self.works:
            work.wait()
        self.works = []
        (f1, h1), (h2, f2) = self.shapes
        w1 = torch.stack([b[: f1 * h1].view(f1, h1) for b in self.buffers])
        w2 = torch.stack([b[f1 * h1 :].view(h2, f2) for b in self.buffers])
        return w1, w2


class ShadowGrads:
    """One forward's shadow gradients reduced to this rank, for the owner's deferred dW closure (step 5)."""

    def __init__(self):
        self.grads: tuple | None = None
        """(dW1, dW2) of this rank's experts from the shadows, None where it owns no shadowed expert."""
        self.reduced = False

    def put(self, grads: tuple | None) -> None:
        self.grads, self.reduced = grads, True

    def added(self, grads: tuple) -> tuple:
        """The owner's closure's (dW1, dW2) plus the shadows' (once)."""
        if not self.reduced:
            raise RuntimeError(
                "shadow experts: the owner's weight-gradient closure ran before the shadows' gradients were reduced "
                "to it (their backward must run first, moe/shadow.py step 5); run with --moe-shadow-experts off"
            )
        extra, self.grads = self.grads, None
        if extra is None:
            return grads
        return tuple(e if g is None else g + e for g, e in zip(grads, extra))


class WithShadowGrads:
    """A deferring `WeightGradStore` around the experts' own for one forward: each closure it is given returns the
    shadows' gradients (`ShadowGrads`) added to its own."""

    defers = True

    def __init__(self, store, slot: ShadowGrads):
        self.store, self.slot = store, slot

    def put(self, weight_grad, outs: tuple):
        def plus(*outs):
            return self.slot.added(weight_grad(*outs))

        return self.store.put(plus, outs)


class _ShadowWeights(torch.autograd.Function):
    """Forward: the received shadow weights, tied to the owner's parameters. Backward: each shadow's gradient
    reduced to its owner (step 5): returned as the owner's weight gradient, or into `slot` for a deferred owner's
    closure (None on a rank that owns none)."""

    @staticmethod
    def forward(ctx, weight1, weight2, w1_KFH, w2_KHF, split: ShadowSplit, group, layer, slot):
        ctx.split, ctx.group, ctx.layer, ctx.slot = split, group, layer, slot
        ctx.weights = (weight1.shape, weight2.shape, weight1.dtype, weight1.device)
        return w1_KFH.view_as(w1_KFH), w2_KHF.view_as(w2_KHF)

    @staticmethod
    def backward(ctx, grad_w1_KFH, grad_w2_KHF):
        split, group = ctx.split, ctx.group
        shape1, shape2, dtype, device = ctx.weights
        me = dist.get_rank()
        works, mine = [], []
        for k, e in enumerate(split.experts):
            owner, index = _owner(split, e, group)
            flat = _flat(grad_w1_KFH[k], grad_w2_KHF[k]).contiguous()
            works.append(comm.shadow_reduce(flat, owner, group, layer=ctx.layer))
            if owner == me:
                mine.append((index, flat))
        for work in works:
            work.wait()
        grads = None
        if mine:
            grad1 = torch.zeros(shape1, dtype=dtype, device=device)
            grad2 = torch.zeros(shape2, dtype=dtype, device=device)
            for index, flat in mine:
                n1 = grad1[index].numel()
                grad1[index] = flat[:n1].view_as(grad1[index])
                grad2[index] = flat[n1:].view_as(grad2[index])
            grads = (grad1, grad2)
        if ctx.slot is not None:  # the owner's deferred closure adds them
            ctx.slot.put(grads)
            grads = None
        return *(grads or (None, None)), None, None, None, None, None, None


def shadow_forward(
    experts: FFNExperts,
    broadcast: ShadowBroadcast,
    rows_RH: torch.Tensor,
    group,
    layer: int | None,
    slot: ShadowGrads | None = None,
) -> torch.Tensor:
    """Step 4: this rank's rows of the shadowed experts through their received weights (the owner's arithmetic:
    `GroupedMLP`, its weight gradients now, for the reduce). `slot`: where the reduced gradients wait for the
    owner's deferred closure (None: the owner's node computes its dW itself)."""
    w1_KFH, w2_KHF = broadcast.wait()
    w1_KFH, w2_KHF = _ShadowWeights.apply(
        experts.weight1, experts.weight2, w1_KFH, w2_KHF, broadcast.split, group, layer, slot
    )
    keeping = experts.keeping or SAVE_ALL  # None: the policy runs fc1/act/fc2 apart; the shadows keep everything
    counts = broadcast.split.shadow_counts
    return GroupedMLP.apply(rows_RH, w1_KFH, w2_KHF, counts, experts.gated, experts.chunk_bytes, keeping, RUN_NOW)


class ShadowPlan(Shadowing):
    """One forward's shadowing (`Shadowing`, the splits' transform): `split`'s shadowed rows stay here, `start`
    broadcasts their weights (step 3), `compute` runs them (step 4), `merge` puts them back; the owner's node
    gets a store that adds the shadows' reduced gradients when the experts' store defers (step 5), passed to it
    explicitly (`owner_store`, `experts_options`): no store is swapped."""

    def __init__(self, split: ShadowSplit, experts: FFNExperts, group, layer: int | None):
        self.shadow, self.experts, self.group, self.layer = split, experts, group, layer
        self.shadowed = split.experts
        self.slot = ShadowGrads() if experts.weight_grad_store.defers else None
        self.rows_RH: torch.Tensor | None = None
        self.broadcast: ShadowBroadcast | None = None
        self.out_RH: torch.Tensor | None = None

    def sent_counts(self, counts: list[int]) -> list[int]:
        return self.shadow.sent_counts

    def split(self, rows_RH: torch.Tensor) -> torch.Tensor:
        rows_RH, self.rows_RH = self.shadow.split(rows_RH)
        return rows_RH

    def start(self) -> None:
        self.broadcast = ShadowBroadcast(self.experts, self.shadow, self.group, self.layer)

    def owner_store(self, store):
        return store if self.slot is None else WithShadowGrads(store, self.slot)

    def experts_options(self) -> dict:
        return {"store": self.owner_store(self.experts.weight_grad_store)}

    def compute(self) -> None:
        """Made after the owner's experts' node: autograd runs it first in backward (step 5)."""
        self.out_RH = shadow_forward(self.experts, self.broadcast, self.rows_RH, self.group, self.layer, self.slot)
        self.rows_RH = self.broadcast = None

    def merge(self, rows_RH: torch.Tensor) -> torch.Tensor:
        out_RH, self.out_RH = self.out_RH, None
        return self.shadow.merge(rows_RH, out_RH)


def arrange_shadowed(routing, policy: ShadowPolicy, d, experts: FFNExperts, layer: int | None) -> tuple:
    """`MoELayer.arrange` with shadow experts (dropless, exact rows; `d`: the layer's dispatcher): (RowMap,
    DispatchSplits whose `shadow` is this forward's `ShadowPlan`), after the same one host wait:
    1. on the device: pairs per expert;
    2. on the device: every rank's pairs per expert [G, E] (`comm.gather_counts`, in place of the counts
       exchange: a rank's received counts are its columns);
    3. ONE device->host copy; the shadowed experts chosen from the gathered counts (the same on every rank);
       the splits of the rows still dispatched (the shadowed experts' counts 0) and the `ShadowSplit`."""
    num_experts, local = routing.num_experts, d.num_local_experts
    routed_E = expert_counts(routing.expert_N, num_experts)  # 1.
    gathered_GE = comm.gather_counts(routed_E, d.group, layer=layer)  # 2.
    with comm.host_read("moe plan counts", layer=layer):
        routed, gathered = to_host(routed_E, gathered_GE)  # 3.
    counts_GE = [gathered[g * num_experts : (g + 1) * num_experts] for g in range(d.group_size)]
    row_map = make_row_map(routing, capacity=None, padded=False, routed_E=routed_E, routed=routed)
    shadow = ShadowSplit(policy.choose(counts_GE), row_map.counts, local)
    shadowed, first = set(shadow.experts), comm.group_rank(d.group) * local
    received = [0 if e in shadowed else row[e] for row in counts_GE for e in range(first, first + local)]
    if d.hierarchy is not None:  # 2DH's dispatcher takes every rank's counts [G, E] (its columns: received)
        received = [0 if e in shadowed else row[e] for row in counts_GE for e in range(num_experts)]
    received_dev = from_host(received, torch.long, routed_E.device)
    splits = d.make_splits(shadow.sent_counts, received_dev, received)
    if not shadow.experts:
        return row_map, splits
    return row_map, dataclasses.replace(splits, shadow=ShadowPlan(shadow, experts, d.group, layer))
