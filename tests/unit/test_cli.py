"""The entry point end to end on bad input: a clear one-line error, exit code 2, nothing written."""

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # each case starts the entry point in a fresh interpreter: ~5 s


def run_cli(*flags, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "pretrain_gpt_moe.py"), *flags],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
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
            ["--moe-router-dim", "8"],
            "--moe-router-dim=8: does nothing in this run; it applies only with --moe-gate xmoe or cosine",
        ),
        (["--expert-tensor-parallel-size", "2"], "--expert-tensor-parallel-size=2: use 1"),
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
