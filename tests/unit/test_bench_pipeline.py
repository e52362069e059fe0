"""tools/bench_pipeline.py's pure parts: the jobs' order, the contenders, the comparison figures."""

import pytest

from tests.conftest import load_tool

bench = load_tool("bench_pipeline")


def test_jobs_cover_every_layout_and_rate_with_the_layouts_order_alternating():
    jobs = bench.jobs(["2x1", "2x2"], [0.5, 1.0, 2.5])
    assert sorted(jobs) == sorted((layout, rate) for layout in ("2x1", "2x2") for rate in (0.5, 1.0, 2.5))
    assert [layout for layout, _ in jobs[::2]] == ["2x1", "2x2", "2x1"]


def test_contenders_are_the_degree_grid_then_the_solver():
    assert bench.contenders([1, 2]) == ["1,1", "1,2", "2,1", "2,2", "solver"]
    assert len(bench.contenders([1, 2, 4, 8])) == 16 + 1


def test_summarize_picks_the_best_fixed_and_brute_force_and_the_ratios():
    ms = {"1,1": 100.0, "1,2": 70.0, "2,1": 80.0, "2,2": 75.0, "solver": 60.0}
    row = bench.summarize({name: {"ms": v} for name, v in ms.items()}, [1, 2])
    assert row["r1_ms"] == 100.0 and row["solver_ms"] == 60.0
    assert row["best_fixed"] == {"r": 2, "ms": 75.0}  # the best r = r, not the best pair
    assert row["best_brute_force"] == {"forward": 1, "backward": 2, "ms": 70.0}
    assert row["speedup_vs_r1"] == round(100 / 60, 3) and row["speedup_vs_best_fixed"] == round(75 / 60, 3)
    assert row["solver_within_best"] == round(70 / 60, 3)


def test_bad_flags_name_the_flag():
    with pytest.raises(SystemExit):
        bench.parse_args(["--cluster", "4x1"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--degrees", "2", "4"])  # no r = 1 baseline
