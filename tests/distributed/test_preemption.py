"""SIGTERM to a running torchrun job: it saves and exits; the next start resumes exactly."""

import contextlib
import os
import re
import signal
import subprocess
import time

import psutil
import pytest

from megatron_moe.checkpointing import SAVE_PAUSE_ENV
from megatron_moe.platform.upstream_fixes import WRITER_PAUSE_ENV
from tests.conftest import ROOT
from tests.distributed.launcher import tiny_pretrain_command

STEP = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: (\S+)")
ITERS = 30


def launch(train_data, *flags, env=None, **kwargs):
    cmd = tiny_pretrain_command(
        train_data, "--train-iters", str(ITERS), "--lr", "1e-3", "--hidden-dropout", "0.1", *flags
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **(env or {}))
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT, **kwargs
    )


def losses(lines):
    return {int(m[1]): m[2] for m in map(STEP.search, lines) if m}


def test_sigterm_saves_and_resume_continues_exactly(train_data, tmp_path):
    save = str(tmp_path / "ckpt")
    straight = launch(train_data)
    straight_losses = losses(straight.communicate(timeout=300)[0].splitlines())
    assert straight.returncode == 0 and len(straight_losses) == ITERS

    job = launch(train_data, "--save", save, "--load", save)
    lines = []
    for line in job.stdout:
        lines.append(line)
        if STEP.search(line) and int(STEP.search(line)[1]) >= 3:
            job.send_signal(signal.SIGTERM)  # what slurm sends before the time limit
            break
    lines += job.communicate(timeout=300)[0].splitlines()
    assert any("SIGTERM received: saving at iteration" in line for line in lines), "".join(lines[-40:])
    saved = int(open(os.path.join(save, "latest_checkpointed_iteration.txt")).read())
    assert 3 <= saved < ITERS

    resumed = launch(train_data, "--save", save, "--load", save)
    resumed_losses = losses(resumed.communicate(timeout=300)[0].splitlines())
    assert resumed.returncode == 0
    assert min(resumed_losses) == saved + 1
    assert resumed_losses == {i: straight_losses[i] for i in range(saved + 1, ITERS + 1)}


PAUSED = re.compile(rf"({SAVE_PAUSE_ENV}|{WRITER_PAUSE_ENV}): ")


def job_processes(job) -> list[psutil.Process]:
    launcher = psutil.Process(job.pid)
    return [launcher, *launcher.children(recursive=True)]


@pytest.mark.parametrize("phase", ["begin", "writers", "publish"])
def test_one_sigterm_to_every_process_during_a_save_finishes_it_and_exits_0(train_data, tmp_path, phase):
    """slurm's warning signals every process of the job: torchrun (which forwards its own SIGTERM to each worker's
    process group), the ranks, their checkpoint writers. The rank must take that for one SIGTERM: it completes the
    save in progress, saves at the next step, and the job exits 0 with no iter_N.tmp left."""
    save = str(tmp_path / "ckpt")
    env = {WRITER_PAUSE_ENV: "3"} if phase == "writers" else {SAVE_PAUSE_ENV: f"{phase}@2"}
    job = launch(train_data, "--save", save, "--load", save, "--save-interval", "2", env=env, start_new_session=True)
    lines = []
    try:
        for line in job.stdout:
            lines.append(line)
            if PAUSED.search(line):
                break
        time.sleep(0.5)  # every rank (and writer) is in that phase now
        for proc in job_processes(job):
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGTERM)
        lines += job.communicate(timeout=300)[0].splitlines(keepends=True)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
    text = "".join(lines)
    assert job.returncode == 0, text[-3000:]
    assert "second SIGTERM" not in text, text[-3000:]
    assert "SIGTERM received: saving at iteration" in text, text[-3000:]
    saved = int(open(os.path.join(save, "latest_checkpointed_iteration.txt")).read())
    assert saved >= 3
    assert sorted(os.listdir(save)) == sorted(
        {"iter_0000002", f"iter_{saved:07d}", "latest_checkpointed_iteration.txt"}
    )
