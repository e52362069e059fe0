"""One node's process of tests/distributed/test_comm_timers_physics.py (2 emulated nodes x 1 process).

    ip netns exec NODE python comm_timers_worker.py OUT_JSON CASES [DATA_PREFIX TOKENIZER]

CASES: `sync` (a), `async` (b), `train` (c), `skew` (d), comma-separated. The node's launch variables (NNODES,
NODE_RANK, MASTER_ADDR, MASTER_PORT, GLOO_SOCKET_IFNAME) come from tools/emulated_cluster.py. Every timed figure
of (a) and (b) is the slowest rank's (all-reduced MAX), each call between barriers, as tools/bench_link.py times its
calls; (d)'s are each rank's own.
"""

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from megatron_moe import comm
from megatron_moe.comm import Collective, CommTimers, skew
from megatron_moe.comm.transport import all_to_all_single

MIB = 1 << 20
SIZE_BYTES = 4 * MIB  # B: crosses the link
REPEATS = 9
DELAY_MS = 200.0  # (d): how late the late rank issues


def slowest(value: float) -> float:
    """The largest `value` over the ranks."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def exchange(size: int, *, async_op: bool = False):
    """An all-to-all (the transport's, as the MoE layer's) in which rank 0 sends `size` bytes to rank 1 and rank 1
    sends nothing: one direction of the link only. Returns a function that starts it."""
    n = size // 4  # float32
    sender = dist.get_rank() == 0
    send = torch.ones(n if sender else 0)
    recv = torch.empty(0 if sender else n)
    in_splits, out_splits = ([0, n], [0, 0]) if sender else ([0, 0], [n, 0])
    return lambda: all_to_all_single(recv, send, out_splits, in_splits, async_op=async_op)


def timed_sync(size: int) -> tuple[float, float]:
    """One synchronous all-to-all through `comm.issue` with the timers on: (timers' exposed ms, wall ms of the
    same call measured around it)."""
    start = exchange(size)
    dist.barrier()
    with comm.monitoring(CommTimers()) as timers:
        t0 = time.perf_counter()
        comm.issue(Collective("a2a_dispatch", "physics", layer=0, nbytes=size), start)
        wall = time.perf_counter() - t0
    return slowest(timers.summary().exposed_ms["a2a_dispatch"]), slowest(wall) * 1000


def untimed_sync(size: int) -> float:
    """The same call with no monitor, timed by the wall clock (ms)."""
    start = exchange(size)
    dist.barrier()
    t0 = time.perf_counter()
    start()
    return slowest(time.perf_counter() - t0) * 1000


def common(times: list[float]) -> float:
    """The time of the common case: the median of the largest cluster of calls within 10% of each other (a call
    that waited for a busy core of this shared machine is left out; ties go to the slower cluster)."""
    center = max(times, key=lambda x: (sum(abs(y - x) <= 0.1 * x for y in times), x))
    return statistics.median(y for y in times if abs(y - center) <= 0.1 * center)


def case_sync() -> dict:
    """(a) sizes B and 2B, calls alternated round by round (round 0 warms up); `common` of each."""
    runs = {"timers_ms": {}, "wall_ms": {}, "untimed_ms": {}}
    for name in runs:
        runs[name] = {str(s): [] for s in (SIZE_BYTES, 2 * SIZE_BYTES)}
    for round_ in range(REPEATS + 1):
        for size in (SIZE_BYTES, 2 * SIZE_BYTES):
            exposed, wall = timed_sync(size)
            untimed = untimed_sync(size)
            if round_ > 0:
                runs["timers_ms"][str(size)].append(exposed)
                runs["wall_ms"][str(size)].append(wall)
                runs["untimed_ms"][str(size)].append(untimed)
    return {name: {s: common(v) for s, v in by_size.items()} for name, by_size in runs.items()} | {"calls": runs}


def compute(steps: int) -> None:
    a = torch.ones(256, 256)
    for _ in range(steps):
        a = torch.mm(a, a) * (1.0 / 256)


def compute_ms(steps: int) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    compute(steps)
    return slowest(time.perf_counter() - t0) * 1000


def overlapped(size: int, steps: int) -> dict:
    """Start the all-to-all, compute `steps` GEMMs, wait: the timers' exposed and comm ms."""
    start = exchange(size, async_op=True)
    dist.barrier()
    with comm.monitoring(CommTimers()) as timers:
        work = comm.issue(
            Collective("a2a_dispatch", "physics", layer=0, nbytes=size),
            start,
        )
        compute(steps)
        work.wait()
    s = timers.summary()
    return {"exposed_ms": slowest(s.exposed_ms["a2a_dispatch"]), "comm_ms": slowest(s.comm_ms["a2a_dispatch"])}


def case_async() -> dict:
    """(b) GEMMs sized to ~0.4 C and ~2.5 C (C: the all-to-all alone, a first estimate); then per case, round by
    round: the all-to-all alone, the GEMMs alone, and the two overlapped (start, GEMMs, wait). Alone and
    overlapped alternate, so the medians see the same machine (it is shared, and gloo's rate varies)."""
    compute(20)  # warm up
    per_gemm_ms = statistics.median(compute_ms(50) for _ in range(3)) / 50
    first_ms = statistics.median(untimed_sync(SIZE_BYTES) for _ in range(3))
    cases = []
    for fraction in (0.4, 2.5):
        steps = max(1, round(fraction * first_ms / per_gemm_ms))
        comm_alone, compute_alone, runs = [], [], []
        for _ in range(REPEATS):
            comm_alone.append(untimed_sync(SIZE_BYTES))
            compute_alone.append(compute_ms(steps))
            runs.append(overlapped(SIZE_BYTES, steps))
        cases.append(
            {
                "fraction": fraction,
                "comm_ms": statistics.median(comm_alone),
                "compute_ms": statistics.median(compute_alone),
                "exposed_ms": statistics.median(r["exposed_ms"] for r in runs),
                "timers_comm_ms": statistics.median(r["comm_ms"] for r in runs),
                "runs": runs,
                "comm_alone": comm_alone,
                "compute_alone": compute_alone,
            }
        )
    return {"per_gemm_ms": per_gemm_ms, "cases": cases}


def late(size: int, sleeper: int | None) -> dict:
    """(d) one all-to-all (rank 0 sends `size` bytes to rank 1) that rank `sleeper` (None: no one) issues `DELAY_MS`
    after the barrier; every rank's timers, then the arrival stamps exchanged (`summary(reader=1)`, as the training
    loop's logging rank, the last): this rank's skew, transfer and exposed ms."""
    start = exchange(size)
    timers = CommTimers()
    dist.barrier()
    with comm.monitoring(timers):
        if dist.get_rank() == sleeper:
            time.sleep(DELAY_MS / 1000)
        comm.issue(Collective("a2a_dispatch", "physics", layer=0, nbytes=size), start)
    s = timers.summary(reader=1)
    figures = ("skew_ms", "transfer_ms", "exposed_ms")
    return {figure: getattr(s, figure)["a2a_dispatch"] for figure in figures} | {"from": s.skew_from["a2a_dispatch"]}


def estimated_offset() -> dict:
    """(d) the start-up clock offset estimate as on two hosts (each rank given its own boot id), on one clock in
    truth: its offset (ms) is its error."""
    shared = skew._boot_id
    skew._boot_id = lambda: f"{shared()}-node{dist.get_rank()}"
    try:
        offset = skew.estimate_clock_offset()
    finally:
        skew._boot_id = shared
    return {"offset_ms": 1000 * offset.seconds, "error_ms": 1000 * offset.error_s, "shared": offset.shared}


def case_skew() -> dict:
    """(d) rank 0 (the sender) late, and no one late, alternated round by round (round 0 warms up); then the
    clock offset estimate."""
    runs: dict = {"late": [], "on_time": []}
    for round_ in range(REPEATS + 1):
        for name, sleeper in (("late", 0), ("on_time", None)):
            figures = late(SIZE_BYTES, sleeper)
            if round_ > 0:
                runs[name].append(figures)
    return runs | {"clock": estimated_offset()}


def case_train(data: str, tokenizer: str) -> list[dict]:
    """(c) a short training run through pretrain(): EP=2 across the two nodes."""
    from megatron_moe.config import parse_args
    from megatron_moe.training import pretrain

    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(int(os.environ["MASTER_PORT"]) + 1)
    flags = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --num-experts 4 "
        "--expert-model-parallel-size 2 --micro-batch-size 2 --global-batch-size 4 --log-interval 1 "
        "--eval-interval 0 --eval-iters 0 --split 98,2,0 --train-iters 5"
    ).split() + ["--data-path", data, "--tokenizer-model", tokenizer]
    return pretrain(parse_args(flags), keep_process_group=True)


def main() -> None:
    out, cases = sys.argv[1], sys.argv[2].split(",")
    rank, world = int(os.environ["NODE_RANK"]), int(os.environ["NNODES"])
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0")
    dist.init_process_group("gloo")
    results: dict = {"rank": rank}
    if "sync" in cases:
        results["sync"] = case_sync()
    if "async" in cases:
        results["async"] = case_async()
    if "skew" in cases:
        results["skew"] = case_skew()
    if "train" in cases:
        results["train"] = case_train(*sys.argv[3:5])
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
