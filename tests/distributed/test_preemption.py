"""SIGTERM to a running torchrun job: it saves and exits; the next start resumes exactly."""

import os
import re
import signal
import subprocess
import sys

from tests.conftest import ROOT
from tests.distributed.launcher import free_port

STEP = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: (\S+)")
ITERS = 30


def launch(train_data, *flags):
    data, tokenizer = train_data
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node=2", f"--master-port={free_port()}", os.path.join(ROOT, "pretrain_gpt_moe.py"),
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--num-experts", "4", "--expert-model-parallel-size", "2", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", str(ITERS), "--lr", "1e-3", "--log-interval", "1",
        "--eval-interval", "0", "--eval-iters", "0", "--hidden-dropout", "0.1", "--data-path", data,
        "--tokenizer-model", tokenizer, "--split", "98,2,0", *flags,
    ]  # fmt: skip
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
