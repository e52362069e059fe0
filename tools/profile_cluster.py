"""Fit the cost model's lines on a cluster and save them (megatron_moe/overlap/profiler.py), for
tools/plan_schedule.py --profile and for training.

    python -m tools.profile_cluster --cluster 2x2 --link-gbit 1 --expert-tensor-parallel-size 2 --out fits.json
    torchrun --nproc-per-node 4 tools/profile_cluster.py --expert-tensor-parallel-size 2 --out fits.json

With `--cluster NxK` it builds an emulated cluster (tools/emulated_cluster.py, N nodes of K processes, links at
`--link-gbit`) and runs itself there under torchrun; without it, it is one rank of the torchrun job it runs in.
Groups as megatron-core orders the expert ranks with TP = PP = CP = 1: ESP groups of P consecutive ranks (inside a
node when P divides the processes per node), EP groups of G = --expert-model-parallel-size (default world / P)
ranks P apart, the data-parallel group the world. A saved profile at --out whose cluster description matches is
loaded instead of measured. Prints one JSON line per kind (alpha ms, beta ms per byte or per multiply-add, R^2,
points) and a last line with `measured` and the cluster description.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from tools.cli import HelpFormatter

KIB = 1 << 10


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--out", required=True, help="the profile JSON (loaded if it matches, else written)")
    parser.add_argument("--cluster", help="NODESxPROCS: run on an emulated cluster of that shape")
    parser.add_argument("--link-gbit", type=float, default=1.0, help="the emulated links' rate (with --cluster)")
    parser.add_argument("--link", help="a description of the link, part of the cluster description")
    parser.add_argument("--expert-tensor-parallel-size", type=int, default=1, help="P, the ESP group size")
    parser.add_argument("--expert-model-parallel-size", type=int, help="G, the EP group size (default world / P)")
    parser.add_argument("--comm-kib", type=int, nargs="+", default=[256, 512, 768, 1024], help="message sizes")
    experts = parser.add_argument_group("experts", "the expert work the gemm, gemm_bwd and gemm_dw lines are fitted on")
    experts.add_argument("--num-local-experts", type=int, default=4, help="L, the layer's experts on one rank")
    experts.add_argument("--hidden-size", type=int, default=256, help="H")
    experts.add_argument("--ffn-hidden-size", type=int, default=256, help="this rank's slice of an expert's width")
    experts.add_argument("--swiglu", action="store_true", help="gated experts (fc1 of twice the width)")
    experts.add_argument("--rows", type=int, default=1024, help="rows this rank's experts compute at r = 1")
    experts.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4, 8], help="pipeline degrees measured")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per size")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _groups(world: int, rank: int, esp: int, ep: int | None):
    """(EP group, ESP group) of `rank` in megatron-core's expert order:
    rank = (edp_rank * G + ep_rank) * P + esp_rank."""
    import torch.distributed as dist

    ep = world // esp if ep is None else ep
    if esp < 1 or ep < 1 or world % (esp * ep):
        raise ValueError(f"--expert-tensor-parallel-size={esp} x --expert-model-parallel-size={ep} must divide {world}")
    mine = {}
    for start in range(0, world, esp):  # every rank joins every new_group, in the same order
        group = dist.new_group(list(range(start, start + esp)))
        if start <= rank < start + esp:
            mine["esp"] = group
    for block in range(0, world, esp * ep):
        for esp_rank in range(esp):
            ranks = [block + i * esp + esp_rank for i in range(ep)]
            group = dist.new_group(ranks)
            if rank in ranks:
                mine["ep"] = group
    return mine["ep"], mine["esp"]


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from megatron_moe.overlap.profiler import ExpertWork, ProfileGroups, ProfileSettings, load_or_measure
    from megatron_moe.platform import current_platform, init_platform

    init_platform()
    dist.init_process_group(current_platform().backend)
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        ep, esp = _groups(world, rank, args.expert_tensor_parallel_size, args.expert_model_parallel_size)
        experts = ExpertWork(
            num_local_experts=args.num_local_experts,
            hidden_size=args.hidden_size,
            ffn_hidden_size=args.ffn_hidden_size,
            gated=args.swiglu,
            sources=dist.get_world_size(ep) * dist.get_world_size(esp),  # X: the blocks each expert's rows come in
            rows=(args.rows,),
            degrees=tuple(args.degrees),
        )
        settings = ProfileSettings(
            comm_bytes=tuple(kib * KIB for kib in args.comm_kib),
            experts=experts,
            repeats=args.repeats,
        )
        groups = ProfileGroups(ep=ep, esp=esp, dp=dist.group.WORLD)
        fits, measured = load_or_measure(args.out, groups, settings, link=args.link)
        if rank == 0:
            result = {"fits": fits.to_json(), "measured": measured}
            if "BENCH_RESULT" in os.environ:
                from tools.benchcluster import write_result

                write_result(result)
            else:
                _print(result)
    finally:
        dist.destroy_process_group()


def _print(result: dict) -> None:
    for kind, fit in result["fits"]["fits"].items():
        print(json.dumps({"kind": kind, **fit}), flush=True)
    print(json.dumps({"measured": result["measured"], "cluster": result["fits"]["cluster"]}), flush=True)


def run_on_cluster(args: argparse.Namespace, argv: list[str], cluster=None) -> dict:
    """Run this tool's worker on an emulated cluster of shape --cluster (a new one at --link-gbit, or `cluster`,
    whose links are then set to --link-gbit), with the worker flags `argv`; the result of its rank 0."""
    from tools.benchcluster import parse_cluster, run_job
    from tools.emulated_cluster import EmulatedCluster

    nodes, procs = parse_cluster(args.cluster)
    link = args.link or f"emulated {args.cluster}, tc {args.link_gbit:g} Gbit/s"
    script = ["-m", "tools.profile_cluster", *argv, "--worker", "--link", link, "--out", os.path.abspath(args.out)]
    if cluster is not None:
        cluster.set_link_gbit(args.link_gbit)
        return run_job(cluster, procs, script)
    with EmulatedCluster(nodes, args.link_gbit) as new:
        return run_job(new, procs, script)


def worker_flags(argv: list[str]) -> list[str]:
    """`argv` less the driver's own flags (--cluster, --link-gbit, --link, --out and their values)."""
    own = ("--cluster", "--link-gbit", "--link", "--out")
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in own:
            skip = True
        elif not arg.startswith(tuple(f"{flag}=" for flag in own)):
            kept.append(arg)
    return kept


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.worker or args.cluster is None:
        worker(args)
        return 0
    _print(run_on_cluster(args, worker_flags(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
