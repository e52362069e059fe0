"""examples/slurm/pretrain_gpt_moe.sbatch on a real Slurm cluster: trains, checkpoints, resumes when requeued.

The test installs Debian's slurmctld, slurmd, slurm-client and munge (when
they are missing; skipped with the reason when that cannot be done: not
root, no apt-get, no network), starts a private cluster of two pretend nodes
on this host (tests/slurm/cluster.py) and submits the real sbatch script for
the tiny CPU example, shrunk by EXTRA_ARGS: 2 nodes x 1 process, EP=2.

1. The job trains iterations 1-3 (`--exit-interval 3`), saves, and completes.
2. `scontrol requeue` reruns it (attempt 1, same job, same job directory): it
   must load the iteration-3 checkpoint and train iterations 4-6.
"""

import os
import re
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT
from tests.slurm.cluster import NODES, SlurmCluster, Unavailable, free_ports, install

SBATCH = os.path.join(ROOT, "examples", "slurm", "pretrain_gpt_moe.sbatch")
JOB_NAME = "tinymoe"
JOB_TIMEOUT = 420  # seconds per attempt; ~30 s on an idle 2-core machine
EXTRA_ARGS = (
    "--hidden-size 64 --seq-length 32 --num-experts 4 --micro-batch-size 2 --global-batch-size 4 "
    "--train-iters 6 --exit-interval 3 --lr-warmup-iters 1 --eval-interval 0 --eval-iters 0 "
    "--log-interval 1"
)
STEP = re.compile(r"iteration\s+(\d+)/\s*6 \|.*lm loss: (\S+)")


@pytest.fixture(scope="module")
def cluster():
    """A running two-node cluster; its daemons are stopped by PID afterwards, also on failure."""
    try:
        print(f"slurm: {install()}")
    except Unavailable as reason:
        pytest.skip(f"no Slurm cluster on this machine: {reason}")
    started = time.monotonic()
    # Each pretend node claims the host's cores (at most 2, the script's --cpus-per-task); memory is not tracked.
    cluster = SlurmCluster(cpus_per_node=max(1, min(2, os.cpu_count() or 1)), memory_mb=2000)
    try:
        cluster.start()
        print(f"slurm: cluster up in {time.monotonic() - started:.1f} s ({cluster.root})")
        yield cluster
    finally:
        killed = cluster.stop()
        cluster.remove()
        assert not killed, f"processes outlived the cluster and were killed: {killed}"


@pytest.fixture(scope="module")
def data_dir(example_data):
    return example_data


class Job:
    """One sbatch submission: its id, state, and the logs it wrote."""

    def __init__(self, cluster: SlurmCluster, runs_root: str, job_id: str):
        self.cluster, self.runs_root, self.id = cluster, runs_root, job_id
        self.job_dir = os.path.join(runs_root, JOB_NAME)

    def wait(self) -> dict:
        try:
            fields = self.cluster.wait_job(self.id, JOB_TIMEOUT)
        except TimeoutError as error:  # the job was cancelled: say where it stood
            raise AssertionError(f"{error}\n{self.report(self.cluster.job_fields(self.id))}") from None
        assert fields.get("JobState") == "COMPLETED" and fields.get("ExitCode") == "0:0", self.report(fields)
        return fields

    def node_logs(self, attempt: int) -> str:
        logs = os.path.join(self.job_dir, "logs")
        if not os.path.isdir(logs):
            return ""
        names = sorted(n for n in os.listdir(logs) if n.startswith(f"{self.id}-attempt{attempt}-"))
        return "".join(open(os.path.join(logs, n), errors="replace").read() for n in names)

    def output(self) -> str:
        path = os.path.join(self.runs_root, f"slurm-{JOB_NAME}-{self.id}.out")
        return open(path, errors="replace").read() if os.path.exists(path) else f"(no {path})"

    def report(self, fields: dict) -> str:
        """Everything needed to see why a job failed: state, its output, node logs, daemon logs."""
        return (
            f"job {self.id}: JobState={fields.get('JobState')} ExitCode={fields.get('ExitCode')} "
            f"Reason={fields.get('Reason')}\n===== job output =====\n{self.output()[-6000:]}\n"
            f"===== node logs, attempt 0 =====\n{self.node_logs(0)[-8000:]}\n"
            f"===== node logs, attempt 1 =====\n{self.node_logs(1)[-8000:]}\n"
            f"===== daemons =====\n{self.cluster.diagnostics()}"
        )

    def latest_checkpoint(self) -> str | None:
        path = os.path.join(self.job_dir, "checkpoints", "latest_checkpointed_iteration.txt")
        return open(path).read().strip() if os.path.exists(path) else None


def submit(cluster: SlurmCluster, runs_root: str, data_dir: str) -> Job:
    """The real sbatch script, from the repository root, for 2 nodes x 1 CPU process."""
    env = {
        "RUNS_ROOT": runs_root,
        "DATA_DIR": data_dir,
        "GPUS_PER_NODE": "1",  # processes per node
        "MASTER_PORT": str(free_ports(1)[0]),  # job ids restart at 1: the script's default port may be taken
        "PYTHON": sys.executable,
        "EXTRA_ARGS": EXTRA_ARGS,
        "OMP_NUM_THREADS": "1",
    }
    args = [
        f"--job-name={JOB_NAME}",
        "--nodes=2",
        f"--cpus-per-task={cluster.cpus_per_node}",
        "--time=15",
        f"--output={runs_root}/slurm-%x-%j.out",
    ]
    return Job(cluster, runs_root, cluster.submit(SBATCH, args, env, cwd=ROOT))


def requeue_now(cluster: SlurmCluster, job: Job) -> None:
    """Requeue a finished job and cut the ~2 min hold Slurm puts on a requeued job's start to 2 s.

    First wait until both nodes are idle: a job reads COMPLETED while its batch
    step may still be exiting on n1. Then start no sooner than 2 s later: when
    the job ended, slurmd revoked its credential, and it refuses a launch whose
    credential was made in the same second as that revocation (the times are
    whole seconds). The relaunch then fails ("Job credential revoked",
    JobState=FAILED, no attempt 1 output; seen twice in CI with StartTime=now).
    """
    cluster.wait_idle(timeout=60, what=f"nodes {', '.join(NODES)} to be idle after job {job.id}")
    for cmd in (["scontrol", "requeue", job.id], ["scontrol", "update", f"JobId={job.id}", "StartTime=now+2"]):
        result = subprocess.run(cmd, env=cluster.env(), capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, f"{' '.join(cmd)}: {result.stderr}"


@pytest.fixture(scope="module")
def attempts(cluster, data_dir, tmp_path_factory):
    """Run the job, then requeue it; the job and each attempt's node logs."""
    if not os.path.isfile(SBATCH):
        pytest.fail(f"{SBATCH} is missing")
    runs_root = str(tmp_path_factory.mktemp("slurm_runs"))
    started = time.monotonic()
    job = submit(cluster, runs_root, data_dir)
    job.wait()
    first_s = time.monotonic() - started
    first = job.node_logs(0)
    checkpoint_after_first = job.latest_checkpoint()
    requeue_now(cluster, job)
    started = time.monotonic()
    fields = job.wait()
    assert fields.get("Restarts") == "1", job.report(fields)
    second_s = time.monotonic() - started
    print(f"slurm: attempt 0 took {first_s:.1f} s, attempt 1 {second_s:.1f} s")
    return {"job": job, "first": first, "second": job.node_logs(1), "checkpoint_after_first": checkpoint_after_first}


def steps(log: str) -> dict[int, float]:
    return {int(m[1]): float(m[2]) for m in STEP.finditer(log)}


def test_first_attempt_trains_and_saves_a_checkpoint(attempts):
    job, log = attempts["job"], attempts["first"]
    assert sorted(steps(log)) == [1, 2, 3], job.report({})
    assert "saved checkpoint at iteration 3" in log, job.report({})
    assert attempts["checkpoint_after_first"] == "3"
    assert os.path.isdir(os.path.join(job.job_dir, "checkpoints", "iter_0000003"))


def test_requeued_attempt_resumes_from_the_checkpoint(attempts):
    job, log = attempts["job"], attempts["second"]
    checkpoint = os.path.join(job.job_dir, "checkpoints", "iter_0000003")
    assert f"loaded {checkpoint} (iteration 3, optimizer restored)" in log, job.report({})
    assert sorted(steps(log)) == [4, 5, 6], job.report({})
    assert job.latest_checkpoint() == "6"


def test_job_ran_on_both_nodes_with_expert_parallelism(attempts):
    job, log = attempts["job"], attempts["first"]
    assert "layout: world=2 TP=1 PP=1 CP=1 EP=2 DP=2" in log, job.report({})
    logs = os.listdir(os.path.join(job.job_dir, "logs"))
    assert {f"{job.id}-attempt{a}-node{n}.log" for a in (0, 1) for n in (0, 1)} <= set(logs), logs
    output = job.output()
    assert "attempt 0" in output and "attempt 1" in output and "latest checkpoint: 6" in output, output


def test_loss_is_finite_and_logged(attempts):
    losses = {**steps(attempts["first"]), **steps(attempts["second"])}
    assert len(losses) == 6 and all(0 < loss < 20 for loss in losses.values()), losses
