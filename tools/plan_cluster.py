"""Find the layout a model trains fastest with on a cluster, predicted without running it, and the flags for it.

    python -m tools.plan_cluster --model-script examples/pretrain_mixtral_8x7b.sh --nodes 8 --gpus-per-node 8 \\
        --gpu h100
    python -m tools.plan_cluster --nodes 2 --gpus-per-node 8 --gpu h200 --inter-node-gbit 200 \\
        --num-layers 16 --hidden-size 2048 --num-attention-heads 16 --num-experts 8 --moe-router-topk 2 \\
        --moe-ffn-hidden-size 4096 --seq-length 2048 --global-batch-size 128 --bf16 --swiglu
    python -m tools.plan_cluster --nodes 2 --gpus-per-node 2 --gpu cpu --gemm-tflops 0.05 --inter-node-gbit 1 \\
        --model-script examples/pretrain_gpt_moe_tiny_cpu.sh --given-only      # an emulated cluster

The model: an example script's flags (`--model-script`: run with DRY_RUN=1 for this cluster's shape, its printed
command read) and/or the trainer's own flags after the planner's (they override the script's, as extra arguments
to an example do), parsed by the trainer's parser. The global batch and the sequence length are the model's.

The cluster: `--gpu` (a preset from data sheets: h100, h200, a100, b200; cpu for an emulated cluster's
processes, with `--gemm-tflops`), `--nodes`, `--gpus-per-node`, the links (`--intra-node-gbit`,
`--inter-node-gbit`, per GPU per direction; default the preset's; `--intra-node-alpha-ms`,
`--inter-node-alpha-ms`: the start-up of one message), or `--profile FILE` (tools/profile_cluster.py's fits,
measured on the real cluster, used for the collectives and the GEMM rate).

Output: the best `--top` layouts (step time, tokens/s/GPU, model TFLOP/s/GPU, memory per GPU, the exposed time of
the bubble and of each kind of communication, ms per step), the layout of the script's own flags beside them,
the flags for the best one, and where its step time goes (`explain`). `--json`: the same as one JSON document.
What the model assumes: megatron_moe/planning/ and docs/planning.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from megatron_moe.config import ConfigError, RunConfig, parse_args, rules
from megatron_moe.config.fields import require
from megatron_moe.planning.hardware import (
    GIB,
    GPUS,
    INTER_ALPHA_MS,
    INTRA_ALPHA_MS,
    Cluster,
    Measured,
    build_cluster,
    compute_for,
)
from megatron_moe.planning.model import POLICIES, Layout, Shape
from tools.cli import HelpFormatter

if TYPE_CHECKING:
    from megatron_moe.planning.step import Prediction

# The predictor (planning.search/.step, overlap.cost_model, training.flops) is imported where it is used: the
# packages around it load torch and megatron-core, seconds that `--help` and a flag error need not wait for.

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLACEMENT_FLAGS = ("--expert-placement", "--moe-a2a-algorithm")
"""The flags the planner prints for layouts with EP > 1 (docs/placement.md; docs/overlap.md, 2DH)."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
        usage="%(prog)s [planner flags] [trainer flags]",
        formatter_class=HelpFormatter,
    )
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--nodes", type=int, required=True)
    cluster.add_argument("--gpus-per-node", type=int, required=True)
    cluster.add_argument("--gpu", choices=tuple(GPUS), default="h100", help="a data-sheet preset (default h100)")
    cluster.add_argument("--gpu-memory-gib", type=float, help="the GPU's memory (default the preset's)")
    cluster.add_argument(
        "--gemm-tflops",
        help="the rate of large GEMMs in the run's dtype (default 0.805 x the preset's peak); with --gpu cpu, "
        "'measure': a one-thread matmul here, shared as the cluster's processes share this host's cores",
    )
    cluster.add_argument(
        "--compute-overhead",
        type=float,
        default=1.25,
        help="a layer's time over its GEMMs' (norms, routing, permutes; 1.25 measured on an H200)",
    )
    cluster.add_argument(
        "--host-cores",
        type=int,
        default=0,
        help="with --gpu cpu: the cores the emulated cluster's processes share (a stage waiting in the pipeline's "
        "bubble lends them to the busy one); 0: this host's with --gemm-tflops measure, else none shared",
    )
    cluster.add_argument("--intra-node-gbit", type=float, help="NVLink per GPU per direction (default the preset's)")
    cluster.add_argument("--inter-node-gbit", type=float, help="the NIC per GPU per direction (default the preset's)")
    cluster.add_argument("--intra-node-alpha-ms", type=float, default=INTRA_ALPHA_MS, help="one message's start-up")
    cluster.add_argument("--inter-node-alpha-ms", type=float, default=INTER_ALPHA_MS, help="one message's start-up")
    cluster.add_argument("--profile", help="fits from tools/profile_cluster.py, for the collectives and GEMM rate")
    plan = parser.add_argument_group("plan")
    plan.add_argument("--model-script", help="an example script whose flags give the model (run with DRY_RUN=1)")
    plan.add_argument("--vocab-size", type=int, default=32000, help="the tokenizer's (before padding)")
    plan.add_argument(
        "--flash-attention",
        choices=("auto", "yes", "no"),
        default="auto",
        help="attention keeps no s x s probabilities (auto: yes on a GPU preset or with --use-flash-attn)",
    )
    plan.add_argument("--memory-fraction", type=float, default=0.9, help="of the GPU's memory a layout may use")
    plan.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES), help="activation policies")
    plan.add_argument("--top", type=int, default=5, help="layouts printed")
    plan.add_argument("--given-only", action="store_true", help="predict only the layout of the model's flags")
    plan.add_argument("--json", action="store_true", help="one JSON document instead of the table")
    return parser


SCRIPT_VARIABLES = {
    "TP": "--tensor-model-parallel-size",
    "PP": "--pipeline-model-parallel-size",
    "EP": "--expert-model-parallel-size",
}
"""Environment variables the examples read their degrees from (examples/pretrain_mixtral_8x7b.sh: TP, PP, EP;
it adds --sequence-parallel itself where TP > 1)."""


def script_variables(path: str | None) -> list[str]:
    """The `SCRIPT_VARIABLES` the script reads (`${TP:-...}`)."""
    if path is None:
        return []
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return [name for name in SCRIPT_VARIABLES if f"${{{name}:-" in text]


def script_flags(path: str, nodes: int, gpus_per_node: int, variables: dict[str, str] | None = None) -> list[str]:
    """The trainer flags an example script passes (its DRY_RUN=1 command line, printed before its own check), with
    the environment `variables` set."""
    require(os.path.isfile(path), "--model-script", path, "an example script, e.g. examples/pretrain_mixtral_8x7b.sh")
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "DRY_RUN": "1",
        "DATA_PATH": os.environ.get("DATA_PATH", "/data/corpus_text_document"),
        "TOKENIZER_MODEL": os.environ.get("TOKENIZER_MODEL", "/data/tokenizer.model"),
        "MASTER_ADDR": "node0",
        "NNODES": str(nodes),
        "GPUS_PER_NODE": str(gpus_per_node),
        **(variables or {}),
    }
    proc = subprocess.run(["bash", path], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = proc.stdout.splitlines()
    words = shlex.split(lines[0]) if lines else []
    trainer = [i for i, word in enumerate(words) if word.endswith("pretrain_gpt_moe.py")]
    require(bool(trainer), "--model-script", path, f"a script that prints its command under DRY_RUN=1 ({proc.stderr})")
    return words[trainer[0] + 1 :]


def load_model(args: argparse.Namespace, trainer_argv: list[str]) -> RunConfig:
    flags = script_flags(args.model_script, args.nodes, args.gpus_per_node) if args.model_script else []
    cfg = parse_args([*flags, *trainer_argv])
    rules.check_model(cfg.model)
    rules.check_moe(cfg.moe, cfg.model)
    return cfg


def cluster_and_compute(args: argparse.Namespace, dtype: str):
    from megatron_moe.overlap.cost_model import ClusterFits

    measured = None
    if args.profile is not None:
        try:
            measured = Measured.from_fits(ClusterFits.load(args.profile))
        except (OSError, ValueError, KeyError) as err:
            raise ConfigError(f"--profile={args.profile}: {err}; give a JSON tools/profile_cluster.py saved") from err
    cluster = build_cluster(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        gpu=args.gpu,
        memory_gib=args.gpu_memory_gib,
        intra_node_gbit=args.intra_node_gbit,
        inter_node_gbit=args.inter_node_gbit,
        intra_alpha_ms=args.intra_node_alpha_ms,
        inter_alpha_ms=args.inter_node_alpha_ms,
    )
    rate = gemm_tflops(args, dtype)
    if rate is None and measured is not None:
        rate = measured.gemm_tflops
    cores = args.host_cores or (os.cpu_count() or 1 if args.gemm_tflops == "measure" else 0)
    compute = compute_for(cluster.gpu, dtype, rate, args.compute_overhead, cores)
    if measured is not None:
        cluster = dataclasses.replace(cluster, measured=measured)
        compute = dataclasses.replace(compute, flat=True)
    return cluster, compute


def gemm_tflops(args: argparse.Namespace, dtype: str) -> float | None:
    """--gemm-tflops as a rate (None: not given); 'measure' on --gpu cpu (`measure_cpu_tflops`)."""
    if args.gemm_tflops is None:
        return None
    if args.gemm_tflops == "measure":
        require(args.gpu == "cpu", "--gemm-tflops", "measure", "a rate in TFLOP/s for a GPU preset (measure: cpu)")
        return measure_cpu_tflops(dtype, args.nodes * args.gpus_per_node)
    try:
        return float(args.gemm_tflops)
    except ValueError:
        raise ConfigError(f"--gemm-tflops={args.gemm_tflops}: a rate in TFLOP/s, e.g. 700, or measure") from None


def measure_cpu_tflops(dtype: str, processes: int, size: int = 1024, repeats: int = 5) -> float:
    """One thread's rate of a [size x size] x [size x size] matmul in `dtype` here (torchrun gives each process one
    thread), times min(1, cores / processes): the emulated cluster's processes share this host's cores."""
    import time

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        kind = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
        a, b = torch.randn(size, size, dtype=kind), torch.randn(size, size, dtype=kind)
        a @ b
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        seconds = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    return 2 * size**3 * repeats / seconds / 1e12 * min(1.0, (os.cpu_count() or 1) / processes)


def profile_warnings(cluster: Cluster, best: list[Prediction]) -> list[str]:
    """Where the profile's groups differ from the best layout's: its lines were measured on other traffic."""
    if cluster.measured is None or not best:
        return []
    lay = best[0].layout
    sizes = {"ep": lay.ep, "esp": lay.esp, "dp": lay.dp}
    return [
        f"the profile was measured at {name.upper()}={size}, #1 runs {name.upper()}={sizes[name]}"
        for name, size in cluster.measured.groups
        if size not in (sizes[name], 0)
    ]


def given_layout(cfg: RunConfig, world: int) -> tuple[Layout | None, str | None]:
    """The layout the model's own flags ask for on `world` ranks, or None and why not."""
    p = cfg.parallel
    if p.context_parallel_size != 1:
        return None, "the planner models CP = 1"
    if p.pipeline_model_parallel_layout is not None:
        return None, "the planner models even pipeline stages, not --pipeline-model-parallel-layout"
    model = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    if world % model:
        return None, f"TP x PP = {model} does not divide {world} GPUs"
    a, moe = cfg.activations, cfg.moe
    policy = "full" if a.full_recompute else "arctic" if a.activation_policy == "arctic" else "none"
    degrees = (moe.moe_pipeline_degree, moe.moe_bp_pipeline_degree)
    fixed = moe.own_layer and all(type(r) is int for r in degrees)
    adaptive = p.grad_reduce_schedule == "adaptive" and moe.own_layer and p.expert_model_parallel_size > 1
    lay = Layout(
        tp=p.tensor_model_parallel_size,
        pp=p.pipeline_model_parallel_size,
        vpp=p.virtual_pipeline_size(cfg.model.num_layers) or 1,
        ep=p.expert_model_parallel_size,
        esp=p.expert_tensor_parallel,
        dp=world // model,
        micro_batch=cfg.training.micro_batch_size,
        placement=p.expert_placement,  # auto: resolved by `resolve_auto`
        a2a=moe.moe_a2a_algorithm,
        activations=policy,
        degrees=tuple(int(r) for r in degrees) if fixed else None,
        overlap_dp=p.overlap_grad_reduce or adaptive,
        distributed_optimizer=p.use_distributed_optimizer,
    )
    return lay, None


def resolve_auto(given: Layout, predict, gpus_per_node: int) -> Layout:
    """The model's own layout with --expert-placement / --moe-a2a-algorithm auto taken as the faster of the
    choices they leave open, by the planner's prediction (`predict`: layout -> Prediction). The runtime's auto
    rules are simpler (placement: bytes across nodes; 2DH: messages and bytes), so this is what auto could reach."""
    from megatron_moe.planning.search import variants

    if "auto" not in (given.placement, given.a2a):
        return given
    options = [
        v
        for v in variants(given, gpus_per_node, [given.activations])
        if given.placement in ("auto", v.placement) and given.a2a in ("auto", v.a2a)
    ]
    return min(options, key=lambda v: predict(v).step_ms)


def layout_flags(cfg: RunConfig, pred: Prediction, variables: Sequence[str] = ()) -> tuple[dict, list[str], list[str]]:
    """(environment variables for the script, flags to append, notes on the model's flags to remove) that give
    `pred`'s layout; `variables`: the `SCRIPT_VARIABLES` the script reads (their flags are set through them)."""
    lay = pred.layout
    flags = [
        *("--tensor-model-parallel-size", str(lay.tp), "--pipeline-model-parallel-size", str(lay.pp)),
        *(("--num-virtual-stages-per-pipeline-rank", str(lay.vpp)) if lay.vpp > 1 else ()),
        *("--expert-model-parallel-size", str(lay.ep), "--expert-tensor-parallel-size", str(lay.esp)),
        *(("--sequence-parallel",) if lay.tp > 1 and "TP" not in variables else ()),
        *("--micro-batch-size", str(lay.micro_batch)),
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
    ]
    env = {}
    for name in variables:
        at = flags.index(SCRIPT_VARIABLES[name])
        env[name] = flags[at + 1]
        del flags[at : at + 2]
    if lay.ep > 1:
        flags += [PLACEMENT_FLAGS[0], lay.placement, PLACEMENT_FLAGS[1], lay.a2a]
        if cfg.moe.own_layer and pred.moe is not None:
            forward, backward = pred.moe.degrees
            flags += ["--moe-pipeline-degree", str(forward), "--moe-bp-pipeline-degree", str(backward)]
    notes = []
    if lay.activations == "full":
        flags += ["--recompute-granularity", "full"]
    elif lay.activations == "arctic":
        flags += ["--activation-policy", "arctic"]
    if lay.activations != "full" and cfg.activations.full_recompute:
        notes.append("remove --recompute-granularity full / --activation-policy full from the script")
    p = cfg.parallel
    if lay.tp == 1 and p.sequence_parallel and "TP" not in variables:
        notes.append("remove --sequence-parallel (TP = 1)")
    if lay.vpp == 1 and (p.num_layers_per_virtual_pipeline_stage or p.num_virtual_stages_per_pipeline_rank):
        notes.append("remove the script's virtual-pipeline flag")
    if p.pipeline_model_parallel_layout is not None:
        notes.append("remove --pipeline-model-parallel-layout (the planned layout splits the layers evenly)")
    return env, flags, notes


def row(pred: Prediction) -> dict:
    lay = pred.layout
    return {
        **dataclasses.asdict(lay),
        "expert_dp": lay.expert_dp,
        "microbatches": pred.microbatches,
        "step_ms": pred.step_ms,
        "tokens_per_s_per_gpu": pred.tokens_per_s_per_gpu,
        "tflops_per_gpu": pred.tflops_per_gpu,
        "memory_gib": pred.memory["total"] / GIB,
        "memory": {k: (v / GIB if k != "stage" else int(v)) for k, v in pred.memory.items()},
        "breakdown_ms": pred.breakdown,
        "per_microbatch_ms": pred.per_microbatch,
        "moe_degrees": list(pred.moe.degrees) if pred.moe else None,
    }


HEADER = (
    f"{'':>6} {'TP':>2} {'PP':>2} {'VPP':>3} {'EP':>2} {'ESP':>3} {'DP':>3} {'mbs':>3} {'place':<5} {'a2a':<6} "
    f"{'act':<6} {'step s':>8} {'tok/s/GPU':>9} {'TFLOP/s':>7} {'mem GiB':>7} | {'bubble':>7} {'ep':>6} {'tp':>6} "
    f"{'pp':>6} {'dp':>6}"
)
LEGEND = "TFLOP/s: model FLOPs per GPU; mem: the fullest GPU; after |: ms of the step in the bubble and exposed comm"


def _number(value: float, width: int) -> str:
    """A figure in `width` characters, with decimals where it is small (a CPU cluster's TFLOP/s)."""
    return f"{value:>{width}.1f}" if abs(value) >= 10 or value == 0 else f"{value:>{width}.3g}"


def distinct(ranked: list[Prediction], top: int) -> list[Prediction]:
    """The `top` fastest layouts that differ in more than the placement and the all-to-all algorithm (the table
    shows the best of those for each)."""
    seen, out = set(), []
    for pred in ranked:
        key = dataclasses.replace(pred.layout, placement="", a2a="")
        if key not in seen:
            seen.add(key)
            out.append(pred)
        if len(out) == top:
            break
    return out


def table_line(name: str, pred: Prediction) -> str:
    lay, b = pred.layout, pred.breakdown
    return (
        f"{name:>6} {lay.tp:>2} {lay.pp:>2} {lay.vpp:>3} {lay.ep:>2} {lay.esp:>3} {lay.dp:>3} {lay.micro_batch:>3} "
        f"{lay.placement:<5} {lay.a2a:<6} {lay.activations:<6} {pred.step_ms / 1e3:>8.3f} "
        f"{_number(pred.tokens_per_s_per_gpu, 9)} {_number(pred.tflops_per_gpu, 7)} "
        f"{_number(pred.memory['total'] / GIB, 7)} | "
        + " ".join(_number(b[kind], 7 if kind == "bubble" else 6) for kind in ("bubble", "ep", "tp", "pp", "dp"))
    )


def explain(pred: Prediction, compute_tflops: float) -> dict[str, str]:
    """Each term of the step with how it was made (`megatron_moe.planning.model`'s formula)."""
    lay, b, per, m = pred.layout, pred.breakdown, pred.per_microbatch, pred.microbatches
    t = sum(per.values())
    speedup = (lay.pp - 1) / lay.vpp * t / b["bubble"] if b["bubble"] > 0 else 1.0
    moe = pred.moe
    ep = (
        f"{m} micro-batches x {per['ep']:.2f} ms: per MoE layer {moe.exposed_forward_ms:.3f} forward + "
        f"{moe.exposed_backward_ms:.3f} backward beyond its experts' {moe.experts_forward_ms:.3f} + "
        f"{moe.experts_backward_ms:.3f} ms (pipeline degrees {moe.degrees[0]}/{moe.degrees[1]})"
        if moe
        else "no MoE layer"
    )
    return {
        "step": f"{pred.step_ms:.1f} ms = m t + (PP - 1) / VPP x t + dp + optimizer, m = {m}, t = {t:.2f} ms "
        "(the slowest stage's compute + ep + tp + pp per micro-batch)",
        "compute": f"{b['compute']:.1f} ms = {m} x {per['compute']:.2f} ms (GEMMs at up to {compute_tflops:.4g} "
        "TFLOP/s by size, x the overhead; backward 2x forward"
        + (", a second forward for full recompute)" if lay.activations == "full" else ")"),
        "bubble": f"{b['bubble']:.1f} ms = ({lay.pp} - 1) / {lay.vpp} x {t:.2f}"
        + (f" / {speedup:.3g} (the busy stage on the waiting ones' cores)" if abs(speedup - 1.0) > 1e-9 else ""),
        "ep": f"{b['ep']:.1f} ms = {ep}",
        "tp": f"{b['tp']:.1f} ms = {m} x {per['tp']:.2f} ms (SP all-gather + reduce-scatter, not overlapped)",
        "pp": f"{b['pp']:.1f} ms = {m} x {per['pp']:.2f} ms (a send each way per model chunk)",
        "dp": f"{b['dp']:.1f} ms (gradient reduce-scatter and weight all-gather beyond the backward and forward "
        "of one micro-batch they run under)",
        "optimizer": f"{b['optimizer']:.1f} ms (Adam over the local shard at the memory bandwidth)",
    }


def _check(args: argparse.Namespace) -> None:
    for flag, ok, choice in (
        ("--top", args.top >= 1, "an integer >= 1, e.g. 5"),
        ("--memory-fraction", 0 < args.memory_fraction <= 1, "a fraction in (0, 1], e.g. 0.9"),
        ("--vocab-size", args.vocab_size >= 1, "an integer >= 1, e.g. 32000"),
    ):
        require(ok, flag, getattr(args, flag[2:].replace("-", "_")), choice)


def plan(args: argparse.Namespace, trainer_argv: list[str]) -> tuple[dict, list[Prediction], Prediction | None]:
    """(the JSON document, the best layouts, the model's own layout's prediction or None)."""
    from megatron_moe.planning.search import check_layout, search
    from megatron_moe.planning.step import predict_step
    from megatron_moe.training.flops import flops_per_token

    _check(args)
    cfg = load_model(args, trainer_argv)
    flash = {"yes": True, "no": False}.get(args.flash_attention, args.gpu != "cpu" or cfg.model.use_flash_attn)
    shape = Shape.from_config(cfg, args.vocab_size, flash)
    cluster, compute = cluster_and_compute(args, shape.dtype)
    fpt = flops_per_token(cfg, shape.padded_vocab(1))
    given, why_not = given_layout(cfg, cluster.world)
    if given is not None:
        given = resolve_auto(given, lambda v: predict_step(shape, v, cluster, compute, fpt), cluster.gpus_per_node)
        why_not = check_layout(cfg, shape, given)
    given_pred = predict_step(shape, given, cluster, compute, fpt) if why_not is None else None
    require(not args.given_only or given_pred is not None, "--given-only", True, f"a valid layout ({why_not})")
    result = None
    if not args.given_only:
        result = search(cfg, shape, cluster, compute, fpt, memory_fraction=args.memory_fraction, policies=args.policies)
    limit = cluster.gpu.memory_gib * args.memory_fraction
    best = distinct(result.ranked, args.top) if result else []
    env, flags, notes = layout_flags(cfg, best[0], script_variables(args.model_script)) if best else ({}, [], [])
    command = [*(f"{name}={value}" for name, value in env.items()), *([args.model_script] if args.model_script else [])]
    shown = best[0] if best else given_pred
    document = {
        "cluster": cluster.describe(),
        "gemm_tflops": compute.large_gemm_tflops,
        "model": {"flops_per_token": fpt, "global_batch": shape.global_batch, "seq_length": shape.seq},
        "memory_limit_gib": limit,
        "given_only": args.given_only,
        "searched": result.searched if result else 0,
        "too_big": result.too_big if result else 0,
        "layouts": [row(p) for p in best],
        "given": row(given_pred) if given_pred else None,
        "given_fits": given_pred is not None and given_pred.memory["total"] <= limit * GIB,
        "given_not_valid": why_not,
        "best_env": env,
        "best_flags": flags,
        "best_command": " ".join([*command, *flags]),
        "notes": notes,
        "warnings": profile_warnings(cluster, best),
        "explain": explain(shown, compute.large_gemm_tflops) if shown else {},
    }
    return document, best, given_pred


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args, trainer_argv = _parser().parse_known_args(argv)
        document, best, given = plan(args, trainer_argv)
    except ConfigError as err:
        print(f"plan_cluster: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(document, indent=1))
    else:
        _print(document, best, given)
    return 0


def _print(document: dict, best: list[Prediction], given: Prediction | None) -> None:
    limit = document["memory_limit_gib"]
    print(f"cluster: {document['cluster']}; large GEMMs at {document['gemm_tflops']:.4g} TFLOP/s")
    model = document["model"]
    searched = (
        f"{document['searched']} valid layouts, {document['too_big']} over {limit:.1f} GiB"
        if not document["given_only"]
        else "not searched (--given-only)"
    )
    print(
        f"model: {model['flops_per_token'] / 1e9:.3g} GFLOP per token, global batch {model['global_batch']} x "
        f"{model['seq_length']} tokens; {searched}"
    )
    print(LEGEND)
    print(HEADER)
    for i, pred in enumerate(best, start=1):
        print(table_line(f"#{i}", pred))
    if given is not None:
        fits = "" if document["given_fits"] else f"  (over {limit:.1f} GiB)"
        print(table_line("flags", given) + fits)
    elif document["given_not_valid"]:
        print(f"the model's own layout: not predicted ({document['given_not_valid']})")
    if not best:
        if document["searched"]:
            print("no layout fits in memory: more GPUs, a larger --memory-fraction, or a smaller model")
        return
    if document["best_env"] or document["best_command"] != " ".join(document["best_flags"]):
        print("\nto run #1 (the script's flags with these after them, which override its own):")
        print("  " + document["best_command"])
    else:
        print("\nflags for #1 (append to the launch script; they override its own):")
        print("  " + " ".join(document["best_flags"]))
    for note in document["notes"]:
        print(f"  and {note}")
    for warning in document["warnings"]:
        print(f"warning: {warning}")
    print("\nwhere #1's step goes:")
    for name, text in document["explain"].items():
        print(f"  {name:<9} {text}")


if __name__ == "__main__":
    sys.exit(main())
