"""megatron_moe/planning and tools/plan_cluster.py: memory and step time worked by hand on a tiny model, the
bubble, the memory limit, the placement's links, and the tool on the Mixtral example."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from megatron_moe.config import parse_args
from megatron_moe.overlap.cost_model import ClusterFits
from megatron_moe.planning.hardware import GIB, GroupShape, Measured, build_cluster, compute_for, efficiency_shape
from megatron_moe.planning.model import Layout, Shape, memory_per_gpu
from megatron_moe.planning.search import check_layout, search
from megatron_moe.planning.step import groups, moe_times, predict_step, stage_microbatch
from megatron_moe.training.flops import flops_per_token
from tests.conftest import load_tool

plan_tool = load_tool("plan_cluster")

TINY = (  # 2 MoE layers of 2 experts, top-1, fp32, GELU, tied embeddings, 4 samples a step
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --ffn-hidden-size 128 --num-experts 2 "
    "--moe-router-topk 1 --moe-layer-freq 1 --global-batch-size 4 --micro-batch-size 1"
).split()
# A GEMM rate of 1 GFLOP/s (1 FLOP = 1e-6 ms), no overhead, links of 8 Gbit/s (1 byte = 1e-6 ms), no start-up.
RATE_TFLOPS, LINK_GBIT = 1e-3, 8.0


def _tiny(nodes=1, gpus=2, memory_gib=None, inter_gbit=LINK_GBIT, **model):
    argv = [*TINY]
    for flag, value in model.items():
        argv += [f"--{flag.replace('_', '-')}", str(value)]
    cfg = parse_args(argv)
    shape = Shape.from_config(cfg, vocab_size=128, flash_attention=False)
    cluster = build_cluster(
        nodes=nodes,
        gpus_per_node=gpus,
        gpu="cpu",
        memory_gib=memory_gib,
        intra_node_gbit=LINK_GBIT,
        inter_node_gbit=inter_gbit,
        intra_alpha_ms=0.0,
        inter_alpha_ms=0.0,
    )
    compute = compute_for(cluster.gpu, shape.dtype, RATE_TFLOPS, overhead=1.0)
    return cfg, shape, cluster, compute


DATA_PARALLEL = Layout(tp=1, pp=1, vpp=1, ep=1, esp=1, dp=2, micro_batch=1)


def test_memory_of_a_tiny_model_worked_by_hand():
    _, shape, _, _ = _tiny()
    # Weights. A layer: QKV 64 x 192 + projection 64 x 64 + 2 norms of 64 + router 64 x 2 = 16,640 dense; 2 experts
    # of 2 x 64 x 128 = 32,768. The rank holds both layers, the embedding 128 x 64 and the final norm (tied output
    # layer, one stage: no copy). fp32: weight 4 + gradient 4 + Adam's moments 8 over DP 2 (expert-DP 2) = 12 B.
    dense, expert = 2 * 16_640 + 128 * 64 + 64, 2 * 32_768
    weights = (dense + expert) * 12
    # Activations of one layer, one micro-batch (32 tokens), fp32: input 32 x 64, input norm's output 32 x 64, QKV
    # 32 x 192, the rotated Q and K 32 x 128, softmax probabilities 4 heads x 32 x 32, attention output 32 x 64,
    # residual 32 x 64, pre-MLP norm's output 32 x 64, the 32 dispatched rows 32 x 64, fc1 32 x 128, activation
    # 32 x 128, the combined rows and their gate-weighted copy 2 x 32 x 64; and the router's scores 32 x 2 x 4 B.
    elements = 2048 + 2048 + 6144 + 4096 + 4096 + 2048 + 2048 + 2048 + 2048 + 4096 + 4096 + 2 * 2048
    layer = elements * 4 + 32 * 2 * 4
    logits = 32 * 128 * (4 + 4)  # the output layer's and the loss's fp32 copy
    memory = memory_per_gpu(shape, DATA_PARALLEL, microbatches=2)
    assert memory["weights"] == pytest.approx(weights)
    assert memory["activations"] == pytest.approx(2 * layer + logits)  # one micro-batch in flight (PP = 1)
    full = memory_per_gpu(shape, dataclasses.replace(DATA_PARALLEL, activations="full"), microbatches=2)
    # Full recompute: each layer keeps its input, and one layer's activations exist while it is recomputed.
    assert full["activations"] == pytest.approx(2 * 32 * 64 * 4 + layer + logits)


def test_step_time_of_a_tiny_model_worked_by_hand():
    cfg, shape, cluster, compute = _tiny()
    pred = predict_step(shape, DATA_PARALLEL, cluster, compute, flops_per_token(cfg, 128))
    # Forward FLOPs of a layer but its experts: QKV 2 x 32 x 64 x 192, attention core 4 x 32 x 32 x 64, projection
    # 2 x 32 x 64 x 64, router 2 x 32 x 64 x 2. The experts: 32 rows x 64 x 128 x 2 multiply-adds, 2 FLOPs each,
    # plus the chunk's start-up 0.01 ms. Backward is twice the forward.
    dense = (2 * 32 * 64 * 192 + 4 * 32 * 32 * 64 + 2 * 32 * 64 * 64 + 2 * 32 * 64 * 2) * 1e-6
    experts = 0.01 + 2 * 32 * 64 * 128 * 2 * 1e-6
    output_layer = 3 * 2 * 32 * 64 * 128 * 1e-6
    per_microbatch = 2 * 3 * (dense + experts) + output_layer
    assert pred.per_microbatch == pytest.approx({"compute": per_microbatch, "ep": 0.0, "tp": 0.0, "pp": 0.0})
    # DP 2 on one node: the gradients' reduce-scatter (fp32) and the weights' all-gather (fp32) move half their
    # bytes; they hide under a micro-batch's backward / forward but for one layer's share (1 of 2 layers).
    moved = 0.5 * (2 * 16_640 + 128 * 64 + 64 + 2 * 32_768) * 4 * 1e-6
    dp = 2 * moved / 2
    # Adam: 34 B per local parameter (the half this DP rank owns) at the cpu entry's 0.02 TB/s.
    optimizer = (2 * 16_640 + 128 * 64 + 64 + 2 * 32_768) / 2 * 34 / 0.02e12 * 1e3
    assert pred.microbatches == 2  # 4 samples / (1 x DP 2)
    assert pred.breakdown == pytest.approx(
        {
            "compute": 2 * per_microbatch,
            "bubble": 0.0,
            "ep": 0.0,
            "tp": 0.0,
            "pp": 0.0,
            "dp": dp,
            "optimizer": optimizer,
        }
    )
    assert pred.step_ms == pytest.approx(2 * per_microbatch + dp + optimizer)
    assert pred.tokens_per_s_per_gpu == pytest.approx(4 * 32 / (pred.step_ms / 1e3) / 2)


def test_a_given_layout_keeps_its_degrees_and_its_unoverlapped_reduction():
    cfg, shape, cluster, compute = _tiny()
    plain = dataclasses.replace(DATA_PARALLEL, overlap_dp=False, distributed_optimizer=False)
    pred = predict_step(shape, plain, cluster, compute, flops_per_token(cfg, 128))
    params = 2 * 16_640 + 128 * 64 + 64 + 2 * 32_768
    # The whole fp32 all-reduce of the gradients (a reduce-scatter and an all-gather, half the bytes each way on 2
    # ranks), none of it under backward; Adam's state whole on each rank: 4 + 4 + 8 B per parameter.
    assert pred.breakdown["dp"] == pytest.approx(2 * 0.5 * params * 4 * 1e-6)
    assert pred.memory["weights"] == pytest.approx(params * 16)
    expert_parallel = Layout(tp=1, pp=1, vpp=1, ep=2, esp=1, dp=2, micro_batch=1)
    for degrees in ((2, 3), (1, 1)):
        times = moe_times(shape, dataclasses.replace(expert_parallel, degrees=degrees), cluster, compute)
        assert times.degrees == degrees


def test_the_bubble_is_p_minus_1_over_m_v_of_the_work():
    cfg, shape, cluster, compute = _tiny(gpus=4, num_layers=8, global_batch_size=8)
    fpt = flops_per_token(cfg, 128)
    for pp, vpp in ((2, 1), (4, 1), (2, 2), (2, 4)):
        lay = Layout(tp=1, pp=pp, vpp=vpp, ep=1, esp=1, dp=4 // pp, micro_batch=1)
        assert check_layout(cfg, shape, lay) is None, lay
        pred = predict_step(shape, lay, cluster, compute, fpt)
        t, m = sum(pred.per_microbatch.values()), pred.microbatches
        work = m * t
        assert pred.breakdown["bubble"] == pytest.approx((pp - 1) / (m * vpp) * work)
        assert pred.per_microbatch["pp"] == pytest.approx(2 * vpp * 32 * 64 * 4 * 1e-6)  # a send each way per chunk


def test_on_a_shared_host_the_bubble_runs_on_the_waiting_stages_cores():
    # 4 processes on 2 cores (an emulated cluster): all busy, each runs at half a core, so t is twice one core's;
    # in the bubble one stage's 2 processes compute, a core each: the bubble takes half of (p - 1) t.
    cfg, shape, cluster, compute = _tiny(gpus=4, num_layers=8, global_batch_size=8)
    shared = dataclasses.replace(compute, host_cores=2)
    assert compute.busy_rate(4, 2) == 1.0 and shared.busy_rate(4, 2) == 2.0 and shared.busy_rate(4, 1) == 2.0
    assert shared.busy_rate(2, 1) == 1.0  # a core each already
    fpt = flops_per_token(cfg, 128)
    lay = Layout(tp=1, pp=2, vpp=1, ep=1, esp=1, dp=2, micro_batch=1)
    own, lent = (predict_step(shape, lay, cluster, c, fpt) for c in (compute, shared))
    t = sum(lent.per_microbatch.values())
    assert lent.breakdown["bubble"] == pytest.approx(t / 2) and own.breakdown["bubble"] > 0
    # the last stage also runs the output layer: its own GPUs wait on it, a shared host's cores run the mean stage
    first, last = (stage_microbatch(shape, lay, cluster, compute, s, own.moe) for s in (0, 1))
    assert last["compute"] > first["compute"]
    assert own.per_microbatch == last
    assert lent.per_microbatch == {**last, "compute": pytest.approx((first["compute"] + last["compute"]) / 2)}
    with pytest.raises(Exception, match="--host-cores"):
        compute_for(build_cluster(nodes=1, gpus_per_node=8, gpu="h100").gpu, "bf16", None, 1.25, host_cores=2)


def test_a_layout_that_does_not_fit_in_memory_is_left_out():
    cfg, shape, cluster, compute = _tiny()
    none = memory_per_gpu(shape, DATA_PARALLEL, 2)["total"]
    full = memory_per_gpu(shape, dataclasses.replace(DATA_PARALLEL, activations="full"), 2)["total"]
    assert full < none
    limit_gib = (full + none) / 2 / GIB  # the full-recompute variant fits, the one that keeps everything does not
    cfg, shape, cluster, compute = _tiny(memory_gib=limit_gib)
    result = search(cfg, shape, cluster, compute, flops_per_token(cfg, 128), memory_fraction=1.0)
    layouts = [p.layout for p in result.ranked]
    assert dataclasses.replace(DATA_PARALLEL, activations="full") in layouts
    assert DATA_PARALLEL not in layouts
    assert all(p.memory["total"] <= limit_gib * GIB for p in result.ranked)
    assert result.too_big >= 1 and result.searched == len(layouts) + result.too_big


def test_only_layouts_the_trainer_accepts_are_searched():
    cfg, shape, cluster, compute = _tiny(gpus=8, global_batch_size=8)
    result = search(cfg, shape, cluster, compute, flops_per_token(cfg, 128))
    layouts = {p.layout for p in result.ranked}
    assert layouts and all(check_layout(cfg, shape, lay) is None for lay in layouts)
    assert {lay.tp for lay in layouts} == {1, 2, 4}  # TP 8 does not divide the 4 heads
    assert {lay.ep for lay in layouts} == {1, 2}  # EP divides the 2 experts
    assert all(lay.tp * lay.pp * lay.dp == 8 for lay in layouts)
    refused = Layout(tp=8, pp=1, vpp=1, ep=1, esp=1, dp=1, micro_batch=8)
    assert "--tensor-model-parallel-size" in check_layout(cfg, shape, refused)


def test_placement_decides_which_link_carries_the_all_to_all_and_the_expert_gradients():
    # 2 nodes x 4: EP 4, expert-DP 2. e+d keeps the EP group in a node and reduces the experts' gradients across
    # nodes; d+e spreads the EP group over both nodes and reduces the gradients in a node.
    lay = Layout(tp=1, pp=1, vpp=1, ep=4, esp=1, dp=8, micro_batch=1)
    e_d, d_e = groups(lay, 4), groups(dataclasses.replace(lay, placement="d+e"), 4)
    assert e_d["ep"] == GroupShape(size=4, per_node=4, nodes=1) and e_d["edp"].crosses_nodes
    assert d_e["ep"] == GroupShape(size=4, per_node=2, nodes=2) and not d_e["edp"].crosses_nodes
    cfg, shape, cluster, compute = _tiny(
        nodes=2, gpus=4, inter_gbit=LINK_GBIT / 100, num_experts=4, global_batch_size=8
    )
    fpt = flops_per_token(cfg, 128)
    near, far = (
        predict_step(shape, x, cluster, compute, fpt) for x in (lay, dataclasses.replace(lay, placement="d+e"))
    )
    assert near.per_microbatch["ep"] < far.per_microbatch["ep"]  # the all-to-all moved to the slow link
    assert (
        moe_times(shape, lay, cluster, compute).exposed_forward_ms
        < moe_times(shape, far.layout, cluster, compute).exposed_forward_ms
    )
    assert far.breakdown["dp"] < near.breakdown["dp"]  # the experts' gradients moved off it


def test_the_all_to_all_lines_worked_by_hand():
    links = {"intra_node_gbit": 800, "inter_node_gbit": 80, "intra_alpha_ms": 0.01, "inter_alpha_ms": 0.1}
    cluster = build_cluster(nodes=2, gpus_per_node=4, gpu="h100", **links)
    group = GroupShape(size=8, per_node=4, nodes=2)
    intra, inter = 8 / 800e9 * 1e3, 8 / 80e9 * 1e3  # ms per byte
    # linear: 3 peers over NVLink and 4 over the NIC at once; the slower side.
    assert cluster.a2a_line(group, "linear") == pytest.approx((4 * 0.1, 4 / 8 * inter))
    # 2dh: 3 messages carrying 3/4 of the bytes in the node, then 1 message of 1/2 of them to the other node, and two
    # copies through memory (3.35 TB/s).
    copies = 2 / 3.35e12 * 1e3
    assert cluster.a2a_line(group, "2dh") == pytest.approx((3 * 0.01 + 0.1, 3 / 4 * intra + 1 / 2 * inter + copies))


def test_the_efficiency_curve_follows_the_measured_gemms():
    assert efficiency_shape(2 * 8192**3) == pytest.approx(1.0)
    assert efficiency_shape(2 * 1024 * 4096 * 14336) == pytest.approx(0.650 / 0.805)
    assert efficiency_shape(1.0) == pytest.approx(0.337 / 0.805)  # held flat below the smallest measured
    assert efficiency_shape(1e9) < efficiency_shape(1e11) < efficiency_shape(1e12)


MIXTRAL = ["--model-script", "examples/pretrain_mixtral_8x7b.sh", "--nodes", "8", "--gpus-per-node", "8"]


@pytest.mark.slow  # runs the example's dry run twice and searches ~11,000 layouts twice: ~30 s
def test_the_tool_plans_mixtral_on_64_h100s(capsys):
    assert plan_tool.main([*MIXTRAL, "--gpu", "h100", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    layouts = document["layouts"]
    assert len(layouts) == 5 and [r["step_ms"] for r in layouts] == sorted(r["step_ms"] for r in layouts)
    assert all(r["memory_gib"] <= 80 * 0.9 for r in layouts)
    assert all(r["tp"] * r["pp"] * r["dp"] == 64 for r in layouts)
    given = document["given"]  # the script's own layout: TP 2, PP 4, EP 8, full recompute
    assert (given["tp"], given["pp"], given["ep"], given["activations"]) == (2, 4, 8, "full")
    assert given["breakdown_ms"]["bubble"] == pytest.approx(3 * sum(given["per_microbatch_ms"].values()))
    assert layouts[0]["step_ms"] <= given["step_ms"]
    assert sum(layouts[0]["breakdown_ms"].values()) == pytest.approx(layouts[0]["step_ms"])
    flags = document["best_flags"]
    assert document["best_env"]["TP"] == str(layouts[0]["tp"])
    assert flags[flags.index("--expert-tensor-parallel-size") + 1] == str(layouts[0]["esp"])
    # The flags pass the trainer's checks on 64 ranks, the placement and all-to-all algorithm included.
    script = plan_tool.script_flags("examples/pretrain_mixtral_8x7b.sh", 8, 8, document["best_env"])
    assert set(document["best_env"]) == {"TP", "PP", "EP"}  # the example reads them (and sets SP from TP)
    cfg = parse_args([*script, *flags])
    cfg.validate(64)
    assert cfg.parallel.expert_model_parallel_size == layouts[0]["ep"]
    assert (cfg.parallel.expert_placement, cfg.moe.moe_a2a_algorithm) == (layouts[0]["placement"], layouts[0]["a2a"])

    assert plan_tool.main([*MIXTRAL, "--gpu", "h100", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n    #") == 3 and "\n flags " in out
    assert "to run #1" in out and "examples/pretrain_mixtral_8x7b.sh --expert-tensor-parallel-size" in out
    assert "where #1's step goes" in out and "bubble" in out


def test_a_pipeline_layout_string_is_left_unplanned_and_named():
    cfg = parse_args([*TINY, "--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|tL"])
    assert plan_tool.given_layout(cfg, 2) == (
        None,
        "the planner models even pipeline stages, not --pipeline-model-parallel-layout",
    )


def test_the_tool_refuses_what_it_cannot_plan(capsys):
    tiny = ["--nodes", "1", "--gpus-per-node", "2", *TINY, "--global-batch-size", "4"]
    assert plan_tool.main([*tiny, "--gpu", "cpu"]) == 2
    assert "--gemm-tflops" in capsys.readouterr().err
    cpu = [*tiny, "--gpu", "cpu", "--gemm-tflops", "0.01"]
    assert plan_tool.main([*cpu, "--expert-model-parallel-size", "4", "--given-only"]) == 2  # EP 4 with 2 experts
    assert "--given-only" in capsys.readouterr().err
    assert plan_tool.main([*cpu, "--given-only", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["layouts"] == [] and document["given"]["dp"] == 2


def test_a_profile_replaces_the_links_and_the_gemm_rate(tmp_path, capsys):
    alpha = {"a2a": 0.5, "ag": 0.2, "rs": 0.2, "ar": 0.3, "gemm": 0.05}
    beta = {"a2a": 2e-6, "ag": 1e-6, "rs": 1e-6, "ar": 4e-6, "gemm": 2e-9}
    fits = ClusterFits.from_coefficients(alpha, beta, cluster={"ep": 4, "esp": 1, "dp": 2})
    path = str(tmp_path / "fits.json")
    fits.save(path)
    measured = Measured.from_fits(ClusterFits.load(path))
    assert measured.gemm_tflops == pytest.approx(2 / 2e-9 * 1e3 / 1e12)  # 2 FLOPs per multiply-add
    _, _, cluster, _ = _tiny(nodes=2, gpus=4)
    cluster = dataclasses.replace(cluster, measured=measured)
    for shape in (GroupShape(size=4, per_node=4, nodes=1), GroupShape(size=8, per_node=4, nodes=2)):
        assert cluster.a2a_line(shape, "linear") == (0.5, 2e-6)  # measured, wherever the group lies
        assert cluster.ring_ms(shape, 1000) == pytest.approx(0.2 + 1e-3)
        assert cluster.dp_ring_ms(shape, 1000) == pytest.approx((0.3 + 4e-3) / 2)
    tiny = ["--nodes", "1", "--gpus-per-node", "2", "--gpu", "cpu", *TINY]
    assert plan_tool.main([*tiny, "--profile", path, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["gemm_tflops"] == pytest.approx(measured.gemm_tflops)
    best = document["layouts"][0]
    assert document["warnings"] == [
        f"the profile was measured at {name.upper()}={size}, #1 runs {name.upper()}={best[name]}"
        for name, size in (("ep", 4), ("esp", 1), ("dp", 2))
        if best[name] != size
    ]
    assert plan_tool.main([*tiny, "--profile", str(tmp_path / "missing.json")]) == 2
    assert "--profile=" in capsys.readouterr().err


def test_a_cpu_cluster_measures_its_rate(capsys):
    tiny = ["--nodes", "1", "--gpus-per-node", "2", *TINY, "--given-only", "--json"]
    assert plan_tool.main([*tiny, "--gpu", "cpu", "--gemm-tflops", "measure"]) == 0
    assert json.loads(capsys.readouterr().out)["gemm_tflops"] > 0
    assert plan_tool.main([*tiny, "--gpu", "h100", "--gemm-tflops", "measure"]) == 2
    assert "--gemm-tflops=measure" in capsys.readouterr().err


def test_auto_in_the_models_own_flags_is_the_faster_of_the_choices_it_leaves_open():
    """2 nodes x 2: EP=2, expert-DP=2 leaves e+d and d+e open; under d+e the EP group crosses with one rank per
    node, so 2DH changes nothing there and only linear is costed."""
    lay = Layout(tp=1, pp=1, vpp=1, ep=2, esp=1, dp=4, micro_batch=1, placement="auto", a2a="auto")
    costed = []

    def predict(v):
        costed.append((v.placement, v.a2a))
        return SimpleNamespace(step_ms={"e+d": 2.0, "d+e": 1.0}[v.placement])

    chosen = plan_tool.resolve_auto(lay, predict, gpus_per_node=2)
    assert (chosen.placement, chosen.a2a) == ("d+e", "linear") and sorted(costed) == [
        ("d+e", "linear"),
        ("e+d", "linear"),
    ]
    fixed = dataclasses.replace(lay, placement="e+d", a2a="linear")
    assert plan_tool.resolve_auto(fixed, predict, gpus_per_node=2) is fixed
