"""Deferrable Column/RowParallelLinear at TP=2, with and without sequence parallelism (2 gloo ranks, one job).

Outputs, input gradients and weight/bias gradients are bit-identical (fp32)
to megatron-core's own linears when the weight-gradient GEMMs run inside
backward (RUN_NOW, and a deferring store that runs them at once) and when a
store queues them and runs them after two micro-batches of two blocks.
"""

import pytest

from tests.distributed.shared_jobs import Part

JOB_PARTS = {"deferred_linears_tp": Part("deferred_linears_worker", "cases", 2, timeout=300)}
LAYOUTS = ("sp_nobias", "sp_bias", "no_sp_nobias", "no_sp_bias")
STORES = ("run_now", "immediate", "queue")


@pytest.fixture(scope="module")
def results(shared_jobs):
    return shared_jobs.result("deferred_linears_tp")


def test_every_layout_and_store_ran(results):
    assert set(results) == {f"{layout}/{store}" for layout in LAYOUTS for store in STORES}
    # 2 micro-batches x 2 outputs + 2 input grads + (4 weights, and 4 biases with bias)
    assert all(v["tensors"] == (12 if "nobias" not in k else 8) for k, v in results.items())


def test_deferred_and_not_are_bit_identical_to_megatron_core(results):
    bad = {k: v for k, v in results.items() if not v["equal"]}
    assert not bad, bad


def test_queued_store_owns_the_weight_grads(results):
    for layout in LAYOUTS:
        figures = results[f"{layout}/queue"]
        assert figures["weight_grads_none_before_run"], figures
        assert figures["closures"] == [2, 2, 2, 2], figures  # one per micro-batch for each of the 4 linears
