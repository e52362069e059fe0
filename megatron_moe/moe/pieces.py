"""Stage generators and the pieces of a partitioned micro-batch (Lancet's operator partition, section 5).

Legend: S = sequence (this TP rank's shard under sequence parallelism), B = micro-batch, B_i = piece i's share of
it, T = S x B tokens in their unpartitioned order (s-major: token s * B + b, as `hidden_SBH.reshape(-1, H)`).

A forward written as a generator (`MoELayer.stages`) yields where a collective it started is in flight and returns
its output. `run_to_end` runs one straight through (the unpartitioned forward); `run_interleaved` runs k of them
in Lancet's stage order (5.3): piece 0 until it yields, then piece 1, ..., then piece 0 again, so piece i's
all-to-all is in flight while the pieces after it compute. Every rank runs the same pieces in the same order, so
every rank issues the same collectives in the same order.

The pieces split the micro-batch along B; the router's losses and the layer's statistics are the micro-batch's
(`Piece.routings` collects each piece's routing; `batch_order` puts their tokens back in the unpartitioned order).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Sequence

import torch


@dataclasses.dataclass(frozen=True)
class Piece:
    """Piece `index` of `count` of one micro-batch, in one partitioned forward."""

    index: int
    count: int
    routings: dict = dataclasses.field(default_factory=dict)
    """MoE layer -> what its pieces left for the micro-batch's router losses (shared by the pieces of a forward)."""


def run_to_end(stages: Generator):
    """A stage generator run straight through; its return value."""
    while True:
        try:
            next(stages)
        except StopIteration as done:
            return done.value


def run_interleaved(stages: Sequence[Generator]) -> list:
    """The generators run in Lancet's stage order (module docstring); their return values, in order."""
    results, live = [None] * len(stages), list(range(len(stages)))
    while live:
        for i in list(live):
            try:
                next(stages[i])
            except StopIteration as done:
                results[i] = done.value
                live.remove(i)
    return results


def piece_sizes(batch: int, count: int) -> list[int]:
    """B_i of `count` pieces of a micro-batch of `batch` sequences (they differ by at most 1, each >= 1)."""
    assert 1 <= count <= batch, (batch, count)
    return [batch * (i + 1) // count - batch * i // count for i in range(count)]


def batch_order(parts_T: Sequence[torch.Tensor | None], shapes: Sequence[torch.Size]) -> torch.Tensor | None:
    """Per-piece token tensors [S x B_i, ...] (piece i's [S, B_i, H] input had `shapes[i]`) -> the micro-batch's
    [S x B, ...] in the unpartitioned token order; None when the pieces have None."""
    if parts_T[0] is None:
        return None
    s = shapes[0][0]
    parts = [part.reshape(s, shape[1], *part.shape[1:]) for part, shape in zip(parts_T, shapes)]
    return torch.cat(parts, dim=1).reshape(-1, *parts_T[0].shape[1:])
