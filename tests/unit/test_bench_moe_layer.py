"""tools/bench_moe_layer.py: one case end to end at toy size, and how the floors are summed."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import bench_moe_layer as bench  # noqa: E402


def test_floor_per_round_takes_each_gemm_at_its_fastest_kernel():
    times = {
        "ours": [9.0, 9.0],
        "floor/mm/gate": [1.0, 1.0], "floor/mm/fc1": [5.0, 6.0],
        "floor/onednn/gate": [2.0, 0.5], "floor/onednn/fc1": [4.0, 7.0],
    }  # fmt: skip
    assert bench.floor_per_round(times, ["mm"]) == [6.0, 7.0]
    assert bench.floor_per_round(times, ["mm", "onednn"]) == [5.0, 6.5]  # per GEMM and per round


def test_one_case_runs_and_matches_megatron_core(megatron_world1):
    from megatron_moe.platform import current_platform

    args = bench.parse_args(["--repeats", "2", "--warmup", "1", "--max-warmup", "1", "--dtype", "fp32"])
    result = bench.run_case("toy", hidden=32, ffn=64, tokens=64, experts=4, topk=2, capacity_factor=0.0,
                            dispatcher="alltoallv", args=args, platform=current_platform())  # fmt: skip
    assert result["rows_computed"] == 128 and result["dropped_fraction"] == 0.0
    assert result["max_abs_diff_vs_mcore"] < 1e-5  # same router and weights: the same output
    assert result["floor_kernels"][0] == "mm"
    assert 0 < result["ideal_fastest_ms"] <= result["ideal_ms"]
    assert len(result["layer_ms_all"]) == len(result["ideal_ms_all"]) == 2
    assert result["kernel"] in ("onednn", "torch._grouped_mm", "mm-loop")
