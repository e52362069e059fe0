"""FSMoE's chunked pipeline: dispatch -> experts -> combine of the built-in experts in r chunks, one autograd node.

Legend: G = EP group size, L = local experts, P = ESP group size, X = P x G (source ranks of a local expert's
rows after the ESP all-gather, in (p, g) order), r = pipeline degree, R = rows of this rank's send buffer
(expert-major), Q = rows this rank's experts compute (the r = 1 layout), H = hidden, F = this rank's expert width.

In: the send buffer [R, H] (`counts[e]` rows for global expert e), the host counts every rank has
(`DispatchSplits.received_GL`), the degrees (forward, backward) and the dispatcher's `ChunkTransport`. Out: the
experts' outputs [R, H] in the send layout. Chunk j takes part j (`part`) of every (g, l) block; chunk j+1's
all-to-all is in flight while chunk j computes. Invariants: nothing here reads the device; the kept activations,
the memory and the weight gradients (one closure over all rows, handed to the store when the last dX is on the
wire) equal r = 1's; r = 1 (`Chunk.whole`) copies nothing. Two nodes: `_StartPipeline` (chunk 0's all-to-all;
in backward the last dX) and `PipelinedExperts` (the rest), so the layer's work between them runs under those
all-to-alls. The schedule step by step: docs/internals/moe.md.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from megatron_moe import comm
from megatron_moe.moe.dispatch import ChunkTransport, chunk_permutation
from megatron_moe.moe.experts import fc1, mlp_weight_grads, save_kept, saved_kept
from megatron_moe.moe.ffn import ffn_activation, ffn_activation_backward_
from megatron_moe.moe.grouped_gemm import grouped_mm
from megatron_moe.platform import from_host

Links = ChunkTransport
"""The dispatcher's per-chunk transport under the name overlap/profiler.py imports."""


def part(count: int, r: int, j: int) -> int:
    """Rows of chunk j of r of a block of `count` rows (the parts of a block add up to it, sizes differ by <= 1)."""
    return count * (j + 1) // r - count * j // r


def _ranges(starts: list[int], sizes: list[int], device) -> torch.Tensor:
    """The concatenated row ranges [start, start + size) as a long tensor on `device` (copied from the host
    without waiting for the device)."""
    total = sum(sizes)
    starts_B, sizes_B = (from_host(values, torch.long, device) for values in (starts, sizes))
    shift_B = starts_B - (torch.cumsum(sizes_B, 0) - sizes_B)
    return torch.repeat_interleave(shift_B, sizes_B, output_size=total) + torch.arange(total, device=device)


def _starts(sizes: list[int]) -> list[int]:
    return list(itertools.accumulate(sizes, initial=0))[:-1]


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One chunk's host splits and device index tensors."""

    send_rows: torch.Tensor
    """Rows of the send buffer, in (destination g, expert l) order [R_j]."""
    send_splits: list[int]
    """Rows to each EP rank [G]."""
    recv_splits: list[int]
    """Rows from each EP rank [G]."""
    esp_sizes: list[int]
    """Rows each ESP peer received from its all-to-all [P] (this rank's: sum(recv_splits))."""
    counts: list[int]
    """Rows per local expert [L]."""
    to_expert: torch.Tensor | None
    """(x, l) -> (l, x) row permutation of the received (and gathered) rows; None: the identity."""
    to_source: torch.Tensor | None
    expert_rows: torch.Tensor
    """Where the chunk's rows, in (l, x) order, lie in the r = 1 layout [Q_j]."""
    pairs: tuple[tuple[int, ...], ...] | None = None
    """Rows from each EP rank to each in this chunk [G][G], for 2DH (comm/hierarchy.py); None: not needed."""
    whole: bool = False
    """The only chunk (r = 1): `send_rows` and `expert_rows` are the identity, so its rows are the buffers
    themselves, with no gather or copy (`_rows_of`, `_into`): r = 1 here costs what the unpipelined path does."""

    @property
    def num_rows(self) -> int:
        return sum(self.counts)


def plan_chunks(
    send_GL: list[list[int]],
    received_XL: list[list[int]],
    r: int,
    *,
    esp_rank: int = 0,
    device=None,
    sent_GE: list[list[int]] | None = None,
) -> list[Chunk]:
    """The r chunks of one forward (or backward): `send_GL` rows this rank sends to (g, l), `received_XL` rows
    each source x = (p, g) sends to this rank's ESP group for local expert l (P = 1: this rank's received_GL);
    the index tensors on `device` (None: the host). `sent_GE`: every rank's rows per expert, for each chunk's
    pairs (2DH); None: no pairs."""
    device = torch.device("cpu") if device is None else device
    g_size, l_size, x_size = len(send_GL), len(send_GL[0]), len(received_XL)
    p_size = x_size // g_size
    send = [c for row in send_GL for c in row]  # (g, l) order
    send_starts = _starts(send)
    received_lx = [received_XL[x][l] for l in range(l_size) for x in range(x_size)]  # the r = 1 layout's blocks
    q_starts = _starts(received_lx)
    lx = [(l, x) for l in range(l_size) for x in range(x_size)]
    chunks = []
    for j in range(r):
        send_parts = [part(c, r, j) for c in send]
        parts_XL = [[part(c, r, j) for c in row] for row in received_XL]
        mine_GL = parts_XL[esp_rank * g_size : (esp_rank + 1) * g_size]
        num_rows = sum(map(sum, parts_XL))
        to_expert = to_source = None
        if x_size > 1 and l_size > 1:
            to_expert, to_source = chunk_permutation(from_host(parts_XL, torch.long, device), num_rows)
        chunks.append(
            Chunk(
                send_rows=_ranges([s + c * j // r for s, c in zip(send_starts, send)], send_parts, device),
                send_splits=[sum(send_parts[g * l_size : (g + 1) * l_size]) for g in range(g_size)],
                recv_splits=[sum(row) for row in mine_GL],
                esp_sizes=[sum(map(sum, parts_XL[p * g_size : (p + 1) * g_size])) for p in range(p_size)],
                counts=[sum(parts_XL[x][l] for x in range(x_size)) for l in range(l_size)],
                to_expert=to_expert,
                to_source=to_source,
                expert_rows=_ranges(
                    [q_starts[i] + received_XL[x][l] * j // r for i, (l, x) in enumerate(lx)],
                    [parts_XL[x][l] for l, x in lx],
                    device,
                ),
                pairs=None if sent_GE is None else _chunk_pairs(sent_GE, l_size, r, j),
                whole=r == 1,
            )
        )
    return chunks


def _chunk_pairs(sent_GE: list[list[int]], l_size: int, r: int, j: int) -> tuple[tuple[int, ...], ...]:
    """Chunk j's rows from each EP rank to each [G][G]: part j of every (source, expert) block, summed over the
    destination's local experts (the splits every rank computes for its own row and column, for all pairs)."""
    return tuple(
        tuple(sum(part(c, r, j) for c in row[d * l_size : (d + 1) * l_size]) for d in range(len(row) // l_size))
        for row in sent_GE
    )


def _rows_of(rows: torch.Tensor, index: torch.Tensor, whole: bool) -> torch.Tensor:
    """A chunk's rows (at `index`) of a buffer in the r = 1 layout; a whole chunk's are the buffer."""
    return rows if whole else rows.index_select(0, index)


def _into(buffer: torch.Tensor | None, index: torch.Tensor, values: torch.Tensor, whole: bool) -> torch.Tensor:
    """`values` written at rows `index` of `buffer` (returned); a whole chunk's values are the buffer (no copy)."""
    if whole:
        return values
    return buffer.index_copy_(0, index, values)


@dataclasses.dataclass(frozen=True)
class PipelineRun:
    """Everything one pipelined forward and its backward need besides the tensors."""

    forward: list[Chunk]
    backward: list[Chunk]
    counts: list[int]
    """Rows per local expert in the r = 1 layout [L]."""
    links: ChunkTransport
    gated: bool
    keeping: object
    """The experts' `Keeping` (activation policy)."""
    store: object
    """The experts' `WeightGradStore`."""

    @property
    def num_rows(self) -> int:
        return sum(self.counts)


def _chunk_forward(x, w1_EFH, w2_EHF, chunk: Chunk, gated: bool, kept_QX: list) -> torch.Tensor:
    """fc1 -> act -> fc2 of one chunk's rows; x, h, a go into the r = 1 layout buffers `kept_QX` (a whole chunk's
    are the buffers)."""
    if chunk.num_rows == 0:
        if chunk.whole:
            kept_QX[:] = [x.new_empty(0, n) for n in (x.shape[1], w1_EFH.shape[1], w2_EHF.shape[2])]
        return x.new_empty(0, w2_EHF.shape[1])
    h = fc1(x, w1_EFH, chunk.counts)
    a = ffn_activation(h, gated)
    y = grouped_mm(a, w2_EHF.transpose(1, 2), chunk.counts)
    kept_QX[:] = [_into(buffer, chunk.expert_rows, t, chunk.whole) for buffer, t in zip(kept_QX, (x, h, a))]
    return y


class _Flight:
    """What one pipelined call's two nodes hand each other: forward, chunk 0's all-to-all (started by the first
    node); backward, the last all-to-all of dX and the buffer it completes (waited by the first node)."""

    def __init__(self):
        self.sending: comm.CommHandle | None = None
        self.returning: tuple[comm.CommHandle, Chunk] | None = None
        self.grad_in_RH: torch.Tensor | None = None


class _StartPipeline(torch.autograd.Function):
    """Forward: start chunk 0's all-to-all. Backward: wait for the last chunk's dX and return the input gradient.

    Work autograd places between this node and `PipelinedExperts` (the shared expert, forward and backward)
    runs while those all-to-alls are in flight. Returns an empty token that orders the two nodes."""

    @staticmethod
    def forward(ctx, rows_RH, run: PipelineRun, flight: _Flight):
        chunk = run.forward[0]
        rows = _rows_of(rows_RH, chunk.send_rows, chunk.whole)
        flight.sending = run.links.to_experts(rows, chunk, backward=False)
        ctx.run, ctx.flight = run, flight
        return rows_RH.new_empty(0)

    @staticmethod
    def backward(ctx, _):
        flight = ctx.flight
        if flight.returning is not None:
            handle, chunk = flight.returning
            grad_in = ctx.run.links.wait(handle, backward=True)
            flight.grad_in_RH = _into(flight.grad_in_RH, chunk.send_rows, grad_in, chunk.whole)
        grad_in_RH, flight.grad_in_RH, flight.returning = flight.grad_in_RH, None, None
        return grad_in_RH, None, None


class PipelinedExperts(torch.autograd.Function):
    """rows [R, H] in the send layout -> the experts' outputs back in the same layout; see docs/internals/moe.md.

    Its input gradient goes to `_StartPipeline` (the token's node), which finishes it."""

    @staticmethod
    def forward(ctx, rows_RH, token, w1_EFH, w2_EHF, run: PipelineRun, flight: _Flight):
        q, links, chunks = run.num_rows, run.links, run.forward
        whole = chunks[0].whole  # r = 1: the chunk's tensors are the kept ones and the output, no copies
        widths = (rows_RH.shape[1], w1_EFH.shape[1], w2_EHF.shape[2])
        kept_QX = [None] * 3 if whole else [rows_RH.new_empty(q, n) for n in widths]
        out_RH = None if whole else torch.empty_like(rows_RH)
        sending, flight.sending = flight.sending, None
        returning = None
        for j, chunk in enumerate(chunks):
            received = sending
            if j + 1 < len(chunks):  # 1. the next chunk's all-to-all is in flight while this one computes
                after = chunks[j + 1]
                sending = links.to_experts(rows_RH.index_select(0, after.send_rows), after, backward=False)
            x = links.gather(received.wait(), chunk, backward=False)  # 2.
            y = _chunk_forward(x, w1_EFH, w2_EHF, chunk, run.gated, kept_QX)  # 3.
            handle = links.from_experts(links.scatter(y, chunk, backward=False), chunk, backward=False)  # 4., 5.
            if returning is not None:
                out_RH.index_copy_(0, returning[1].send_rows, returning[0].wait())
            returning = (handle, chunk)
        out_RH = _into(out_RH, returning[1].send_rows, returning[0].wait(), whole)
        keeping = run.keeping
        save_kept(ctx, (w1_EFH, w2_EHF), [keeping.keep(name, t) for name, t in zip("xha", kept_QX)])
        ctx.run, ctx.flight = run, flight
        return out_RH

    @staticmethod
    def backward(ctx, grad_RH):
        run = ctx.run
        (w1_EFH, w2_EHF), kept = saved_kept(ctx, 2)
        x_QH, h_QF, a_QF = (run.keeping.fetch(k, 0, run.num_rows) for k in kept)
        need_x, need_w1, need_w2 = ctx.needs_input_grad[0], *ctx.needs_input_grad[2:4]
        grad_RH = grad_RH.contiguous()
        whole = run.backward[0].whole  # r_b = 1: the chunk's tensors are the buffers below, no copies

        def buffer(width: int, needed: bool) -> torch.Tensor | None:
            return grad_RH.new_empty(run.num_rows, width) if needed and not whole else None

        # The weight gradients' operands in the r = 1 layout, filled chunk by chunk.
        recompute_a = need_w2 and a_QF is None
        schedule = _Backward(
            run,
            (w1_EFH, w2_EHF),
            kept={"x": x_QH, "h": h_QF, "a": a_QF if not recompute_a else buffer(w2_EHF.shape[2], True)},
            grads={"y": buffer(grad_RH.shape[1], need_w2), "h": buffer(w1_EFH.shape[1], need_w1)},
            wanted={"x": need_x, "w1": need_w1, "w2": need_w2, "a": recompute_a},
        )
        ctx.flight.grad_in_RH = torch.empty_like(grad_RH) if need_x and not whole else None
        grads = schedule.schedule(grad_RH, ctx.flight)
        return None, grad_RH.new_empty(0), *grads, None, None


class _Backward:
    """The backward schedule of r_b chunks (numbered as in docs/internals/moe.md)."""

    def __init__(self, run: PipelineRun, weights: tuple, *, kept: dict, grads: dict, wanted: dict):
        """`kept`: the forward's x, h (None: recompute) and a (None: not needed; with wanted["a"] the buffer it is
        recomputed into); `grads`: the r = 1 layout buffers of dY and dH the weight gradients read (None: not
        needed, or a whole chunk's own tensors); `wanted`: which of dX, dW1, dW2 autograd asks for."""
        self.run, (self.w1_EFH, self.w2_EHF) = run, weights
        self.kept, self.grads, self.wanted = kept, grads, wanted

    def schedule(self, grad_RH, flight: _Flight) -> tuple:
        """Writes dX into `flight.grad_in_RH` but for the last chunk's, left in flight for `_StartPipeline`;
        returns (dW1, dW2) for autograd (None where the store keeps them)."""
        links, chunks, need_x = self.run.links, self.run.backward, self.wanted["x"]
        grads = (None, None)
        first = chunks[0]
        sending = links.to_experts(_rows_of(grad_RH, first.send_rows, first.whole), first, backward=True)
        returning = None
        for j, chunk in enumerate(chunks):
            received = sending
            if j + 1 < len(chunks):
                after = chunks[j + 1]
                sending = links.to_experts(grad_RH.index_select(0, after.send_rows), after, backward=True)
            grad_y = links.gather(links.wait(received, backward=True), chunk, backward=True)  # 1.
            grad_x = self._chunk(grad_y, chunk)  # 2.
            handle = None
            if need_x:  # 3.
                handle = links.from_experts(links.scatter(grad_x, chunk, backward=True), chunk, backward=True)
            if j + 1 == len(chunks) and (self.wanted["w1"] or self.wanted["w2"]):  # every chunk's dY, dH is in:
                grads = self.run.store.put(self._weight_grads(), (None, None)) or (None, None)  # dW under the last
            if returning is not None:
                flight.grad_in_RH.index_copy_(0, returning[1].send_rows, links.wait(returning[0], backward=True))
            returning = None if handle is None else (handle, chunk)
        flight.returning = returning
        return grads

    def _weight_grads(self):
        kept, grads, wanted = self.kept, self.grads, self.wanted
        needs = (wanted["w1"], wanted["w2"])
        return mlp_weight_grads(grads["y"], kept["x"], kept["a"], grads["h"], self.run.counts, needs)

    def _chunk(self, grad_y, chunk: Chunk):
        """dX of one chunk's rows (or None); its dY and dH go into the r = 1 layout buffers (a whole chunk's are
        the buffers)."""
        kept, grads, wanted = self.kept, self.grads, self.wanted
        if chunk.num_rows == 0:
            if chunk.whole:  # the buffers are this chunk's: empty ones
                grads["y"], grads["h"] = grad_y, grad_y.new_empty(0, self.w1_EFH.shape[1])
                if wanted["a"]:
                    kept["a"] = grad_y.new_empty(0, self.w2_EHF.shape[2])
            return grad_y.new_empty(0, kept["x"].shape[1])
        rows, counts, gated, whole = chunk.expert_rows, chunk.counts, self.run.gated, chunk.whole
        x = _rows_of(kept["x"], rows, whole)
        h = fc1(x, self.w1_EFH, counts) if kept["h"] is None else _rows_of(kept["h"], rows, whole)
        if wanted["a"]:
            kept["a"] = _into(kept["a"], rows, ffn_activation(h, gated), whole)
        if wanted["w2"]:
            grads["y"] = _into(grads["y"], rows, grad_y, whole)
        # dA = dY W2, dH = act'(h) dA (in dA's buffer), dX = dH W1: as GroupedMLP's backward
        grad_h = ffn_activation_backward_(grouped_mm(grad_y, self.w2_EHF, counts), h, gated)
        grad_x = grouped_mm(grad_h, self.w1_EFH, counts) if wanted["x"] else None
        if wanted["w1"]:
            grads["h"] = _into(grads["h"], rows, grad_h, whole)
        return grad_x


class PipelineStart:
    """A pipelined call whose chunk 0 is in flight: `finish()` runs the rest and returns the combined rows."""

    def __init__(self, rows_RH: torch.Tensor, experts, run: PipelineRun):
        self.rows_RH, self.experts, self.run, self.flight = rows_RH, experts, run, _Flight()
        self.token = _StartPipeline.apply(rows_RH, run, self.flight)

    def finish(self) -> torch.Tensor:
        weights = (self.experts.weight1, self.experts.weight2)
        return PipelinedExperts.apply(self.rows_RH, self.token, *weights, self.run, self.flight)


def start_pipeline(
    rows_RH: torch.Tensor,
    experts,
    counts: list[int],
    received_XL: list[list[int]],
    degrees: tuple[int, int],
    links: ChunkTransport,
    *,
    esp_rank: int = 0,
    sent_GE: list[list[int]] | None = None,
    store=None,
) -> PipelineStart:
    """The built-in `experts` (`FFNExperts`) on the send buffer `rows_RH` (`counts[e]` rows for global expert
    e), through the EP (and ESP) groups of `links`, in degrees[0] chunks forward and degrees[1] backward;
    `received_XL`: rows each source x = (p, g) sends this rank's ESP group for each local expert; `sent_GE`: every
    rank's rows per expert where the transport needs every pair (2DH); `store`: where the weight gradients go
    (None: the experts' `weight_grad_store`). Every chunk's splits and indices are computed here, and chunk 0's
    all-to-all starts."""
    g, l = links.ep_size, experts.num_local_experts
    send_GL = [counts[i * l : (i + 1) * l] for i in range(g)]
    forward, backward = degrees
    device = rows_RH.device
    chunks_f = plan_chunks(send_GL, received_XL, forward, esp_rank=esp_rank, device=device, sent_GE=sent_GE)
    chunks_b = chunks_f
    if backward != forward:
        chunks_b = plan_chunks(send_GL, received_XL, backward, esp_rank=esp_rank, device=device, sent_GE=sent_GE)
    local_counts = [sum(row[e] for row in received_XL) for e in range(l)]
    store = experts.weight_grad_store if store is None else store
    run = PipelineRun(chunks_f, chunks_b, local_counts, links, experts.gated, experts.keeping, store)
    return PipelineStart(rows_RH, experts, run)


def pipelined_experts(rows_RH, experts, counts, received_XL, degrees, links, *, esp_rank: int = 0) -> torch.Tensor:
    """`start_pipeline(...).finish()`: nothing between the two."""
    return start_pipeline(rows_RH, experts, counts, received_XL, degrees, links, esp_rank=esp_rank).finish()
