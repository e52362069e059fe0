"""--expert-placement: the groups each placement builds are megatron-core's, the flag's refusals, auto's rule on
hand-worked cases (megatron_moe/config/placement.py).

megatron-core's `initialize_model_parallel` runs over a pretend world (as in test_parallel_dims.py), recording every
group it asks torch.distributed for, so `placement.groups` is compared with what megatron-core itself builds for
the placement's `order`.
"""

import re
import warnings
from unittest import mock

import pytest
import torch.distributed as dist

from megatron_moe.config import ConfigError, parse_args
from megatron_moe.config import placement as P
from tests.unit.test_parallel_dims import BASE, _Group, dims_of

MOE = [*BASE, "--num-experts", "8"]
MEGATRON_GROUPS = {
    "ep": "EXPERT_MODEL_PARALLEL_GROUP",
    "expert_dp": "EXPERT_DATA_PARALLEL_GROUP",
    "dp": "DATA_PARALLEL_GROUP_WITH_CP",
    "esp": "EXPERT_TENSOR_PARALLEL_GROUP",
    "tp": "TENSOR_MODEL_PARALLEL_GROUP",
    "pp": "PIPELINE_MODEL_PARALLEL_GROUP",
}


def megatron_core_groups(world: int, order: str, *, tp=1, pp=1, cp=1, ep=1, esp=1) -> dict[str, list[list[int]]]:
    """Every group megatron-core's initialize_model_parallel asks for under `order`, by our names."""
    from megatron.core import parallel_state

    made: dict[str, list[list[int]]] = {}

    def new_group(ranks=None, group_desc=None, **_):
        made.setdefault(group_desc, []).append(list(ranks))
        return _Group(ranks)

    with (
        mock.patch.object(dist, "is_initialized", lambda: True),
        mock.patch.object(dist, "get_world_size", lambda group=None: world if group is None else group.size()),
        mock.patch.object(dist, "get_rank", lambda group=None: 0 if group is None else group.rank()),
        mock.patch.object(dist, "new_group", new_group),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=esp,
            create_gloo_process_groups=False,
            order=order,
        )
        parallel_state.destroy_model_parallel()
    return {ours: made[theirs] for ours, theirs in MEGATRON_GROUPS.items()}


LAYOUTS = [  # world, tp, pp, cp, ep, esp
    (4, 1, 1, 1, 2, 1),
    (8, 1, 1, 1, 2, 1),
    (8, 2, 1, 1, 2, 2),
    (16, 2, 2, 1, 2, 1),
    (16, 1, 2, 2, 2, 2),
    (16, 2, 1, 2, 4, 1),
]


@pytest.mark.parametrize("world,tp,pp,cp,ep,esp", LAYOUTS)
def test_the_groups_are_megatron_cores_and_only_the_expert_ones_move(world, tp, pp, cp, ep, esp):
    degrees = {"tp": tp, "pp": pp, "cp": cp, "ep": ep, "esp": esp}
    dims = dims_of(world, **degrees)
    built = {p: megatron_core_groups(world, P.ORDERS[p], **degrees) for p in P.PLACEMENTS}
    for p in P.PLACEMENTS:
        ours = P.groups(dims, p)
        assert {name: built[p][name] for name in ours} == ours
    # the dense groups, the ESP groups and the pipeline stages are the same under both placements
    for name in ("dp", "tp", "pp", "esp"):
        assert built["e+d"][name] == built["d+e"][name], name
    assert built["e+d"]["ep"] != built["d+e"]["ep"]


def test_the_two_placements_on_two_nodes_of_two():
    """EP=2, DP=2 on 2 nodes x 2 ranks (docs/placement.md): e+d keeps each EP group on a node, d+e each expert-DP
    group."""
    dims = dims_of(4, ep=2)
    assert P.groups(dims, "e+d") == {"ep": [[0, 1], [2, 3]], "expert_dp": [[0, 2], [1, 3]], "dp": [[0, 1, 2, 3]]}
    assert P.groups(dims, "d+e") == {"ep": [[0, 2], [1, 3]], "expert_dp": [[0, 1], [2, 3]], "dp": [[0, 1, 2, 3]]}
    assert P.describe(dims, "e+d", 2) == "placement=e+d (nodes of 2 ranks; across nodes: expert-DP, DP)"
    assert P.describe(dims, "d+e", 2) == "placement=d+e (nodes of 2 ranks; across nodes: EP, DP)"
    assert P.describe(dims, "d+e", 4) == "placement=d+e (one node)"


def test_crossing_bytes_by_hand():
    """2 nodes x 2, EP=2 DP=2, 100 bytes of all-to-all payload and 10 of expert gradients per rank:
    e+d: no all-to-all crosses; the expert-DP ring of 2 sends 2 x 1/2 x 10 = 10 bytes to the other node;
    d+e: half of each rank's payload goes to its peer on the other node (50); the gradient ring stays home.
    2 nodes x 4, EP=4 DP=2 (expert-DP 2): e+d keeps the EP group home; d+e: the EP group {0, 2, 4, 6} has 2 of 4
    members on the other node: 100 x 2/4 = 50."""
    v = P.StepVolumes(a2a_bytes=100, expert_grad_bytes=10)
    dims = dims_of(4, ep=2)
    assert P.crossing_bytes(dims, "e+d", 2, v) == {"a2a": 0.0, "expert_grads": 10.0}
    assert P.crossing_bytes(dims, "d+e", 2, v) == {"a2a": 50.0, "expert_grads": 0.0}
    dims = dims_of(8, ep=4)
    assert P.crossing_bytes(dims, "e+d", 4, v) == {"a2a": 0.0, "expert_grads": 10.0}
    assert P.crossing_bytes(dims, "d+e", 4, v) == {"a2a": 50.0, "expert_grads": 0.0}
    # EP=8 over two nodes of 4: both placements build the same groups: half the payload crosses either way
    assert P.same_groups(dims_of(8, ep=8))


@pytest.mark.parametrize(
    "a2a,grads,expected",
    [
        (100, 10, "e+d"),  # the all-to-all is the larger volume: keep it on the node
        (100, 60, "d+e"),  # 60 bytes of gradients cross under e+d, 50 of all-to-all under d+e
        (100, 50, "e+d"),  # a tie keeps today's placement
    ],
)
def test_auto_keeps_the_larger_volume_on_the_node(a2a, grads, expected):
    pick, why = P.choose(dims_of(4, ep=2), 2, P.StepVolumes(a2a_bytes=a2a, expert_grad_bytes=grads))
    assert pick == expected, why
    assert why.startswith("fewer bytes across nodes per rank and step: e+d ")


def test_auto_where_there_is_nothing_to_choose():
    v = P.StepVolumes(a2a_bytes=1, expert_grad_bytes=10**9)
    assert P.choose(dims_of(4, ep=2), 4, v) == ("e+d", "one node: no group crosses a node")
    assert P.choose(dims_of(4, ep=4), 2, v)[0] == "e+d"  # expert-DP 1: the same groups
    assert "both placements build the same groups" in P.choose(dims_of(4, ep=4), 2, v)[1]


def test_step_volumes_of_a_run():
    """4 layers, MoE every other one, hidden 64, experts' FFN 128 (GELU: 2 matrices), top-2, 8 experts over EP=2,
    micro-batch 2 x 32 tokens, global batch 8 over DP=4: 1 micro-batch. fp32."""
    flags = "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --ffn-hidden-size 128 "
    flags += "--moe-layer-freq 2 --moe-router-topk 2 --micro-batch-size 2 --global-batch-size 8 "
    cfg = parse_args([*MOE, *flags.split(), "--expert-model-parallel-size", "2"])
    cfg.validate(4)
    v = P.StepVolumes.of(cfg, cfg.dims(4))
    assert v.a2a_bytes == 4 * (2 * 32) * 2 * 64 * 4 * 2  # (dispatch, combine) x (fwd, bwd) x tokens x top-k x ...
    assert v.expert_grad_bytes == 4 * (64 * 128 * 2) * (8 // 2) * 2  # fp32 x per expert x experts here x layers


def test_resolve_says_what_it_did():
    cfg = parse_args([*MOE, "--expert-model-parallel-size", "2", "--expert-placement", "d+e"])
    cfg.validate(4)
    assert P.resolve(cfg, 4, 2) == ("d+e", "expert placement: d+e")
    cfg = parse_args([*MOE, "--expert-model-parallel-size", "4", "--expert-placement", "d+e"])
    cfg.validate(4)
    assert P.resolve(cfg, 4, 2) == ("d+e", "expert placement: d+e builds the groups e+d does (EP=4 expert-DP=1)")
    cfg = parse_args([*MOE, "--expert-model-parallel-size", "2", "--expert-placement", "auto"])
    cfg.validate(4)
    pick, line = P.resolve(cfg, 4, 2)
    assert line.startswith(f"expert placement: auto -> {pick} (fewer bytes across nodes")
    assert P.resolve(cfg, 4, 4) == ("e+d", "expert placement: auto -> e+d (one node: no group crosses a node)")
    assert parse_args(MOE).parallel.expert_placement == "e+d"  # today's layout stays the default


def test_auto_refuses_unequal_nodes():
    cfg = parse_args([*MOE, "--expert-model-parallel-size", "2", "--expert-placement", "auto"])
    cfg.validate(4)
    with pytest.raises(ConfigError, match=r"^--expert-placement=auto: needs equal nodes to choose, but 3 ranks per"):
        P.resolve(cfg, 4, 3)
    cfg.parallel.expert_placement = "d+e"  # e+d and d+e need no node size
    assert P.resolve(cfg, 4, 3)[0] == "d+e"


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            ["--expert-placement", "d+e"],
            r"--expert-placement d\+e: changes nothing in this run \(it applies only ",
        ),
        (
            ["--expert-placement", "d+e", "--expert-model-parallel-size", "1", "--num-experts", "8"],
            r"--expert-placement d\+e: changes nothing in this run \(it applies only with --num-experts and "
            r"--expert-model-parallel-size > 1",
        ),
    ],
)
def test_the_flag_is_named_as_changing_nothing_where_there_are_no_expert_groups(flags, message):
    notes = parse_args([*BASE, *flags]).notes
    assert [line for line in notes if line.startswith("--expert-placement")] == notes and len(notes) == 1, notes
    assert re.match(message, notes[0]), notes


def test_an_unknown_placement_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match=r"--expert-placement: invalid choice: 'ed' \(choose from '?e\+d'?, "):
        parse_args([*MOE, "--expert-model-parallel-size", "2", "--expert-placement", "ed"])


def test_the_benchmark_runs_each_placement_and_compares_them():
    """tools/bench_step.py: 2x2dp runs e+d, 2x2de d+e (the same flags otherwise), and the `placement` row takes the
    logging rank's (rank 3's) figures: its all-to-all's bytes cross the link under d+e only."""
    from tests.conftest import load_tool

    bench = load_tool("bench_step")
    data = ("D", "T")
    ed, de = (bench.trainer_flags(layout, 3, data, None) for layout in ("2x2dp", "2x2de"))
    assert bench._flag(ed, "--expert-placement") == "e+d" and bench._flag(de, "--expert-placement") == "d+e"
    assert [f for f in ed if f != "e+d"] == [f for f in de if f != "d+e"]
    assert bench.cluster_of("2x2de") == (2, 2) and bench.layout_name("2x2de") == "2x2de EP=2 DP=4 d+e"

    def row(layout, flags, step_ms, a2a_ms, grad_ms):
        kinds = {"a2a_dispatch": 1000, "a2a_combine_bwd": 3000, "dp_grad_reduce": 500}
        return {
            "case": f"step_{layout}_1gbit",
            "link_gbit": 1.0,
            "overlap": {},
            "flags": [*flags, "--data-path", "d", "--tokenizer-model", "t.model"],
            "step_ms": step_ms,
            "exposed_ms": {"a2a_dispatch": a2a_ms, "dp_grad_reduce": grad_ms},
            "comm_ms": {"a2a_dispatch": a2a_ms, "dp_grad_reduce": grad_ms},
            "wire_bytes": kinds,
        }

    out = bench.compare_placement(row("2x2dp", ed, 100.0, 1.0, 30.0), row("2x2de", de, 80.0, 20.0, 2.0))
    assert out["case"] == "placement_1gbit" and out["step_ratio_de_over_ed"] == 0.8
    ed_row, de_row = out["placements"]["e+d"], out["placements"]["d+e"]
    assert (ed_row["a2a_link_bytes"], de_row["a2a_link_bytes"]) == (0, 4000)  # rank 3's EP peer: rank 2 / rank 1
    assert (ed_row["dp_grad_reduce_exposed_ms"], de_row["a2a_exposed_ms"]) == (30.0, 20.0)
    assert ed_row["model_link_bytes"]["a2a"] == 0 and de_row["model_link_bytes"]["expert_grads"] == 0
    assert out["auto"]["picks"] in P.PLACEMENTS


@pytest.mark.parametrize("world,tp,pp,cp,ep,esp", [(16, 2, 2, 1, 2, 1), (8, 1, 2, 2, 2, 1), (16, 2, 2, 2, 2, 2)])
def test_the_tp_pp_dp_mapping_is_megatron_lms_order_and_moves_the_pipeline_before_dp(world, tp, pp, cp, ep, esp):
    """--use-tp-pp-dp-mapping: Megatron-LM's order "tp-cp-ep-pp-dp" (its initialize.py); our groups are the ones
    megatron-core builds under it; a pipeline's stages are nearer ranks than under the default order."""
    degrees = {"tp": tp, "pp": pp, "cp": cp, "ep": ep, "esp": esp}
    dims = dims_of(world, **degrees)
    built = megatron_core_groups(world, "tp-cp-ep-pp-dp", **degrees)
    ours = P.groups(dims, "e+d", pp_before_dp=True)
    assert {name: built[name] for name in ours} == ours
    default = megatron_core_groups(world, P.ORDERS["e+d"], **degrees)
    spread = lambda groups: max(g[-1] - g[0] for g in groups)  # noqa: E731
    assert spread(built["pp"]) < spread(default["pp"]) and spread(built["dp"]) > spread(default["dp"])


def test_the_tp_pp_dp_mapping_takes_e_plus_d_and_is_refused_with_d_plus_e():
    flags = [*MOE, "--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "4"]
    flags += ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1"]
    # expert DP = dense DP = 2 on 8 ranks
    cfg = parse_args([*flags, "--use-tp-pp-dp-mapping", "--expert-placement", "auto"])
    cfg.validate(8)
    assert P.resolve(cfg, 8, 2) == ("e+d", "expert placement: auto -> e+d (--use-tp-pp-dp-mapping's order is e+d's)")
    cfg = parse_args([*flags, "--use-tp-pp-dp-mapping", "--expert-placement", "d+e"])
    with pytest.raises(ConfigError, match=r"^--expert-placement=d\+e: --use-tp-pp-dp-mapping orders the ranks as e\+d"):
        cfg.validate(8)
    # megatron-core's own condition (it asserts otherwise, after start-up): expert DP 8 / (2 x 4) = 1, dense DP 2
    cfg = parse_args([*flags, "--use-tp-pp-dp-mapping", "--expert-model-parallel-size", "4"])
    with pytest.raises(ConfigError, match=r"^--use-tp-pp-dp-mapping=True: megatron-core builds .* here 1 and 2 "):
        cfg.validate(8)
