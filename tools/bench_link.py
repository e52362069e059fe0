"""Calibrate an emulated cluster's link: the all-to-all throughput megatron_moe's collectives get between 2 nodes.

The physics tests calibrate inside the test with these functions instead of assuming tc's configured rate.

    python -m tools.bench_link                               # 0.5, 1 and 2 Gbit/s, a JSON line per rate
    python -m tools.bench_link --link-gbit 1 --sizes-mib 4 8 16 --repeats 5

Per rate: a 2-node x 1-process cluster (tools/emulated_cluster.py) runs this file in `--probe` mode on each node:
the all-to-all of S bytes per rank that the MoE layer uses (`megatron_moe.comm.transport.all_to_all_single`: on
gloo, every receive posted before any send), sizes alternated round by round, each call timed between barriers;
the slowest rank's time counts, the median of the calls per size. Half of each rank's S bytes cross its node's
link (the other half stays on the rank), so a call moves S/2 bytes over every link at once. JSON fields: `world`
and `ranks` (as the probe's ranks saw them), `link_gbit` (tc's rate), `sizes_bytes`, `ms` (per size),
`crossing_bytes` (per link per call), `bytes_per_s` (achieved, from a least-squares line ms = fixed + bytes /
rate over the sizes), `gbit_per_s` (the same in Gbit/s), `fixed_ms` (the line's intercept), `fraction_of_tc`
(achieved / configured).

Measured here (2 cores, shared): raw TCP between two nodes gets ~0.95 of tc's rate in both directions at once,
and so does the transport's all-to-all (~0.93-0.97). gloo's own all_to_all_single (and a batch_isend_irecv
exchange) does in only about every other call once a peer's message passes ~1 MiB, and half of it in the
others, as if the two directions took turns: the reason the transport exists (megatron_moe/comm/transport.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from tools.cli import HelpFormatter
from tools.emulated_cluster import EmulatedCluster

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MIB = 1 << 20
PROBE_TIMEOUT_S = 300


def probe(sizes: list[int], repeats: int) -> dict:
    """One rank of the probe (NODE_RANK of NNODES, one process per node): times the all-to-all per size."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    from megatron_moe.comm.transport import all_to_all_single

    rank, world = int(os.environ["NODE_RANK"]), int(os.environ["NNODES"])
    init = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        ranks = torch.zeros(world, dtype=torch.int64)
        dist.all_gather_into_tensor(ranks, torch.tensor([rank]))
        buffers = {size: (torch.ones(size // 4), torch.empty(size // 4)) for size in sizes}  # float32: S bytes
        times: dict[int, list[float]] = {size: [] for size in sizes}
        for round_ in range(repeats + 1):  # round 0 warms up (connections, pages)
            for size, (send, recv) in buffers.items():
                dist.barrier()
                t0 = time.perf_counter()
                all_to_all_single(recv, send)
                elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the call ends when the slowest rank's does
                if round_ > 0:
                    times[size].append(elapsed.item())
        return {"world": world, "ranks": ranks.tolist(), "seconds": {str(s): t for s, t in times.items()}}
    finally:
        dist.destroy_process_group()


def run_probe(cluster: EmulatedCluster, sizes: list[int], repeats: int, master_port: int = 29500) -> dict:
    """Run the probe on every node of `cluster` (one process each); returns rank 0's result."""
    argv = [sys.executable, "-m", "tools.bench_link", "--probe", "--repeats", str(repeats)]
    argv += ["--sizes-bytes", *map(str, sizes)]
    python_path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))  # `-m tools...` from any cwd
    procs = []
    for i in range(cluster.nodes):
        env = {**os.environ, **cluster.node_env(i, 1, master_port), "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path}
        procs.append(cluster.run_on(i, argv, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [proc.communicate(timeout=PROBE_TIMEOUT_S) for proc in procs]
    for i, (proc, (_out, err)) in enumerate(zip(procs, outputs)):
        if proc.returncode != 0:
            raise RuntimeError(f"link probe on node {i} failed ({proc.returncode}):\n{err[-3000:]}")
    return json.loads(outputs[0][0].strip().splitlines()[-1])


def summarize(link_gbit: float, sizes: list[int], result: dict) -> dict:
    """The median time per size and the achieved link rate (least-squares slope of time over crossing bytes)."""
    world = result["world"]
    crossing = [size * (world - 1) // world for size in sizes]  # per rank = per link, per call
    seconds = [statistics.median(result["seconds"][str(size)]) for size in sizes]
    mean_b, mean_t = statistics.fmean(crossing), statistics.fmean(seconds)
    if len(sizes) > 1:
        slope = sum((b - mean_b) * (t - mean_t) for b, t in zip(crossing, seconds))
        slope /= sum((b - mean_b) ** 2 for b in crossing)
    else:
        slope = mean_t / mean_b
    rate = 1.0 / slope
    return {
        "case": "link_alltoall",
        "layout": f"{world}x1",
        "world": world,
        "ranks": result["ranks"],
        "link_gbit": link_gbit,
        "sizes_bytes": sizes,
        "crossing_bytes": crossing,
        "ms": [round(t * 1000, 2) for t in seconds],
        "bytes_per_s": round(rate),
        "gbit_per_s": round(rate * 8 / 1e9, 3),
        "fixed_ms": round((mean_t - slope * mean_b) * 1000, 2),
        "fraction_of_tc": round(rate * 8 / (link_gbit * 1e9), 3),
    }


def calibrate(link_gbit: float, sizes_mib=(4, 8, 16), repeats: int = 5, cluster: EmulatedCluster | None = None):
    """The achieved all-to-all throughput of a 2-node link at `link_gbit` (a `summarize` dict). Builds a 2-node
    cluster unless one is given (whose links are then set to `link_gbit`)."""
    sizes = [int(mib * MIB) // 4 * 4 for mib in sizes_mib]
    if cluster is not None:
        cluster.set_link_gbit(link_gbit)
        return summarize(link_gbit, sizes, run_probe(cluster, sizes, repeats))
    with EmulatedCluster(2, link_gbit) as new:
        return summarize(link_gbit, sizes, run_probe(new, sizes, repeats))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--link-gbit", type=float, nargs="+", default=[0.5, 1.0, 2.0], help="tc rates to measure")
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[4, 8, 16], help="all-to-all MiB per rank")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per size (after one warm-up)")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # one node's rank (internal)
    parser.add_argument("--sizes-bytes", type=int, nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        print(json.dumps(probe(args.sizes_bytes, args.repeats)), flush=True)
        return 0
    with EmulatedCluster(2, args.link_gbit[0]) as cluster:
        for rate in args.link_gbit:
            print(json.dumps(calibrate(rate, args.sizes_mib, args.repeats, cluster)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
