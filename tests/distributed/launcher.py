"""Run a worker script under torchrun (gloo on CPU by default) and hand its JSON results to pytest.

A torchrun job costs 10-20 s to start here, so each worker runs many cases
and writes `{case: result}` to `$RESULTS` (rank 0), and most workers are parts
of the shared jobs (`shared_jobs.py`); `run_torchrun` is for the jobs that run
alone (GPU ones, 8 ranks, a conversion between two jobs). The launcher also
checks that the job left no child process behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


BACKGROUND = "MEGATRON_MOE_TEST_BACKGROUND_JOB"
"""In the environment of a shared job run in the background (`shared_jobs.py`), and so of all its processes: the
job's number. A foreground launch's leftovers are not among them."""


def descendants(job: str | None = None) -> set[int]:
    """This process's live descendants: the foreground's, or those of background job `job`."""
    found = set()
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(BACKGROUND) == job:
                found.add(proc.pid)
    return found


def left_behind(before: set[int], job: str | None = None) -> list[str]:
    """The command lines of the live descendants (of the foreground, or of background job `job`) not in `before`:
    what a launch between the two left behind."""
    found = []
    for pid in descendants(job) - before:
        with contextlib.suppress(psutil.Error):
            found.append(" ".join(psutil.Process(pid).cmdline()))
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_pretrain_command(train_data, *flags: str) -> list[str]:
    """torchrun of pretrain_gpt_moe.py itself on 2 CPU ranks (EP=2) for a tiny MoE on `train_data`, plus `flags`:
    for tests of the entry point's own behaviour (signals, failures), where `run_torchrun`'s workers do not fit.
    The pipeline degrees are pinned to 1 and the gradient reduction to megatron-core's (auto's degrees and the
    adaptive partition come from start-up timings, and runs these tests compare must not differ in them; `flags`
    may override)."""
    data, tokenizer = train_data
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node=2", f"--master-port={free_port()}", os.path.join(ROOT, "pretrain_gpt_moe.py"),
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--num-experts", "4", "--moe-aux-loss-coeff", "0.01", "--expert-model-parallel-size", "2",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1", "--eval-interval", "0",
        "--eval-iters", "0",
        "--data-path", data, "--tokenizer-model", tokenizer, "--split", "98,2,0",
        "--moe-pipeline-degree", "1", "--moe-bp-pipeline-degree", "1", "--grad-reduce-schedule", "megatron", *flags,
    ]  # fmt: skip


def run_torchrun(script: str, nproc: int, args: list[str] = (), timeout: int = 900, env: dict | None = None) -> dict:
    """Run `script` on `nproc` ranks; returns the JSON rank 0 wrote to $RESULTS.

    The ranks run on the CPU with gloo, also on a machine with GPUs, unless
    `env` sets MEGATRON_MOE_FORCE_CPU=0.
    """
    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "results.json")
        python_path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
        full_env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "RESULTS": results,
            "PYTHONPATH": python_path,
            "MEGATRON_MOE_FORCE_CPU": "1",
            **(env or {}),
        }
        before = descendants()
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            f"--master-port={free_port()}",
            script,
            *args,
        ]
        proc = subprocess.run(cmd, env=full_env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise AssertionError(
                f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
            )
        leftovers = left_behind(before)
        assert not leftovers, f"processes outlived the job: {leftovers}"
        with open(results) as f:
            return json.load(f)


# Equivalence tolerances of a layout against the single-process run (reduction order differs; seen ~1e-7).
LOSS_RTOL, GRAD_NORM_RTOL, PARAMS_NORM_RTOL = 1e-5, 1e-4, 1e-5


def assert_matches(steps: list[dict], reference: list[dict]) -> None:
    """Every step's lm loss, grad norm and (when logged) params norm equal the reference's step of the same
    iteration."""
    import pytest

    by_iteration = {step["iteration"]: step for step in reference}
    assert steps, "the run logged no steps"
    for step in steps:
        ref = by_iteration[step["iteration"]]
        assert step["lm loss"] == pytest.approx(ref["lm loss"], rel=LOSS_RTOL), step
        assert step["grad norm"] == pytest.approx(ref["grad norm"], rel=GRAD_NORM_RTOL), step
        assert ("params norm" in step) == ("params norm" in ref), step
        if "params norm" in ref:
            assert step["params norm"] == pytest.approx(ref["params norm"], rel=PARAMS_NORM_RTOL), step


def computed(steps: list[dict]) -> list[dict]:
    """Each step's computed figures (losses, norms, MoE metrics): its history entry without the timings (`step_ms`,
    `comm`), where Lancet's queue ran each dW (`wgrad`: its plan comes from timings), which bucket groups the
    adaptive gradient partition launched (`grad_reduce`), which differ from run to run, and the pipeline degrees a
    run started with and its start-up summary (`pipeline_degrees`, `startup`: in its first entry only, per-rank
    counts differ between layouts) and --overlap-report's timings (`overlap_report`), for comparisons that must be
    bit-identical."""
    skip = ("step_ms", "comm", "wgrad", "grad_reduce", "pipeline_degrees", "startup", "overlap_report")
    return [{k: v for k, v in step.items() if k not in skip} for step in steps]


def train_in_job(flags: list[str]) -> list[dict]:
    """Inside a worker: one pretraining run with `flags`; every rank gets the logging rank's steps."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from megatron_moe.config import parse_args
    from megatron_moe.training import pretrain

    history = pretrain(parse_args(flags), keep_process_group=True)
    left = [group for group in distributed_c10d._world.pg_map if group is not distributed_c10d._get_default_group()]
    assert not left, f"the run left {len(left)} process groups (and their threads) behind"
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, history)
    return gathered[-1]


def finish_job(results: dict) -> None:
    """Inside a worker, at the end: rank 0 writes `results` to $RESULTS (what `run_torchrun` returns)."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        with open(os.environ["RESULTS"], "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


def reset_megatron_core_aux_loss_scale() -> None:
    """megatron-core keeps the MoE aux-loss scale in a class attribute, per process: a training run's schedule
    leaves it at 1 / its micro-batches (0.5 in a 2-micro-batch run), which scales the aux-loss gradient of a layer
    run backward outside a schedule afterwards; and its MoEAuxLossAutoScaler.backward creates it 0-dim there
    (tools/bench_moe_layer.py does), which the next schedule's copy_ of shape [1] into it then fails on. One
    training run per process never meets this; a test process and a shared job run many, so each starts from
    none."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = None
