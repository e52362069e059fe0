"""On a GPU the communication timers are CUDA events on the compute stream, read once per step
after the step's loss reached the host: a step with the timers on takes within 2% of one with them off, and they
add exactly one device wait per step (the event `summary()` settles). Skipped without a CUDA GPU."""

import os
import statistics

import pytest
import torch

from tests.distributed.launcher import run_torchrun

WORKER = os.path.join(os.path.dirname(__file__), "gpu_comm_timers_worker.py")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def runs(train_data):
    return run_torchrun(WORKER, 1, list(train_data), env={"MEGATRON_MOE_FORCE_CPU": "0"})


def test_a_step_with_the_timers_is_within_two_percent_of_one_without(runs):
    on, off = statistics.median(runs["on"]["step_ms"]), statistics.median(runs["off"]["step_ms"])
    assert on <= 1.02 * off, (on, off)


def test_the_timers_add_one_device_wait_per_step_and_measure(runs):
    steps = 12  # per run (the worker's STEPS)
    extra = [a - b for a, b in zip(runs["on"]["waits"], runs["off"]["waits"])]
    assert all(e <= steps for e in extra), (runs["on"]["waits"], runs["off"]["waits"], runs["warm_up_waits"])
    comm = runs["on"]["comm"]
    assert sum(comm["calls"].values()) > 0 and sum(comm["comm_ms"].values()) > 0, comm
    assert runs["off"]["comm"] is None
