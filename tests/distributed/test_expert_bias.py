"""Aux-loss-free balancing with group-limited routing in training (`train_worker.py expert_bias`, 4 gloo ranks, one
torchrun job): EP=2 and EP=4 agree, the bias is the same on every rank and survives a checkpoint resumed at another
EP size. In the same job, FasterMoE's shadow experts (`train_worker.shadow_runs`): training with N experts shadowed
per layer, under Lancet's greedy dW plan and the chunked pipeline, matches training without, at EP=2 and EP=4, and
--moe-shadow-experts auto decides on the profile measured at start-up."""

import pytest

from tests.distributed.launcher import assert_matches
from tests.distributed.shared_jobs import train_part

JOB_PARTS = {"expert_bias": train_part("expert_bias", timeout=900)}
RATE = 0.01


@pytest.fixture(scope="module")
def runs(shared_jobs):
    return shared_jobs.result("expert_bias")


def test_ep2_and_ep4_train_alike_and_move_the_bias_alike(runs):
    assert len(runs["ep2"]) == len(runs["ep4"]) == 4
    assert_matches(runs["ep4"], runs["ep2"])
    biases = runs["bias_ep2/biases"]
    assert len(biases) == 2 and all(len(layer) == 4 for layer in biases)  # 2 MoE layers of 4 experts, at EP=1
    assert biases == runs["bias_ep4/biases"]
    # 4 steps of +-rate (or 0 at the mean): each bias a multiple of the rate within 4 of it, and some moved
    for bias in (b for layer in biases for b in layer):
        assert abs(bias) <= 4 * RATE + 1e-7 and abs(bias / RATE - round(bias / RATE)) < 1e-4
    assert any(abs(b) > 0 for layer in biases for b in layer)
    # the bias changed the routing: the run without it differs
    assert [s["lm loss"] for s in runs["ep2_no_bias"]] != [s["lm loss"] for s in runs["ep2"]]


def test_the_bias_resumes_at_another_ep_size(runs):
    assert runs["bias_ep2_step2/biases"] != runs["bias_ep2/biases"]  # it moved after step 2
    assert [s["iteration"] for s in runs["resumed_ep4"]] == [3, 4]
    assert_matches(runs["resumed_ep4"], runs["ep2"])
    assert runs["bias_resumed/biases"] == runs["bias_ep2/biases"]


def assert_within(steps: list[dict], reference: list[dict], rel: float = 1e-6) -> None:
    """fp32: the same sums, some in another order (an owner adds the shadows' reduced gradients to its own)."""
    assert len(steps) == len(reference)
    for got, want in zip(steps, reference):
        for figure in ("lm loss", "grad norm", "params norm"):
            assert got[figure] == pytest.approx(want[figure], rel=rel, abs=0), (figure, got[figure], want[figure])


@pytest.mark.parametrize("ep", ["2", "4"])
def test_shadow_experts_train_as_without_them_with_lancet_and_the_pipeline(runs, ep):
    off, on = runs[f"shadow/ep{ep}_off"], runs[f"shadow/ep{ep}_on"]
    assert len(off) == len(on) == 4
    assert_within(on, off)
    n = 2 if ep == "2" else 1
    for step in on:  # every MoE layer shadowed n experts in every step, and the queue deferred dW from step 3
        assert [len(experts) for experts in step["shadowed"].values()] == [n, n], step["shadowed"]
    assert all("shadowed" not in step for step in off)
    assert on[-1]["wgrad"]["under_a2a"] > 0, on[-1]["wgrad"]


def test_shadow_experts_auto_decides_from_the_profile_and_trains_as_without(runs):
    auto = runs["shadow/ep2_auto"]
    assert_within(auto, runs["shadow/ep2_off"])
    assert all(len(step["shadowed"]) == 2 for step in auto), auto  # both MoE layers decided, whatever they chose
