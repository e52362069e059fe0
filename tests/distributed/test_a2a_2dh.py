"""Tutel's 2DH all-to-all moves the same rows as the linear one (`a2a_2dh_worker.py`, 8 gloo ranks in one torchrun
job, emulated nodes of 2 ranks): at 2x2 (EP=4) and 4x2 (EP=8) nodes x ranks, for dropless, capacity-padded and
capped layers, unpipelined and in FSMoE's chunked pipeline (2, 2), with Lancet's deferring weight-gradient store and
with shadow experts, the layer's output and every gradient are bit-identical to the linear all-to-all's. Each
rank's dispatch/combine records show N - 1 messages across nodes where linear sends G - g (every pair has rows in the
padded case), the same bytes crossing in total, and the host still waits once per forward+backward. Training
through `pretrain` (start-up makes the 2DH groups: `initialize.make_a2a_groups`) with 2dh and auto gives the
linear run's losses and norms, bit for bit.
"""

import os

import pytest

from tests.distributed.launcher import run_torchrun

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "a2a_2dh_worker.py")
LAYOUTS = {"2x2": (2, 2), "4x2": (4, 2)}
CASES = ("gelu_dropless", "swiglu_padded", "shared_losses_cap125")
GROUPS = ("output", "input_grad", "expert_grads", "router_and_shared_grads")


@pytest.fixture(scope="module")
def results(train_data):
    return run_torchrun(WORKER, nproc=8, args=list(train_data), timeout=900)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES)
def test_2dh_is_bit_identical_to_linear(results, layout, case):
    runs = results[f"{layout}/{case}"]
    expected = {"1x1", "2x2", "deferred/1x1", "deferred/2x2"} | ({"shadow2"} if case == "gelu_dropless" else set())
    assert set(runs) == expected
    for name, run in runs.items():
        assert run["two_level"], name
        for group in GROUPS:
            assert run[f"{group}_equal"], (name, group, run[f"{group}_abs"])
        assert run["records_2dh"] and run["crossing_bytes"][0] == run["crossing_bytes"][1] > 0, (name, run)
        if name.startswith("deferred"):  # the deferred dW ran under a backward all-to-all of the 2DH layer
            assert run["ran_under"], name
    if "shadow2" in runs:
        assert len(runs["shadow2"]["shadowed"]) == 2, runs["shadow2"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES)
def test_2dh_sends_one_message_per_remote_node(results, layout, case):
    nodes, per_node = LAYOUTS[layout]
    assert results[f"{layout}/layout"] == [nodes, per_node]
    for name, run in results[f"{layout}/{case}"].items():
        linear = [r[2][0] for r in run["records_linear"]]
        two_level = [r[2][0] for r in run["records_2dh"]]
        assert max(two_level) <= nodes - 1 and max(linear) <= nodes * per_node - per_node, name
        if case == "swiglu_padded":  # every pair has C rows: exactly G - g messages vs N - 1
            assert set(linear) == {nodes * per_node - per_node} and set(two_level) == {nodes - 1}, name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_host_waits_once_per_forward_and_backward_with_2dh(results, layout):
    assert results[f"{layout}/host_syncs"] == {"max": 1, "min": 1}


def test_training_with_2dh_is_bit_identical_and_start_up_makes_the_groups(results):
    runs = results["training"]
    assert len(runs["linear"]["steps"]) == 2 and runs["linear"]["made"] == []
    assert runs["2dh"]["steps"] == runs["linear"]["steps"]
    assert runs["auto"]["steps"] == runs["linear"]["steps"]
    # every rank makes the groups of its own EP group (2 nodes x 2 ranks); rank 0's is [0, 1, 2, 3]
    assert runs["2dh"]["made"] == [[0, 1, 2, 3]]
    assert runs["auto"]["made"] == [[0, 1, 2, 3]]  # a few KiB per rank: the start-ups dominate, auto runs 2DH
