"""The entry point end to end on bad input: a clear one-line error, exit code 2, nothing written."""

import os
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, shell_env

pytestmark = pytest.mark.slow  # each case starts the entry point in a fresh interpreter: ~5 s


def run_cli(*flags, cwd):
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "pretrain_gpt_moe.py"), *flags],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=shell_env(OMP_NUM_THREADS="1"),
        timeout=300,
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--expert-model-parallel-size", "3"],
            "--num-experts=8: must be a multiple of --expert-model-parallel-size=3",
        ),
        (["--data-path", "missing_prefix"], "--data-path missing_prefix: missing missing_prefix.bin"),
        (
            ["--moe-router-dim", "8", "--tokenizer-type", "TikTokenizer", "--moe-router-topk", "9"],
            "error: 2 configuration errors:\n  --tokenizer-type=TikTokenizer: not supported: ",
        ),
        (
            ["--expert-tensor-parallel-size", "3", "--moe-ffn-hidden-size", "128"],
            "--expert-tensor-parallel-size=3: must divide the experts' width --moe-ffn-hidden-size=128",
        ),
    ],
)
def test_bad_input_exits_with_clear_error(train_data, tmp_path, flags, message):
    data, tokenizer = train_data
    save = tmp_path / "ckpt"
    base = [
        "--num-experts", "8", "--num-layers", "2", "--hidden-size", "64", "--seq-length", "32", "--data-path", data,
        "--tokenizer-model", tokenizer, "--save", str(save), "--train-iters", "2",
    ]  # fmt: skip
    proc = run_cli(*base, *flags, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message in proc.stderr, proc.stderr[-3000:]
    assert not save.exists()


def test_a_bad_flag_fails_before_any_heavy_import_on_rank_0_only(tmp_path):
    """Validated right after parsing (no data, no torch): one line on rank 0, the other ranks silent."""
    flags = ["--data-path", "d", "--tokenizer-model", "t.model", "--num-attention-heads", "0"]
    proc = run_cli(*flags, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("--num-attention-heads=0: must be > 0") == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    env = dict(os.environ, RANK="1", WORLD_SIZE="2")
    rank1 = subprocess.run(
        [sys.executable, os.path.join(ROOT, "pretrain_gpt_moe.py"), *flags], capture_output=True, text=True, env=env
    )
    assert (rank1.returncode, rank1.stderr) == (2, "")


def test_the_launcher_refuses_a_bad_flag_in_one_line_before_torchrun(tmp_path):
    """examples/common.sh's launch_pretrain checks the flags first: no worker, no ChildFailedError."""
    script = (
        f"set -euo pipefail; source {ROOT}/examples/common.sh; resolve_launcher 2; "
        "launch_pretrain --data-path d --tokenizer-model t.model --num-experts 8 --log-interval 0"
    )
    env = dict(os.environ, PYTHON=sys.executable, NNODES="1", MASTER_PORT="29999")
    start = time.monotonic()
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == ["error: --log-interval=0: must be > 0, e.g. --log-interval 10"]
    assert elapsed < 10, elapsed  # ~0.3 s alone; generous for a loaded 2-core machine
