"""The communication timers' cost: a training step with them on vs off (--no-comm-timers), and per collective.

    python -m tools.bench_comm_timers                        # tiny model, 2 CPU ranks, EP=2; data in ./data
    python -m tools.bench_comm_timers --data-dir DIR --rounds 4 --steps 12

One torchrun job of 2 gloo ranks. Two measurements, one JSON line each:
1. `comm_timers_step`: the same tiny training run (EP=2) repeated, timers on and off alternated round by round
   (`--rounds` of each, `--steps` steps per run, the first 2 steps of each run not counted); the median step time
   of each and their ratio.
2. `comm_timers_per_call`: the monitor's own cost per collective, the difference between `comm.issue` of the same
   call with the timers installed and without (a synchronous no-op, and a 1-element asynchronous all-reduce, whose
   timing adds the work future's callback: a thread wake-up, costly on an oversubscribed CPU), median of
   alternated rounds; with the synchronous and asynchronous collectives per step (counted in the runs of (1),
   start-up included) and the step time of (1) this gives the cost as a share of a step: `per_step_frac` (the
   figure to keep under 1%; the step comparison of (1) is as noisy as the shared machine, a few %).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from tools.cli import HelpFormatter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = (
    "--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --num-experts 8 --moe-router-topk 2 "
    "--moe-aux-loss-coeff 0.01 --expert-model-parallel-size 2 --micro-batch-size 2 --global-batch-size 8 "
    "--log-interval 1000 --eval-interval 0 --eval-iters 0 --split 98,2,0"
).split()
SKIP = 2  # steps of each run not counted (warm-up)


class _Count:
    """A monitor that counts the collectives issued and those started asynchronously (a work handle)."""

    def __init__(self):
        self.calls = self.asynchronous = 0

    def issued(self, collective):
        self.calls += 1

    def handle(self, token, work):
        self.asynchronous += 1

    def blocked(self, token):
        pass

    def unblocked(self, token, *, completed):
        pass

    def read_started(self, read):
        pass

    def read_ended(self, token):
        pass


def _per_call_us(calls: int, rounds: int) -> dict:
    """The monitor's cost per collective (µs): issue with CommTimers installed minus issue without."""
    import torch
    import torch.distributed as dist

    from megatron_moe import comm
    from megatron_moe.comm import Collective, CommTimers

    x = torch.ones(1)
    record = Collective("other", "bench")

    def noop():
        for _ in range(calls):
            comm.issue(record, lambda: None)

    def small_async():
        for _ in range(calls):
            comm.issue(record, lambda: dist.all_reduce(x, async_op=True)).wait()

    result = {}
    for name, loop in (("sync_noop", noop), ("async_all_reduce", small_async)):
        plain, timed = [], []
        for _ in range(rounds):
            for timers_on, times in ((False, plain), (True, timed)):
                dist.barrier()
                with comm.monitoring(CommTimers()) if timers_on else _nothing():
                    t0 = time.perf_counter()
                    loop()
                    times.append((time.perf_counter() - t0) / calls * 1e6)
        result[name] = round(statistics.median(timed) - statistics.median(plain), 2)
    return result


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def worker(args) -> None:
    import torch.distributed as dist

    from megatron_moe import comm
    from megatron_moe.config import parse_args
    from megatron_moe.training import pretrain

    data = ["--data-path", os.path.join(args.data_dir, "stdlib_text_document")]
    data += ["--tokenizer-model", os.path.join(args.data_dir, "tokenizer.model")]
    flags = TINY + data + ["--train-iters", str(args.steps)]
    step_ms = {"on": [], "off": []}
    count = _Count()
    for _ in range(args.rounds):
        for mode in ("on", "off"):
            off = ["--no-comm-timers"] if mode == "off" else []
            with comm.monitoring(count) if mode == "on" else _nothing():
                history = pretrain(parse_args(flags + off), keep_process_group=True)
            step_ms[mode] += [entry["step_ms"] for entry in history[SKIP:]]
    per_call = _per_call_us(calls=1000, rounds=5)
    if dist.get_rank() == dist.get_world_size() - 1:  # the logging rank holds the history
        on, off = statistics.median(step_ms["on"]), statistics.median(step_ms["off"])
        steps = args.rounds * args.steps
        per_step = {"sync": (count.calls - count.asynchronous) / steps, "async": count.asynchronous / steps}
        cost_ms = (per_call["sync_noop"] * per_step["sync"] + per_call["async_all_reduce"] * per_step["async"]) / 1000
        lines = [
            {
                "case": "comm_timers_step",
                "layout": "1x2 EP=2 DP=2 (loopback)",
                "step_ms_on": round(on, 2),
                "step_ms_off": round(off, 2),
                "ratio_on_off": round(on / off, 4),
                "steps_each": len(step_ms["on"]),
            },
            {
                "case": "comm_timers_per_call",
                "us_per_call": per_call,
                "collectives_per_step": {k: round(v, 1) for k, v in per_step.items()},
                "per_step_ms": round(cost_ms, 3),
                "per_step_frac": round(cost_ms / off, 5),
            },
        ]
        with open(args.out, "w") as f:
            f.write("".join(json.dumps(line) + "\n" for line in lines))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--data-dir", default=os.path.join(ROOT, "data"), help="stdlib_text_document + tokenizer")
    parser.add_argument("--rounds", type=int, default=3, help="runs with timers on, and off, alternated")
    parser.add_argument("--steps", type=int, default=10, help="training steps per run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if not os.path.exists(os.path.join(args.data_dir, "tokenizer.model")):
        parser.error(f"--data-dir: {args.data_dir} has no tokenizer.model; run examples/pretrain_gpt_moe_tiny_cpu.sh")
    with tempfile.TemporaryDirectory() as tmp:
        from megatron_moe.platform.process import free_port  # torch: only once the flags are good

        out = os.path.join(tmp, "out.jsonl")
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}"]
        argv += ["-m", "tools.bench_comm_timers", "--worker", "--out", out, "--data-dir", args.data_dir]
        argv += ["--rounds", str(args.rounds), "--steps", str(args.steps)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGATRON_MOE_FORCE_CPU": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
        run = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True)
        if run.returncode != 0:
            sys.stderr.write(run.stdout[-3000:] + run.stderr[-5000:])
            return run.returncode
        sys.stdout.write(open(out).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
