"""`python -m megatron_moe.launch` (torchrun with one line per failure) and the example scripts through it (issue
41, docs/troubleshooting.md "Directories, caches and tools"): each failing rank's own line, torchrun's summary in
one line, no launcher traceback, the worker's exit code kept (2 for a flag, data or tokenizer error; torchrun and
the scripts exited 1)."""

import os
import shutil
import subprocess
import sys

from tests.conftest import ROOT

WORKER = """
import os, sys, time
rank = int(os.environ["RANK"])
sys.stderr.write(f"rank {rank}: --data-path: bad\\n")  # one write, as logging makes (print writes the end apart)
if rank == 1:
    time.sleep(30)  # stopped by torchrun
sys.exit(2)
"""


def run(command, **env):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=240)


def test_a_failed_job_ends_in_its_ranks_lines_and_one_summary_line_with_the_workers_code(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    proc = run([sys.executable, "-m", "megatron_moe.launch", "--nproc-per-node", "2", str(worker)])
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr
    summary = f"torchrun: {worker} failed: rank 0 (local rank 0) exited with code 2 first; then rank 1 (SIGTERM)"
    assert lines[-1] == summary, lines
    assert set(lines[:-1]) <= {"rank 0: --data-path: bad", "rank 1: --data-path: bad"}, lines  # nothing of torchrun's


def test_an_example_script_keeps_the_workers_exit_code_2_for_a_data_error(example_data, tmp_path):
    """A truncated .idx, found by the workers' flag pass (the script's own check reads no file): exit 2, not 1."""
    data = tmp_path / "data"
    data.mkdir()
    for name in os.listdir(example_data):  # the prefix's files (not megatron-core's index cache beside them)
        if os.path.isfile(os.path.join(example_data, name)):
            shutil.copyfile(os.path.join(example_data, name), data / name)
    idx = data / "stdlib_text_document.idx"
    idx.write_bytes(idx.read_bytes()[:-8])
    script = os.path.join(ROOT, "examples", "pretrain_gpt_moe_tiny_cpu.sh")
    proc = run(["bash", script], PYTHON=sys.executable, DATA_DIR=str(data), RUN_DIR=str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"index file {idx} is truncated or corrupt" in proc.stderr
    summary = [line for line in proc.stderr.splitlines() if line.startswith("torchrun: ")]
    assert len(summary) == 1 and "rank 0 (local rank 0) exited with code 2 first" in summary[0], proc.stderr
