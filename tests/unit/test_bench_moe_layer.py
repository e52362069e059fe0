"""tools/bench_moe_layer.py: one case end to end at toy size, and how the floors are summed."""

from __future__ import annotations

import pytest
import torch

from tools import bench_moe_layer as bench


def test_floor_per_round_takes_each_gemm_at_its_fastest_kernel():
    times = {
        "ours": [9.0, 9.0],
        "floor/mm/gate": [1.0, 1.0],
        "floor/mm/fc1": [5.0, 6.0],
        "floor/onednn/gate": [2.0, 0.5],
        "floor/onednn/fc1": [4.0, 7.0],
    }
    assert bench.floor_per_round(times, ["mm"]) == [6.0, 7.0]
    assert bench.floor_per_round(times, ["mm", "onednn"]) == [5.0, 6.5]  # per GEMM and per round


def test_one_case_runs_and_matches_megatron_core(megatron_world1):
    from megatron_moe.platform import current_platform

    args = bench.parse_args(["--repeats", "2", "--warmup", "1", "--max-warmup", "1", "--dtype", "fp32"])
    result = bench.run_case(
        "toy",
        hidden=32,
        ffn=64,
        tokens=64,
        experts=4,
        topk=2,
        capacity_factor=0.0,
        dispatcher="alltoallv",
        args=args,
        platform=current_platform(),
    )
    assert result["rows_computed"] == 128 and result["dropped_fraction"] == 0.0
    assert result["max_abs_diff_vs_mcore"] < 1e-5  # same router and weights: the same output
    assert result["floor_kernels"][0] == "mm"
    assert len(result["layer_ms_all"]) == len(result["ideal_ms_all"]) == 2
    assert result["kernel"] in ("onednn", "torch._grouped_mm", "mm-loop")


def test_fine_grained_cases_are_the_issues_shapes():
    assert bench.CASES["fine"] == (512, 352, 4096, [(64, 8), (32, 4)])
    hidden, ffn, tokens, shapes = bench.CASES["dsv3"]
    assert hidden / ffn == 7168 / 2048 and shapes == [(256, 8)]  # DeepSeek-V3's ratio and routing
    assert bench.CASE_OPTIONS["dsv3"] == dict(
        swiglu=True, sigmoid=True, num_groups=8, group_topk=4, scaling=2.5, shared=ffn
    )


def test_fine_grained_64_experts_top8_match_megatron_core(megatron_world1):
    """64 small experts, top-8 (the `fine` case's routing at toy widths: small experts, one run)."""
    from megatron_moe.platform import current_platform

    args = bench.parse_args(["--repeats", "1", "--warmup", "1", "--max-warmup", "1", "--dtype", "fp32"])
    result = bench.run_case("toy", 32, 24, 128, 64, 8, 0.0, "alltoallv", args, current_platform())
    assert result["rows_computed"] == 1024
    assert result["max_abs_diff_vs_mcore"] < 1e-5


def test_deepseek_options_run_and_match_megatron_core(megatron_world1):
    """The dsv3 case's router (sigmoid, expert bias, groups, x2.5) and shared expert at toy size, in both layers."""
    from megatron_moe.platform import current_platform

    args = bench.parse_args(["--repeats", "1", "--warmup", "1", "--max-warmup", "1", "--dtype", "fp32"])
    options = dict(bench.CASE_OPTIONS["dsv3"], num_groups=4, group_topk=2, shared=16)
    result = bench.run_case("toy", 32, 16, 64, 16, 4, 0.0, "alltoallv", args, current_platform(), options)
    assert result["rows_computed"] == 256 and result["swiglu"] and result["shared"] == 16
    assert result["max_abs_diff_vs_mcore"] < 1e-5  # same router, bias, groups, scaling and shared expert
    shared_floor = bench.floor_gemms(64, 32, 16, 16, 256, True, torch.device("cpu"), torch.float32, shared=16)
    assert shared_floor["shared_fc1"].args[1].shape == (32, 32) and len(shared_floor) == 15


@pytest.mark.parametrize("swiglu", [False, True], ids=["gelu", "swiglu"])
def test_floor_is_the_layer_gemms_of_the_rows_computed(swiglu):
    """The floor is the gate GEMM over all tokens plus the expert GEMMs over exactly the rows computed,
    forward, dX and dW: its FLOPs are the layer's dense math, and oneDNN's floor computes the same products."""
    tokens, hidden, ffn, experts, rows = 64, 32, 48, 4, 96
    kernels = ["mm"] + (["onednn"] if bench.onednn_works(torch.float32) else [])
    steps = {
        k: bench.floor_gemms(tokens, hidden, ffn, experts, rows, swiglu, torch.device("cpu"), torch.float32, k)
        for k in kernels
    }
    flops = {
        name: 2 * a.shape[0] * a.shape[1] * b.shape[1]
        for name, (a, b) in ((name, step.args) for name, step in steps["mm"].items())
    }
    fc1_cols = 2 * ffn if swiglu else ffn
    assert sum(flops[g] for g in flops if g.startswith("gate")) == 3 * 2 * tokens * hidden * experts
    assert sum(flops[g] for g in flops if g.startswith("fc1")) == 3 * 2 * rows * hidden * fc1_cols
    assert sum(flops[g] for g in flops if g.startswith("fc2")) == 3 * 2 * rows * ffn * hidden
    assert len(flops) == 9
    for kernel in kernels[1:]:
        for name, step in steps[kernel].items():
            torch.testing.assert_close(step(), steps["mm"][name](), rtol=1e-4, atol=1e-4, msg=name)
