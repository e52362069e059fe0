"""tools/bench_moe_layer.py's cluster mode: one MoE layer, forward + backward, at EP = all ranks of an emulated cluster.

    python -m tools.bench_moe_layer --cluster 2x1 --link-gbit 1      # EP=2: the all-to-all crosses the link
    python -m tools.bench_moe_layer --cluster 2x2 --link-gbit 1      # EP=4: 2 of each rank's 3 peers across it

Every rank of a torchrun job per node (tools/benchcluster.py) builds megatron-core's MoELayer (alltoall
dispatcher, SequentialMLP) and ours with megatron-core's router and local expert weights, each holding
experts/EP experts, and runs both on its own `tokens` tokens, interleaved round by round, each call between
barriers, under the communication timers (megatron_moe/comm/timers.py). Per case and contender, rank 0 reports:
`layer_ms` / `mcore_ms` (median of the slowest rank's call), `exposed_ms` / `mcore_exposed_ms` and `comm_ms` /
`mcore_comm_ms` (kind -> ms per call, mean, rank 0's view), `bytes` / `mcore_bytes` (kind -> bytes rank 0 sent per
call). megatron-core's dispatcher all-to-alls reach the timers through the torch.distributed taps, classified by
group: they show as kind `other` (ours carry their MoE kinds: `a2a_dispatch`, `a2a_combine`, ..._bwd).

Lancet: our layer runs twice per round, without a weight-gradient queue (`layer_ms`, `exposed_ms`,
`comm_ms`) and with one (`overlap_wgrad` = "all-under-next-a2a", no DDP: its dW GEMMs run under the next backward
all-to-all and accumulate into `.grad`; `layer_ms_wgrad`, `exposed_ms_wgrad`, `comm_ms_wgrad`). `bwd_a2a_exposed_ms`
(off, on) sums the backward all-to-alls' exposed ms, `bwd_a2a_exposed_cut` = 1 - on / off; `wgrad` is the queue's
figures of the last round (closures run under an all-to-all, ...); `grads_identical`: every parameter's and the
input's gradient of one extra on and off call are bit-identical (torch.equal) on every rank.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from tools.benchcluster import parse_cluster, run_job, write_result

BWD_A2A_KINDS = ("a2a_dispatch_bwd", "a2a_combine_bwd")
WGRAD_POLICY = "all-under-next-a2a"


def run_cluster(args, cases: list[tuple]) -> None:
    """Driver: one job per `--cluster` layout on a 2-node (or more) cluster at `--link-gbit`; prints a JSON line per
    case and layout. `cases`: (name, hidden, ffn, tokens, experts, topk) tuples."""
    from tools.emulated_cluster import EmulatedCluster

    layouts = [parse_cluster(spec) for spec in args.cluster]
    with EmulatedCluster(max(nodes for nodes, _ in layouts), args.link_gbit) as cluster:
        for spec, (nodes, procs) in zip(args.cluster, layouts):
            if nodes != cluster.nodes:
                raise ValueError(f"--cluster: {args.cluster} mixes node counts; give layouts of one node count")
            script = ["-m", "tools.bench_moe_layer_ep", json.dumps(cases), str(args.warmup), str(args.repeats or 5)]
            for row in run_job(cluster, procs, script):
                ep = nodes * procs
                overlap = {"overlap_wgrad": {"off": "layer_ms", WGRAD_POLICY: "layer_ms_wgrad"}}
                row |= {"layout": f"{spec} EP={ep}", "link_gbit": args.link_gbit, "overlap": overlap}
                print(json.dumps(row), flush=True)


# ----------------------------------------------------------------------------- worker (one rank of the job)


def _init(ep: int):
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_moe.comm.megatron_core import tap_megatron_core
    from megatron_moe.platform import init_platform
    from megatron_moe.platform.rng import seed_model_parallel

    platform = init_platform()
    dist.init_process_group(platform.backend)
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    tap_megatron_core()  # megatron-core's collectives reach the timers, as in training
    seed_model_parallel(1234)
    return platform


def _contenders(hidden, ffn, experts, topk, ep):
    """(ours, megatron-core's) at EP=`ep`, ours with megatron-core's router and this rank's expert weights."""
    from tools.bench_moe_layer import build_mcore, build_ours, transformer_config

    config = transformer_config(hidden, ffn, experts, topk, 0.0, False)
    config.expert_model_parallel_size = ep
    mcore = build_mcore(config)
    ours = build_ours(config, mcore, 0.0, "alltoallv")
    assert ours.num_local_experts == len(mcore.experts.local_experts) == experts // ep
    return ours, mcore


def _timed_call(step, timers) -> tuple[float, dict]:
    """(ms of the slowest rank, this rank's comm summary) of one call started together on every rank."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    timers.reset()
    t0 = time.perf_counter()
    step()
    elapsed = torch.tensor([(time.perf_counter() - t0) * 1000.0], dtype=torch.float64)
    summary = timers.summary().as_dict()
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item(), summary


def _mean(summaries: list[dict], field: str) -> dict:
    kinds = [k for k in summaries[0][field] if any(s[field][k] for s in summaries)]
    return {k: round(statistics.fmean(s[field][k] for s in summaries), 3) for k in kinds}


class _Lancet:
    """Our layer's weight-gradient queue, switched on for the calls of `step` (Lancet's on/off contender)."""

    def __init__(self, layer):
        from megatron_moe.moe.weight_grad import RUN_NOW
        from megatron_moe.overlap.runtime import OverlapRuntime
        from megatron_moe.overlap.wgrad_queue import WgradQueue

        self.layer, self.run_now = layer, RUN_NOW
        self.queue = WgradQueue(WGRAD_POLICY, max_mb=None, num_layers=1)
        self.runtime = OverlapRuntime(self.queue)
        self.modules = [module for _, module in self.runtime.attach_moe_layer(layer)]
        self.stores = [module.weight_grad_store for module in self.modules]
        self.switch(False)
        self.rounds = 0

    def switch(self, on: bool) -> None:
        for module, store in zip(self.modules, self.stores):
            module.weight_grad_store = store if on else self.run_now
        self.layer.dispatcher.backward_overlap = self.runtime if on else None

    def step(self, step):
        def run():
            self.rounds += 1
            self.queue.start_iteration(self.rounds)
            self.switch(True)
            try:
                return step()
            finally:
                self.switch(False)
                self.queue.end_iteration()

        return run


def _grads(layer, x, step) -> list:
    step()
    return [x.grad.clone()] + [p.grad.clone() for p in layer.parameters() if p.grad is not None]


def _grads_identical(off: list, on: list) -> bool:
    """Every rank's gradients of the on and off calls bit-identical (a MIN over ranks)."""
    import torch
    import torch.distributed as dist

    same = len(off) == len(on) and all(torch.equal(a, b) for a, b in zip(off, on))
    flag = torch.tensor([int(same)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _bwd_a2a_ms(summaries: list[dict]) -> float:
    exposed = _mean(summaries, "exposed_ms")
    return round(sum(exposed.get(k, 0.0) for k in BWD_A2A_KINDS), 3)


def _wgrad_figures(lancet, summaries: dict) -> dict:
    off, on = _bwd_a2a_ms(summaries["ours"]), _bwd_a2a_ms(summaries["ours_wgrad"])
    return {
        "bwd_a2a_exposed_ms": {"off": off, "on": on},
        "bwd_a2a_exposed_cut": round(1 - on / off, 3) if off > 0 else 0.0,
        "wgrad": lancet.queue.stats(),
    }


def run_worker_case(name, hidden, ffn, tokens, experts, topk, warmup, repeats) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core.transformer.moe import moe_utils

    from megatron_moe import comm
    from megatron_moe.comm.timers import CommTimers
    from tools.bench_moe_layer import fwd_bwd

    ep = dist.get_world_size()
    torch.manual_seed(1234 + dist.get_rank())  # each rank its own tokens
    ours, mcore = _contenders(hidden, ffn, experts, topk, ep)
    lancet = _Lancet(ours)
    x = torch.randn(tokens, 1, hidden, requires_grad=True)
    grad = torch.randn(tokens, 1, hidden)
    steps = {"ours": fwd_bwd(ours, x, grad), "mcore": fwd_bwd(mcore, x, grad)}
    steps["ours_wgrad"] = lancet.step(steps["ours"])
    times = {k: [] for k in steps}
    summaries = {k: [] for k in steps}
    with comm.monitoring(CommTimers()) as timers:
        for round_ in range(warmup + repeats):
            for contender, step in steps.items():
                ms, summary = _timed_call(step, timers)
                if round_ >= warmup:
                    times[contender].append(ms)
                    summaries[contender].append(summary)
            moe_utils.clear_aux_losses_tracker()
            ours.stats.reset()
    row = {"case": name, "hidden": hidden, "ffn": ffn, "tokens": tokens, "experts": experts, "topk": topk}
    for contender, prefix, suffix in (("ours", "", ""), ("mcore", "mcore_", ""), ("ours_wgrad", "", "_wgrad")):
        ms_name = f"{prefix or 'layer_'}ms{suffix}"
        row[ms_name] = round(statistics.median(times[contender]), 2)
        row[f"{prefix}comm_ms{suffix}"] = _mean(summaries[contender], "comm_ms")
        row[f"{prefix}exposed_ms{suffix}"] = _mean(summaries[contender], "exposed_ms")
        row[f"{prefix}bytes{suffix}"] = {k: round(v) for k, v in _mean(summaries[contender], "bytes").items()}
        row[f"{ms_name}_all"] = [round(t, 1) for t in times[contender]]
    row |= _wgrad_figures(lancet, summaries)
    row["overlap_wgrad"] = WGRAD_POLICY
    row["grads_identical"] = _grads_identical(_grads(ours, x, steps["ours"]), _grads(ours, x, steps["ours_wgrad"]))
    row |= {"ep": ep, "tokens_per_rank": tokens, "warmup": warmup, "repeats": repeats, "figures_of": "rank 0"}
    return row


def worker(cases: list, warmup: int, repeats: int) -> None:
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    _init(int(os.environ["WORLD_SIZE"]))
    rows = [run_worker_case(*case, warmup, repeats) for case in cases]
    if dist.get_rank() == 0:
        write_result(rows)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
