"""--overlap-report: the planners' predictions beside the timers' figures over the job's steps 3-12 (its end when it
is shorter), per kind, per MoE layer, for the operator partition (per micro-batch) and the gradient partition."""

import pytest

from megatron_moe.comm.timers import SUMMARY_KINDS, CommSummary
from megatron_moe.config import ConfigError, parse_args
from megatron_moe.overlap.cost_model import Schedule
from megatron_moe.overlap.grad_partition import GradPartition
from megatron_moe.training.overlap_report import OverlapPlans, OverlapReport, as_text

BASE = ["--data-path", "d", "--tokenizer-model", "t.model", "--num-experts", "4", "--expert-model-parallel-size", "2"]


def step(dispatch_wire: float, dispatch_exposed: float, grad_wire: float, grad_exposed: float) -> CommSummary:
    """One step: layer 2's forward dispatch (a quarter of its exposed time skew) and the DP gradient reduction
    (not split; the other kinds: nothing)."""
    wire = {**dict.fromkeys(SUMMARY_KINDS, 0.0), "a2a_dispatch": dispatch_wire, "dp_grad_reduce": grad_wire}
    exposed = {**dict.fromkeys(SUMMARY_KINDS, 0.0), "a2a_dispatch": dispatch_exposed, "dp_grad_reduce": grad_exposed}
    zeros = dict.fromkeys(SUMMARY_KINDS, 0)
    skew = {**dict.fromkeys(SUMMARY_KINDS, 0.0), "a2a_dispatch": dispatch_exposed / 4}
    layer = {"wire_ms": {"a2a_dispatch": dispatch_wire}, "exposed_ms": {"a2a_dispatch": dispatch_exposed}}
    layer |= {"skew_ms": {"a2a_dispatch": dispatch_exposed / 4}}
    return CommSummary(
        comm_ms=exposed,
        exposed_ms=exposed,
        bytes=zeros,
        wire_bytes=zeros,
        wire_ms=wire,
        wire_from=dict.fromkeys(SUMMARY_KINDS, "fit"),
        skew_ms=skew,
        transfer_ms={kind: exposed[kind] - skew[kind] for kind in SUMMARY_KINDS},
        skew_from={**dict.fromkeys(SUMMARY_KINDS, ""), "a2a_dispatch": "arrivals"},
        calls=zeros,
        per_layer={2: layer},
        hidden_frac=0.0,
    )


PLANS = OverlapPlans(
    degrees={2: Schedule(forward=2, backward=1, predicted_ms={"forward": 3.0, "backward": 5.0}, case={})},
    partition=[
        {
            "layers": [1, 2],
            "ranges": [[1, 2, 2]],
            "predicted_ms": {"partitioned": 30.0, "unpartitioned": 34.0},
            "a2a_ms": {"partitioned": 8.0, "unpartitioned": 8.0},
            "hidden_ms": {"partitioned": 6.0, "unpartitioned": 2.0},
        }
    ],
    grad_reduce=GradPartition(
        first={}, assigned={}, tail_bytes=0.0, olp_ms={}, predicted_ms={"tail": 4.0, "total": 40.0, "megatron": 50.0}
    ),
)


def test_the_report_averages_iterations_3_to_12_and_sets_each_plan_beside_its_measurement():
    report = OverlapReport(PLANS, job_steps=100, micro_batches=2)
    figures = {1: (99, 99, 99, 99), 2: (99, 99, 99, 99)}  # warm-up: not counted
    figures |= {i: (10.0, 2.0 + (i % 2) * 2, 20.0, 6.0) for i in range(3, 14)}  # exposed dispatch 2 / 4 alternating
    out = [report.observe(i, step(*figures[i])) for i in range(1, 14)]
    assert [i + 1 for i, r in enumerate(out) if r is not None] == [12]  # once, at the window's end
    r = out[11]
    assert r["iterations"] == [3, 12]
    assert r["kinds"].keys() == {"a2a_dispatch", "dp_grad_reduce"}
    dispatch = {"wire_ms": 10.0, "exposed_ms": 3.0, "skew_ms": 0.75, "transfer_ms": 2.25, "hidden": 0.7}
    assert r["kinds"]["a2a_dispatch"] == pytest.approx(dispatch)
    assert r["kinds"]["dp_grad_reduce"]["skew_ms"] == 0.0 and r["kinds"]["dp_grad_reduce"]["transfer_ms"] == 6.0
    assert (r["skew_ms"], r["transfer_ms"]) == pytest.approx((0.75, 8.25))
    assert (r["wire_ms"], r["exposed_ms"]) == (30.0, 9.0) and r["hidden"] == pytest.approx(0.7)
    assert r["layers"][2] == {
        "a2a_wire_ms": 10.0,
        "a2a_exposed_ms": 3.0,
        "a2a_skew_ms": 0.75,
        "hidden": 0.7,
        "degrees": [2, 1],
        "predicted_ms": {"forward": 3.0, "backward": 5.0},
    }
    (chunk,) = r["partition"]  # per micro-batch: 2 a step
    assert (chunk["a2a_wire_ms"], chunk["a2a_hidden_ms"]) == (5.0, 3.5)
    assert (chunk["predicted_a2a_ms"], chunk["predicted_hidden_ms"]) == (8.0, 6.0)
    assert r["grad_reduce"] == {"predicted_exposed_ms": 4.0, "exposed_ms": 6.0, "wire_ms": 20.0}
    text = as_text(r)
    assert "iterations 3-12" in text
    assert "MoE layer 2: degrees 2/1 (predicted forward 3.0, backward 5.0 ms a micro-batch)" in text
    assert "all-to-alls 3.0 exposed (0.8 skew) of 10.0 on the wire, 70.0% hidden" in text
    header, *rows = text.splitlines()[1:4]
    assert header.split() == ["kind", "wire", "exposed", "skew", "transfer", "hidden"]
    assert rows[0].split() == ["a2a_dispatch", "10.0", "3.0", "0.8", "2.2", "70.0%"]
    assert "operator partition, layers 1-2 (1-2 in 2 pieces): all-to-all ms hidden a micro-batch: predicted 6.0 of " \
        "8.0, measured 3.5 of 5.0" in text  # fmt: skip
    assert "gradient partition: exposed reduction predicted 4.0, measured 6.0 (of 20.0 on the wire)" in text


def test_a_short_run_reports_at_its_last_step_and_pieces_without_a_plan_say_so():
    plans = OverlapPlans(partition=[{"layers": [1, 2], "ranges": [[1, 2, 2]]}])
    report = OverlapReport(plans, job_steps=2, micro_batches=1)
    assert report.observe(1, step(10.0, 10.0, 0.0, 0.0)) is None
    r = report.observe(2, step(10.0, 4.0, 0.0, 0.0))
    assert r["iterations"] == [2, 2] and "grad_reduce" not in r
    assert "degrees" not in r["layers"][2]
    assert "measured 6.0 of 10.0 (no plan: pieces given)" in as_text(r)


def test_the_report_needs_the_timers():
    cfg = parse_args([*BASE, "--overlap-report", "--no-comm-timers"])
    with pytest.raises(ConfigError, match=r"--overlap-report=True: without --no-comm-timers"):
        cfg.validate(2)
    parse_args([*BASE, "--overlap-report"]).validate(2)


def test_a_resumed_job_reports_its_own_steps_3_to_12():
    """Resumed at iteration 100: Lancet's plan is in force from the job's third step (it profiles the job's cluster
    in its second), so the window is iterations 103-112, not the run's 3-12."""
    report = OverlapReport(PLANS, job_steps=50, micro_batches=2)
    out = {i: report.observe(i, step(10.0, 2.0, 20.0, 6.0)) for i in range(101, 121)}
    assert [i for i, r in out.items() if r is not None] == [112]
    assert out[112]["iterations"] == [103, 112]


def test_the_overlap_choice_is_reported_beside_the_measured_step():
    """--moe-overlap-choice auto: the chosen features and their predicted step beside the window's median step."""
    from megatron_moe.overlap.choice import OverlapChoice

    choice = OverlapChoice(open=("batch", "wgrad"), on=frozenset({"batch"}), steps={"none": 120.0, "batch": 90.0,
                           "wgrad": 118.0, "batch+wgrad": 89.0})  # fmt: skip
    report = OverlapReport(OverlapPlans(choice=choice), job_steps=100, micro_batches=2)
    out = None
    for it, ms in enumerate([500.0, 500.0, 100.0, 300.0, 110.0, 105.0, 95.0, 100.0, 102.0, 98.0, 101.0, 99.0], 1):
        out = report.observe(it, step(10.0, 5.0, 0.0, 0.0), ms) or out
    assert out["choice"] == {"on": ["batch"], "predicted_step_ms": 90.0, "predicted_none_ms": 120.0,
                             "step_ms": 100.5}  # fmt: skip
    assert "overlap choice: batch on; step predicted 90.0 (with none: 120.0), measured 100.5 (median)" in as_text(out)
