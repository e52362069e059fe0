"""torchrun worker (1 rank on a CUDA GPU, nccl) of tests/distributed/test_gpu_comm_timers.py.

    torchrun --nproc-per-node 1 gpu_comm_timers_worker.py DATA_PREFIX TOKENIZER

The same training run with the communication timers on and off (--no-comm-timers), alternated round by round;
every step's time, and how often the process waited for the device (torch.cuda.synchronize, Event.synchronize)
in each run.
"""

import sys

import torch

from tests.distributed.launcher import finish_job, train_in_job

DATA, TOKENIZER = sys.argv[1:3]
ROUNDS, STEPS = 3, 12
MODEL = (
    "--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --num-experts 8 "
    "--moe-router-topk 2 --micro-batch-size 4 --global-batch-size 8 --eval-iters 0 --eval-interval 0 "
    "--log-interval 1000 --split 98,2,0 --bf16"
).split() + ["--data-path", DATA, "--tokenizer-model", TOKENIZER, "--train-iters", str(STEPS)]


class Waits:
    """Counts the calls that wait for the device."""

    def __init__(self):
        self.count = 0
        self._device, self._event = torch.cuda.synchronize, torch.cuda.Event.synchronize

    def __enter__(self):
        def device(*args, **kwargs):
            self.count += 1
            return self._device(*args, **kwargs)

        def event(event, *args, **kwargs):
            self.count += 1
            return self._event(event, *args, **kwargs)

        torch.cuda.synchronize, torch.cuda.Event.synchronize = device, event
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize, torch.cuda.Event.synchronize = self._device, self._event


results = {"on": {"step_ms": [], "waits": []}, "off": {"step_ms": [], "waits": []}}
# The process's first run pays one-time start-up waits that belong to neither mode: on an H200 the first round's
# "on" run waited 28 times, the later ones 12 (one per step), the "off" runs never (torch.compile's first build of
# megatron-core's fused kernels, which benchmarks on the device, is the likely one). A warm-up run takes them.
with Waits() as waits:
    train_in_job(MODEL + ["--no-comm-timers"])
results["warm_up_waits"] = waits.count
for _ in range(ROUNDS):
    for mode in ("on", "off"):
        with Waits() as waits:
            history = train_in_job(MODEL + (["--no-comm-timers"] if mode == "off" else []))
        results[mode]["step_ms"] += [entry["step_ms"] for entry in history[3:]]  # after warm-up
        results[mode]["waits"].append(waits.count)
        results[mode]["comm"] = history[-1]["comm"]
finish_job(results)
