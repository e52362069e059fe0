"""A diverging 2-rank job (--lr 1e3): warned at its first steps, stopped naming the non-finite gradient.

Before, a diverging run died with "found NaN ... iteration -1", and the loss
reached 4e7 at iteration 2 with no warning until one step before the stop. An exception or a NaN on one rank:
tests/faults/test_ranks.py.
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
    assert "iteration -1" not in stop and " at iteration " in stop, stop
    assert re.search(r" first on (rank \d|ranks \[[\d, ]+\])", stop), stop  # both diverge alike here
    assert "gradient" not in stop or "first in parameter " in stop, stop
    assert "loss spike at iteration" in text, text[-3000:]
    assert seconds is not None and seconds < FAIL_WITHIN_S, (seconds, text[-3000:])


def test_an_immediate_divergence_is_warned_at_its_first_step(diverged):
    """With --lr 1e3 the loss reached 4e7 at iteration 2 with no warning until one step
    before the stop."""
    _, lines, _ = diverged
    warnings = [line for line in lines if "loss spike at iteration" in line]
    assert warnings, "".join(lines)[-3000:]
    first = int(re.search(r"loss spike at iteration (\d+)", warnings[0]).group(1))
    assert first <= 3, warnings[0]
