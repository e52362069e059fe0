"""Tutel's two-dimensional hierarchical (2DH) all-to-all (Tutel, section 3.4 and Algorithm 3): the EP group's nodes,
its groups, and the split arithmetic of one exchange. The collective itself is `transport.all_to_all_2dh`.

Legend: G = EP group size, N = nodes it spans, g = its ranks per node (G = N x g; rank (n, l) = n x g + l,
node-major), R = rows.

Phases: 1. stride copy to (local peer, node) order; 2. intra-node all-to-all; 3. stride copy to (node, source
local) order; 4. inter-node all-to-all per rail (ranks of one local index). Inputs: the [G, G] pair matrix of
rows (`pairs`, from the layer's one counts exchange). Outputs: per-phase split sizes on the host. Invariants:
the output equals the linear all-to-all's, in source rank order, with no copy after; nothing here reads the
device. The message and byte counts, and the deviations from the paper (uneven splits, messages per node pair
per rail, phase 2 completing before phase 3): docs/internals/comm.md.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import torch
import torch.distributed as dist

from megatron_moe.comm.core import Collective, issue


class NotHierarchical(ValueError):
    """The EP group cannot run 2DH; the message says why."""


def ranks_per_node(world: int | None = None) -> int:
    """Ranks per node, as the launcher says (torchrun's LOCAL_WORLD_SIZE: --nproc-per-node). Global ranks are
    node-major: node n holds ranks n x g .. n x g + g - 1 (torchrun's --node-rank). Where no launcher says, the
    whole world (`world`, else the default group's size, else 1) is one node: nothing is taken to cross a link."""
    if "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    if world is None:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return world


@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """Where the EP group's ranks lie: N nodes of g ranks each, group rank = node x g + local."""

    nodes: int
    per_node: int
    node: int
    """This rank's node (0..N-1, in the EP group's order)."""
    local: int
    """This rank's index inside its node (0..g-1): its rail."""

    @property
    def size(self) -> int:
        return self.nodes * self.per_node

    @property
    def rank(self) -> int:
        return self.node * self.per_node + self.local

    def crossing(self, splits: list[int]) -> tuple[int, int]:
        """(messages, rows) a linear all-to-all sending `splits[d]` rows to rank d sends across nodes."""
        remote = [s for d, s in enumerate(splits) if d // self.per_node != self.node]
        return sum(1 for s in remote if s), sum(remote)


def node_layout(ranks: list[int], per_node: int, me: int) -> NodeLayout:
    """The layout of an EP group of global `ranks` (in group order) on nodes of `per_node` consecutive global ranks;
    `me`: this process's global rank. NotHierarchical when the group's ranks are not node-major with the same
    count on each node it spans."""
    node_of = [r // per_node for r in ranks]
    nodes = list(dict.fromkeys(node_of))
    per = len(ranks) // len(nodes)
    blocks = [node_of[i * per : (i + 1) * per] for i in range(len(nodes))]
    if per * len(nodes) != len(ranks) or any(block != [n] * per for block, n in zip(blocks, nodes)):
        raise NotHierarchical(
            f"the EP group's ranks {ranks} are not node-major with the same number per node ({per_node} ranks per "
            "node, LOCAL_WORLD_SIZE)"
        )
    index = ranks.index(me)
    return NodeLayout(nodes=len(nodes), per_node=per, node=index // per, local=index % per)


def layout_of(group) -> NodeLayout | None:
    """This rank's EP group (`group`) on the nodes, from the launcher's ranks per node; None in a single process or
    where the group is not node-major (no collective: every rank computes it from the same figures)."""
    if group is None or not dist.is_initialized():
        return None
    try:
        return node_layout(dist.get_process_group_ranks(group), ranks_per_node(), dist.get_rank())
    except NotHierarchical:
        return None


@dataclasses.dataclass(frozen=True)
class Hierarchy:
    """An EP group's layout and the two groups 2DH runs on: this rank's node (intra, g ranks, group rank = local)
    and its rail (inter, N ranks of the same local index, group rank = node)."""

    layout: NodeLayout
    intra: Any
    inter: Any


_HIERARCHIES: dict = {}
"""EP group -> its `Hierarchy` (`make_hierarchy_groups`)."""


def make_hierarchy_groups(group, timeout=None) -> Hierarchy:
    """For every EP group (this rank's: `group`), its intra-node and rail groups. Collective: every rank calls it
    with its own EP group, and every rank makes every group in one order. NotHierarchical (on every rank: each
    checks every EP group) when an EP group lies in one node or is not node-major with equal ranks per node; the
    groups go with the others (`destroy_groups_but_world`, `forget_hierarchies`)."""
    if group in _HIERARCHIES:
        return _HIERARCHIES[group]
    everyone: list = [None] * dist.get_world_size()
    mine = (dist.get_process_group_ranks(group), ranks_per_node())
    issue(Collective("other", "hierarchy_groups"), lambda: dist.all_gather_object(everyone, mine))
    if len({per for _, per in everyone}) > 1:
        raise NotHierarchical(f"ranks disagree on the ranks per node (LOCAL_WORLD_SIZE): {[p for _, p in everyone]}")
    per_node = everyone[0][1]
    me, found = dist.get_rank(), None
    for ranks in sorted({tuple(r) for r, _ in everyone}):
        layout = node_layout(list(ranks), per_node, ranks[0])
        if layout.nodes == 1:
            raise NotHierarchical(f"the EP group {list(ranks)} lies in one node ({per_node} ranks per node)")
        g = layout.per_node
        nodes = [list(ranks[n * g : (n + 1) * g]) for n in range(layout.nodes)]
        rails = [[node[i] for node in nodes] for i in range(g)]
        made = {}
        for kind, members in [("intra", m) for m in nodes] + [("inter", m) for m in rails]:
            new = dist.new_group(members, timeout=timeout, group_desc=f"EXPERT_MODEL_PARALLEL_2DH_{kind.upper()}")
            if me in members:
                made[kind] = new
        if me in ranks:
            found = Hierarchy(node_layout(list(ranks), per_node, me), made["intra"], made["inter"])
    _HIERARCHIES[group] = found
    return found


def hierarchy_of(group) -> Hierarchy | None:
    """The `Hierarchy` made for `group`, or None."""
    return _HIERARCHIES.get(group)


def forget_hierarchies() -> None:
    """The run's 2DH groups are gone (its groups destroyed)."""
    _HIERARCHIES.clear()


def transpose_blocks(x_RH: torch.Tensor, sizes_AB: list[list[int]]) -> torch.Tensor:
    """The stride copy of Algorithm 3 with per-block sizes: rows in blocks (a, b) (a-major, `sizes_AB[a][b]` rows)
    -> the same blocks in (b, a) order. One copy; a copy of the rows, never arithmetic on them."""
    sizes = [s for row in sizes_AB for s in row]
    blocks = x_RH.split(sizes)
    a_size, b_size = len(sizes_AB), len(sizes_AB[0]) if sizes_AB else 0
    order = [blocks[a * b_size + b] for b in range(b_size) for a in range(a_size)]
    return torch.cat(order) if order else x_RH[:0]


@dataclasses.dataclass(frozen=True)
class TwoLevelPlan:
    """One 2DH all-to-all's split sizes on this rank (numbered as the phases in the module docstring)."""

    out_NL: list[list[int]]
    """1. the send buffer's blocks by destination (node n, local l) [N][g]."""
    intra_send: list[int]
    """2. rows to each local peer [g]."""
    intra_recv: list[int]
    """2. rows from each local peer [g]."""
    mid_LN: list[list[int]]
    """3. the received blocks by (source local l', destination node n) [g][N]."""
    inter_send: list[int]
    """4. rows to this rail's rank on each node [N]."""
    inter_recv: list[int]
    """4. rows from this rail's rank on each node [N] (the output's blocks, in source rank order)."""


def plan_2dh(pairs: list[list[int]], layout: NodeLayout) -> TwoLevelPlan:
    """The plan of the all-to-all in which EP rank s sends `pairs[s][d]` rows to rank d, on this rank (`layout`)."""
    n_size, g, node, local = layout.nodes, layout.per_node, layout.node, layout.local
    me = layout.rank
    out_NL = [[pairs[me][n * g + l] for l in range(g)] for n in range(n_size)]
    # what local peer l' of this node sends this rank's rail, per destination node
    mid_LN = [[pairs[node * g + lp][n * g + local] for n in range(n_size)] for lp in range(g)]
    return TwoLevelPlan(
        out_NL=out_NL,
        intra_send=[sum(out_NL[n][l] for n in range(n_size)) for l in range(g)],
        intra_recv=[sum(row) for row in mid_LN],
        mid_LN=mid_LN,
        inter_send=[sum(mid_LN[lp][n] for lp in range(g)) for n in range(n_size)],
        inter_recv=[sum(pairs[n * g + lp][me] for lp in range(g)) for n in range(n_size)],
    )


@dataclasses.dataclass(frozen=True)
class Route:
    """How one all-to-all goes: its EP group's `layout` (for the bytes that cross nodes) and, for 2DH, the
    `hierarchy` and every rank pair's rows (`pairs[s][d]`: rows from EP rank s to d). `hierarchy` None: linear."""

    layout: NodeLayout
    hierarchy: Hierarchy | None = None
    pairs: tuple[tuple[int, ...], ...] | None = None

    @property
    def two_level(self) -> bool:
        return self.hierarchy is not None

    def reversed(self) -> Route:
        """The reverse all-to-all's route (its backward, the combine after the dispatch): the pairs transposed."""
        if self.pairs is None:
            return self
        return dataclasses.replace(self, pairs=tuple(zip(*self.pairs)))

    @functools.cached_property
    def plan(self) -> TwoLevelPlan:
        return plan_2dh([list(row) for row in self.pairs], self.layout)

    def crossing(self, in_splits: list[int]) -> tuple[int, int]:
        """(messages, rows) this rank sends across nodes, sending `in_splits[d]` rows to EP rank d."""
        if not self.two_level:
            return self.layout.crossing(in_splits)
        remote = [s for n, s in enumerate(self.plan.inter_send) if n != self.layout.node]
        return sum(1 for s in remote if s), sum(remote)

    def check(self, out_splits: list[int], in_splits: list[int]) -> None:
        """The pairs agree with the call's splits (this rank's row and column): a plan from other counts would
        move rows to the wrong ranks."""
        if self.pairs is None:
            return
        me = self.layout.rank
        assert list(self.pairs[me]) == list(in_splits), ("2DH pairs vs send splits", self.pairs[me], in_splits)
        column = [row[me] for row in self.pairs]
        assert column == list(out_splits), ("2DH pairs vs receive splits", column, out_splits)
