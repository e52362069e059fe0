"""tools/plan_schedule.py: each MoE layer's degrees from a saved profile or from --alpha/--beta flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_moe.overlap.cost_model import FIT_KINDS, ClusterFits, LayerSizes, fit_linear, predict, solve_degrees
from tests.conftest import load_tool

plan_tool = load_tool("plan_schedule")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = (
    "--num-layers 4 --moe-layer-freq 2 --hidden-size 1024 --num-attention-heads 8 --moe-ffn-hidden-size 4096 "
    "--num-experts 8 --moe-router-topk 2 --micro-batch-size 4 --seq-length 1024 --expert-model-parallel-size 2 "
    "--expert-tensor-parallel-size 2"
).split()
TESTBED_B = {  # FSMoE's fitted coefficients of its Testbed-B (figure 5 c, d)
    "a2a": (0.175, 3.06e-7),
    "ag": (0.032, 1.68e-7),
    "rs": (0.0391, 1.67e-7),
    "ar": (0.0837, 5.99e-7),
    "gemm": (0.0924, 4.42e-11),
}
FLAGS = [arg for kind, (a, b) in TESTBED_B.items() for arg in (f"--alpha-{kind}", str(a), f"--beta-{kind}", str(b))]
SIZES = LayerSizes.from_layer(tokens=4096, topk=2, hidden_size=1024, ffn_hidden_size=4096, num_experts=8, ep=2, esp=2)


def _testbed_b() -> ClusterFits:
    alpha, beta = ({k: ab[i] for k, ab in TESTBED_B.items()} for i in (0, 1))
    return ClusterFits.from_coefficients(alpha, beta)


def _run(argv, capsys) -> tuple[int, list[dict], str]:
    code = plan_tool.main(argv)
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines()], err


def test_flags_give_the_solver_schedule_per_moe_layer(capsys):
    code, lines, _ = _run(MODEL + FLAGS, capsys)
    assert code == 0
    fits = _testbed_b()
    expected = solve_degrees(fits, SIZES, dw_in_backward=False)  # --overlap-wgrad greedy (EP > 1) defers dW
    assert lines[0]["source"] == "flags" and lines[0]["fits"]["a2a"]["beta"] == 3.06e-7
    assert [row["layer"] for row in lines[1:]] == [1, 3]  # --moe-layer-freq 2 over 4 layers
    for row in lines[1:]:
        assert (row["forward"], row["backward"]) == (expected.forward, expected.backward)
        assert row["predicted_ms"] == pytest.approx(expected.predicted_ms)
        assert row["r1_ms"] == pytest.approx(predict(fits, SIZES, 1, 1, dw_in_backward=False).predicted_ms)
        assert row["dw_in_backward"] is False
        assert row["speedup_vs_r1"]["forward"] >= 1.0
        assert row["sizes"]["n_a2a"] == SIZES.n_a2a


@pytest.mark.slow  # a fresh interpreter that imports megatron-core: ~5-15 s
def test_saved_profile_end_to_end(tmp_path):
    fits = ClusterFits(
        fits={
            k: fit_linear([(1e6, a + 1e6 * b), (4e6, a + 4e6 * b), (9e6, a + 9e6 * b)])
            for k, (a, b) in TESTBED_B.items()
        },
        cluster={"world": 4, "ep": 2, "esp": 2},
    )
    path = tmp_path / "fits.json"
    fits.save(str(path))
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-m", "tools.plan_schedule", "--profile", str(path), *MODEL],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert lines[0]["source"] == str(path) and lines[0]["cluster"] == {"world": 4, "ep": 2, "esp": 2}
    assert lines[0]["warnings"] == []
    assert lines[0]["fits"]["gemm"]["r2"] == pytest.approx(1.0, abs=1e-9)
    expected = solve_degrees(fits, SIZES, dw_in_backward=False)
    assert [(r["forward"], r["backward"]) for r in lines[1:]] == [(expected.forward, expected.backward)] * 2


def test_a_flag_overrides_the_profile(tmp_path, capsys):
    cluster = {"world": 4, "ep": 4, "esp": 1}
    beta = {k: 1e-7 for k in FIT_KINDS} | {"gemm": 1e-10}
    fits = ClusterFits.from_coefficients({k: 0.1 for k in FIT_KINDS}, beta, cluster)
    path = tmp_path / "fits.json"
    fits.save(str(path))
    code, lines, _ = _run(["--profile", str(path), "--t-gar-ms", "100", "--beta-a2a", "1e-6", *MODEL], capsys)
    assert code == 0 and lines[0]["source"] == f"{path} + flags"
    assert lines[0]["fits"]["a2a"] == {"alpha": 0.1, "beta": 1e-6, "r2": 1.0}
    assert lines[0]["warnings"] == [
        "the profile was measured at EP=4, the model runs EP=2",
        "the profile was measured at ESP=1, the model runs ESP=2",
    ]
    assert lines[1]["case"]["backward"] == 1 and lines[1]["backward"] == 1  # t_gar dominates the backward


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--profile", "/nonexistent/fits.json"], "--profile=/nonexistent/fits.json"),
        (FLAGS[:-4], "--alpha-gemm/--beta-gemm=None"),
        (FLAGS[:-2], "--beta-gemm=None: give it beside --alpha-gemm"),
        ([*FLAGS, "--max-degree", "0"], "--max-degree=0"),
        ([*FLAGS, "--alpha-a2a", "-1"], "--alpha-a2a=-1.0"),
        ([*FLAGS, "--fixed-degrees", "0", "2"], "--fixed-degrees="),
    ],
)
def test_bad_input_names_the_flag(argv, message, capsys):
    code, lines, err = _run(MODEL + argv, capsys)
    assert code == 2 and not lines
    assert message in err


def test_bad_model_names_the_flag(capsys):
    code, _, err = _run([*MODEL, *FLAGS, "--expert-tensor-parallel-size", "3"], capsys)
    assert code == 2 and "--moe-ffn-hidden-size=4096" in err
    i = MODEL.index("--num-experts")
    code, _, err = _run(MODEL[:i] + MODEL[i + 2 :] + FLAGS, capsys)
    assert code == 2 and "--num-experts" in err


def test_run_flags_to_layer_sizes_and_degrees():
    from megatron_moe.config import parse_args
    from megatron_moe.overlap.degrees import layer_sizes, plan_degrees

    argv = [*MODEL, "--bf16", "--tensor-model-parallel-size", "2", "--sequence-parallel", "--swiglu"]
    cfg = parse_args(argv)
    sizes = layer_sizes(cfg)
    expected = LayerSizes.from_layer(
        tokens=4 * 1024 // 2,
        topk=2,
        hidden_size=1024,
        ffn_hidden_size=4096,
        num_experts=8,
        ep=2,
        esp=2,
        dtype_bytes=2,
        gated=True,
    )
    assert sizes == expected
    fits = _testbed_b()
    plan = plan_degrees(cfg, fits, t_gar_ms=3.0)
    assert list(plan) == [1, 3] and plan[1] == solve_degrees(fits, expected, t_gar_ms=3.0, dw_in_backward=False)
    kept = plan_degrees(parse_args([*argv, "--overlap-wgrad", "off"]), fits, t_gar_ms=3.0)  # dW in the backward
    assert kept[1] == solve_degrees(fits, expected, t_gar_ms=3.0)
    assert kept[1].predicted_ms["backward"] > plan[1].predicted_ms["backward"]


def test_data_parallel_runs_get_the_adaptive_gradient_partition(capsys):
    """--data-parallel-size > 1: the estimated gradient bytes are partitioned (FSMoE section 5), each layer's
    backward is solved with its share, and a last line gives the partition; DP = 1: none."""
    code, lines, _ = _run([*MODEL, *FLAGS, "--data-parallel-size", "4", "--vocab-size", "32000"], capsys)
    assert code == 0
    *rows, last = lines[1:]
    assert last["grad_reduce_schedule"] == "adaptive" and set(last["assigned"]) == {"1", "3"}
    cfg, args = plan_tool._config([*MODEL, *FLAGS, "--data-parallel-size", "4"])
    per_layer, head, embedding = plan_tool.layer_grad_bytes(cfg, args)
    total = sum(per_layer.values()) + head + embedding
    assert sum(last["assigned"].values()) + last["tail_bytes"] == pytest.approx(total)
    # what layer 3 takes was made above it (layer 4, the head); layer 1 may take layers 2-4's too
    assert last["assigned"]["3"] <= per_layer[4] + head + 1
    assert last["predicted_ms"]["total"] <= last["predicted_ms"]["megatron"] + 1e-6
    fits = _testbed_b()
    for row in rows:
        share = last["assigned"][str(row["layer"])]
        expected = 0.0 if share <= 0 else 0.0837 + share * 5.99e-7
        assert row["t_gar_ms"] == pytest.approx(expected)
        solved = solve_degrees(fits, SIZES, t_gar_ms=row["t_gar_ms"], dw_in_backward=False)
        assert (row["forward"], row["backward"]) == (solved.forward, solved.backward)
    code, lines, _ = _run([*MODEL, *FLAGS], capsys)
    assert code == 0 and "grad_reduce_schedule" not in lines[-1]
    assert _run([*MODEL, *FLAGS, "--data-parallel-size", "0"], capsys)[0] == 2
