"""Processes end with their job (issue 12 item 5): killed launchers, SIGTERMs, a rank killed mid-save.

Before: killing the launcher's process group (bash + torchrun) or the torchrun agent left the workers training
and writing checkpoints; a second SIGTERM was ignored like the first (a rank outlived torchrun's stop by 30 s);
checkpoint-writer processes outlived a killed rank by 37 minutes.
"""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from megatron_moe.platform.upstream_fixes import WRITER_PAUSE_ENV
from megatron_moe.training.preemption import SAME_REQUEST_S
from tests.conftest import ROOT
from tests.distributed.launcher import tiny_pretrain_command

STEP = re.compile(r"iteration\s+(\d+)/")
TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--num-experts", "4", "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1",
    "--eval-interval", "0", "--eval-iters", "0", "--lr-warmup-iters", "0",
]  # fmt: skip


@contextlib.contextmanager
def running(cmd, marker: str, **kwargs):
    """The job `cmd` started; on the way out (a failed assertion too) every process of it is killed."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **kwargs.pop("env", {}))
    job = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT, **kwargs
    )
    try:
        yield job
    finally:
        for proc in alive(job_processes(marker)):
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.resume()
                proc.kill()
        job.kill()
        job.wait(timeout=30)


def read_until_step(job, step: int, lines: list[str]) -> None:
    for line in job.stdout:
        lines.append(line)
        if (m := STEP.search(line)) and int(m[1]) >= step:
            return
    raise AssertionError(f"the job ended before iteration {step}:\n" + "".join(lines[-40:]))


def job_processes(marker: str) -> list[psutil.Process]:
    """Every live process whose command line contains `marker` (not zombies: they run nothing)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if marker in " ".join(proc.info["cmdline"] or ()) and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(proc)
    return found


def is_torchrun(proc: psutil.Process) -> bool:
    return any(part == "torch.distributed.run" or part.endswith("/torchrun") for part in proc.cmdline())


def workers(marker: str) -> dict[int, psutil.Process]:
    """{rank: process} of the job's pretrain_gpt_moe.py workers: torchrun's children (not their forked writers)."""
    found = {}
    for proc in job_processes(marker):
        if not is_torchrun(proc) and is_torchrun(proc.parent()):
            found[int(proc.environ()["RANK"])] = proc
    return found


def alive(procs) -> list[psutil.Process]:
    live = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                live.append(proc)
        except psutil.NoSuchProcess:
            pass
    return live


def wait_gone(procs, seconds: float) -> list[psutil.Process]:
    end = time.monotonic() + seconds
    while (live := alive(procs)) and time.monotonic() < end:
        time.sleep(0.2)
    return live


@pytest.fixture
def example_data(train_data, tmp_path):
    """A DATA_DIR in the layout examples/pretrain_gpt_moe_tiny_cpu.sh expects, linking the test corpus."""
    data, tokenizer = train_data
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    for ext in (".bin", ".idx", ".meta.json"):
        if os.path.exists(data + ext):
            os.symlink(data + ext, data_dir / f"stdlib_text_document{ext}")
    os.symlink(tokenizer, data_dir / "tokenizer.model")
    return str(data_dir)


@pytest.mark.parametrize("kill", ["launcher_group", "torchrun_agent"])
def test_workers_die_with_their_launcher(example_data, tmp_path, kill):
    run_dir = str(tmp_path / f"run_{kill}")  # in every worker's command line (--save RUN_DIR/checkpoints)
    script = os.path.join(ROOT, "examples", "pretrain_gpt_moe_tiny_cpu.sh")
    env = {"PYTHON": sys.executable, "DATA_DIR": example_data, "RUN_DIR": run_dir}
    cmd = ["bash", script, *TINY, "--train-iters", "100000"]
    with running(cmd, run_dir, env=env, start_new_session=True) as job:
        read_until_step(job, 2, [])
        ranks = workers(run_dir)
        assert sorted(ranks) == [0, 1], [p.cmdline() for p in job_processes(run_dir)]
        if kill == "launcher_group":
            os.killpg(job.pid, signal.SIGKILL)  # bash and torchrun: the workers are in sessions of their own
        else:
            agent = ranks[0].parent()
            assert is_torchrun(agent), agent.cmdline()
            agent.kill()
        left = wait_gone(list(ranks.values()), 10)
        assert not left, f"workers outlived the {kill}: {[p.pid for p in left]}"
        assert not wait_gone(job_processes(run_dir), 5), [p.cmdline() for p in alive(job_processes(run_dir))]


@contextlib.contextmanager
def saving_job_at_step_3(train_data, save: str):
    """A long tiny 2-rank job saving to (and resuming from) `save`, once it has logged step 3: (job, lines)."""
    cmd = tiny_pretrain_command(train_data, "--train-iters", "100000", "--save", save, "--load", save)
    with running(cmd, save) as job:
        lines = []
        read_until_step(job, 3, lines)
        yield job, lines


def test_sigterm_to_one_worker_saves_at_the_next_step_and_the_job_exits_0(train_data, tmp_path):
    save = str(tmp_path / "ckpt")
    with saving_job_at_step_3(train_data, save) as (job, lines):
        workers(save)[1].send_signal(signal.SIGTERM)  # one rank only: the per-step all-reduce tells the other
        lines += job.communicate(timeout=120)[0].splitlines(keepends=True)
    text = "".join(lines)
    assert job.returncode == 0, text[-3000:]
    assert "SIGTERM received: saving at iteration" in text, text[-3000:]
    assert int(open(os.path.join(save, "latest_checkpointed_iteration.txt")).read()) >= 3


def test_a_second_sigterm_ends_a_blocked_worker_at_once_without_saving(train_data, tmp_path):
    save = str(tmp_path / "ckpt")
    with saving_job_at_step_3(train_data, save) as (job, lines):
        ranks = workers(save)
        ranks[0].suspend()  # rank 1's step now waits inside a collective (C code: no Python signal handler runs)
        time.sleep(1.0)
        ranks[1].send_signal(signal.SIGTERM)
        time.sleep(SAME_REQUEST_S + 0.5)  # sooner, it is the first one again (by another route, as slurm's is)
        ranks[1].send_signal(signal.SIGTERM)
        assert not wait_gone([ranks[1]], 2.0), "the worker survived a second SIGTERM by 2 s"
        ranks[0].resume()
        lines += job.communicate(timeout=120)[0].splitlines(keepends=True)
    text = "".join(lines)
    assert job.returncode != 0, text[-3000:]
    assert sum("rank 1: second SIGTERM: exiting without saving" in line for line in lines) == 1, text[-3000:]
    assert "saving at iteration" not in text
    assert not os.path.exists(os.path.join(save, "latest_checkpointed_iteration.txt"))
    assert not os.path.isdir(save) or not [name for name in os.listdir(save) if name.startswith("iter_")]


def test_no_checkpoint_writer_outlives_a_rank_killed_mid_save(train_data, tmp_path):
    save = str(tmp_path / "ckpt")
    flags = ("--train-iters", "100000", "--save", save, "--load", save, "--save-interval", "2")
    env = {WRITER_PAUSE_ENV: "15"}  # each writer process waits 15 s before writing
    with running(tiny_pretrain_command(train_data, *flags), save, env=env) as job:
        read_until_step(job, 2, [])
        ranks = workers(save)
        end = time.monotonic() + 60
        while not [c for c in ranks[1].children() if "pretrain_gpt_moe.py" in " ".join(c.cmdline())]:
            assert time.monotonic() < end, "no checkpoint writer process appeared"
            time.sleep(0.1)
        helpers = ranks[1].children(recursive=True)  # its forked writers, the spawned Manager of the results queue
        everything = [psutil.Process(job.pid), *ranks.values(), *ranks[0].children(recursive=True), *helpers]
        assert any("multiprocessing" in " ".join(p.cmdline()) for p in helpers), [p.cmdline() for p in helpers]
        ranks[1].kill()
        left = wait_gone(helpers, 5)
        assert not left, f"the killed rank's helpers outlived it: {[p.cmdline() for p in left]}"
        job.communicate(timeout=60)
        assert job.returncode != 0
        left = wait_gone(everything + job_processes(save), 30)
        assert not left, f"outlived the job: {[p.cmdline() for p in left]}"
