"""The dispatch all-to-all alone, linear vs Tutel's 2DH (comm/hierarchy.py), on an emulated cluster.

    python -m tools.bench_a2a --cluster 2x2 4x2 --link-gbit 1 --sizes-kib 64 1024 8192

Per `--cluster` layout (NODESxRANKS, EP = every rank) one torchrun job per node (tools/benchcluster.py); per size S
(bytes each rank sends, spread evenly over the G ranks), `--repeats` rounds alternating linear and 2DH, each call
between barriers, synchronous. Rank 0 reports per algorithm the median of the slowest rank's call (`ms`), the
messages and bytes each rank sends across nodes and inside its node (from the plan and `Collective.inter_node`),
and whether the two outputs are bit-identical; for 2DH also its phase 2 (inside the node) and phase 4 (along the
rail) timed alone (`intra_ms`, `inter_ms`). The emulated links have bandwidth only (no per-message latency, no
netem): 2DH's saving, (N - 1)(g - 1) inter-node start-ups per rank, cannot show here; its cost (a phase inside the
node and two copies) can. overlap/a2a_cost.py predicts where it pays on links with a start-up cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from tools.benchcluster import check_layouts_and_rates, parse_cluster, run_job, write_result
from tools.cli import HelpFormatter

LAYOUTS = ("2x2", "4x2", "2x4")
HIDDEN = 256
"""Row width (fp32): 1 KiB rows."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--cluster", nargs="+", default=["2x2", "4x2"], help=f"layouts, of {', '.join(LAYOUTS)}")
    p.add_argument("--link-gbit", type=float, default=1.0, help="each node's link rate, Gbit/s")
    p.add_argument("--sizes-kib", nargs="+", type=int, default=[64, 1024, 8192], help="KiB each rank sends")
    p.add_argument("--repeats", type=int, default=7, help="timed all-to-alls per size")
    args = p.parse_args(argv)
    check_layouts_and_rates(p, args.cluster, [args.link_gbit], LAYOUTS)
    if any(s < 1 for s in args.sizes_kib) or args.repeats < 1:
        p.error(f"--sizes-kib {args.sizes_kib} / --repeats {args.repeats}: give positive numbers, e.g. 64 1024")
    return args


def main(argv=None) -> int:
    from tools.emulated_cluster import EmulatedCluster

    args = parse_args(argv)
    layouts = [parse_cluster(spec) for spec in args.cluster]
    for spec, (nodes, procs) in zip(args.cluster, layouts):
        with EmulatedCluster(nodes, args.link_gbit) as cluster:
            script = ["-m", "tools.bench_a2a", "--worker", json.dumps(args.sizes_kib), str(args.repeats)]
            for row in run_job(cluster, procs, script):
                print(json.dumps(row | {"layout": spec, "link_gbit": args.link_gbit}), flush=True)
    return 0


# ----------------------------------------------------------------------------- worker (one rank of the job)


def _call(x, splits, group, route):
    import torch.distributed as dist

    from megatron_moe import comm

    dist.barrier()
    start = time.perf_counter()
    out = comm.dispatch_all_to_all(x, splits, splits, group, async_op=False, route=route).wait()
    return out, (time.perf_counter() - start) * 1e3


def _phases(x, route) -> dict:
    """2DH's two all-to-alls timed alone (each between barriers, the slowest rank's ms): phase 2 inside the node and
    phase 4 along the rail, on the plan's sizes (the copies are what the whole call adds)."""
    import torch.distributed as dist

    from megatron_moe.comm.transport import all_to_all_single

    plan, hierarchy, ms = route.plan, route.hierarchy, {}
    for name, group, send, recv in (
        ("intra_ms", hierarchy.intra, plan.intra_send, plan.intra_recv),
        ("inter_ms", hierarchy.inter, plan.inter_send, plan.inter_recv),
    ):
        out = x.new_empty((sum(recv), x.shape[1]))
        dist.barrier()
        start = time.perf_counter()
        all_to_all_single(out, x[: sum(send)], recv, send, group=group)
        ms[name] = _slowest((time.perf_counter() - start) * 1e3)
    return ms


def _slowest(ms: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([ms])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _traffic(route, splits, row_bytes) -> dict:
    """Messages and bytes this rank sends inside its node and across nodes."""
    layout = route.layout
    inter_messages, inter_rows = route.crossing(splits)
    if route.two_level:
        sends = [s for l, s in enumerate(route.plan.intra_send) if l != layout.local]
        intra_messages, intra_rows = sum(1 for s in sends if s), sum(sends)
    else:
        local = [s for d, s in enumerate(splits) if d // layout.per_node == layout.node and d != layout.rank]
        intra_messages, intra_rows = sum(1 for s in local if s), sum(local)
    return {
        "inter_messages": inter_messages,
        "inter_bytes": inter_rows * row_bytes,
        "intra_messages": intra_messages,
        "intra_bytes": intra_rows * row_bytes,
    }


def worker(sizes_kib: list[int], repeats: int) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    from megatron_moe import comm
    from megatron_moe.platform import init_platform

    warnings.filterwarnings("ignore")
    init_platform()
    dist.init_process_group("gloo")
    group, g_size = dist.group.WORLD, dist.get_world_size()
    hierarchy = comm.make_hierarchy_groups(group)
    rows = []
    for kib in sizes_kib:
        per_rank = max(1, kib * 1024 // (4 * HIDDEN * g_size))  # rows to each destination
        splits = [per_rank] * g_size
        pairs = tuple(tuple(splits) for _ in range(g_size))
        routes = {
            "linear": comm.Route(hierarchy.layout),
            "2dh": comm.Route(hierarchy.layout, hierarchy, pairs),
        }
        x = torch.randn(per_rank * g_size, HIDDEN)
        times = {name: [] for name in routes}
        outs, phases = {}, []
        for _ in range(repeats + 1):  # the first round warms up
            for name, route in routes.items():
                outs[name], ms = _call(x, splits, group, route)
                times[name].append(_slowest(ms))
            phases.append(_phases(x, routes["2dh"]))
        row = {"kib_per_rank": per_rank * g_size * HIDDEN * 4 // 1024, "identical": torch.equal(*outs.values())}
        for name, route in routes.items():
            row[name] = {"ms": round(statistics.median(times[name][1:]), 2), **_traffic(route, splits, 4 * HIDDEN)}
        for phase in ("intra_ms", "inter_ms"):
            row["2dh"][phase] = round(statistics.median(p[phase] for p in phases[1:]), 2)
        rows.append(row)
    if dist.get_rank() == 0:
        write_result(rows)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(json.loads(sys.argv[2]), int(sys.argv[3]))
    else:
        sys.exit(main())
