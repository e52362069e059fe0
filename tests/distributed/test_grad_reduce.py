"""FSMoE's adaptive gradient partition changes where the data-parallel reduction starts, not what it
computes (`train_worker.py grad_reduce`, 4 gloo ranks, one torchrun job, 4 steps from the same seed per run).

With DP = 2 for the dense and the expert parameters (TP=2+SP+EP=2; alone, under Lancet's deferred dW, with 4
micro-batches) the sum of two gradients is the same whatever the buckets: lm loss, grad norm and params norm are
bit-identical to megatron-core's reduction, step by step. With the distributed optimizer the shards are laid out
per parameter instead of per bucket, so the grad norm sums its pieces in another order: 1e-6 relative. With DP=4
(EP=2 on 4 ranks) gloo's ring sums each element in an order that depends on its place in the bucket: 1e-6. PP=2:
the first stage runs the plan (megatron-core keeps one bucket on the other). The runs' own figures show that the
MoE layers' all-to-alls released the planned bucket groups in every step.
"""

import pytest

from tests.distributed.launcher import computed
from tests.distributed.shared_jobs import train_part

JOB_PARTS = {"grad_reduce": train_part("grad_reduce", timeout=900)}
EXACT = ["tp2_ep2", "tp2_ep2_lancet", "tp2_ep2_accumulate"]
CLOSE = ["tp2_ep2_distopt", "ep2", "pp2_ep2"]
REL = 1e-6


@pytest.fixture(scope="module")
def runs(shared_jobs):
    return shared_jobs.result("grad_reduce")


def numbers(history: list[dict]) -> list[tuple]:
    return [(step["lm loss"], step["grad norm"], step["params norm"]) for step in history]


@pytest.mark.parametrize("layout", EXACT)
def test_the_adaptive_partition_is_bit_identical_where_dp_is_two(runs, layout):
    megatron, adaptive = runs[f"{layout}/megatron"], runs[f"{layout}/adaptive"]
    assert len(megatron) == len(adaptive) == 4
    assert computed(adaptive) == computed(megatron)
    assert all(step["grad_reduce"] is None for step in megatron)


@pytest.mark.parametrize("layout", CLOSE)
def test_the_adaptive_partition_matches_within_tolerance(runs, layout):
    megatron, adaptive = runs[f"{layout}/megatron"], runs[f"{layout}/adaptive"]
    assert len(megatron) == len(adaptive) == 4
    for a, b in zip(numbers(adaptive), numbers(megatron)):
        assert a == pytest.approx(b, rel=REL), (a, b)


@pytest.mark.parametrize("layout", [*EXACT, "tp2_ep2_distopt", "ep2"])
def test_every_step_launches_planned_groups_from_the_moe_layers(runs, layout):
    for step in runs[f"{layout}/adaptive"]:
        figures = step["grad_reduce"]
        assert figures is not None and figures["planned"] > 0, step
        # the logging rank's groups: each released by its MoE layer's backward all-to-all once per step
        assert figures["released"] == figures["planned"], figures


def test_later_pipeline_stages_keep_megatron_cores_bucket(runs):
    # the logging rank is on the last stage, where megatron-core turns bucketing off: no plan there
    assert all(step["grad_reduce"] is None for step in runs["pp2_ep2/adaptive"])
