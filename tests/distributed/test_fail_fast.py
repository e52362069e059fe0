"""Faults on one rank of a 2-rank torchrun job: the job ends in seconds, naming the rank and the error.

Issue 12 items 1 and 7: before, an exception on one rank hung the job (`shutdown()`'s barrier waited for the
other rank, inside a training collective) and a diverging run died with "found NaN ... iteration -1".
"""

import os
import re
import subprocess
import time

import pytest

from tests.conftest import ROOT
from tests.distributed.launcher import tiny_pretrain_command

FAIL_WITHIN_S = 15
RANK_ERROR = re.compile(r"\] rank \d+: ")  # our error line: "[time] rank R: message"


def run_job(train_data, *flags, env=None):
    """Launch pretrain_gpt_moe.py on 2 ranks (EP=2); returns (exit code, output lines, seconds from the
    first line naming a rank's error to the end of the job)."""
    cmd = tiny_pretrain_command(train_data, "--train-iters", "200", *flags)
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **(env or {}))
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env, cwd=ROOT)
    lines, failed_at = [], None
    for line in job.stdout:
        lines.append(line)
        if failed_at is None and RANK_ERROR.search(line):
            failed_at = time.monotonic()
    job.wait(timeout=300)
    ended = time.monotonic()
    return job.returncode, lines, None if failed_at is None else ended - failed_at


@pytest.mark.parametrize("rank, step", [(1, 3), (0, 2)])  # rank 0 also hosts the rendezvous store
def test_an_exception_on_one_rank_ends_the_job_at_once(train_data, rank, step):
    code, lines, seconds = run_job(train_data, "--lr", "1e-3", env={"MEGATRON_MOE_TEST_RAISE_AT": f"{rank}:{step}"})
    text = "".join(lines)
    message = f"rank {rank}: RuntimeError: injected failure at step {step}"
    assert code != 0, text[-3000:]
    assert sum(message in line for line in lines) == 1, text[-3000:]
    assert seconds is not None and seconds < FAIL_WITHIN_S, (seconds, text[-3000:])
    assert f"iteration {step:8d}/" not in text  # the step that raised never completed
    assert "Traceback" not in text.split(message)[0]  # the rank and message come first
    other = [line for line in lines if RANK_ERROR.search(line) and f"] rank {1 - rank}: " in line]
    assert all("another rank ended first" in line for line in other if "raised at" not in line), other


@pytest.fixture(scope="module")
def diverged(train_data):
    return run_job(train_data, "--lr", "1e3", "--clip-grad", "0")


def test_divergence_warns_then_a_non_finite_gradient_stops_the_run_naming_it(diverged):
    code, lines, seconds = diverged
    text = "".join(lines)
    assert code != 0, text[-3000:]
    stops = [line for line in lines if "NonFiniteError: non-finite" in line]
    assert stops, text[-3000:]
    stop = stops[0]
    assert "iteration -1" not in stop and " at iteration " in stop and " on rank " in stop, stop
    assert "gradient" not in stop or "first in parameter " in stop, stop
    assert "loss spike at iteration" in text, text[-3000:]
    assert seconds is not None and seconds < FAIL_WITHIN_S, (seconds, text[-3000:])


def test_a_nan_on_rank_1_is_named_by_every_rank(train_data):
    """Issue 26 item 5d: a NaN injected on rank 1 was reported first by rank 0, and no rank was singled out."""
    code, lines, seconds = run_job(train_data, "--lr", "1e-3", env={"MEGATRON_MOE_TEST_NAN_AT": "1:3"})
    text = "".join(lines)
    stops = [line for line in lines if "NonFiniteError: " in line and RANK_ERROR.search(line)]
    assert code != 0 and stops, text[-3000:]
    for stop in stops:  # whichever rank printed first names rank 1
        assert "non-finite values at iteration 3 first on rank 1: in their own forward outputs" in stop, stop
    assert "first on rank 0" not in text and "first on ranks" not in text, text[-3000:]
    assert seconds is not None and seconds < FAIL_WITHIN_S, (seconds, text[-3000:])


def test_an_immediate_divergence_is_warned_at_its_first_step(diverged):
    """Issue 26 item 5e: with --lr 1e3 the loss reached 4e7 at iteration 2 with no warning until one step
    before the stop."""
    _, lines, _ = diverged
    warnings = [line for line in lines if "loss spike at iteration" in line]
    assert warnings, "".join(lines)[-3000:]
    first = int(re.search(r"loss spike at iteration (\d+)", warnings[0]).group(1))
    assert first <= 3, warnings[0]
