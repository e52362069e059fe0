"""Global expert e's initial weights are a function of (seed, layer, e) alone (one torchrun job
of 4 gloo ranks, expert_init_worker.py).

At EP=1 (x DP=4), EP=2, EP=4 and ESP=2 x EP=2, GELU and SwiGLU with a shared expert, the gathered experts equal
the single-process layer's bit for bit, no two experts are alike, expert-DP replicas agree, and the router and
shared expert are the same on every rank; all of it also with megatron-core's RNG tracker behaving as on a GPU
(its fork swaps a generator the host-side init does not draw from).
"""

import pytest

from tests.distributed.shared_jobs import Part

JOB_PARTS = {"expert_init": Part("expert_init_worker", "cases", 4, timeout=300)}
MODES = ("cpu_tracker", "gpu_like_tracker")
LAYOUTS = ("ep1", "ep2", "ep4", "esp2_ep2")
CASES = ("gelu", "swiglu_shared")


@pytest.fixture(scope="module")
def results(shared_jobs):
    return shared_jobs.result("expert_init")


def layout_cases(results):
    return {f"{m}/{lay}/{c}": results[f"{m}/{lay}/{c}"] for m in MODES for lay in LAYOUTS for c in CASES}


def test_every_layout_gathers_the_single_process_experts_exactly(results):
    cases = layout_cases(results)
    bad = {k: v for k, v in cases.items() if not v["experts_equal_single_process"]}
    assert not bad, bad


def test_experts_differ_from_each_other_and_are_initialised(results):
    for name, figures in layout_cases(results).items():
        assert figures["experts_distinct"], name
        assert 0.01 < figures["experts_std"] < 0.03, (name, figures["experts_std"])  # N(0, 0.02), not zeros


def test_router_and_shared_expert_identical_on_every_rank_and_layout(results):
    for name, figures in layout_cases(results).items():
        assert figures["router_same_on_every_rank"] and figures["shared_same_on_every_rank"], name
        assert figures["router_and_shared_equal_single_process"], name
        assert figures["replicas_agree"], name


def test_the_layer_number_is_part_of_the_key(results):
    assert all(results[f"{m}/other_layer/{c}"] for m in MODES for c in CASES)


def test_the_coalesced_parameter_broadcast_leaves_what_megatron_cores_leaves(results):
    """comm.broadcast_params (2 collectives at this size) against DistributedDataParallel.broadcast_params (one per
    parameter): the same numbers on every rank, dense ones from rank 0, expert ones from each expert-DP group's
    first rank (ranks 0 and 1 at EP=2)."""
    figures = results["broadcast_params"]
    assert figures["ours_equals_megatron_core"]
    assert figures["dense_from_rank_0"]
    assert figures["experts_per_expert_dp_group"] == [True] * 4
    assert figures["experts_differ_across_ep"]
