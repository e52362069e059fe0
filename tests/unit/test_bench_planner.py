"""tools/bench_planner.py's row, summary and ranking logic, and its configurations (no training)."""

import json

import pytest

from tools import bench_planner as bp

DATA = ("/data/corpus_text_document", "/data/tokenizer.model")


def _history(steps, exposed=None):
    exposed = exposed or {}
    return [{"step_ms": s, "comm": {"exposed_ms": dict(exposed)}} for s in steps]


def _predicted(step_ms):
    return {"step_ms": step_ms, "breakdown_ms": {"compute": step_ms - 10.0, "ep": 6.0, "dp": 4.0}}


def test_row_ratio_within_and_breakdown():
    config = bp.CONFIGS[0]
    history = _history([9999.0, 1000.0, 1100.0, 900.0], {"a2a_dispatch": 30.0, "esp_ag": 5.0, "dp_grad_reduce": 7.0})
    r = bp.row(config, "EP2 DP2", _predicted(1150.0), history, warmup=1)
    assert r["measured_ms"] == 1000.0  # the median of the timed steps, the warm-up step dropped
    assert r["ratio"] == 1.15 and r["within"]
    assert r["measured_exposed_ms"] == {"ep": 35.0, "dp": 7.0, "tp": 0.0, "pp": 0.0}
    assert r["measured_step_ms_all"] == [1000.0, 1100.0, 900.0]
    off = bp.row(config, "EP2 DP2", _predicted(1160.0), history, warmup=1)
    assert off["ratio"] == 1.16 and not off["within"]
    under = bp.row(config, "EP2 DP2", _predicted(840.0), history, warmup=1)
    assert not under["within"]


def test_summary_counts_and_names_the_worst():
    history = _history([1000.0])
    rows = [bp.row(c, "x", _predicted(ms), history, warmup=0) for c, ms in zip(bp.CONFIGS, (1000.0, 1200.0, 750.0))]
    s = bp.summary(rows, gemm_tflops=0.05, cores=2)
    assert (s["within"], s["rows"]) == (1, 3)
    assert s["worst"] == {"config": bp.CONFIGS[2].name, "ratio": 0.75}


def test_ranking_first_against_best_measured():
    cands = [{"label": "a", "measured_ms": 1040.0}, {"label": "b", "measured_ms": 1000.0}]
    r = bp.ranking("2x2", 1.0, cands)
    assert r["best_measured"] == "b" and r["first_over_best"] == 1.04 and r["within"]
    r = bp.ranking("2x2", 1.0, [{"label": "a", "measured_ms": 1060.0}, {"label": "b", "measured_ms": 1000.0}])
    assert not r["within"]


def test_configs_cover_the_issue_and_the_planner_predicts_each():
    clusters = {c.cluster for c in bp.CONFIGS}
    assert {"2x1", "2x2", "4x1", "4x2"} <= clusters and len(bp.CONFIGS) >= 8
    assert len({c.link_gbit for c in bp.CONFIGS}) >= 2
    flags = " ".join(" ".join(c.parallel) for c in bp.CONFIGS)
    assert "--expert-tensor-parallel-size 2" in flags and "--pipeline-model-parallel-size 2" in flags
    for config in bp.CONFIGS:
        nodes, procs = bp.parse_cluster(config.cluster)
        rate = bp.cluster_rate(0.05, nodes * procs, cores=2)
        document, _, _ = bp.predict(
            config.cluster, config.link_gbit, rate, bp.model_flags(config.cluster, 4, DATA, list(config.parallel))
        )
        given = document["given"]
        assert given is not None and given["step_ms"] > 0, config
        assert given["dp"] > 1 or config.cluster == "2x1", config  # every layout keeps some data parallelism


def test_cluster_rate_shares_the_cores():
    assert bp.cluster_rate(0.06, 1, cores=2) == 0.06
    assert bp.cluster_rate(0.06, 8, cores=2) == pytest.approx(0.015)


def test_ranking_flag_is_checked():
    with pytest.raises(SystemExit):
        bp.parse_args(["--ranking", "2x2"])


def test_ranking_without_the_first_measured_says_nothing():
    cands = [{"label": "a", "error": "node 0 exited 1"}, {"label": "b", "measured_ms": 1000.0}]
    assert bp.ranking("2x2", 1.0, cands)["within"] is None


def test_calibrated_overhead_reproduces_the_measured_one_process_step():
    flags = bp.model_flags(bp.CALIBRATION, 4, DATA, [], off=False)
    predicted = bp.predict(bp.CALIBRATION, 1.0, 0.05, flags)[0]["given"]
    overhead = bp.calibrate_overhead(2 * predicted["step_ms"], predicted)
    assert overhead > bp.DEFAULT_OVERHEAD
    refit = bp.predict(bp.CALIBRATION, 1.0, 0.05, flags, overhead=overhead)[0]["given"]
    assert refit["step_ms"] == pytest.approx(2 * predicted["step_ms"], rel=1e-3)


def test_the_node_link_is_shared_by_its_processes():
    argv = bp.planner_argv("2x2", 1.0, 0.05)
    assert argv[argv.index("--inter-node-gbit") + 1] == "0.5"


def test_replay_predicts_a_saved_run_again_and_keeps_its_measurements(tmp_path):
    config = bp.CONFIGS[2]
    head = {"gemm_tflops_one_thread": 0.05, "cores": 2, "calibration": bp.calibration_job()}
    head["calibration_measured_ms"] = 900.0
    measured = {"measured_ms": 2000.0, "measured_exposed_ms": {"ep": 1.0}, "measured_step_ms_all": [1990.0, 2010.0]}
    saved_row = {"config": config.name, "predicted_ms": 1.0, "ratio": 0.0005, "within": False, **measured}
    stale = {"ranking": "2x2 at 1 Gbit/s", "candidates": [{"label": "TP9", "flags": [], "measured_ms": 1.0}]}
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in (head, saved_row, stale)) + "\n")

    out = bp.replay(str(path), steps=4)
    assert [line.get("config") or line.get("summary") or line.get("ranking") for line in out[1:]] == [
        config.name, "planner vs measured step", "2x2 at 1 Gbit/s",
    ]  # fmt: skip
    # the overhead refitted to the saved calibration job, the row predicted as a fresh run would
    data = ("data_text_document", "tokenizer.model")
    calibration = bp.predict(
        bp.CALIBRATION, 1.0, 0.05, bp.model_flags(bp.CALIBRATION, 4, data, list(bp.CALIBRATION_PARALLEL))
    )[0]["given"]
    overhead = bp.calibrate_overhead(900.0, calibration)
    assert out[0]["compute_overhead"] == round(overhead, 3)
    nodes, procs = bp.parse_cluster(config.cluster)
    flags = bp.model_flags(config.cluster, 4, data, list(config.parallel))
    rate = bp.cluster_rate(0.05, nodes * procs, 2)
    fresh = bp.predict(config.cluster, config.link_gbit, rate, flags, overhead=overhead)
    row = out[1]
    assert row["predicted_ms"] == round(fresh[0]["given"]["step_ms"], 1) != 1.0
    assert row["ratio"] == round(row["predicted_ms"] / 2000.0, 3)
    assert {k: row[k] for k in measured} == measured
    assert out[2]["within"] == row["within"] and out[2]["rows"] == 1
    assert out[3]["within"] is None  # the planner's top 3 are not the saved candidates: not replayed


def test_replay_refuses_a_run_calibrated_otherwise(tmp_path):
    path = tmp_path / "run.jsonl"
    head = {"gemm_tflops_one_thread": 0.05, "cores": 2, "calibration": "1x1", "calibration_measured_ms": 600.0}
    path.write_text(json.dumps(head) + "\n")
    with pytest.raises(SystemExit, match="calibrated on 1x1"):
        bp.replay(str(path), steps=4)
