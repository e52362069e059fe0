"""The Mixtral-shaped example on one GPU, bf16, EP=1, as a user launches it (examples/pretrain_mixtral_8x7b.sh).

Skipped without a CUDA GPU (CI has none). Narrowed to fit one GPU (2 layers, hidden 2048, FFN 7168, 16 heads
in 4 groups, 2048-token sequences), everything else as the script has it: RMSNorm, SwiGLU, RoPE, untied output,
8 experts top-2 in every layer, full recompute, the distributed optimizer, bf16, a checkpoint at the end. The
log must name the kernels it ran (the grouped GEMM's per dtype, the fused kernels), every logged step's record
(log.jsonl) MFU (at most 100%) and memory, and the loss must fall. The lines are
printed for the person running `make test-gpu`.
"""

import glob
import json
import os
import re
import subprocess

import pytest
import torch

from tests.conftest import ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
NARROWED = [
    *("--num-layers", "2", "--hidden-size", "2048", "--ffn-hidden-size", "7168"),
    *("--num-attention-heads", "16", "--num-query-groups", "4", "--seq-length", "2048"),
    *("--global-batch-size", "8", "--train-iters", "8", "--lr-warmup-iters", "2", "--log-interval", "2"),
    *("--eval-interval", "0", "--eval-iters", "0"),
]


@pytest.fixture(scope="module")
def run_log(train_data, tmp_path_factory):
    data, tokenizer = train_data
    run_dir = tmp_path_factory.mktemp("mixtral")
    env = {
        **os.environ,
        "DATA_PATH": data,
        "TOKENIZER_MODEL": tokenizer,
        "RUN_DIR": str(run_dir),
        "NNODES": "1",
        "GPUS_PER_NODE": "1",
        "TP": "1",
        "PP": "1",
        "EP": "1",
        "MEGATRON_MOE_FORCE_CPU": "0",
    }
    script = os.path.join(ROOT, "examples", "pretrain_mixtral_8x7b.sh")
    proc = subprocess.run(["bash", script, *NARROWED], env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    return log, str(run_dir)


def test_logs_kernels_mfu_and_memory_and_learns(run_log, capsys):
    run_log, run_dir = run_log
    kernels = [line for line in run_log.splitlines() if "kernels:" in line or "fusions" in line]
    steps = [line for line in run_log.splitlines() if re.search(r"iteration\s+\d+/", line)]
    with capsys.disabled():
        print("\n".join(["", "--- Mixtral-shaped example, one GPU, bf16, EP=1 ---", *kernels, *steps]))
    assert any("expert_gemm=" in line for line in kernels), kernels
    assert len(steps) == 4, steps
    (path,) = glob.glob(os.path.join(run_dir, "**", "log.jsonl"), recursive=True)
    with open(path) as f:
        records = [json.loads(line) for line in f if '"train_iters"' in line]
    assert len(records) == 4 and all(r["memory_bytes"] > 0 for r in records), records
    assert all(0 < r["mfu_percent"] <= 100 for r in records), [r["mfu_percent"] for r in records]
    losses = [float(re.search(r"lm loss: ([0-9.E+-]+)", s).group(1)) for s in steps]
    assert losses[-1] < losses[0], losses
