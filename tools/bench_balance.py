"""Benchmark load-balancing methods on an emulated cluster: the wait for the slowest rank, step time, and the loss.

    python -m tools.bench_balance                          # aux, bias, shadow, both on 2x1 and 2x2 at 1 Gbit/s
    python -m tools.bench_balance --methods aux bias       # what runs on a tree without shadow experts
    python -m tools.bench_balance --methods aux bias --warm-steps 20 --quality-steps 0 --rounds 1   # a quick look

Issue 29's item 4, on tools/bench_step.py's machinery (its `MODEL`, dropless top-2 with every layer MoE, its
`trainer_flags`, `run_case` and `summarize`, the demo data, one `EmulatedCluster`). The methods (`METHODS`):

- `aux`: today's balancing, the aux loss at bench_step's --moe-aux-loss-coeff 0.01 (the trainer's default was 0.01;
  it is Megatron-LM's 0 now), softmax scores;
- `bias`: aux-loss-free balancing as DeepSeek-V3 and Megatron-LM run it: --moe-router-enable-expert-bias (each
  layer's per-expert bias, moved by --moe-router-bias-update-rate, default 1e-3, toward the mean load after every
  step), with --moe-router-score-function sigmoid (the code biases sigmoid scores only, config/rules.py) and
  --moe-aux-loss-coeff 0 (no aux loss at all);
- `shadow`: `aux` + --moe-shadow-experts auto (FasterMoE's shadow experts). The flag is passed through as it is: a
  trainer that does not know it refuses it, and so does this tool, with the trainer's error, before any job runs;
- `both`: `bias` + --moe-shadow-experts auto.

The router in its natural imbalance, not at init: the tool first trains a starting checkpoint per balancing family
for `--warm-steps` on 2x1 (EP=2) at `WARM_LINK_GBIT` (aux for `aux` and `shadow`, bias for `bias` and `both`,
`START_OF`), and every case resumes from its family's (--load; a 2x1 checkpoint loads at EP=4, resharded). One
starting checkpoint for all four cannot do: the expert bias needs its own warm-up (at 1e-3 a step, the 5 steps of a
case move it by at most 0.005, nothing against the sigmoid scores' spread), and a run with the bias refuses a
checkpoint saved without its `expert_bias` buffers (no flag loads one without them). Both families start from the
same seed and data; the cases resume at the checkpoint's learning rate (--min-lr once the decay is over).

The cases alternate in one run, as bench_step's (`plan`: layouts interleaved, the methods of a layout back to back,
which one first rotating round by round); each runs `--rounds` times, `--steps` steps each, the first `--warmup`
dropped. Per case one JSON line, printed once every case has run: bench_step's row (`step_ms`, the median; per kind
`exposed_ms`, `skew_ms`, the wait for the last rank of the group to arrive, and `transfer_ms`, the rest of the
exposed time, with their totals; `wire_ms`, `comm_ms`, ...), its `case` suffixed with the method (step_2x1_1gbit_aux),
`method`, `method_flags`, `start` (the family whose checkpoint it resumed), `tokens_cv` (the mean over timed steps
of the layers' mean coefficient of variation of tokens per expert), and `load_imbalance`: max / mean routed pairs
per expert (`expert`) and per EP rank (`ep_rank`, the sum of its experts': what the skew follows), each layer's
mean over the timed steps (`per_layer`) and their mean over layers, from the Trainer's `tokens_per_expert` (the
whole step's, every rank's). Then one `balance` row per layout: per method `step_ms`, `step_ratio` (aux / method:
above 1 is faster), `skew_ms` and `skew_cut` (1 - method / aux, all kinds' skew), `a2a_skew_ms`, `transfer_ms`,
`exposed_ms`, and `ep_rank_imbalance` / `expert_imbalance` (the `load_imbalance` means).

Quality (`--quality-steps`, 0: none): the demo's own run (examples/pretrain_gpt_moe_tiny_cpu.sh's flags, asked
from the script with DRY_RUN=1, --train-iters set to this) on 2x1, from scratch, with `aux`'s and `bias`'s flags,
each with `--quality-seeds` (run-to-run noise: the spread between seeds); one `quality` row with each run's
validation losses, the final one per method and seed, the means and spreads. Shadow experts change no arithmetic
(equivalence-tested against no shadowing), so `shadow`'s loss is `aux`'s and `both`'s is `bias`'s: the row says
so rather than training them.

After the `balance` rows, one `warm_start` row per family: its steps, wall seconds, median step ms and the last
step's tokens cv (the imbalance the cases start from). The figures are the logging rank's (the last rank, on the
last node).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from megatron_moe.config import ConfigError
from megatron_moe.config import parse_args as parse_run_args
from tools import bench_step
from tools.benchcluster import ROOT, check_layouts_and_rates, run_job
from tools.cli import HelpFormatter
from tools.emulated_cluster import EmulatedCluster

BIAS_FLAGS = (
    "--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid", "--moe-aux-loss-coeff", "0",
)  # fmt: skip
SHADOW_FLAGS = ("--moe-shadow-experts", "auto")
METHODS = {"aux": (), "bias": BIAS_FLAGS, "shadow": SHADOW_FLAGS, "both": (*BIAS_FLAGS, *SHADOW_FLAGS)}
"""Trainer flags of each balancing method, after bench_step's `trainer_flags` (`aux`: its aux loss, weight 0.01)."""
START_OF = {"aux": "aux", "bias": "bias", "shadow": "aux", "both": "bias"}
"""The starting checkpoint (balancing family) each method resumes from: shadowing changes no routing."""
QUALITY_OF = {"aux": "aux", "bias": "bias", "shadow": "aux", "both": "bias"}
"""The method whose loss stands for each: shadow experts change no arithmetic (equivalence-tested)."""
LAYOUTS = ("2x1", "2x2")
WARM_LAYOUT = "2x1"
WARM_LINK_GBIT = 10.0
"""The link of the starting checkpoints' and the quality runs' jobs: fast enough that it costs them nothing."""
DEFAULT_WARM_STEPS = 100
"""At ~1.9 s a step on 2x1 (MODEL, this 2-core machine) the two families took 8 minutes: `--methods aux bias` at
the defaults took 32 minutes here (7 of cases, 17 of quality runs; each further method adds ~3.5 of cases)."""
DEMO_SCRIPT = os.path.join(ROOT, "examples", "pretrain_gpt_moe_tiny_cpu.sh")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS), help="balancing methods")
    p.add_argument("--cluster", nargs="+", default=list(LAYOUTS), help=f"layouts of {list(LAYOUTS)}")
    p.add_argument("--link-gbit", type=float, default=1.0, help="the link's rate, Gbit/s")
    p.add_argument("--warm-steps", type=int, default=DEFAULT_WARM_STEPS, help="steps of the starting checkpoints")
    p.add_argument("--quality-steps", type=int, default=200, help="steps of the demo's quality runs (0: none)")
    p.add_argument("--quality-seeds", type=int, nargs="+", default=[1234, 1235], help="seeds of the quality runs")
    p.add_argument(
        "--bias-update-rate",
        type=float,
        default=None,
        help="--moe-router-bias-update-rate of bias and both (unset: the trainer's 1e-3, Megatron-LM's and "
        "DeepSeek-V3's over long runs; the warm-up here is 100 steps)",
    )
    choices = [*bench_step.SETTINGS, *bench_step.ALIASES]
    p.add_argument("--overlap", default="off", choices=choices, help="bench_step's overlap setting of every case")
    bench_step.add_case_arguments(p)
    args = p.parse_args(argv)
    args.methods = list(dict.fromkeys(args.methods))
    args.overlap = bench_step.ALIASES.get(args.overlap, args.overlap)
    check_layouts_and_rates(p, args.cluster, [args.link_gbit], LAYOUTS)
    bench_step.check_case_arguments(p, args)
    if args.warm_steps < 1 or args.quality_steps < 0:
        p.error(f"--warm-steps {args.warm_steps} / --quality-steps {args.quality_steps}: give >= 1 / >= 0")
    return args


def plan(layouts: list[str], rate: float, methods: list[str], rounds: int) -> list[tuple[str, str]]:
    """(layout, method) of every case `rounds` times, in bench_step's order: layouts interleaved round by round,
    a layout's methods back to back, which one first rotating."""
    return [(layout, method) for layout, _, method in bench_step.plan(layouts, [rate], rounds, methods)]


def starts(methods: list[str]) -> list[str]:
    """The starting checkpoints (balancing families) the methods need, in `METHODS`' order."""
    return [family for family in METHODS if family in {START_OF[m] for m in methods}]


def case_flags(method: str, checkpoint: str, warm_steps: int, steps: int) -> list[str]:
    """A case's trainer flags after MODEL's: its method's, resuming from its family's checkpoint for `steps`."""
    return [*METHODS[method], "--load", checkpoint, "--train-iters", str(warm_steps + steps)]


def warm_flags(family: str, checkpoint: str) -> list[str]:
    """A starting checkpoint's flags after MODEL's (its family's method, saved at the end; steps: trainer_flags)."""
    return [*METHODS[family], "--save", checkpoint]


def check_flags(method: str, flags: list[str]) -> None:
    """The trainer's own parsing of a case's `flags` (as bench_step's worker parses them): an unknown or refused
    flag stops the tool now, with the trainer's error, rather than after the starting checkpoints."""
    try:
        parse_run_args(flags)
    except ConfigError as error:
        given = " ".join(METHODS[method]) or "none"
        raise SystemExit(
            f"bench_balance: --methods {method} (flags: {given}): the trainer refuses it: {error}"
        ) from None


def imbalance(steps: list[dict], ep: int) -> dict | None:
    """Max / mean routed pairs per expert and per EP rank (experts contiguous on the ranks, as the layer places
    them), each layer's mean over `steps`, and their mean over layers; None without `tokens_per_expert`."""
    counted = [h["tokens_per_expert"] for h in steps if h.get("tokens_per_expert")]
    if not counted:
        return None
    per_layer = {}
    for layer in counted[0]:
        expert = [_max_over_mean(c[layer]) for c in counted]
        ranks = [_max_over_mean(_rank_loads(c[layer], ep)) for c in counted]
        per_layer[layer] = {"expert": round(statistics.fmean(expert), 3), "ep_rank": round(statistics.fmean(ranks), 3)}
    return {
        "expert": round(statistics.fmean(f["expert"] for f in per_layer.values()), 3),
        "ep_rank": round(statistics.fmean(f["ep_rank"] for f in per_layer.values()), 3),
        "per_layer": per_layer,
    }


def _rank_loads(counts: list[float], ep: int) -> list[float]:
    per_rank = len(counts) // ep
    return [sum(counts[r * per_rank : (r + 1) * per_rank]) for r in range(ep)]


def _max_over_mean(loads: list[float]) -> float:
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def case_row(layout: str, args, method: str, histories: list[list[dict]], flags: list[str]) -> dict:
    """One case's JSON row: bench_step's, renamed, with the method and the load imbalance of its timed steps."""
    row = bench_step.summarize(layout, args.link_gbit, histories, args.warmup, flags, args.overlap)
    row["case"] += f"_{method}"  # step_2x1_1gbit_aux (+ the overlap setting's suffix where not off)
    timed = [entry for history in histories for entry in history[args.warmup :]]
    cvs = [h["moe tokens cv"] for h in timed if "moe tokens cv" in h]
    return {
        "case": row.pop("case"),
        "method": method,
        "method_flags": list(METHODS[method]),
        "start": START_OF[method],
        "tokens_cv": round(statistics.fmean(cvs), 4) if cvs else None,
        "load_imbalance": imbalance(timed, bench_step.LAYOUTS[layout][0]),
        **row,
    }


def balance(rows: dict[str, dict]) -> dict:
    """The `balance` row of one layout: each method against `aux` (in `rows`): step ratio aux / method (above 1 is
    faster), skew (all kinds; the all-to-alls') and its cut 1 - method / aux, exposed ms, load imbalance."""
    aux = rows["aux"]

    def a2a_skew(row: dict) -> float:
        return round(sum(row["skew_ms"].get(k, 0.0) for k in bench_step.A2A_KINDS), 1)

    table = {}
    for method, row in rows.items():
        skew, base = row["skew_ms_total"], aux["skew_ms_total"]
        table[method] = {
            "step_ms": row["step_ms"],
            "step_ratio": round(aux["step_ms"] / row["step_ms"], 3),
            "skew_ms": skew,
            "skew_cut": round(1 - skew / base, 3) if base > 0 else None,
            "a2a_skew_ms": a2a_skew(row),
            "transfer_ms": row["transfer_ms_total"],
            "exposed_ms": row["exposed_ms_total"],
            "ep_rank_imbalance": (row["load_imbalance"] or {}).get("ep_rank"),
            "expert_imbalance": (row["load_imbalance"] or {}).get("expert"),
        }
    return {
        "case": f"balance_{aux['case'].removeprefix('step_').removesuffix('_aux')}",
        "layout": aux["layout"],
        "link_gbit": aux["link_gbit"],
        "against": "aux",
        "overlap": aux["overlap"],
        "methods": table,
    }


def quality(losses: dict[str, dict[int, dict]], methods: list[str], steps: int) -> dict:
    """The `quality` row: per trained method and seed the validation losses ({iteration: loss}) and the last one;
    per method the mean and spread (max - min) over seeds of the last; `shadow` and `both` named as `aux`'s and
    `bias`'s (not trained: shadow experts change no arithmetic)."""
    final = {m: {seed: curve[steps] for seed, curve in runs.items()} for m, runs in losses.items()}
    row = {
        "case": f"quality_{steps}steps",
        "steps": steps,
        "validation_loss": {m: {str(seed): round(v, 4) for seed, v in runs.items()} for m, runs in final.items()},
        "mean": {m: round(statistics.fmean(runs.values()), 4) for m, runs in final.items()},
        "spread": {m: round(max(runs.values()) - min(runs.values()), 4) for m, runs in final.items()},
        "curves": {
            m: {str(s): {str(i): round(v, 4) for i, v in c.items()} for s, c in r.items()} for m, r in losses.items()
        },
        "same_as": {m: QUALITY_OF[m] for m in methods if QUALITY_OF[m] != m},
        "note": "shadow experts change no arithmetic (equivalence-tested): shadow's loss is aux's, both's is bias's",
    }
    if "aux" in row["mean"] and "bias" in row["mean"]:
        row["bias_minus_aux"] = round(row["mean"]["bias"] - row["mean"]["aux"], 4)
    return row


def demo_flags(data_dir: str, run_dir: str, extra: list[str]) -> list[str]:
    """The demo's trainer flags + `extra`, as examples/pretrain_gpt_moe_tiny_cpu.sh gives them (DRY_RUN=1 prints its
    torchrun command): its model, data and schedule, TensorBoard and checkpoints under `run_dir`."""
    env = {**os.environ, "DRY_RUN": "1", "DATA_DIR": data_dir, "RUN_DIR": run_dir, "PYTHON": sys.executable}
    out = subprocess.run(["bash", DEMO_SCRIPT, *extra], env=env, check=True, capture_output=True, text=True).stdout
    command = shlex.split(out.splitlines()[0])
    return command[[os.path.basename(a) for a in command].index("pretrain_gpt_moe.py") + 1 :]


def validation_losses(history: list[dict]) -> dict[int, float]:
    """{iteration: validation lm loss} of a run's history (the Trainer's `validation lm loss`)."""
    losses = {h["iteration"]: h["validation lm loss"] for h in history if "validation lm loss" in h}
    if not losses:
        raise RuntimeError("the run's history has no `validation lm loss`: no validation ran (--eval-iters 0?)")
    return losses


def train_job(cluster: EmulatedCluster, layout: str, flags: list[str]) -> list[dict]:
    """One training job of `flags` on `layout` at `WARM_LINK_GBIT` (bench_step's worker): its history."""
    cluster.set_link_gbit(WARM_LINK_GBIT)
    return run_job(cluster, bench_step.cluster_of(layout)[1], ["-m", "tools.bench_step", "--worker", *flags])


def warm_start(cluster, family: str, checkpoint: str, args, data) -> dict:
    """Train `family`'s starting checkpoint; its `warm_start` row."""
    started = time.monotonic()
    flags = bench_step.trainer_flags(
        WARM_LAYOUT, args.warm_steps, data, [*(args.model or []), *warm_flags(family, checkpoint)]
    )
    history = train_job(cluster, WARM_LAYOUT, flags)
    wall_s = time.monotonic() - started
    print(f"bench_balance: starting checkpoint {family}: {args.warm_steps} steps in {wall_s:.0f} s", file=sys.stderr)
    return {
        "case": f"warm_start_{family}",
        "layout": bench_step.layout_name(WARM_LAYOUT),
        "steps": args.warm_steps,
        "wall_s": round(wall_s, 1),
        "step_ms": round(statistics.median(h["step_ms"] for h in history), 1),
        "tokens_cv_last": history[-1].get("moe tokens cv"),
        "flags": flags,
    }


def run_quality(cluster, args, workdir: str) -> dict:
    """The demo's run with `aux`'s and `bias`'s flags (those the methods stand for), each seed: the `quality` row."""
    trained = [m for m in METHODS if m in {QUALITY_OF[x] for x in args.methods}]
    losses: dict[str, dict[int, dict]] = {}
    # The cluster's cost profile (the demo's pipeline degrees are auto), measured by the first run, loaded by the
    # others: the same degrees for every run, and the start-up measurement once.
    profile = ["--moe-cost-profile", os.path.join(workdir, "cost_profile_quality.json")]
    for seed in args.quality_seeds:  # seeds outside, methods inside: the machine's drift hits the methods alike
        for method in trained:
            run_dir = os.path.join(workdir, f"quality_{method}_{seed}")
            extra = ["--train-iters", str(args.quality_steps), "--seed", str(seed), *METHODS[method], *profile]
            history = train_job(cluster, WARM_LAYOUT, demo_flags(args.data_dir, run_dir, extra))
            losses.setdefault(method, {})[seed] = validation_losses(history)
            print(f"bench_balance: quality {method} seed {seed}: {losses[method][seed]}", file=sys.stderr)
    return quality(losses, args.methods, args.quality_steps)


def run_cases(cluster, args, data, checkpoints: dict[str, str]) -> dict[tuple[str, str], dict]:
    """Every case of `plan`, alternated; {(layout, method): its row}."""
    histories: dict[tuple[str, str], list] = {}
    for layout, method in plan(args.cluster, args.link_gbit, args.methods, args.rounds):
        extra = case_flags(method, checkpoints[START_OF[method]], args.warm_steps, args.steps)
        history = bench_step.run_case(cluster, layout, args.link_gbit, args.overlap, args, data, extra)
        histories.setdefault((layout, method), []).append(history)
        steps = ", ".join(f"{h['step_ms']:.0f}" for h in history)
        print(f"bench_balance: {layout}, {method}: step ms {steps}", file=sys.stderr)
    rows = {}
    for (layout, method), runs in histories.items():
        extra = case_flags(method, checkpoints[START_OF[method]], args.warm_steps, args.steps)
        flags = bench_step.trainer_flags(layout, args.steps, data, [*(args.model or []), *extra], args.overlap)
        rows[layout, method] = case_row(layout, args, method, runs, flags)
    return rows


def main(argv=None) -> int:
    started = time.monotonic()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.bias_update_rate is not None:  # the methods with the expert bias move it at this rate
        rate = ("--moe-router-bias-update-rate", str(args.bias_update_rate))
        METHODS.update({method: (*flags, *rate) for method, flags in METHODS.items() if BIAS_FLAGS[0] in flags})
    data = bench_step.prepare_data(args.data_dir)
    for method in args.methods:  # refused flags (e.g. --moe-shadow-experts on a tree without it) end the tool now
        flags = bench_step.trainer_flags(WARM_LAYOUT, 1, data, [*(args.model or []), *METHODS[method]], args.overlap)
        check_flags(method, flags)
    with tempfile.TemporaryDirectory(prefix="bench_balance_") as workdir, EmulatedCluster(2, WARM_LINK_GBIT) as cluster:
        args.profile_dir = workdir  # bench_step's cost profiles (an `auto` overlap setting), one per layout and rate
        checkpoints = {family: os.path.join(workdir, f"start_{family}") for family in starts(args.methods)}
        warm = [warm_start(cluster, family, path, args, data) for family, path in checkpoints.items()]
        rows = run_cases(cluster, args, data, checkpoints)
        for row in rows.values():
            print(json.dumps(row), flush=True)
        for layout in args.cluster:
            measured = {m: rows[layout, m] for m in args.methods if (layout, m) in rows}
            if "aux" in measured:
                print(json.dumps(balance(measured)), flush=True)
        for row in warm:
            print(json.dumps(row), flush=True)
        if args.quality_steps:
            print(json.dumps(run_quality(cluster, args, workdir)), flush=True)
    print(f"bench_balance: done in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
