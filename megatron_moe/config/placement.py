"""Where the expert-parallel groups sit on the nodes: E+D or D+E (Snowflake Arctic's names), and auto's rule.

In: --expert-placement (e+d, d+e, auto) and the run's shapes; out: megatron-core's rank `order` string
("tp-cp-ep-dp-pp" for e+d: EP groups of consecutive ranks; "tp-cp-dp-ep-pp" for d+e: expert-DP replicas
consecutive). auto (`choose`): the placement that sends fewer bytes per step across nodes (`StepVolumes`); ties,
one node, EP = 1 or expert-DP = 1 give e+d. Invariants: the dense, ESP and pipeline groups are the same under
both; experts and checkpoints are indexed by global expert, so results agree to rounding and checkpoints load
under either. Derivation: docs/internals/config.md.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from typing import TYPE_CHECKING

from megatron_moe.config.fields import require
from megatron_moe.config.parallel_dims import ParallelDims

if TYPE_CHECKING:
    from megatron_moe.config import RunConfig

PLACEMENTS = ("e+d", "d+e")
ORDERS = {"e+d": "tp-cp-ep-dp-pp", "d+e": "tp-cp-dp-ep-pp"}
"""Placement -> megatron-core's `order` (initialize_model_parallel's; its RankGenerator's names)."""
PP_BEFORE_DP = "tp-cp-ep-pp-dp"
"""--use-tp-pp-dp-mapping's order (Megatron-LM's), e+d's with the pipeline before the data-parallel dimension."""


def rank_order(placement: str, pp_before_dp: bool = False) -> str:
    """megatron-core's `order` for `placement` (--use-tp-pp-dp-mapping: `pp_before_dp`, e+d only)."""
    assert not pp_before_dp or placement == "e+d", placement
    return PP_BEFORE_DP if pp_before_dp else ORDERS[placement]


GROUP_NAMES = {"ep": "EP", "expert_dp": "expert-DP", "dp": "DP"}


def groups(dims: ParallelDims, placement: str, pp_before_dp: bool = False) -> dict[str, list[list[int]]]:
    """The EP, expert-DP and (dense) DP groups megatron-core builds for `placement` (and --use-tp-pp-dp-mapping),
    as its RankGenerators (`initialize_model_parallel`) list them; no process group needed
    (tests/unit/test_placement.py compares them with megatron-core's own)."""
    order = rank_order(placement, pp_before_dp).split("-")
    dense = {"tp": dims.tp, "cp": dims.cp, "ep": 1, "dp": dims.dp, "pp": dims.pp}
    expert = {"tp": dims.esp, "cp": 1, "ep": dims.ep, "dp": dims.expert_dp, "pp": dims.pp}
    return {
        "ep": rank_groups(order, expert, {"ep"}),
        "expert_dp": rank_groups(order, expert, {"dp"}),
        "dp": rank_groups(order, dense, {"dp", "cp"}),
    }


def rank_groups(order: list[str], sizes: dict[str, int], names: set[str]) -> list[list[int]]:
    """The groups of the dimensions `names` (megatron-core's `generate_masked_orthogonal_rank_groups`): a rank's
    coordinate along order[i] has stride sizes[order[0]] x ... x sizes[order[i - 1]]; a group varies the named
    coordinates (the first name fastest) and fixes the others, groups listed with the first fixed one fastest."""
    strides = dict(zip(order, itertools.accumulate([1] + [sizes[n] for n in order[:-1]], operator.mul)))

    def ranks(dims: list[str]) -> list[int]:  # every offset of those coordinates, the first fastest
        axes = [range(0, sizes[n] * strides[n], strides[n]) for n in reversed(dims)]
        return [sum(offsets) for offsets in itertools.product(*axes)] if axes else [0]

    inside, outside = [n for n in order if n in names], [n for n in order if n not in names]
    return [[base + r for r in ranks(inside)] for base in ranks(outside)]


def same_groups(dims: ParallelDims) -> bool:
    """True when e+d and d+e build the same groups (EP = 1 or expert-DP = 1: one of the two names has size 1)."""
    return dims.ep == 1 or dims.expert_dp == 1


def crossing(groups_of: dict[str, list[list[int]]], ranks_per_node: int) -> list[str]:
    """The names of the group kinds with a group whose ranks are on more than one node."""
    return [name for name, gs in groups_of.items() if any(len({r // ranks_per_node for r in g}) > 1 for g in gs)]


@dataclasses.dataclass(frozen=True)
class StepVolumes:
    """Bytes one rank moves per step, before any wire factor: what auto weighs."""

    a2a_bytes: int
    """All-to-all payload: tokens x top-k rows of hidden activations, dispatch and combine, forward and backward,
    over this stage's MoE layers (uniform routing: (EP - 1) / EP of it goes to the peers)."""
    expert_grad_bytes: int
    """The experts' gradients this rank holds (fp32 gradient buffers: megatron-core DDP reduces in fp32 under
    --bf16/--fp16 here, training/setup.py), reduced over expert-DP."""

    @classmethod
    def of(cls, cfg: RunConfig, dims: ParallelDims) -> StepVolumes:
        model, moe, t = cfg.model, cfg.moe, cfg.training
        moe_layers = sum(moe.layer_pattern(model.num_layers)) // dims.pp
        tokens = t.micro_batch_size * model.seq_length // dims.token_split * cfg.num_microbatches(dims.world)
        activation_bytes = 2 if t.bf16 or t.fp16 else 4
        a2a = 4 * tokens * moe.moe_router_topk * model.hidden_size * activation_bytes * moe_layers
        per_expert = model.hidden_size * moe.expert_ffn_width(model) * (3 if model.swiglu else 2) // dims.esp
        grads = 4 * per_expert * moe.num_experts // dims.ep * moe_layers
        return cls(a2a_bytes=a2a, expert_grad_bytes=grads)


def crossing_bytes(dims: ParallelDims, placement: str, ranks_per_node: int, volumes: StepVolumes) -> dict[str, float]:
    """Mean bytes per rank and step that cross nodes under `placement`: {"a2a": ..., "expert_grads": ...}.
    All-to-all: each peer gets 1/EP of the payload, counted for the peers on other nodes. Gradients: a ring
    all-reduce over the expert-DP group (gloo's and NCCL's large-message algorithm) sends 2 (p - 1) / p of them
    to the next rank of the group, counted where that rank is on another node."""
    node = lambda r: r // ranks_per_node  # noqa: E731
    g = groups(dims, placement)
    a2a = grads = 0.0
    for group in g["ep"]:
        for r in group:
            a2a += volumes.a2a_bytes * sum(node(q) != node(r) for q in group) / len(group)
    for group in g["expert_dp"]:
        p = len(group)
        for i, r in enumerate(group):
            if node(group[(i + 1) % p]) != node(r):
                grads += 2 * (p - 1) / p * volumes.expert_grad_bytes
    return {"a2a": a2a / dims.world, "expert_grads": grads / dims.world}


def choose(dims: ParallelDims, ranks_per_node: int, volumes: StepVolumes) -> tuple[str, str]:
    """(auto's placement, why, in words): the one with fewer bytes across nodes (`crossing_bytes`); e+d on ties."""
    if ranks_per_node >= dims.world:
        return "e+d", "one node: no group crosses a node"
    if same_groups(dims):
        return "e+d", f"EP={dims.ep} expert-DP={dims.expert_dp}: both placements build the same groups"
    cost = {p: crossing_bytes(dims, p, ranks_per_node, volumes) for p in PLACEMENTS}
    total = {p: sum(c.values()) for p, c in cost.items()}
    pick = "d+e" if total["d+e"] < total["e+d"] else "e+d"
    mb = lambda n: f"{n / 1e6:.2f}"  # noqa: E731
    said = "; ".join(
        f"{p} {mb(total[p])} MB (all-to-all {mb(c['a2a'])} + expert gradients {mb(c['expert_grads'])})"
        for p, c in cost.items()
    )
    return pick, f"fewer bytes across nodes per rank and step: {said}"


def check_nodes(placement: str, world: int, ranks_per_node: int) -> None:
    """auto needs the node size: equal nodes, so that ranks per node divides the world."""
    require(
        placement != "auto" or (ranks_per_node >= 1 and world % ranks_per_node == 0),
        "--expert-placement",
        placement,
        f"needs equal nodes to choose, but {ranks_per_node} ranks per node (torchrun's LOCAL_WORLD_SIZE) do not "
        f"divide the world of {world}; give e+d or d+e",
    )


def resolve(cfg: RunConfig, world: int, ranks_per_node: int) -> tuple[str, str]:
    """(the placement in force, a line for the start-up log) from --expert-placement, before any group exists."""
    placement = cfg.parallel.expert_placement
    check_nodes(placement, world, ranks_per_node)
    dims = cfg.dims(world)
    if cfg.parallel.use_tp_pp_dp_mapping and placement == "auto":
        return "e+d", "expert placement: auto -> e+d (--use-tp-pp-dp-mapping's order is e+d's)"
    if placement == "auto":
        pick, why = choose(dims, min(ranks_per_node, world), StepVolumes.of(cfg, dims))
        return pick, f"expert placement: auto -> {pick} ({why})"
    if same_groups(dims) and placement == "d+e":
        return placement, f"expert placement: d+e builds the groups e+d does (EP={dims.ep} expert-DP={dims.expert_dp})"
    return placement, f"expert placement: {placement}"


def describe(dims: ParallelDims, placement: str, ranks_per_node: int, pp_before_dp: bool = False) -> str:
    """E.g. "placement=d+e (nodes of 2 ranks; across nodes: EP, DP)" for the layout line."""
    if ranks_per_node >= dims.world:
        return f"placement={placement} (one node)"
    crossed = [GROUP_NAMES[name] for name in crossing(groups(dims, placement, pp_before_dp), ranks_per_node)]
    return f"placement={placement} (nodes of {ranks_per_node} ranks; across nodes: {', '.join(crossed) or 'none'})"
