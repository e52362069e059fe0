"""Past --distributed-timeout-minutes the job ends with the watchdog's report: a rank stopped
(SIGSTOP) with --dead-peer-seconds beyond the timeout, so that the timeout ends the job.

Before, a rank stopped for 100-120 s produced no line at all, and gloo's eventual timeout ("Timed out waiting
60000ms for recv operation") named neither the rank nor the collective. The fault battery's stall cases (named
and goes on; ended by --dead-peer-seconds) are in tests/faults/test_ranks.py.
"""

import re

from tests.faults.jobs import stop_rank_1_until_the_job_ends, tiny_job


def test_past_the_deadline_the_job_ends_with_the_report(train_data):
    flags = ("--train-iters", "400", "--stall-report-seconds", "5", "--distributed-timeout-minutes", "0.25")
    with tiny_job(train_data, *flags, "--dead-peer-seconds", "60") as run:
        stopped = stop_rank_1_until_the_job_ends(run)
        code = run.proc.returncode
    (ending,) = [line for line in run.lines if "ending the job" in line]
    assert re.search(r"\] rank 0: blocked 1[56] s in collective ", ending), ending  # checked every 1.25 s
    assert "rank 1 (no heartbeat" in ending or "ranks [1] send no heartbeat" in ending, ending
    assert "--distributed-timeout-minutes=0.25 passed" in ending, ending
    assert code != 0 and run.ended_at - stopped < 30, (code, run.tail())
