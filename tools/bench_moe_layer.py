"""Benchmark one MoE layer, forward + backward: ours vs megatron-core 0.16.1's MoELayer vs the GEMM floor.

    python -m tools.bench_moe_layer                      # every case, one JSON object per line
    python -m tools.bench_moe_layer --cases small --repeats 10
    python -m tools.bench_moe_layer --cluster 2x1 --link-gbit 1   # EP=2 across 2 emulated nodes (see below)

On CPU the cases run in fp32 (cases small and gpt2s); on a GPU in bf16, with
a Mixtral-sized case `large` added (`--dtype`, `--cases` override both). The
router and the gate GEMMs stay fp32 either way.

Per case, all measured in this process, interleaved round by round (ours,
megatron-core, the floor's GEMMs) so background load hits them alike; each figure
is the median over `--repeats` rounds after warm-up. Warm-up lasts at least
`--warmup` rounds and goes on (up to `--max-warmup`) until a round in which
no contender page-faulted: on CPU the heap grows for the first few steps
until every contender's buffers find reused blocks (see
`megatron_moe.platform.host_memory`), and a first touch of fresh pages costs
more than the arithmetic on them. `page_faults_timed` reports what faulted
anyway during the timed rounds.

- `layer_ms`: our MoELayer (default stages: sparse ordering, alltoallv dispatcher);
- `mcore_ms`: megatron-core's MoELayer, alltoall dispatcher, its own experts
  (SequentialMLP: grouped_gemm is a GPU package), same router and expert weights;
- `ideal_ms`: the gate GEMM plus the expert GEMMs of exactly the rows our
  experts processed (no padding), forward and backward (dX and dW), as plain
  dense `torch.mm` on one [rows, H] matrix: the issue's floor;
- `efficiency` = ideal_ms / layer_ms and `speedup_vs_mcore` = mcore_ms / layer_ms;
- `ideal_fastest_ms` and `efficiency_vs_fastest`: the same floor with each of
  its GEMMs, round by round, at the faster of `torch.mm` and oneDNN's matmul
  (CPU). torch.mm is MKL, which on the CI machine's AMD cores runs 15-40%
  slower than oneDNN; our experts run oneDNN there (see
  `megatron_moe.moe.grouped_gemm`), so `efficiency` can pass 1 and this is
  the stricter figure.

`--cluster 2x1` (EP=2) or `2x2` (EP=4), with `--link-gbit R`: the layer at EP = every rank of an emulated
2-node cluster whose links run at R Gbit/s (tools/emulated_cluster.py; needs root), ours and megatron-core's,
with the time each exposed per communication kind and the bytes it sent (tools/bench_moe_layer_ep.py; default
case `small`, its tokens per rank).

`peak_mem_bytes` (and `mcore_peak_mem_bytes`): most bytes in use above the
level before one extra fwd+bwd, read from glibc's allocator after every torch
op (CPU), or the accelerator's peak-allocated counter.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys

from tools.benchcluster import parse_cluster
from tools.cli import HelpFormatter

THREADS = os.environ.setdefault("OMP_NUM_THREADS", "2")  # before torch is imported

CASES = {
    # name: (hidden, ffn, tokens, [(experts, topk), ...])
    "gpt2s": (768, 3072, 8192, [(8, 1), (8, 2), (16, 1), (16, 2)]),
    "small": (256, 1024, 2048, [(8, 2)]),
    # GPU only (by default): a Mixtral-like layer, 16k tokens.
    "large": (4096, 14336, 16384, [(8, 2)]),
    # Fine-grained experts (Qwen3-MoE-like widths): many small expert GEMMs, 8 or 4 per token.
    "fine": (512, 352, 4096, [(64, 8), (32, 4)]),
    # DeepSeek-V3's ratios at a CPU size: hidden / moe FFN = 7168 / 2048 = 3.5 (448 / 128), 256 experts top-8,
    # one shared expert as wide as a routed one, ~128 rows per expert at 4096 tokens as in `fine`. Its router
    # and experts: `CASE_OPTIONS`.
    "dsv3": (448, 128, 4096, [(256, 8)]),
}
CASE_OPTIONS = {
    # DeepSeek-V3: SwiGLU experts, sigmoid scores with the aux-loss-free expert bias, group-limited routing
    # (8 groups, a token's experts within its best 4), combine weights x 2.5, a shared expert of the routed width.
    # No balancing loss: its seq_aux_loss (coefficient 1e-4) is megatron-core's alone (--moe-layer-impl mcore).
    "dsv3": dict(swiglu=True, sigmoid=True, num_groups=8, group_topk=4, scaling=2.5, shared=128),
}
"""Per case, what differs from the plain softmax top-k, aux-loss, GELU (`--swiglu`: SwiGLU), shared-less layer."""
KERNEL_NAMES = ("grouped_gemm", "bmm", "onednn", "torch._grouped_mm", "mm-loop")
"""megatron_moe.moe.grouped_gemm's KERNELS, for the command line (built before torch loads)."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    p.add_argument(
        "--cases",
        nargs="+",
        default=None,
        choices=sorted(CASES),
        help="default: small gpt2s fine dsv3 on CPU; and large on a GPU",
    )
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: fp32 on CPU, bf16 on a GPU")
    p.add_argument(
        "--shapes",
        nargs="+",
        default=None,
        metavar="ExK",
        help="only these experts x top-k of a case, e.g. 16x1 (default: all)",
    )
    p.add_argument(
        "--grouped-kernel",
        choices=KERNEL_NAMES,
        default=None,
        help="pin our experts' grouped GEMM kernel (default: the fastest that fits)",
    )
    p.add_argument(
        "--capacity-factors", nargs="+", type=float, default=[0.0, 1.25], help="expert capacity factors (0: dropless)"
    )
    p.add_argument(
        "--padded-too",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time our padded alltoall dispatcher (bmm experts) at capacity factors > 0",
    )
    p.add_argument("--warmup", type=int, default=2, help="fewest rounds before timing")
    p.add_argument("--max-warmup", type=int, default=10, help="most rounds before timing, faults or not")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 11 small, 5 gpt2s)")
    p.add_argument(
        "--threads", type=int, default=int(THREADS), help="torch's intra-op threads (default: OMP_NUM_THREADS, else 2)"
    )
    p.add_argument("--swiglu", action="store_true", help="SwiGLU experts instead of GELU")
    p.add_argument("--seed", type=int, default=1234, help="weights' and tokens' seed")
    p.add_argument(
        "--cluster",
        nargs="+",
        default=None,
        metavar="NxK",
        help="run at EP = N x K across an emulated cluster of N nodes x K processes, e.g. 2x1 2x2 (needs root)",
    )
    p.add_argument("--link-gbit", type=float, default=1.0, help="--cluster: each node's link rate, Gbit/s")
    args = p.parse_args(argv)
    for spec in args.cluster or []:
        try:
            parse_cluster(spec)
        except ValueError as error:
            p.error(str(error))
    return args


if __name__ == "__main__":  # --help and a bad flag answer before torch and megatron-core load (seconds)
    parse_args()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_moe.moe.grouped_gemm import (  # noqa: E402
    KERNELS,
    forced_kernel,
    kernel_name,
    onednn_linear,
    onednn_works,
)
from megatron_moe.platform.process import init_single_process  # noqa: E402
from tools.benchlib import measure_rounds, median_ratio, peak_bytes  # noqa: E402

assert KERNELS == KERNEL_NAMES, "KERNEL_NAMES lists grouped_gemm.KERNELS for the command line"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def cluster_cases(args) -> list[tuple]:
    """(name, hidden, ffn, tokens per rank, experts, top-k) of the dropless cases `--cluster` runs."""
    cases = []
    for case in args.cases or ["small"]:
        hidden, ffn, tokens, shapes = CASES[case]
        for experts, topk in shapes:
            if not args.shapes or f"{experts}x{topk}" in args.shapes:
                cases.append((f"{case}_e{experts}_k{topk}_cf0", hidden, ffn, tokens, experts, topk))
    return cases


# ----------------------------------------------------------------------------- the three contenders


def transformer_config(
    hidden, ffn, experts, topk, capacity_factor, swiglu, *, sigmoid=False, num_groups=None, group_topk=None,
    scaling=None, shared=None,
):  # fmt: skip
    """megatron-core config as megatron_moe.model.builder maps the run flags (built in fp32 on the host); the
    keywords: `CASE_OPTIONS` (sigmoid: DeepSeek-V3's router, its expert bias and no balancing loss)."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=max(1, hidden // 64),
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_router_pre_softmax=topk == 1 and not sigmoid,
        moe_ffn_hidden_size=ffn,
        moe_aux_loss_coeff=0.0 if sigmoid else 0.01,
        moe_router_load_balancing_type="none" if sigmoid else "aux_loss",
        moe_router_score_function="sigmoid" if sigmoid else "softmax",
        moe_router_enable_expert_bias=sigmoid,
        moe_router_num_groups=num_groups,
        moe_router_group_topk=group_topk,
        moe_router_topk_scaling_factor=scaling,
        moe_shared_expert_intermediate_size=shared,
        moe_token_dispatcher_type="alltoall",
        moe_expert_capacity_factor=capacity_factor or None,
        moe_pad_expert_input_to_capacity=bool(capacity_factor),
        moe_grouped_gemm=False,
        moe_router_dtype="fp32",
        add_bias_linear=False,
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
    )


def build_mcore(config):
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
    from megatron.core.transformer.spec_utils import build_module

    spec = get_mlp_module_spec_for_backend(
        LocalSpecProvider(), num_experts=config.num_moe_experts, moe_grouped_gemm=False
    )
    layer = build_module(spec, config=config)
    layer.set_layer_number(1)
    return layer


def build_ours(config, mcore, capacity_factor, dispatcher):
    """Our layer with megatron-core's router and expert weights (so both route the same tokens)."""
    from megatron_moe.moe import MoELayer, MoELayerConfig

    moe_config = MoELayerConfig(
        num_experts=config.num_moe_experts,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.moe_ffn_hidden_size,
        topk=config.moe_router_topk,
        capacity_factor=capacity_factor,
        pad_expert_input_to_capacity=dispatcher == "padded_alltoall",
        expert_type="swiglu" if config.gated_linear_unit else "gelu",
        aux_loss_coeff=config.moe_aux_loss_coeff,
        load_balancing=config.moe_router_load_balancing_type,
        gate="sigmoid" if config.moe_router_score_function == "sigmoid" else "topk",
        expert_bias=config.moe_router_enable_expert_bias,
        num_groups=config.moe_router_num_groups,
        group_topk=config.moe_router_group_topk,
        topk_scaling_factor=config.moe_router_topk_scaling_factor,
        shared_expert_ffn_hidden_size=config.moe_shared_expert_intermediate_size,
    )
    ours = MoELayer(config, moe_config, layer_number=1)
    with torch.no_grad():
        ours.gate.weight.copy_(mcore.router.weight)
        if ours.shared_expert is not None:
            ours.shared_expert.weight1.copy_(mcore.shared_experts.linear_fc1.weight)
            ours.shared_expert.weight2.copy_(mcore.shared_experts.linear_fc2.weight)
        for e, expert in enumerate(mcore.experts.local_experts):
            ours.experts.weight1[e].copy_(expert.linear_fc1.weight)
            ours.experts.weight2[e].copy_(expert.linear_fc2.weight)
    return ours


def fwd_bwd(layer, x, grad):
    def step():
        for p in layer.parameters():
            p.grad = None
        x.grad = None
        out, _ = layer(x)
        out.backward(grad)
        return out

    return step


def floor_gemms(tokens, hidden, ffn, experts, rows, swiglu, device, dtype, kernel="mm", shared=0):
    """The floor's GEMMs, each a step: the gate's in fp32 (router math), the experts' in `dtype`, as
    one dense matrix of `rows`, and a `shared` expert's (that wide) over all tokens. `kernel` "mm" is
    torch.mm; "onednn" is oneDNN's matmul (CPU)."""
    g = torch.Generator().manual_seed(0)
    w1_cols = 2 * ffn if swiglu else ffn

    def randn(*shape, dtype=dtype):
        return torch.randn(*shape, generator=g).to(device, dtype)

    x_TH, wg_HE, dl_TE = (
        randn(*shape, dtype=torch.float32) for shape in ((tokens, hidden), (hidden, experts), (tokens, experts))
    )
    x_NH, w1_HF = randn(rows, hidden), randn(hidden, w1_cols)
    h_NF, w2_FH = randn(rows, ffn), randn(ffn, hidden)
    dy_NH, dh_NF = randn(rows, hidden), randn(rows, w1_cols)
    mm = torch.mm if kernel == "mm" else (lambda a, b: onednn_linear(a, b.t()))
    operands = {
        "gate": (x_TH, wg_HE),
        "fc1": (x_NH, w1_HF),
        "fc2": (h_NF, w2_FH),
        "fc2_dx": (dy_NH, w2_FH.t()),
        "fc2_dw": (h_NF.t(), dy_NH),
        "fc1_dx": (dh_NF, w1_HF.t()),
        "fc1_dw": (x_NH.t(), dh_NF),
        "gate_dx": (dl_TE, wg_HE.t()),
        "gate_dw": (x_TH.t(), dl_TE),
    }
    if shared:  # the same six GEMMs over every token, `shared` wide
        s1_cols = 2 * shared if swiglu else shared
        xs_TH, s1_HF, dy_TH = randn(tokens, hidden), randn(hidden, s1_cols), randn(tokens, hidden)
        s_TF, s2_FH, ds_TF = randn(tokens, shared), randn(shared, hidden), randn(tokens, s1_cols)
        operands |= {
            "shared_fc1": (xs_TH, s1_HF),
            "shared_fc2": (s_TF, s2_FH),
            "shared_fc2_dx": (dy_TH, s2_FH.t()),
            "shared_fc2_dw": (s_TF.t(), dy_TH),
            "shared_fc1_dx": (ds_TF, s1_HF.t()),
            "shared_fc1_dw": (xs_TH.t(), ds_TF),
        }
    return {name: functools.partial(mm, a, b) for name, (a, b) in operands.items()}


def floor_kernels(platform, dtype) -> list[str]:
    """torch.mm (the issue's floor), and oneDNN where it runs: the fastest dense GEMM may be either."""
    return ["mm"] + (["onednn"] if not platform.is_accelerator and onednn_works(dtype) else [])


def floor_per_round(times: dict, kernels: list[str]) -> list[float]:
    """Per round, the floor's GEMMs summed, each at the fastest of `kernels` in that round."""
    gemms = [name.split("/")[2] for name in times if name.startswith(f"floor/{kernels[0]}/")]
    rounds = len(times[f"floor/{kernels[0]}/gate"])
    return [sum(min(times[f"floor/{k}/{g}"][r] for k in kernels) for g in gemms) for r in range(rounds)]


# ----------------------------------------------------------------------------- one case


def run_case(name, hidden, ffn, tokens, experts, topk, capacity_factor, dispatcher, args, platform, options=None):
    """One case's JSON object; `options`: the case's `CASE_OPTIONS` (its swiglu, else `--swiglu`)."""
    from megatron.core.transformer.moe import moe_utils

    from megatron_moe.platform import synchronize

    torch.manual_seed(args.seed)
    dtype = DTYPES[args.dtype]
    options = dict(options or {})
    swiglu = options.pop("swiglu", args.swiglu)
    config = transformer_config(hidden, ffn, experts, topk, capacity_factor, swiglu, **options)
    mcore = build_mcore(config).to(platform.device, dtype)
    ours = build_ours(config, mcore, capacity_factor, dispatcher).to(platform.device, dtype)
    x = torch.randn(tokens, 1, hidden, device=platform.device, dtype=dtype, requires_grad=True)
    grad = torch.randn(tokens, 1, hidden, device=platform.device, dtype=dtype)
    ours_step, mcore_step = fwd_bwd(ours, x, grad), fwd_bwd(mcore, x, grad)

    out_ours, out_mcore = ours_step(), mcore_step()
    moe_utils.clear_aux_losses_tracker()
    sums = ours.stats.sums
    rows = int(sums[experts + 1] - sums[experts])  # routed pairs - dropped = rows the experts computed
    dropped_fraction = float(sums[experts] / sums[experts + 1])
    kernels = floor_kernels(platform, dtype)
    floor = {
        f"floor/{k}/{name}": step
        for k in kernels
        for name, step in floor_gemms(
            tokens, hidden, ffn, experts, rows, swiglu, platform.device, dtype, k, options.get("shared") or 0
        ).items()
    }
    # Same weights, same routing: dropless outputs must agree (capacity semantics differ).
    diff = (out_ours - out_mcore).abs().max().item() if not capacity_factor else None

    small = hidden * tokens < 10**6
    repeats = args.repeats if args.repeats is not None else (11 if small or platform.is_accelerator else 5)

    def after_round():
        moe_utils.clear_aux_losses_tracker()
        ours.stats.reset()

    times, warmup, faults_timed = measure_rounds(
        {"ours": ours_step, "mcore": mcore_step, **floor},
        warmup=args.warmup,
        max_warmup=args.max_warmup,
        repeats=repeats,
        after_round=after_round,
        sync=synchronize,
    )
    peak_ours, peak_mcore = peak_bytes(ours_step, platform), peak_bytes(mcore_step, platform)
    moe_utils.clear_aux_losses_tracker()
    times["ideal"], times["fastest"] = floor_per_round(times, ["mm"]), floor_per_round(times, kernels)
    faults_timed = {k: v for k, v in faults_timed.items() if not k.startswith("floor/")} | {
        "floor": sum(v for k, v in faults_timed.items() if k.startswith("floor/"))
    }
    layer_ms, mcore_ms, ideal_ms, fastest_ms = (
        statistics.median(times[k]) for k in ("ours", "mcore", "ideal", "fastest")
    )
    return {
        "case": name,
        "hidden": hidden,
        "ffn": ffn,
        "tokens": tokens,
        "experts": experts,
        "topk": topk,
        "capacity_factor": capacity_factor,
        "dispatcher": dispatcher,
        "swiglu": swiglu,
        **options,
        "layer_ms": round(layer_ms, 2),
        "ideal_ms": round(ideal_ms, 2),
        "efficiency": round(ideal_ms / layer_ms, 3),
        "mcore_ms": round(mcore_ms, 2),
        "speedup_vs_mcore": round(mcore_ms / layer_ms, 3),
        # The same floor with each GEMM at the fastest dense kernel here (torch.mm or oneDNN).
        "floor_kernels": kernels,
        "ideal_fastest_ms": round(fastest_ms, 2),
        "efficiency_vs_fastest": round(fastest_ms / layer_ms, 3),
        "peak_mem_bytes": peak_ours,
        "mcore_peak_mem_bytes": peak_mcore,
        "rows_computed": rows,
        "dropped_fraction": round(dropped_fraction, 4),
        "max_abs_diff_vs_mcore": diff,
        # Supplementary, for a machine whose speed drifts between rounds: the median of the ratios
        # within each round (the contenders ran back to back).
        "efficiency_paired": median_ratio(times["ideal"], times["ours"]),
        "speedup_vs_mcore_paired": median_ratio(times["mcore"], times["ours"]),
        "efficiency_vs_fastest_paired": median_ratio(times["fastest"], times["ours"]),
        "layer_ms_all": [round(t, 1) for t in times["ours"]],
        "mcore_ms_all": [round(t, 1) for t in times["mcore"]],
        "ideal_ms_all": [round(t, 1) for t in times["ideal"]],
        "kernel": kernel_name(platform.device.type, dtype),
        "threads": torch.get_num_threads(),
        "warmup": warmup,
        "repeats": repeats,
        "page_faults_timed": faults_timed,
        "device": str(platform.device),
        "dtype": args.dtype,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cluster:
        from tools.bench_moe_layer_ep import run_cluster

        run_cluster(args, cluster_cases(args))
        return 0
    torch.set_num_threads(args.threads)
    import warnings

    warnings.filterwarnings("ignore")
    platform = init_single_process()
    args.dtype = args.dtype or ("bf16" if platform.is_accelerator else "fp32")
    args.cases = args.cases or ["small", "gpt2s", "fine", "dsv3", *(["large"] if platform.is_accelerator else [])]
    try:
        for case in args.cases:
            hidden, ffn, tokens, shapes = CASES[case]
            for experts, topk in shapes:
                if args.shapes and f"{experts}x{topk}" not in args.shapes:
                    continue
                for cf in args.capacity_factors:
                    if cf and CASE_OPTIONS.get(case, {}).get("sigmoid"):
                        continue  # the expert bias counts every routed pair: dropless only (ours refuses a capacity)
                    dispatchers = ["alltoallv"] + (["padded_alltoall"] if cf > 0 and args.padded_too else [])
                    for dispatcher in dispatchers:
                        suffix = "" if dispatcher == "alltoallv" else "_padded"
                        name = f"{case}_e{experts}_k{topk}_cf{cf:g}{suffix}"
                        with forced_kernel(args.grouped_kernel):
                            result = run_case(
                                name,
                                hidden,
                                ffn,
                                tokens,
                                experts,
                                topk,
                                cf,
                                dispatcher,
                                args,
                                platform,
                                CASE_OPTIONS.get(case),
                            )
                        print(json.dumps(result), flush=True)
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
