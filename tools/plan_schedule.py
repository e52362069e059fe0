"""Print each MoE layer's pipeline degrees (FSMoE Algorithm 1) for a model and a cluster, without training.

    python -m tools.plan_schedule --profile fits.json --num-layers 4 --hidden-size 1024 --num-experts 8 \\
        --moe-ffn-hidden-size 4096 --moe-router-topk 2 --micro-batch-size 4 --seq-length 1024 \\
        --expert-model-parallel-size 2 --expert-tensor-parallel-size 2
    python -m tools.plan_schedule --alpha-a2a 0.175 --beta-a2a 3.06e-7 --alpha-ag 0.032 --beta-ag 1.68e-7 \\
        --alpha-rs 0.039 --beta-rs 1.67e-7 --alpha-ar 0.084 --beta-ar 5.99e-7 --alpha-gemm 0.092 \\
        --beta-gemm 4.42e-11 --num-experts 8 ...             # FSMoE's Testbed-B coefficients

The model takes the trainer's flags (pretrain_gpt_moe.py: any of them is accepted, those below are read):
--num-layers, --moe-layer-freq, --hidden-size, --moe-ffn-hidden-size (default --ffn-hidden-size, else 4 x
hidden), --num-experts, --moe-router-topk, --micro-batch-size, --seq-length, --tensor-model-parallel-size with
--sequence-parallel and --context-parallel-size (tokens per rank = micro-batch x seq / (TP under SP) / CP),
--expert-model-parallel-size, --expert-tensor-parallel-size, --moe-expert-capacity-factor,
--moe-pad-expert-input-to-capacity, --swiglu, --bf16 / --fp16 (2-byte rows, else 4).

The cluster: a profile saved by megatron_moe/overlap/profiler.py (`--profile`), or the ten --alpha-KIND /
--beta-KIND coefficients of a2a, ag, rs, ar and gemm (ms, and ms per byte or per multiply-add; gemm's alpha is one
chunk's fixed cost: FSMoE's per-GEMM alpha x 2 GEMMs per local expert), and optionally gemm_bwd (a chunk's input
gradients; default gemm's) and gemm_dw (the weight gradients; default gemm's); given with a profile, they override
its fits. The experts' weight gradients count in the layer's backward unless --overlap-wgrad defers them (greedy,
the default with EP > 1: Lancet's queue runs them under other all-to-alls). Output, JSON lines: first the fits used
(and `warnings`: the profile's EP / ESP sizes where they differ from the model's); then per MoE layer (numbered from
1) the solver's `forward` / `backward` degrees, `predicted_ms` and `case` per direction, `r1_ms` (the model at r =
1), `speedup_vs_r1`, `dw_in_backward`, and `fixed` (the best single degree for both directions from --fixed-degrees,
Tutel-style); with --data-parallel-size > 1, the gradient bytes each rank reduces are estimated from the flags
(`layer_grad_bytes`), FSMoE's adaptive gradient partition is planned on them, every layer's backward degree is
solved with its share of the all-reduce (`t_gar_ms`), and a last line gives the partition (`grad_reduce_schedule`,
bytes per MoE layer from step 1 and in all, the bytes left after backward, predicted ms against megatron-core's
reduction after backward).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence

from megatron_moe.config import GROUPS, ParallelDims, RunConfig, rules
from megatron_moe.config.fields import ConfigError, add_arguments, check_given_flags_apply, from_namespace, require
from megatron_moe.overlap.cost_model import (
    BACKWARD_KINDS,
    DIRECTIONS,
    FIT_KINDS,
    ClusterFits,
    LinearFit,
    predict,
    solve_degrees,
)
from megatron_moe.overlap.degrees import experts_defer_wgrad, layer_sizes, moe_layers, olp_dense_ms
from megatron_moe.overlap.grad_partition import GeneralizedLayer, GradPartition, partition, t_ar_ms
from tools.cli import HelpFormatter


def _parser(defaults: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], allow_abbrev=False, formatter_class=HelpFormatter
    )
    for name, group in GROUPS:  # --vocab-size is the plan's own (below): the trainer's is NullTokenizer's
        only = [f.name for f in dataclasses.fields(group) if f.name != "vocab_size"]
        add_arguments(parser, group, name, defaults=defaults, only=only)
    plan = parser.add_argument_group("plan", "the cluster and the solver")
    default = (lambda value: value) if defaults else (lambda value: argparse.SUPPRESS)
    plan.add_argument("--profile", default=default(None), help="a ClusterFits JSON saved by the profiler")
    for kind in (*FIT_KINDS, *BACKWARD_KINDS):
        unit = "multiply-add" if kind.startswith("gemm") else "byte"
        plan.add_argument(f"--alpha-{kind}", type=float, default=default(None), help=f"{kind} start-up, ms")
        plan.add_argument(f"--beta-{kind}", type=float, default=default(None), help=f"{kind} ms per {unit}")
    plan.add_argument(
        "--t-gar-ms", type=float, default=default(0.0), help="gradient all-reduce in each backward (no partition)"
    )
    plan.add_argument(
        "--data-parallel-size",
        type=int,
        default=default(1),
        help="DP of the dense layers (> 1: FSMoE's adaptive gradient partition is planned and each layer's "
        "backward degree solved with its share)",
    )
    plan.add_argument("--vocab-size", type=int, default=default(32000), help="the tokenizer's, for the embedding")
    plan.add_argument("--max-degree", type=int, default=default(8), help="largest pipeline degree the solver picks")
    plan.add_argument(
        "--fixed-degrees", type=int, nargs="+", default=default([1, 2, 4, 8]), help="Tutel-style single degrees"
    )
    return parser


def _fits(args: argparse.Namespace) -> tuple[ClusterFits, str]:
    """The profile's fits (if any) with the --alpha/--beta flags given on top of them."""
    fits, source = {}, "flags"
    cluster: dict = {}
    if args.profile is not None:
        try:
            loaded = ClusterFits.load(args.profile)
        except (OSError, ValueError, KeyError) as err:
            raise ConfigError(f"--profile={args.profile}: {err}; give a JSON the profiler saved") from err
        fits, cluster, source = dict(loaded.fits), dict(loaded.cluster), args.profile
    for kind in (*FIT_KINDS, *BACKWARD_KINDS):
        alpha, beta = getattr(args, f"alpha_{kind}"), getattr(args, f"beta_{kind}")
        if alpha is None and beta is None:
            wanted = kind in fits or kind in BACKWARD_KINDS
            require(wanted, f"--alpha-{kind}/--beta-{kind}", None, "give both, or a --profile with the fits")
            continue
        base = fits.get(kind)
        require(alpha is not None or base is not None, f"--alpha-{kind}", None, f"give it beside --beta-{kind}")
        require(beta is not None or base is not None, f"--beta-{kind}", None, f"give it beside --alpha-{kind}")
        alpha = base.alpha if alpha is None else alpha
        beta = base.beta if beta is None else beta
        for flag, value in ((f"--alpha-{kind}", alpha), (f"--beta-{kind}", beta)):
            require(math.isfinite(value) and value >= 0, flag, value, "a number >= 0, e.g. 0.1")
        fits[kind] = LinearFit(alpha=alpha, beta=beta)
        source = "flags" if args.profile is None else f"{args.profile} + flags"
    return ClusterFits(fits=fits, cluster=cluster), source


def _config(argv: Sequence[str]) -> tuple[RunConfig, argparse.Namespace]:
    args = _parser(True).parse_args(argv)
    cfg = RunConfig(**{name: from_namespace(group, args) for name, group in GROUPS})
    given = set(vars(_parser(False).parse_args(argv))) - {"vocab_size"}  # the plan's own flag
    check_given_flags_apply(cfg, GROUPS, given)
    require(cfg.moe.num_experts is not None, "--num-experts", None, "give the experts per MoE layer, e.g. 8")
    rules.check_model(cfg.model)
    rules.check_moe(cfg.moe, cfg.model)
    require(args.max_degree >= 1, "--max-degree", args.max_degree, "an integer >= 1, e.g. 8")
    require(args.t_gar_ms >= 0, "--t-gar-ms", args.t_gar_ms, "must be >= 0 (0: no gradient all-reduce)")
    require(args.data_parallel_size >= 1, "--data-parallel-size", args.data_parallel_size, "an integer >= 1, e.g. 2")
    require(args.vocab_size >= 1, "--vocab-size", args.vocab_size, "an integer >= 1, e.g. 32000")
    bad = [r for r in args.fixed_degrees if r < 1]
    require(not bad, "--fixed-degrees", args.fixed_degrees, "integers >= 1, e.g. 1 2 4 8")
    return cfg, args


def layer_grad_bytes(cfg: RunConfig, args: argparse.Namespace) -> tuple[dict[int, float], float, float]:
    """Estimated gradient bytes one rank reduces across data-parallel ranks: per transformer layer (attention's
    QKV and projection, norms, and the MoE layer's router and local experts or the dense MLP; biases left out),
    the output layer and final norm (before every layer), the embedding (after all). fp32 gradients (bf16 / fp16
    runs reduce in fp32). Dense weights count when DP > 1, expert weights when the expert-DP group
    (DP x TP x CP / (EP x ESP)) has > 1 rank."""
    model, par = cfg.model, cfg.parallel
    dims = ParallelDims.from_config(par, data_parallel_size=args.data_parallel_size)
    h, t, dp = model.hidden_size, dims.tp, dims.dp
    layer = cfg.moe.layer_config(model)
    ep, esp, expert_dp = dims.ep, dims.esp, dims.expert_dp
    dense, expert = (4.0 if dp > 1 else 0.0), (4.0 if expert_dp > 1 else 0.0)
    mats = 3 if layer.expert_type == "swiglu" else 2
    ffn = model.ffn_width
    per_layer = {}
    for number, is_moe in enumerate(cfg.moe.layer_pattern(model.num_layers), start=1):
        attention = 4 * h * h / t + 4 * h
        if is_moe:
            mlp = (
                dense * layer.num_experts * h
                + expert * (layer.num_experts / ep) * mats * h * layer.ffn_hidden_size / esp
            )
        else:
            mlp = dense * mats * h * ffn / t
        per_layer[number] = dense * attention + mlp
    embedding = args.vocab_size * h / t
    head = dense * (2 * h + (embedding if model.untie_embeddings_and_output_weights else 0))
    return per_layer, head, dense * embedding


def grad_partition_plan(cfg: RunConfig, args: argparse.Namespace, fits: ClusterFits) -> GradPartition | None:
    """FSMoE's adaptive gradient partition for the estimated bytes (None with DP = 1: nothing crosses ranks)."""
    per_layer, head, embedding = layer_grad_bytes(cfg, args)
    if args.data_parallel_size <= 1 or sum(per_layer.values()) + head + embedding <= 0:
        return None
    sizes, layers, above, dense = layer_sizes(cfg), [], cfg.model.num_layers, olp_dense_ms(cfg, fits)
    for layer in sorted(moe_layers(cfg), reverse=True):
        made = sum(n for number, n in per_layer.items() if layer < number <= above) + (head if not layers else 0)
        layers.append(GeneralizedLayer(layer=layer, sizes=sizes, grad_bytes=made, t_olp_dense_ms=dense[layer]))
        above = layer
    tail = sum(n for number, n in per_layer.items() if number <= above) + embedding
    return partition(fits, layers, tail, dw_in_backward=not experts_defer_wgrad(cfg), max_degree=args.max_degree)


def plan_rows(
    cfg: RunConfig, args: argparse.Namespace, fits: ClusterFits, grads: GradPartition | None = None
) -> list[dict]:
    """One row per MoE layer: the solver's degrees, its predictions, r = 1 and the best fixed degree; with the
    gradient partition `grads`, each layer's backward carries its share (t_gar) instead of --t-gar-ms."""
    rows = []
    for layer in moe_layers(cfg):
        t_gar = args.t_gar_ms if grads is None else t_ar_ms(fits, grads.assigned.get(layer, 0.0))
        rows.append({"layer": layer, **_plan_row(cfg, args, fits, t_gar)})
    return rows


def _plan_row(cfg: RunConfig, args: argparse.Namespace, fits: ClusterFits, t_gar_ms: float) -> dict:
    sizes = layer_sizes(cfg)
    kw = {"t_gar_ms": t_gar_ms, "dw_in_backward": not experts_defer_wgrad(cfg)}
    schedule = solve_degrees(fits, sizes, max_degree=args.max_degree, **kw)
    r1 = predict(fits, sizes, 1, 1, **kw)
    fixed = min(
        (predict(fits, sizes, r, r, **kw) for r in args.fixed_degrees),
        key=lambda s: (sum(s.predicted_ms.values()), s.forward),
    )
    return {
        "forward": schedule.forward,
        "backward": schedule.backward,
        "predicted_ms": schedule.predicted_ms,
        "case": schedule.case,
        "r1_ms": r1.predicted_ms,
        "speedup_vs_r1": {d: r1.predicted_ms[d] / schedule.predicted_ms[d] for d in DIRECTIONS},
        "fixed": {"degree": fixed.forward, "predicted_ms": fixed.predicted_ms},
        "sizes": dataclasses.asdict(sizes),
        "t_gar_ms": t_gar_ms,
        "dw_in_backward": kw["dw_in_backward"],
    }


def _mismatches(cfg: RunConfig, fits: ClusterFits) -> list[str]:
    """Where the profile's groups differ from the model's: its lines were measured on other traffic."""
    dims = ParallelDims.from_config(cfg.parallel)
    model = {"ep": dims.ep, "esp": dims.esp}
    return [
        f"the profile was measured at {name.upper()}={fits.cluster[name]}, the model runs {name.upper()}={size}"
        for name, size in model.items()
        if name in fits.cluster and fits.cluster[name] not in (size, 0)
    ]


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        cfg, args = _config(argv)
        fits, source = _fits(args)
        grads = grad_partition_plan(cfg, args, fits)
        rows = plan_rows(cfg, args, fits, grads)
    except ConfigError as err:
        print(f"plan_schedule: {err}", file=sys.stderr)
        return 2
    summary = {kind: {"alpha": f.alpha, "beta": f.beta, "r2": f.r2} for kind, f in fits.fits.items()}
    header = {"fits": summary, "source": source, "cluster": fits.cluster, "warnings": _mismatches(cfg, fits)}
    print(json.dumps(header), flush=True)
    for row in rows:
        print(json.dumps(row), flush=True)
    if grads is not None:
        print(json.dumps({"grad_reduce_schedule": "adaptive", **grads.to_json()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
