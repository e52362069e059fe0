"""FSMoE's chunked pipeline at the layer level on an emulated cluster: the solver's degrees against r = 1,
the Tutel-style fixed degree and the brute force.

    python -m tools.bench_pipeline     # 2x1 and 2x2, at 0.5, 1 and 2.5 Gbit/s, degrees {1,2,4,8}^2, 5 repeats
    python -m tools.bench_pipeline --cluster 2x1 --link-gbit 1 --repeats 2 --degrees 1 2

Layouts (2 nodes, tools/emulated_cluster.py): `2x1` = EP=2, ESP=1 (every all-to-all crosses the link); `2x2` =
ESP=2 inside a node x EP=2 across the nodes (the all-gather / reduce-scatter stay on the node, the all-to-all
crosses). One torchrun job per layout and rate (tools/benchcluster.py), the rate changed in place; in each job
every rank builds our MoELayer (GELU, `--experts` top-`--topk`, `--hidden`, `--ffn`, `--tokens` per rank), measures
the cost-model profile on the running cluster at this layer's chunk sizes (megatron_moe/overlap/profiler.py) and
solves the layer's degrees (FSMoE Algorithm 1, `solve_degrees`). The contenders, alternated round by round, each
call between barriers and under the communication timers: every (r_f, r_b) in --degrees x --degrees (the brute
force; r = 1 and the Tutel-style fixed r = r among them) and the solver's (r_f, r_b). A call is a forward, a
barrier, a backward: its forward and backward are timed apart (ms of the slowest rank each), the layer's time is
their sum; so is the dispatch -> experts -> combine region inside it (`megatron_moe.moe.hooks.RegionClock`), the
part the cost model predicts and the degrees change (routing, ordering and their backward are outside it); the
figures are medians over `--repeats` rounds after `--warmup`.

One JSON row per layout and rate: `layout`, `link_gbit`, `solver` {forward, backward, case, predicted_ms,
measured_ms (the region's), predicted_over_measured}, `model_error` {median, worst} (|predicted / measured - 1| of
the region over every contender), `r1_ms`, `best_fixed` {r, ms}, `best_brute_force` {forward, backward, ms},
`solver_ms`, `speedup_vs_r1` (r1 / solver), `speedup_vs_best_fixed`, `solver_within_best` (best brute force ms /
solver ms), `comm_frac_r1` (communication ms / layer ms at r = 1: the issue's target point is where it is about
0.5), `exposed_ms` {r1, best_fixed, solver} (the a2a_* and esp_* kinds, forward and backward, rank 0's view),
`grid` ("r_f,r_b" or "solver" -> ms, forward_ms, backward_ms, region_ms, region_forward_ms, region_backward_ms,
predicted_ms, predicted_over_measured, pipeline_degree, bp_pipeline_degree), `pipeline_degree` /
`bp_pipeline_degree` ("auto": the row is the solver's), `fits` (kind -> alpha, beta, r2), `required_gain`
(direction -> the share of r = 1's time a degree > 1 had to be predicted to save: 5%, or the profile's
`model_error` where larger), `grads_match` (the
solver's input and parameter gradients equal r = 1's within 1e-6 relative on every rank).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from tools.benchcluster import check_layouts_and_rates, parse_cluster, run_job, write_result
from tools.cli import HelpFormatter

LAYOUTS = {"2x1": (2, 1), "2x2": (2, 2)}  # cluster -> (EP, ESP)
RATES_GBIT = (0.5, 1.0, 2.5)
DEGREES = (1, 2, 4, 8)
PIPELINE_KINDS = ("a2a_", "esp_")
GRAD_RTOL = 1e-6
SOLVER = "solver"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--cluster", nargs="+", default=list(LAYOUTS), help="layouts (default: 2x1 2x2)")
    p.add_argument("--link-gbit", type=float, nargs="+", default=list(RATES_GBIT), help="link rates, Gbit/s")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (each contender once per round)")
    p.add_argument("--warmup", type=int, default=1, help="rounds before the timed ones")
    p.add_argument("--degrees", type=int, nargs="+", default=list(DEGREES), help="degrees of the brute force")
    case = p.add_argument_group("case", "the MoE layer (GELU experts)")
    case.add_argument("--hidden", type=int, default=256, help="model width")
    case.add_argument("--ffn", type=int, default=1024, help="each expert's hidden width")
    case.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    case.add_argument("--experts", type=int, default=8, help="experts in the layer")
    case.add_argument("--topk", type=int, default=2, help="experts per token")
    args = p.parse_args(argv)
    check_layouts_and_rates(p, args.cluster, args.link_gbit, LAYOUTS)
    if args.repeats < 1 or args.warmup < 0:
        p.error(f"--repeats {args.repeats} / --warmup {args.warmup}: give >= 1 timed rounds and >= 0 warm-up")
    if 1 not in args.degrees or any(d < 1 for d in args.degrees):
        p.error(f"--degrees: {args.degrees} must be integers >= 1 including 1 (the r = 1 baseline), e.g. 1 2 4 8")
    for name in ("hidden", "ffn", "tokens", "experts", "topk"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: {getattr(args, name)} must be >= 1")
    return args


def jobs(layouts: list[str], rates: list[float]) -> list[tuple[str, float]]:
    """Every (layout, rate) once: rates in the given order, the layouts' order alternating from one rate to the
    next (so neither layout always runs first after a rate change)."""
    return [(layout, rate) for i, rate in enumerate(rates) for layout in (layouts if i % 2 == 0 else layouts[::-1])]


def contenders(degrees: list[int]) -> list[str]:
    """Contender names: every "r_f,r_b" of degrees x degrees, then the solver's."""
    return [f"{f},{b}" for f in degrees for b in degrees] + [SOLVER]


def summarize(grid: dict[str, dict], degrees: list[int]) -> dict:
    """The comparison figures from `grid` (contender -> {ms, ...}): r = 1, the best fixed r = r, the brute force's
    best, the solver's, and their ratios."""
    r1, solver = grid["1,1"]["ms"], grid[SOLVER]["ms"]
    fixed = min(degrees, key=lambda r: (grid[f"{r},{r}"]["ms"], r))
    brute = min((name for name in grid if name != SOLVER), key=lambda name: grid[name]["ms"])
    best_f, best_b = (int(d) for d in brute.split(","))
    return {
        "r1_ms": r1,
        "best_fixed": {"r": fixed, "ms": grid[f"{fixed},{fixed}"]["ms"]},
        "best_brute_force": {"forward": best_f, "backward": best_b, "ms": grid[brute]["ms"]},
        "solver_ms": solver,
        "speedup_vs_r1": round(r1 / solver, 3),
        "speedup_vs_best_fixed": round(grid[f"{fixed},{fixed}"]["ms"] / solver, 3),
        "solver_within_best": round(grid[brute]["ms"] / solver, 3),
    }


def run(args) -> list[dict]:
    """Driver: one job per layout and rate on a 2-node cluster; prints and returns one JSON row each."""
    from tools.emulated_cluster import EmulatedCluster

    case = {k: getattr(args, k) for k in ("hidden", "ffn", "tokens", "experts", "topk")}
    rows = []
    with EmulatedCluster(2, args.link_gbit[0]) as cluster:
        for layout, rate in jobs(args.cluster, args.link_gbit):
            cluster.set_link_gbit(rate)
            ep, esp = LAYOUTS[layout]
            job = {**case, "ep": ep, "esp": esp, "degrees": args.degrees, "link_gbit": rate}
            job |= {"repeats": args.repeats, "warmup": args.warmup}
            script = ["-m", "tools.bench_pipeline", "--worker", json.dumps(job)]
            row = run_job(cluster, parse_cluster(layout)[1], script)
            row = {"layout": f"{layout} ESP={esp} EP={ep}", "link_gbit": rate, **row}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


# ----------------------------------------------------------------------------- worker (one rank of the job)


def _init(ep: int, esp: int):
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_moe.platform import init_platform
    from megatron_moe.platform.rng import seed_model_parallel

    platform = init_platform()
    dist.init_process_group(platform.backend)
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep, expert_tensor_parallel_size=esp)
    seed_model_parallel(1234)
    return platform


def _layer(job: dict):
    from megatron_moe.moe import MoELayer, MoELayerConfig
    from tools.bench_moe_layer import transformer_config

    config = transformer_config(job["hidden"], job["ffn"], job["experts"], job["topk"], 0.0, False)
    config.expert_model_parallel_size, config.expert_tensor_parallel_size = job["ep"], job["esp"]
    moe_config = MoELayerConfig(
        num_experts=job["experts"],
        hidden_size=job["hidden"],
        ffn_hidden_size=job["ffn"],
        topk=job["topk"],
        expert_type="gelu",
        aux_loss_coeff=0.01,
    )
    return MoELayer(config, moe_config, layer_number=1)


def _schedule(job: dict):
    """(fits, the layer's sizes, the solver's schedule) for this layer on the running cluster (every rank measures
    together)."""
    from megatron_moe.overlap.cost_model import LayerSizes, solve_degrees
    from megatron_moe.overlap.profiler import ProfileGroups, layer_profile_settings, load_or_measure

    sizes = LayerSizes.from_layer(
        tokens=job["tokens"],
        topk=job["topk"],
        hidden_size=job["hidden"],
        ffn_hidden_size=job["ffn"],
        num_experts=job["experts"],
        ep=job["ep"],
        esp=job["esp"],
    )
    settings = layer_profile_settings(
        sizes, hidden_size=job["hidden"], ffn_hidden_size=job["ffn"], num_experts=job["experts"]
    )
    fits, _ = load_or_measure(None, ProfileGroups.from_parallel_state(), settings, link=f"tc {job['link_gbit']:g}")
    return fits, sizes, solve_degrees(fits, sizes)


def _timed_call(layer, clock, x, grad, timers) -> tuple[list[float], dict]:
    """[forward, backward, region forward, region backward] ms of the slowest rank each, and this rank's comm
    summary, of one call."""
    import torch
    import torch.distributed as dist

    for p in layer.parameters():
        p.grad = None
    x.grad = None
    dist.barrier()
    timers.reset()
    t0 = time.perf_counter()
    out, _ = layer(x)
    t1 = time.perf_counter()
    dist.barrier()
    t2 = time.perf_counter()
    out.backward(grad)
    whole = [(t1 - t0) * 1000.0, (time.perf_counter() - t2) * 1000.0]
    elapsed = torch.tensor([*whole, *clock.region_ms()], dtype=torch.float64)
    summary = timers.summary().as_dict()
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.tolist(), summary


def _grads(layer, x, grad, degrees: tuple[int, int]) -> list:
    layer.set_pipeline_degrees(*degrees)
    for p in layer.parameters():
        p.grad = None
    x.grad = None
    out, _ = layer(x)
    out.backward(grad)
    return [x.grad.clone()] + [p.grad.clone() for p in layer.parameters() if p.grad is not None]


def _grads_match(got: list, want: list) -> bool:
    """Every tensor within GRAD_RTOL of the largest magnitude of its reference, on every rank (a MIN over ranks)."""
    import torch
    import torch.distributed as dist

    same = len(got) == len(want) and all(
        (a - b).abs().max().item() <= GRAD_RTOL * max(b.abs().max().item(), 1e-30) for a, b in zip(got, want)
    )
    flag = torch.tensor([int(same)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _exposed(summaries: list[dict]) -> dict:
    kinds = [k for k in summaries[0]["exposed_ms"] if k.startswith(PIPELINE_KINDS)]
    return {k: round(statistics.fmean(s["exposed_ms"][k] for s in summaries), 3) for k in kinds}


def _load(layer, x, job) -> dict:
    """Rows each EP rank's experts compute in one forward (every rank routes its own tokens)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    layer.stats.reset()
    layer.set_pipeline_degrees(1, 1)
    layer(x)
    routed_E = layer.stats.sums[: job["experts"]].clone()
    layer.stats.reset()
    dist.all_reduce(routed_E, group=parallel_state.get_expert_model_parallel_group())
    rows = routed_E.view(job["ep"], -1).sum(1).tolist()
    return {"rows_per_ep_rank": rows, "imbalance": round(max(rows) / (sum(rows) / len(rows)), 3)}


def measure(job: dict) -> dict:
    """Every rank: the contenders alternated; rank 0's row."""
    import torch
    import torch.distributed as dist
    from megatron.core.transformer.moe import moe_utils

    from megatron_moe import comm
    from megatron_moe.comm.timers import CommTimers
    from megatron_moe.moe.hooks import RegionClock
    from megatron_moe.overlap.cost_model import predict, required_gain

    layer = _layer(job)
    clock = RegionClock()
    layer.hooks.append(clock)
    fits, sizes, schedule = _schedule(job)
    torch.manual_seed(1234 + dist.get_rank())  # each rank its own tokens
    x = torch.randn(job["tokens"], 1, job["hidden"], requires_grad=True)
    grad = torch.randn(job["tokens"], 1, job["hidden"])
    degrees = {name: tuple(int(d) for d in name.split(",")) for name in contenders(job["degrees"])[:-1]}
    degrees[SOLVER] = (schedule.forward, schedule.backward)
    times = {name: [] for name in degrees}
    summaries = {name: [] for name in degrees}
    with comm.monitoring(CommTimers()) as timers:
        for round_ in range(job["warmup"] + job["repeats"]):
            for name, pair in degrees.items():
                layer.set_pipeline_degrees(*pair)
                elapsed, summary = _timed_call(layer, clock, x, grad, timers)
                if round_ >= job["warmup"]:
                    times[name].append(elapsed)
                    summaries[name].append(summary)
                moe_utils.clear_aux_losses_tracker()
                layer.stats.reset()
    grid = {}
    for name, pair in degrees.items():
        fwd, bwd, region_f, region_b = (statistics.median(t[i] for t in times[name]) for i in range(4))
        ms = statistics.median(t[0] + t[1] for t in times[name])
        region = statistics.median(t[2] + t[3] for t in times[name])
        predicted = predict(fits, sizes, *pair).predicted_ms
        names = ("auto", "auto") if name == SOLVER else pair
        grid[name] = {"ms": round(ms, 2), "forward_ms": round(fwd, 2), "backward_ms": round(bwd, 2)}
        grid[name] |= {"region_ms": round(region, 2), "region_forward_ms": round(region_f, 2)}
        grid[name] |= {"region_backward_ms": round(region_b, 2)}
        grid[name] |= {"predicted_ms": round(sum(predicted.values()), 2)}
        grid[name] |= {"predicted_over_measured": round(sum(predicted.values()) / region, 3)}
        grid[name] |= {"pipeline_degree": names[0], "bp_pipeline_degree": names[1]}
    row = summarize(grid, job["degrees"])
    fixed = row["best_fixed"]["r"]
    comm_r1 = statistics.fmean(sum(s["comm_ms"].values()) for s in summaries["1,1"])
    predicted = schedule.predicted_ms
    measured = {"forward": grid[SOLVER]["region_forward_ms"], "backward": grid[SOLVER]["region_backward_ms"]}
    row["solver"] = {
        "forward": schedule.forward,
        "backward": schedule.backward,
        "case": schedule.case,
        "predicted_ms": {k: round(v, 2) for k, v in predicted.items()},
        "measured_ms": measured,
        "predicted_over_measured": grid[SOLVER]["predicted_over_measured"],
    }
    ratios = [entry["predicted_over_measured"] for entry in grid.values()]
    row["model_error"] = {  # |predicted / measured - 1| of the dispatch -> combine region over every contender
        "median": round(statistics.median(abs(q - 1) for q in ratios), 3),
        "worst": round(max(abs(q - 1) for q in ratios), 3),
    }
    row["comm_frac_r1"] = round(comm_r1 / grid["1,1"]["ms"], 3)
    row["exposed_ms"] = {
        "r1": _exposed(summaries["1,1"]),
        "best_fixed": _exposed(summaries[f"{fixed},{fixed}"]),
        "solver": _exposed(summaries[SOLVER]),
    }
    row["grid"] = grid
    row["load"] = _load(layer, x, job)
    row["pipeline_degree"] = row["bp_pipeline_degree"] = "auto"
    row["fits"] = {kind: {"alpha": fit.alpha, "beta": fit.beta, "r2": fit.r2} for kind, fit in fits.fits.items()}
    row["required_gain"] = {direction: required_gain(fits, direction) for direction in ("forward", "backward")}
    want = _grads(layer, x, grad, (1, 1))
    row["grads_match"] = _grads_match(_grads(layer, x, grad, degrees[SOLVER]), want)
    case = {k: job[k] for k in ("hidden", "ffn", "tokens", "experts", "topk", "ep", "esp", "repeats", "warmup")}
    return {**row, "case": case, "figures_of": "rank 0 (times: the slowest rank)"}


def worker(job: dict) -> None:
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    _init(job["ep"], job["esp"])
    row = measure(job)
    if dist.get_rank() == 0:
        write_result(row)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(json.loads(argv[1]))
        return 0
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
