"""Benchmark a training step on an emulated cluster: step time, communication per kind, how much of it is exposed.

    python -m tools.bench_step    # 2x1 and 2x2, at 0.5, 1 and 2.5 Gbit/s, every overlap setting
    python -m tools.bench_step --cluster 2x2esp --link-gbit 1 --steps 4 --overlap greedy pipeline
    python -m tools.bench_step --cluster 2x1 --link-gbit 0.5 --overlap all-off all-on    # the headline pair

The model is GPT2-S-MoE-shaped, cut down to fit two CPU cores (`MODEL`: 4 layers, every one MoE with 8 experts
top-2; hidden 384, half GPT2-S's, FFN 768, sequences of 256, 1,024 tokens per rank and step), sized so that at
1 Gbit/s the all-to-alls take a share of the step near real clusters' (FSMoE and Lancet report 30-60% of MoE
training time). The CPU's compute per token grows with hidden^2, the all-to-all bytes with hidden: with every other
layer MoE the all-to-alls took ~20% of the 2x1 step at hidden 384 and ~14% at hidden 768 (hidden 256 no more:
per-op overheads); every layer MoE brings 2x1 to ~30% (gloo's all-to-all rate varies from ~0.4 to ~0.9 of tc's
between runs).
It trains on the demo data (`make demo`'s stdlib corpus, built here when missing) across a 2-node cluster
(tools/emulated_cluster.py):

- `2x1`: 2 nodes x 1 process, EP=2: every all-to-all crosses the link;
- `2x2`: 2 nodes x 2 processes, EP=4 (DP=4 for the dense layers): 2 of each rank's 3 peers are on the other node.
  (EP=2 on 2x2 would keep each EP group inside a node: no all-to-all on the link.)
- `2x2esp` (only when asked for): 2 nodes x 2 processes, ESP=2 inside a node (--expert-tensor-parallel-size 2) x
  EP=2 across the nodes: the all-gather / reduce-scatter on the node, the all-to-all on the link.

Overlap settings (`--overlap`, all six by default): `off` (--overlap-wgrad off, pipeline degrees 1 / 1),
`greedy` (Lancet's greedy dW placement, degrees 1 / 1), `pipeline` (Lancet greedy and FSMoE's chunked pipeline,
--moe-pipeline-degree auto --moe-bp-pipeline-degree auto: the first job of a layout and rate measures the cost-model
profile at start-up, later ones load it (--moe-cost-profile, one file per layout and rate in this run), and each
solves the degrees); these three with megatron-core's gradient reduction after backward. Then, as `pipeline`:
`grad_overlap` (megatron-core's --overlap-grad-reduce, default buckets), `grad_small` (the same with
--ddp-bucket-size `SMALL_BUCKET`, small buckets by hand) and `adaptive` (FSMoE's adaptive gradient partition,
--grad-reduce-schedule adaptive). `all-off` and `all-on` name `off` and `adaptive`: every overlap feature off,
and each at its default-on setting (Lancet greedy, pipeline degrees auto, the adaptive gradient partition).
`--overlap features` runs `FEATURES`: all off; each feature alone (`greedy`, `pipeline_alone`, `adaptive_alone`,
`partition_alone`: Lancet's operator partition as its planner picks, --moe-partition-pieces auto); all on
(`adaptive`); all on + the operator partition as planned (`partition`) and in 2 pieces through every layer
(`partition2`, whose MoE layers then run unchunked: auto degrees are solved for whole micro-batches), and prints a
`features` row per layout and rate (step ratio against all off, hidden share, exposed / wire / skew / transfer ms,
the planner's ranges and predicted ms). `unchunked` and `unchunked_partition2` (asked for by name) are all on and 2
pieces with degrees 1 / 1. The
`batch`, `batch_greedy`, `batch_adaptive` and `batch_all` (by name) add batch-level overlap
(--overlap-moe-expert-parallel-comm) to `off`, `greedy`, Lancet with the adaptive partition (degrees 1 / 1) and
`adaptive`; it pairs micro-batches, so give `--micro-batches` 2 or more (micro-batches per step and rank; default 1).
`choice` (by name) is `adaptive` with --moe-overlap-choice auto (the cost model keeps or turns off Lancet's queue
and the adaptive partition and turns batch-level overlap on where each is predicted to win; its row carries the
choice and the predicted step); `mcore` (by name) is megatron-core's MoE layer with megatron-core's overlapped
gradient reduction (ours do not apply to it).
The
`2x2dp` layout (asked for by name) keeps EP=2 inside each node and puts the data-parallel reduction on the link
(--expert-placement e+d); `2x2de` (by name) is the same run under d+e: each EP group spans the two nodes, each
expert's expert-DP pair shares a node. Given both (`--cluster 2x2dp 2x2de`, alternated as any two layouts), a
`placement` row per rate and overlap setting compares them (`compare_placement`; docs/placement.md).

`--warm-start N` first trains a starting checkpoint of N steps (2x1, every overlap off, one micro-batch, at
`WARM_LINK_GBIT`), and every case resumes from it: the router past its first steps, in its natural imbalance.
One cluster serves every case: the link rate changes in place (`set_link_gbit`) and the cases alternate (layouts
interleaved, rates rotated round by round, each overlap setting right after the other, in turn first), so
the machine's drift hits them alike. Each case runs `--rounds` times,
one torchrun job of `--steps` steps each, the first `--warmup` of each job dropped; the timed steps of its rounds
are pooled into one JSON object per case, printed once every case has run:

- `case`, `layout` (e.g. "2x2 EP=4 DP=4"), `link_gbit` (tc's rate; gloo's all-to-all gets about half of it,
  tools/bench_link.py), `step_ms` (median), `step_ms_all`;
- `comm_ms`, `exposed_ms`, `wire_ms`, `skew_ms`, `transfer_ms` (kind -> ms per step, mean over the timed steps:
  issued -> completed, raw, waiting for peers included; the time the compute thread was blocked on it; the time
  its crossing bytes need on the link, from the cost model's fitted line where the job fitted one, else the
  timers' estimate; of the exposed time, the part before the last rank of the group arrived, measured from every
  rank's arrival stamp, and the rest: megatron_moe/comm/timers.py, skew.py), `wire_from` (kind -> "fit" or
  "timers"), `skew_from` (kind -> "arrivals" where measured, "" where not split), `bytes` (kind -> bytes of this
  rank's send buffers per step, the all-to-alls' own blocks included), `wire_bytes` (kind -> bytes that left this
  rank per step: only these cross a link), `calls` (kind -> collectives issued per step), `hidden_frac`
  (1 - exposed / wire over all kinds, clamped to [0, 1]: waiting counts as exposed, not hidden), `exposed_ms_total`,
  `wire_ms_total`, `skew_ms_total`, `transfer_ms_total`, `exposed_frac_of_step` (kind -> exposed / step),
  `a2a_exposed_frac_of_step`;
- the options in force: `overlap_wgrad` (Lancet), `pipeline_degree`, `bp_pipeline_degree` (FSMoE:
  "auto" or the number) and `overlap` (all of them), `pipeline_degrees` (MoE layer -> [forward, backward] in
  force, auto resolved: the Trainer's first history entry), the model flags, steps; `wgrad`: the queue's figures
  (closures under an all-to-all / at their natural place, peak MiB held, and the greedy plan's profile: backward
  all-to-all ms, dW ms available, predicted hidden ms).

After the cases, first one `headline` row per layout and rate, all-on against all-off: `step_ms` (off, on),
`step_ratio` (off / on: above 1 is faster), `hidden_frac`, `exposed_ms`, `wire_ms`, `skew_ms` and `transfer_ms` of
all communication (off, on), `exposed_frac_of_step` (off, on), all-on's options and pipeline degrees. Then one
`overlap_wgrad` row per layout and rate compares greedy with off: `bwd_a2a_exposed_ms` (off, on),
`bwd_a2a_exposed_cut` (1 - on / off), `step_ratio` (on / off, median step times), `peak_held_mb`; then
one `pipeline` row per layout and rate compares pipeline (on) with greedy (off): `step_ms`, `step_ratio`,
`exposed_ms` and `comm_ms` per a2a_* / esp_* kind (off, on), the solver's `pipeline_degrees`; then one
`grad_reduce` row per layout and rate compares adaptive with megatron-core's three (`pipeline`, `grad_overlap`,
`grad_small`): exposed and issued-to-completed dp_grad_reduce ms, the best of the three, the cut against it, step
ms and the ratio against the fastest, exposed all-to-all ms; `floor_ms`, the plan's all-reduce time of the
gradients made after the first MoE layer's backward began (the lowest layer's and the embedding's: nothing is left
to hide them, whatever the launch order), and `floor_cut_vs_best_megatron`, the largest cut any schedule could
reach. Each row names `grad_reduce_schedule`.

The figures are the logging rank's (the last rank, on the last node): its own collectives, as the Trainer's
communication timers (megatron_moe/comm/timers.py) saw them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from megatron_moe.config import parse_args as parse_run_args
from megatron_moe.config import placement
from tools.benchcluster import ROOT, check_layouts_and_rates, parse_cluster, run_job, write_result
from tools.cli import HelpFormatter
from tools.emulated_cluster import EmulatedCluster

# layout -> (EP, ESP); the all-to-all crosses the link, but in 2x2dp (EP inside a node, DP across)
LAYOUTS = {"2x1": (2, 1), "2x2": (4, 1), "2x2esp": (2, 2), "2x2dp": (2, 1), "2x2de": (2, 1)}
PLACEMENT_LAYOUTS = {"2x2dp": "e+d", "2x2de": "d+e"}
"""The layouts run with --expert-placement (the `placement` rows compare them): EP=2 x expert-DP=2 on 2 nodes of 2,
each EP group inside a node (e+d) or across the two (d+e)."""
DEFAULT_LAYOUTS = ("2x1", "2x2")
RATES_GBIT = (0.5, 1.0, 2.5)
A2A_KINDS = ("a2a_dispatch", "a2a_dispatch_bwd", "a2a_combine", "a2a_combine_bwd")
BWD_A2A_KINDS = ("a2a_dispatch_bwd", "a2a_combine_bwd")
PARTITION_AUTO = ("--moe-partition-pieces", "auto", "--moe-partition-range", "auto")
PARTITION_2 = ("--moe-partition-pieces", "2", "--moe-partition-range", "all")
BATCH = ("--overlap-moe-expert-parallel-comm",)
CHOICE = ("--moe-overlap-choice", "auto")
MCORE = ("--moe-layer-impl", "mcore")
SMALL_BUCKET = 250_000
"""--ddp-bucket-size of `grad_small`: megatron-core's buckets made small by hand (~1 MB of fp32 gradients, 10-20
buckets in MODEL; its default is 40M parameters, one bucket here)."""
SETTINGS = {  # setting -> (--overlap-wgrad, --moe-pipeline-degree, --moe-bp-pipeline-degree, gradient flags)
    "off": ("off", "1", "1", ("--grad-reduce-schedule", "megatron")),
    "greedy": ("greedy", "1", "1", ("--grad-reduce-schedule", "megatron")),  # Lancet
    # Lancet + FSMoE's pipeline, profile measured at start-up
    "pipeline": ("greedy", "auto", "auto", ("--grad-reduce-schedule", "megatron")),
    # ... + megatron-core's bucketed overlap of the gradient reduction, default buckets, then small ones
    "grad_overlap": ("greedy", "auto", "auto", ("--grad-reduce-schedule", "megatron", "--overlap-grad-reduce")),
    "grad_small": (
        "greedy",
        "auto",
        "auto",
        ("--grad-reduce-schedule", "megatron", "--overlap-grad-reduce", "--ddp-bucket-size", str(SMALL_BUCKET)),
    ),  # fmt: skip
    # ... + FSMoE's adaptive gradient partition
    "adaptive": ("greedy", "auto", "auto", ("--grad-reduce-schedule", "adaptive")),
    # each feature alone (greedy is Lancet's dW queue alone)
    "pipeline_alone": ("off", "auto", "auto", ("--grad-reduce-schedule", "megatron")),
    "adaptive_alone": ("off", "1", "1", ("--grad-reduce-schedule", "adaptive")),
    "partition_alone": ("off", "1", "1", ("--grad-reduce-schedule", "megatron", *PARTITION_AUTO)),
    # all on + Lancet's operator partition: as its planner picks, and 2 pieces through every layer
    "partition": ("greedy", "auto", "auto", ("--grad-reduce-schedule", "adaptive", *PARTITION_AUTO)),
    "partition2": ("greedy", "auto", "auto", ("--grad-reduce-schedule", "adaptive", *PARTITION_2)),
    # the same two without FSMoE's pipeline (degrees 1 / 1): the partition's pieces against whole micro-batches
    "unchunked": ("greedy", "1", "1", ("--grad-reduce-schedule", "adaptive")),
    "unchunked_partition2": ("greedy", "1", "1", ("--grad-reduce-schedule", "adaptive", *PARTITION_2)),
    # batch-level overlap (one micro-batch's forward beside another's backward): alone, and with every overlap on
    "batch": ("off", "1", "1", ("--grad-reduce-schedule", "megatron", *BATCH)),
    "batch_greedy": ("greedy", "1", "1", ("--grad-reduce-schedule", "megatron", *BATCH)),
    "batch_adaptive": ("greedy", "1", "1", ("--grad-reduce-schedule", "adaptive", *BATCH)),
    "batch_all": ("greedy", "auto", "auto", ("--grad-reduce-schedule", "adaptive", *BATCH)),
    # the defaults with the cost model choosing among them and batch-level overlap (--moe-overlap-choice auto)
    "choice": ("greedy", "auto", "auto", ("--grad-reduce-schedule", "adaptive", *CHOICE)),
    # megatron-core's MoE layer with the overlap it has here (DDP's bucketed reduction; ours are ignored for it)
    "mcore": ("off", "1", "1", ("--grad-reduce-schedule", "megatron", "--overlap-grad-reduce", *MCORE)),
}
DEFAULT_SETTINGS = ("off", "greedy", "pipeline", "grad_overlap", "grad_small", "adaptive")
FEATURES = (
    "off",
    "greedy",
    "pipeline_alone",
    "adaptive_alone",
    "partition_alone",
    "adaptive",
    "partition",
    "partition2",
)
"""The `features` table (`--overlap features`): all off, each feature alone, all on, all on + the partition."""
ALIASES = {"all-off": "off", "all-on": "adaptive"}
"""The headline pair: every overlap feature off, and each at its default-on setting."""
GRAD_BASELINES = ("pipeline", "grad_overlap", "grad_small")
"""megatron-core's reduction in the `grad_reduce` rows: after backward, overlapped in default and small buckets."""
PIPELINE_KINDS = ("a2a_", "esp_")
CASE_SUFFIX = {
    "off": "",
    "greedy": "_wgrad_greedy",
    "pipeline": "_pipeline",
    "grad_overlap": "_grad_overlap",
    "grad_small": "_grad_small",
    "adaptive": "_grad_adaptive",
    "pipeline_alone": "_pipeline_alone",
    "adaptive_alone": "_grad_adaptive_alone",
    "partition_alone": "_partition_alone",
    "partition": "_partition",
    "partition2": "_partition2",
    "unchunked": "_unchunked",
    "unchunked_partition2": "_unchunked_partition2",
    "batch": "_batch",
    "batch_greedy": "_batch_greedy",
    "batch_adaptive": "_batch_adaptive",
    "batch_all": "_batch_all",
    "choice": "_choice",
    "mcore": "_mcore",
}
MODEL = [
    "--num-layers", "4", "--hidden-size", "384", "--num-attention-heads", "6", "--seq-length", "256",
    "--ffn-hidden-size", "768", "--num-experts", "8", "--moe-router-topk", "2", "--moe-layer-freq", "1",
    "--micro-batch-size", "4", "--position-embedding-type", "rope", "--normalization", "LayerNorm",
]  # fmt: skip
TRAINING = [
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "1", "--eval-iters", "0", "--eval-interval", "0",
    "--log-interval", "1", "--split", "98,2,0", "--seed", "1234",
]  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--cluster", nargs="+", default=list(DEFAULT_LAYOUTS), help=f"layouts of {list(LAYOUTS)}")
    p.add_argument("--link-gbit", type=float, nargs="+", default=list(RATES_GBIT), help="link rates, Gbit/s")
    choices = [*SETTINGS, *ALIASES, "features"]
    p.add_argument("--overlap", nargs="+", default=list(DEFAULT_SETTINGS), choices=choices, help="overlap settings")
    p.add_argument(
        "--micro-batches", type=int, default=1, help="micro-batches per step and rank (batch-level overlap needs 2+)"
    )
    p.add_argument(
        "--warm-start",
        type=int,
        default=0,
        help="first train a starting checkpoint of this many steps (2x1 at WARM_LINK_GBIT, one micro-batch), from "
        "which every case resumes: the router past its first steps (0: every case from its initial weights)",
    )
    p.add_argument(
        "--warm-start-dir",
        default=None,
        help="where --warm-start's checkpoint is kept, reused when it holds one of that many steps (unset: a new "
        "temporary directory)",
    )
    add_case_arguments(p)
    args = p.parse_args(argv)
    named = [setting for name in args.overlap for setting in (FEATURES if name == "features" else (name,))]
    args.overlap = list(dict.fromkeys(ALIASES.get(name, name) for name in named))  # all-on: adaptive
    check_layouts_and_rates(p, args.cluster, args.link_gbit, LAYOUTS)
    check_case_arguments(p, args)
    return args


def add_case_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of a benchmark of alternated training cases (this one, tools/bench_balance.py): steps per case,
    warm-up steps dropped, rounds, the demo data, and `--model` (trainer flags after MODEL's)."""
    p.add_argument("--steps", type=int, default=5, help="training steps per case, warm-up included")
    p.add_argument("--warmup", type=int, default=2, help="first steps of each case left out of the figures")
    p.add_argument("--rounds", type=int, default=2, help="times each case runs (alternated), steps pooled")
    p.add_argument("--data-dir", default=os.path.join(ROOT, "data"), help="the demo data (built when missing)")
    p.add_argument(
        "--model", nargs=argparse.REMAINDER, default=None, help="trainer flags after MODEL's, overriding them (last)"
    )


def check_case_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`parser.error` unless `--warmup` leaves timed steps of `--steps`."""
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup: {args.warmup} must leave timed steps of --steps {args.steps}; give 0..{args.steps - 1}")


def plan(layouts: list[str], rates: list[float], rounds: int, policies=("off",)) -> list[tuple[str, float, str]]:
    """Every (layout, rate, overlap setting) `rounds` times, alternated: layouts interleaved, the rates' order
    rotated per round, the settings of a (layout, rate) back to back, which one first rotating."""
    cases = []
    for r in range(rounds):
        order = rates[r % len(rates) :] + rates[: r % len(rates)]
        for i, rate in enumerate(order):
            for j, layout in enumerate(layouts if (i + r) % 2 == 0 else layouts[::-1]):
                k = (r + i + j) % len(policies)
                cases += [(layout, rate, policy) for policy in policies[k:] + policies[:k]]
    return cases


def prepare_data(data_dir: str) -> tuple[str, str]:
    """(data prefix, tokenizer model) of the demo data in `data_dir`, built as examples/pretrain_gpt_moe_tiny_cpu.sh
    builds it when missing."""
    prefix, tokenizer = os.path.join(data_dir, "stdlib_text_document"), os.path.join(data_dir, "tokenizer.model")
    if all(os.path.exists(p) for p in (prefix + ".bin", prefix + ".idx", tokenizer)):
        return prefix, tokenizer
    os.makedirs(data_dir, exist_ok=True)
    corpus = os.path.join(data_dir, "stdlib.jsonl")
    tool = os.path.join(ROOT, "tools")
    for argv in (
        ["make_stdlib_corpus.py", "--output", corpus],
        ["train_tokenizer.py", "--input", corpus, "--model-prefix", os.path.join(data_dir, "tokenizer")]
        + ["--vocab-size", "4096", "--num-threads", "2"],
        ["preprocess_data.py", "--input", corpus, "--tokenizer-model", tokenizer]
        + ["--output-prefix", os.path.join(data_dir, "stdlib"), "--workers", "2", "--append-eod"],
    ):
        subprocess.run([sys.executable, os.path.join(tool, argv[0]), *argv[1:]], check=True)
    return prefix, tokenizer


def cluster_of(layout: str) -> tuple[int, int]:
    """(nodes, processes per node) of a layout ("2x2esp", "2x2dp" and "2x2de" run on 2x2)."""
    return parse_cluster(layout.removesuffix("esp").removesuffix("dp").removesuffix("de"))


def trainer_flags(
    layout: str,
    steps: int,
    data: tuple[str, str],
    model: list[str] | None,
    setting: str = "off",
    micro_batches: int = 1,
) -> list[str]:
    nodes, procs = cluster_of(layout)
    (ep, esp), world = LAYOUTS[layout], nodes * procs
    micro = int(_flag([*MODEL, *(model or [])], "--micro-batch-size"))
    wgrad, degree, bp_degree, grad = SETTINGS[setting]
    return [
        *MODEL,
        *TRAINING,
        "--moe-aux-loss-coeff", "0.01",  # the balancing loss these figures were measured with (the former default)
        "--expert-model-parallel-size", str(ep), "--expert-tensor-parallel-size", str(esp),
        "--global-batch-size", str(micro * world * micro_batches),
        "--train-iters", str(steps), "--data-path", data[0], "--tokenizer-model", data[1],
        "--overlap-wgrad", wgrad, "--moe-pipeline-degree", degree, "--moe-bp-pipeline-degree", bp_degree, *grad,
        *(["--expert-placement", PLACEMENT_LAYOUTS[layout]] if layout in PLACEMENT_LAYOUTS else []),
        *(model or []),
    ]  # fmt: skip


def _flag(flags: list[str], name: str) -> str:
    return flags[len(flags) - 1 - flags[::-1].index(name) + 1]  # the last occurrence wins, as in the parser


def layout_name(layout: str) -> str:
    nodes, procs = cluster_of(layout)
    ep, esp = LAYOUTS[layout]
    placed = f" {PLACEMENT_LAYOUTS[layout]}" if layout in PLACEMENT_LAYOUTS else ""
    return f"{layout} EP={ep} DP={nodes * procs}" + (f" ESP={esp}" if esp > 1 else "") + placed


def summarize(
    layout: str, rate: float, histories: list[list[dict]], warmup: int, flags: list[str], setting: str = "off"
) -> dict:
    """One case's JSON row from the logging rank's per-step histories of its rounds (entries: `step_ms`, `comm`)."""
    from megatron_moe.comm.timers import hidden_share  # the comm package loads torch: not before --help

    timed = [entry for history in histories for entry in history[warmup:]]
    if not timed or any("step_ms" not in h or "comm" not in h for h in timed):
        raise RuntimeError("the Trainer's history has no `step_ms`/`comm`: this tree lacks the comm timers")
    kinds = list(timed[0]["comm"]["comm_ms"])

    def mean(field: str) -> dict:
        return {k: round(statistics.fmean(h["comm"][field][k] for h in timed), 3) for k in kinds}

    step_ms = statistics.median(h["step_ms"] for h in timed)
    mean_step = statistics.fmean(h["step_ms"] for h in timed)
    comm, exposed, wire = mean("comm_ms"), mean("exposed_ms"), mean("wire_ms")
    skew, transfer = mean("skew_ms"), mean("transfer_ms")
    total_exposed, total_wire = sum(exposed.values()), sum(wire.values())
    wgrad = [h.get("wgrad") for h in timed if h.get("wgrad")]
    policy, degree, bp_degree, grad = SETTINGS[setting]
    overlap = {"overlap_wgrad": policy, "pipeline_degree": degree, "bp_pipeline_degree": bp_degree}
    overlap |= {k: int(v) for k, v in overlap.items() if v.isdigit()}
    overlap["grad_reduce_schedule"] = _flag(list(grad), "--grad-reduce-schedule")
    overlap["overlap_grad_reduce"] = "--overlap-grad-reduce" in grad
    overlap["ddp_bucket_size"] = int(_flag(list(grad), "--ddp-bucket-size")) if "--ddp-bucket-size" in grad else None
    pieces = _flag(list(grad), "--moe-partition-pieces") if "--moe-partition-pieces" in grad else "1"
    overlap["partition_pieces"] = int(pieces) if pieces.isdigit() else pieces
    return {
        "case": f"step_{layout}_{rate:g}gbit" + CASE_SUFFIX[setting],
        "layout": layout_name(layout),
        "link_gbit": rate,
        "step_ms": round(step_ms, 1),
        "comm_ms": comm,
        "exposed_ms": exposed,
        "wire_ms": wire,
        "skew_ms": skew,
        "transfer_ms": transfer,
        "wire_from": {k: timed[-1]["comm"]["wire_from"][k] for k in kinds},
        "skew_from": {k: timed[-1]["comm"]["skew_from"][k] for k in kinds},
        "hidden_frac": round(hidden_share(total_exposed, total_wire), 4),
        "bytes": {k: round(statistics.fmean(h["comm"]["bytes"][k] for h in timed)) for k in kinds},
        "wire_bytes": {k: round(statistics.fmean(h["comm"]["wire_bytes"][k] for h in timed)) for k in kinds},
        "calls": {k: round(statistics.fmean(h["comm"]["calls"][k] for h in timed), 1) for k in kinds},
        "exposed_ms_total": round(total_exposed, 1),
        "wire_ms_total": round(total_wire, 1),
        "skew_ms_total": round(sum(skew.values()), 1),
        "transfer_ms_total": round(sum(transfer.values()), 1),
        "exposed_frac_of_step": {k: round(v / mean_step, 4) for k, v in exposed.items()},
        "a2a_exposed_frac_of_step": round(sum(exposed[k] for k in A2A_KINDS if k in exposed) / mean_step, 4),
        "step_ms_all": [[round(h["step_ms"], 1) for h in history] for history in histories],
        "bwd_a2a_exposed_ms": round(sum(exposed.get(k, 0.0) for k in BWD_A2A_KINDS), 3),
        "bwd_a2a_comm_ms": round(sum(comm.get(k, 0.0) for k in BWD_A2A_KINDS), 3),
        **overlap,
        "overlap": overlap,
        "pipeline_degrees": histories[0][0].get("pipeline_degrees"),
        "operator_partition": (histories[0][0].get("startup") or {}).get("operator_partition"),
        "overlap_choice": (histories[0][0].get("startup") or {}).get("overlap_choice"),
        "wgrad": _wgrad_figures(wgrad),
        "grad_reduce_floor_ms": _floor_ms(timed),
        "steps": len(histories[0]),
        "rounds": len(histories),
        "warmup": warmup,
        "figures_of": "the logging rank (last rank)",
        "flags": flags,
    }


def _floor_ms(steps: list[dict]) -> float | None:
    """The adaptive plan's floor (`GradPartition.predicted_ms["floor"]`: the reduction of the gradients made after
    the first MoE layer's backward began, which no launch order hides); None without the plan."""
    floors = [h["grad_reduce"]["floor_ms"] for h in steps if (h.get("grad_reduce") or {}).get("floor_ms") is not None]
    return round(statistics.fmean(floors), 3) if floors else None


def _wgrad_figures(steps: list[dict]) -> dict | None:
    """The queue's figures over the timed steps: mean closures per place, the largest held MiB, the plan's."""
    if not steps:
        return None
    places = ("under_a2a", "natural", "at_backward_end", "over_cap")
    figures = {k: round(statistics.fmean(s[k] for s in steps), 1) for k in places}
    figures["peak_held_mb"] = max(s["peak_held_mb"] for s in steps)
    return {**figures, **{k: v for k, v in steps[-1].items() if k.startswith("plan")}}


def headline(off: dict, on: dict) -> dict:
    """The `headline` row of one layout and rate: all-on (each overlap feature at its default-on setting) against
    all-off. `step_ratio` is off / on (1.2: all-on 1.2x as fast); hidden shares are of all communication, against
    its wire time (megatron_moe/comm/timers.py)."""

    def pair(field: str) -> dict:
        return {"off": off[field], "on": on[field]}

    return {
        "case": f"headline_{off['case'].removeprefix('step_')}",
        "layout": off["layout"],
        "link_gbit": off["link_gbit"],
        "all_on": on["overlap"],
        "step_ms": pair("step_ms"),
        "step_ratio": round(off["step_ms"] / on["step_ms"], 3),
        "hidden_frac": pair("hidden_frac"),
        "exposed_ms": pair("exposed_ms_total"),
        "wire_ms": pair("wire_ms_total"),
        "skew_ms": pair("skew_ms_total"),
        "transfer_ms": pair("transfer_ms_total"),
        "exposed_frac_of_step": {
            name: round(row["exposed_ms_total"] / row["step_ms"], 4) for name, row in (("off", off), ("on", on))
        },
        "pipeline_degrees": on["pipeline_degrees"],
    }


def compare(off: dict, on: dict) -> dict:
    """The `overlap_wgrad` row of one layout and rate: greedy against off."""
    cut = 1 - on["bwd_a2a_exposed_ms"] / off["bwd_a2a_exposed_ms"] if off["bwd_a2a_exposed_ms"] > 0 else 0.0
    return {
        "case": f"overlap_wgrad_{off['case'].removeprefix('step_')}",
        "layout": off["layout"],
        "link_gbit": off["link_gbit"],
        "overlap_wgrad": on["overlap_wgrad"],
        "bwd_a2a_exposed_ms": {"off": off["bwd_a2a_exposed_ms"], "on": on["bwd_a2a_exposed_ms"]},
        "bwd_a2a_comm_ms": {"off": off["bwd_a2a_comm_ms"], "on": on["bwd_a2a_comm_ms"]},
        "bwd_a2a_exposed_cut": round(cut, 3),
        "step_ms": {"off": off["step_ms"], "on": on["step_ms"]},
        "step_ratio": round(on["step_ms"] / off["step_ms"], 3),
        "peak_held_mb": (on["wgrad"] or {}).get("peak_held_mb"),
        "plan": {k: v for k, v in (on["wgrad"] or {}).items() if k.startswith("plan")},
    }


def compare_pipeline(greedy: dict, pipeline: dict) -> dict:
    """The `pipeline` row of one layout and rate: Lancet + FSMoE's pipeline (degrees auto) against Lancet alone."""
    kinds = [k for k in pipeline["exposed_ms"] if k.startswith(PIPELINE_KINDS)]
    return {
        "case": f"pipeline_{greedy['case'].removeprefix('step_').removesuffix(CASE_SUFFIX['greedy'])}",
        "layout": greedy["layout"],
        "link_gbit": greedy["link_gbit"],
        "pipeline_degree": pipeline["pipeline_degree"],
        "bp_pipeline_degree": pipeline["bp_pipeline_degree"],
        "pipeline_degrees": pipeline["pipeline_degrees"],
        "step_ms": {"off": greedy["step_ms"], "on": pipeline["step_ms"]},
        "step_ratio": round(pipeline["step_ms"] / greedy["step_ms"], 3),
        "exposed_ms": {k: {"off": greedy["exposed_ms"].get(k, 0.0), "on": pipeline["exposed_ms"][k]} for k in kinds},
        "comm_ms": {k: {"off": greedy["comm_ms"].get(k, 0.0), "on": pipeline["comm_ms"][k]} for k in kinds},
    }


def compare_grad_reduce(baselines: dict[str, dict], adaptive: dict) -> dict:
    """The `grad_reduce` row of one layout and rate: FSMoE's adaptive partition against megatron-core's reduction
    after backward, overlapped in default buckets and in small ones (everything else as `pipeline`)."""
    kind = "dp_grad_reduce"
    best = min(baselines, key=lambda name: baselines[name]["exposed_ms"].get(kind, 0.0))
    base = baselines[best]["exposed_ms"].get(kind, 0.0)
    cut = 1 - adaptive["exposed_ms"].get(kind, 0.0) / base if base > 0 else 0.0
    floor = adaptive.get("grad_reduce_floor_ms")  # the plan's: about this much stays exposed whatever is done
    return {
        "case": f"grad_reduce_{adaptive['case'].removeprefix('step_').removesuffix(CASE_SUFFIX['adaptive'])}",
        "layout": adaptive["layout"],
        "link_gbit": adaptive["link_gbit"],
        "grad_reduce_schedule": "adaptive",
        "dp_grad_reduce_exposed_ms": {name: row["exposed_ms"].get(kind, 0.0) for name, row in baselines.items()}
        | {"adaptive": adaptive["exposed_ms"].get(kind, 0.0)},
        "dp_grad_reduce_comm_ms": {name: row["comm_ms"].get(kind, 0.0) for name, row in baselines.items()}
        | {"adaptive": adaptive["comm_ms"].get(kind, 0.0)},
        "best_megatron": best,
        "exposed_cut_vs_best_megatron": round(cut, 3),
        "floor_ms": floor,
        "floor_cut_vs_best_megatron": round(1 - floor / base, 3) if floor is not None and base > 0 else None,
        "step_ms": {name: row["step_ms"] for name, row in baselines.items()} | {"adaptive": adaptive["step_ms"]},
        "step_ratio_vs_best_megatron": round(adaptive["step_ms"] / min(r["step_ms"] for r in baselines.values()), 3),
        "a2a_exposed_ms": {
            name: round(sum(row["exposed_ms"].get(k, 0.0) for k in A2A_KINDS), 3)
            for name, row in {**baselines, "adaptive": adaptive}.items()
        },
    }


def run_case(
    cluster: EmulatedCluster, layout: str, rate: float, setting: str, args, data, extra: list[str] | None = None
) -> list[dict]:
    """One round of a case: the logging rank's per-step history. `extra`: trainer flags after `--model`'s, overriding
    them (tools/bench_balance.py's balancing method, starting checkpoint and iterations)."""
    _, procs = cluster_of(layout)
    cluster.set_link_gbit(rate)
    micro_batches = getattr(args, "micro_batches", 1)
    flags = trainer_flags(layout, args.steps, data, [*(args.model or []), *(extra or [])], setting, micro_batches)
    profile_dir = getattr(args, "profile_dir", None)  # main() makes it; without it every job measures its own
    if profile_dir and "--moe-cost-profile" not in (args.model or []):  # measured once per layout and rate
        planned = PARTITION_AUTO[0] in SETTINGS[setting][3] or CHOICE[0] in SETTINGS[setting][3]
        dense = "_dense" if planned else ""  # the planners' lines too
        name = f"cost_profile_{layout}_{rate:g}gbit{dense}.json"
        flags += ["--moe-cost-profile", os.path.join(profile_dir, name)]
    return run_job(cluster, procs, ["-m", "tools.bench_step", "--worker", *flags])


def features(rows: dict[str, dict]) -> dict:
    """The `features` row of one layout and rate: each measured setting of `FEATURES` against all off: step ms,
    step ratio (off / setting: above 1 is faster), hidden share of all communication, exposed, wire, skew and
    transfer ms; the partition settings with the planner's ranges and its predicted micro-batch ms (forward +
    backward of the logging rank's stage, partitioned / unpartitioned) and hidden all-to-all ms."""
    off = rows["off"]
    table = {}
    for name, row in rows.items():
        figures = {
            "step_ms": row["step_ms"],
            "step_ratio": round(off["step_ms"] / row["step_ms"], 3),
            "hidden_frac": row["hidden_frac"],
            "exposed_ms": row["exposed_ms_total"],
            "wire_ms": row["wire_ms_total"],
            "skew_ms": row["skew_ms_total"],
            "transfer_ms": row["transfer_ms_total"],
            "a2a_exposed_frac_of_step": row["a2a_exposed_frac_of_step"],
            "pipeline_degrees": row["pipeline_degrees"],
        }
        if row.get("operator_partition"):
            figures["operator_partition"] = row["operator_partition"]
        table[name] = figures
    return {
        "case": f"features_{off['case'].removeprefix('step_')}",
        "layout": off["layout"],
        "link_gbit": off["link_gbit"],
        "comm_frac_of_off_step": round(off["wire_ms_total"] / off["step_ms"], 4),
        "settings": table,
    }


def compare_placement(ed: dict, de: dict) -> dict:
    """The `placement` row of one rate and overlap setting: 2x2dp (e+d) against 2x2de (d+e), EP=2 x expert-DP=2 on
    2 nodes of 2. Measured (the logging rank's): step ms, exposed and issued-to-completed all-to-all (its four
    kinds) and dp_grad_reduce ms, the wire bytes of each, and the all-to-all's bytes to peers on the other node
    (its wire bytes x the share of its EP peers there: uniform routing). Modelled (`placement.crossing_bytes`, what
    --expert-placement auto weighs, per rank and step): the all-to-all's and the experts' gradient reduction's
    bytes across nodes; the dense gradients' reduction (DP=4 over both nodes) crosses the same under both and is
    left out. `auto`: what the rule picks for this model."""
    cfg = parse_run_args(ed["flags"])
    nodes, procs = cluster_of("2x2dp")
    cfg.validate(nodes * procs)
    dims, volumes = cfg.dims(nodes * procs), placement.StepVolumes.of(cfg, cfg.dims(nodes * procs))
    logging_rank = nodes * procs - 1
    figures = {}
    for row, p in ((ed, "e+d"), (de, "d+e")):
        peers = next(g for g in placement.groups(dims, p)["ep"] if logging_rank in g)
        away = sum(q // procs != logging_rank // procs for q in peers) / (len(peers) - 1)
        a2a_wire = sum(row["wire_bytes"].get(k, 0) for k in A2A_KINDS)
        figures[p] = {
            "step_ms": row["step_ms"],
            "a2a_exposed_ms": round(sum(row["exposed_ms"].get(k, 0.0) for k in A2A_KINDS), 3),
            "dp_grad_reduce_exposed_ms": row["exposed_ms"].get("dp_grad_reduce", 0.0),
            "a2a_comm_ms": round(sum(row["comm_ms"].get(k, 0.0) for k in A2A_KINDS), 3),
            "dp_grad_reduce_comm_ms": row["comm_ms"].get("dp_grad_reduce", 0.0),
            "a2a_wire_bytes": a2a_wire,
            "a2a_link_bytes": round(a2a_wire * away),
            "dp_grad_reduce_wire_bytes": row["wire_bytes"].get("dp_grad_reduce", 0),
            "model_link_bytes": {k: round(v) for k, v in placement.crossing_bytes(dims, p, procs, volumes).items()},
        }
    pick, why = placement.choose(dims, procs, volumes)
    return {
        "case": f"placement_{ed['case'].removeprefix('step_2x2dp_')}",
        "layout": "2x2 EP=2 expert-DP=2 DP=4",
        "link_gbit": ed["link_gbit"],
        "overlap": ed["overlap"],
        "placements": figures,
        "step_ratio_de_over_ed": round(de["step_ms"] / ed["step_ms"], 3),
        "model_volumes": dataclasses.asdict(volumes),
        "auto": {"picks": pick, "why": why},
    }


def worker(flags: list[str]) -> None:
    """One rank of a case: train; the logging rank (the one with a history) writes it."""
    from megatron_moe.failure import setup_logging
    from megatron_moe.training import pretrain

    setup_logging()  # the plan, the degrees and the per-step timer lines, as pretrain_gpt_moe.py logs them
    history = pretrain(parse_run_args(flags))
    if history:
        write_result(history)


WARM_LINK_GBIT = 10.0
"""The starting checkpoint's link (`--warm-start`): fast enough that it costs its job nothing."""


def warm_start(cluster: EmulatedCluster, args, data) -> list[str]:
    """Train `--warm-start` steps on 2x1 with every overlap off and one micro-batch, saved at the end; the flags
    that resume each case from it for `--steps` more (a 2x1 checkpoint loads at EP=4, resharded)."""
    from megatron_moe.checkpointing.paths import TRACKER

    checkpoint = args.warm_start_dir or os.path.join(args.profile_dir, "warm_start")
    tracker = os.path.join(checkpoint, TRACKER)
    if os.path.exists(tracker) and open(tracker).read().strip() == str(args.warm_start):
        print(f"bench_step: starting checkpoint of {args.warm_start} steps reused from {checkpoint}", file=sys.stderr)
    else:
        warm = argparse.Namespace(**{**vars(args), "steps": args.warm_start, "micro_batches": 1})
        started = time.perf_counter()
        run_case(cluster, "2x1", WARM_LINK_GBIT, "off", warm, data, ["--save", checkpoint])
        wall_s = time.perf_counter() - started
        print(f"bench_step: starting checkpoint, {args.warm_start} steps in {wall_s:.0f} s", file=sys.stderr)
    return ["--load", checkpoint, "--train-iters", str(args.warm_start + args.steps)]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(argv[1:])
        return 0
    args = parse_args(argv)
    data = prepare_data(args.data_dir)
    args.profile_dir = tempfile.mkdtemp(prefix="bench_step_profiles_")
    nodes = {cluster_of(layout)[0] for layout in args.cluster}
    histories: dict[tuple[str, float, str], list] = {}
    with EmulatedCluster(max(nodes), args.link_gbit[0]) as cluster:
        resume = warm_start(cluster, args, data) if args.warm_start else []
        for layout, rate, policy in plan(args.cluster, args.link_gbit, args.rounds, args.overlap):
            # megatron-core's layer cannot load our layer's checkpoint: it starts from its initial weights
            history = run_case(cluster, layout, rate, policy, args, data, resume if policy != "mcore" else [])
            histories.setdefault((layout, rate, policy), []).append(history)
            steps = ", ".join(f"{h['step_ms']:.0f}" for h in history)
            print(f"bench_step: {layout} at {rate:g} Gbit/s, overlap {policy}: step ms {steps}", file=sys.stderr)
    rows = {}
    for (layout, rate, policy), runs in histories.items():
        flags = trainer_flags(layout, args.steps, data, args.model, policy, args.micro_batches)
        rows[layout, rate, policy] = summarize(layout, rate, runs, args.warmup, flags, policy)
        print(json.dumps(rows[layout, rate, policy]), flush=True)
    for (layout, rate, policy), row in rows.items():
        if policy == ALIASES["all-on"] and (layout, rate, ALIASES["all-off"]) in rows:
            print(json.dumps(headline(rows[layout, rate, ALIASES["all-off"]], row)), flush=True)
    for layout, rate in dict.fromkeys((layout, rate) for layout, rate, _ in rows):
        measured = {name: rows[layout, rate, name] for name in FEATURES if (layout, rate, name) in rows}
        if len(measured) > 2 and "off" in measured:
            print(json.dumps(features(measured)), flush=True)
    for (layout, rate, policy), row in rows.items():
        if layout == "2x2dp" and ("2x2de", rate, policy) in rows:
            print(json.dumps(compare_placement(row, rows["2x2de", rate, policy])), flush=True)
    for (layout, rate, policy), row in rows.items():
        if policy == "greedy" and (layout, rate, "off") in rows:
            print(json.dumps(compare(rows[layout, rate, "off"], row)), flush=True)
    for (layout, rate, policy), row in rows.items():
        if policy == "pipeline" and (layout, rate, "greedy") in rows:
            print(json.dumps(compare_pipeline(rows[layout, rate, "greedy"], row)), flush=True)
    for (layout, rate, policy), row in rows.items():
        baselines = {name: rows[layout, rate, name] for name in GRAD_BASELINES if (layout, rate, name) in rows}
        if policy == "adaptive" and baselines:
            print(json.dumps(compare_grad_reduce(baselines, row)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
