"""Tutel's 2DH all-to-all's arithmetic (comm/hierarchy.py) in one process: the G ranks simulated, each phase's
messages moved by hand as the intra-node and rail groups would move them; the output must be the linear
all-to-all's, bit for bit, on hand-made uneven splits (empty pairs included), at 2x2, 4x2, 2x4 and 3x1 nodes. Also
the cost model's message counts and auto's choice, and where 2dh is refused."""

from __future__ import annotations

import math
import random

import pytest
import torch

from megatron_moe.comm.hierarchy import NodeLayout, NotHierarchical, Route, node_layout, plan_2dh, transpose_blocks
from megatron_moe.config.fields import ConfigError
from megatron_moe.config.moe_layer import MoELayerConfig
from megatron_moe.moe.pipeline import _chunk_pairs, part
from megatron_moe.overlap.a2a_cost import LinkCosts, a2a_ms, choose, crossover, messages
from megatron_moe.training.initialize import choose_a2a


def _inputs(pairs):
    """Rank s's send buffer: pairs[s][d] rows to d, each row naming (s, d, i) so a misplaced row shows."""
    g = len(pairs)
    return [
        torch.cat(
            [torch.tensor([[s, d, i, 0.5]]).expand(1, 4) for d in range(g) for i in range(pairs[s][d])]
            or [torch.empty(0, 4)]
        )  # fmt: skip
        for s in range(g)
    ]


def _linear(xs, pairs):
    g = len(pairs)
    blocks = [x.split(pairs[s]) for s, x in enumerate(xs)]
    return [torch.cat([blocks[s][d] for s in range(g)]) for d in range(g)]


def _exchange(sends, splits):
    """An all-to-all among the members of one group: sends[i] split by splits[i] -> what member j gets, in member
    order."""
    parts = [x.split(s) for x, s in zip(sends, splits)]
    return [torch.cat([parts[i][j] for i in range(len(sends))]) for j in range(len(sends))]


def _two_level(xs, pairs, nodes, per_node):
    layouts = [NodeLayout(nodes, per_node, r // per_node, r % per_node) for r in range(nodes * per_node)]
    plans = [plan_2dh(pairs, layout) for layout in layouts]
    staged = [transpose_blocks(x, p.out_NL) for x, p in zip(xs, plans)]  # 1.
    mid = [None] * len(xs)
    for n in range(nodes):  # 2. within each node
        members = [n * per_node + l for l in range(per_node)]
        got = _exchange([staged[r] for r in members], [plans[r].intra_send for r in members])
        for r, rows in zip(members, got):
            assert rows.shape[0] == sum(plans[r].intra_recv)
            mid[r] = rows
    staged = [transpose_blocks(m, p.mid_LN) for m, p in zip(mid, plans)]  # 3.
    out = [None] * len(xs)
    for l in range(per_node):  # 4. along each rail
        members = [n * per_node + l for n in range(nodes)]
        got = _exchange([staged[r] for r in members], [plans[r].inter_send for r in members])
        for r, rows in zip(members, got):
            assert rows.shape[0] == sum(plans[r].inter_recv)
            out[r] = rows
    return out


def _pairs(g, seed, zero_share=0.3):
    rng = random.Random(seed)
    return [[0 if rng.random() < zero_share else rng.randint(1, 5) for _ in range(g)] for _ in range(g)]


@pytest.mark.parametrize("nodes,per_node", [(2, 2), (4, 2), (2, 4), (3, 1)])
@pytest.mark.parametrize("seed", range(4))
def test_two_level_equals_linear_bit_for_bit(nodes, per_node, seed):
    pairs = _pairs(nodes * per_node, seed)
    xs = _inputs(pairs)
    want, got = _linear(xs, pairs), _two_level(xs, pairs, nodes, per_node)
    for r, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), (r, a, b)


def test_the_reverse_route_brings_the_rows_back():
    pairs = _pairs(8, 7)
    xs = _inputs(pairs)
    there = _two_level(xs, pairs, 4, 2)
    route = Route(NodeLayout(4, 2, 0, 0), pairs=tuple(map(tuple, pairs)))
    back = [list(row) for row in route.reversed().pairs]
    assert back == [list(col) for col in zip(*pairs)]
    assert all(torch.equal(a, b) for a, b in zip(_two_level(there, back, 4, 2), xs))


def test_a_stride_copy_of_equal_chunks_is_the_papers_transpose():
    # Algorithm 3's strideMemcpy(row, col): chunk i of (a, b) goes to (b, a): a transpose of the chunk grid.
    x = torch.arange(2 * 3 * 4 * 5.0).view(2 * 3 * 4, 5)
    got = transpose_blocks(x, [[4] * 3 for _ in range(2)])
    assert torch.equal(got, x.view(2, 3, 4, 5).transpose(0, 1).reshape(-1, 5))
    assert transpose_blocks(x[:0], [[0, 0], [0, 0]]).shape == (0, 5)


def test_messages_that_cross_nodes():
    pairs = [[1] * 8 for _ in range(8)]  # every pair has rows
    layout = NodeLayout(4, 2, 1, 0)
    linear, two_level = Route(layout), Route(layout, hierarchy=object(), pairs=tuple(map(tuple, pairs)))
    assert linear.crossing(pairs[2]) == (6, 6)  # G - g messages, one row each
    assert two_level.crossing(pairs[2]) == (3, 6)  # N - 1 messages, g rows each: the same bytes
    sparse = [[0] * 8 for _ in range(8)]
    sparse[2][4] = sparse[3][4] = 2  # node 1's two ranks send only to rank 4 (node 2, rail 0)
    sparse[3][5] = 1  # and rank 3 to rank 5 (rail 1: not rank 2's message)
    assert Route(layout, hierarchy=object(), pairs=tuple(map(tuple, sparse))).crossing(sparse[2]) == (1, 4)


def test_node_layout_reads_node_major_groups():
    assert node_layout([0, 1, 2, 3], 2, 3) == NodeLayout(2, 2, 1, 1)
    assert node_layout([0, 2, 4, 6], 4, 4) == NodeLayout(2, 2, 1, 0)  # TP = 2: two of each node's four
    assert node_layout([4, 5, 6, 7], 8, 5).nodes == 1
    with pytest.raises(NotHierarchical, match="node-major"):
        node_layout([0, 1, 2, 4], 2, 0)  # 3 ranks on node 0 and 1, 1 on node 2
    with pytest.raises(NotHierarchical, match="node-major"):
        node_layout([0, 2, 1, 3], 2, 0)  # nodes interleaved in group order


def test_chunk_pairs_add_up_to_the_pairs():
    rng = random.Random(3)
    g, l, r = 4, 3, 3
    sent_GE = [[rng.randint(0, 7) for _ in range(g * l)] for _ in range(g)]
    chunks = [_chunk_pairs(sent_GE, l, r, j) for j in range(r)]
    for s in range(g):
        for d in range(g):
            assert sum(c[s][d] for c in chunks) == sum(sent_GE[s][d * l : (d + 1) * l])
            assert chunks[1][s][d] == sum(part(c, r, 1) for c in sent_GE[s][d * l : (d + 1) * l])


def test_the_cost_model_counts_messages_per_link_kind():
    assert messages("linear", 4, 2) == {"intra": 1, "inter": 6}
    assert messages("2dh", 4, 2) == {"intra": 1, "inter": 3}
    flat = LinkCosts(alpha_intra=0.0, alpha_inter=0.0)  # the emulated links: no per-message cost
    assert crossover(4, 2, flat) == 0.0  # 2DH moves the same inter-node bytes and adds a phase: never pays
    slow = LinkCosts(alpha_inter=0.05)
    assert 0 < crossover(4, 2) < crossover(4, 2, slow) < crossover(32, 8, slow) < math.inf
    small, large = crossover(4, 2) / 4, crossover(4, 2) * 4
    assert a2a_ms("2dh", small, 4, 2) < a2a_ms("linear", small, 4, 2)
    assert a2a_ms("2dh", large, 4, 2) > a2a_ms("linear", large, 4, 2)
    assert choose(small, 4, 2)[0] == "2dh" and choose(large, 4, 2)[0] == "linear"
    assert choose(small, 1, 8)[0] == "linear"


def test_2dh_is_refused_where_it_cannot_apply_and_auto_falls_back():
    size = lambda: 1024  # noqa: E731
    with pytest.raises(ConfigError, match=r"--moe-a2a-algorithm=2dh: linear or auto: .* lies in one node"):
        choose_a2a("2dh", [0, 1, 2, 3], 8, 1, size)
    with pytest.raises(ConfigError, match=r"--moe-a2a-algorithm=2dh: linear or auto: .*node-major"):
        choose_a2a("2dh", [0, 1, 2, 4], 2, 1, size)
    with pytest.raises(ConfigError, match=r"--moe-a2a-algorithm=2dh: .*--expert-tensor-parallel-size=2"):
        choose_a2a("2dh", [0, 2, 4, 6], 2, 2, size)
    assert choose_a2a("auto", [0, 1, 2, 3], 8, 1, size)[0] == "linear"
    assert choose_a2a("2dh", [0, 1, 2, 3], 2, 1, size)[0] == "2dh"
    assert choose_a2a("auto", [0, 1, 2, 3], 2, 1, size)[0] == "2dh"  # 1 KiB per rank: the start-ups dominate
    assert choose_a2a("auto", [0, 1, 2, 3], 2, 1, lambda: 2**30)[0] == "linear"


def test_the_flag_is_checked_by_the_layer_config():
    with pytest.raises(ConfigError, match="--moe-a2a-algorithm=ring: choose one of linear, 2dh, auto"):
        MoELayerConfig(num_experts=4, hidden_size=8, ffn_hidden_size=8, a2a_algorithm="ring").validate()
