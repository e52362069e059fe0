"""SIGTERM to a running torchrun job: it saves and exits; the next start resumes exactly."""

import os
import re
import signal
import subprocess

from tests.conftest import ROOT
from tests.distributed.launcher import tiny_pretrain_command

STEP = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: (\S+)")
ITERS = 30


def launch(train_data, *flags):
    cmd = tiny_pretrain_command(
        train_data, "--train-iters", str(ITERS), "--lr", "1e-3", "--hidden-dropout", "0.1", *flags
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)


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
