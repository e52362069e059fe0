"""Benchmark one MoE layer, forward + backward: ours vs megatron-core 0.16.1's MoELayer vs the GEMM floor.

    python tools/bench_moe_layer.py                      # every case, one JSON object per line
    python tools/bench_moe_layer.py --cases small --repeats 10

Per case, all measured in this process, interleaved round by round (ours,
megatron-core, ideal) so background load hits all three alike; each figure
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
  dense `torch.mm` on one [rows, H] matrix: the physical floor;
- `efficiency` = ideal_ms / layer_ms and `speedup_vs_mcore` = mcore_ms / layer_ms.

`peak_mem_bytes` (and `mcore_peak_mem_bytes`): most bytes in use above the
level before one extra fwd+bwd, read from glibc's allocator after every torch
op (CPU), or the accelerator's peak-allocated counter.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys

THREADS = os.environ.setdefault("OMP_NUM_THREADS", "2")  # before torch is imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from benchlib import measure_rounds, median_ratio  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = {
    # name: (hidden, ffn, tokens, [(experts, topk), ...])
    "gpt2s": (768, 3072, 8192, [(8, 1), (8, 2), (16, 1), (16, 2)]),
    "small": (256, 1024, 2048, [(8, 2)]),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=["small", "gpt2s"], choices=sorted(CASES))
    p.add_argument("--capacity-factors", nargs="+", type=float, default=[0.0, 1.25])
    p.add_argument("--padded-too", action=argparse.BooleanOptionalAction, default=True,
                   help="also time our padded alltoall dispatcher (bmm experts) at capacity factors > 0")
    p.add_argument("--warmup", type=int, default=2, help="fewest rounds before timing")
    p.add_argument("--max-warmup", type=int, default=10, help="most rounds before timing, faults or not")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 11 small, 5 gpt2s)")
    p.add_argument("--threads", type=int, default=int(THREADS))
    p.add_argument("--swiglu", action="store_true", help="SwiGLU experts instead of GELU")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- memory


class _MallocInfo(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip


def _host_bytes_in_use():
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallocInfo

    def in_use() -> int:
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd

    return in_use


def peak_bytes(step, platform) -> int:
    """Peak bytes in use above the starting level during one call of `step`."""
    if platform.is_accelerator:
        torch.accelerator.synchronize()
        torch.accelerator.memory.reset_peak_memory_stats()
        base = torch.accelerator.memory.memory_allocated()
        step()
        torch.accelerator.synchronize()
        return torch.accelerator.memory.max_memory_allocated() - base
    from torch.utils._python_dispatch import TorchDispatchMode

    in_use = _host_bytes_in_use()
    base = in_use()
    peak = [base]

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            peak[0] = max(peak[0], in_use())
            return out

    with Track():
        step()
    return peak[0] - base


# ----------------------------------------------------------------------------- the three contenders


def transformer_config(hidden, ffn, experts, topk, capacity_factor, swiglu):
    """megatron-core config as megatron_moe.model.builder maps the run flags (fp32, CPU)."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=max(1, hidden // 64),
        num_moe_experts=experts, moe_router_topk=topk, moe_router_pre_softmax=topk == 1,
        moe_ffn_hidden_size=ffn, moe_aux_loss_coeff=0.01,
        moe_router_load_balancing_type="aux_loss", moe_token_dispatcher_type="alltoall",
        moe_expert_capacity_factor=capacity_factor or None,
        moe_pad_expert_input_to_capacity=bool(capacity_factor), moe_grouped_gemm=False, moe_router_dtype="fp32",
        add_bias_linear=False, gated_linear_unit=swiglu, activation_func=F.silu if swiglu else F.gelu,
        bias_activation_fusion=False, bias_dropout_fusion=False, gradient_accumulation_fusion=False,
        use_cpu_initialization=True, params_dtype=torch.float32,
    )  # fmt: skip


def build_mcore(config):
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
    from megatron.core.transformer.spec_utils import build_module

    spec = get_mlp_module_spec_for_backend(LocalSpecProvider(), num_experts=config.num_moe_experts,
                                           moe_grouped_gemm=False)  # fmt: skip
    layer = build_module(spec, config=config)
    layer.set_layer_number(1)
    return layer


def build_ours(config, mcore, capacity_factor, dispatcher):
    """Our layer with megatron-core's router and expert weights (so both route the same tokens)."""
    from megatron_moe.moe import MoELayer, moe_layer_config

    ours = MoELayer(config, moe_layer_config(config, capacity_factor=capacity_factor, dispatcher=dispatcher),
                    layer_number=1)  # fmt: skip
    with torch.no_grad():
        ours.gate.weight.copy_(mcore.router.weight)
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


def make_ideal(tokens, hidden, ffn, experts, rows, swiglu):
    g = torch.Generator().manual_seed(0)
    w1_cols = 2 * ffn if swiglu else ffn
    x_TH, wg_HE = torch.randn(tokens, hidden, generator=g), torch.randn(hidden, experts, generator=g)
    dl_TE = torch.randn(tokens, experts, generator=g)
    x_NH, w1_HF = torch.randn(rows, hidden, generator=g), torch.randn(hidden, w1_cols, generator=g)
    h_NF, w2_FH = torch.randn(rows, ffn, generator=g), torch.randn(ffn, hidden, generator=g)
    dy_NH, dh_NF = torch.randn(rows, hidden, generator=g), torch.randn(rows, w1_cols, generator=g)

    def step():
        torch.mm(x_TH, wg_HE)  # gate forward
        torch.mm(x_NH, w1_HF)  # fc1 forward
        torch.mm(h_NF, w2_FH)  # fc2 forward
        torch.mm(dy_NH, w2_FH.t())  # fc2 dX
        torch.mm(h_NF.t(), dy_NH)  # fc2 dW
        torch.mm(dh_NF, w1_HF.t())  # fc1 dX
        torch.mm(x_NH.t(), dh_NF)  # fc1 dW
        torch.mm(dl_TE, wg_HE.t())  # gate dX
        torch.mm(x_TH.t(), dl_TE)  # gate dW

    return step


# ----------------------------------------------------------------------------- one case


def run_case(name, hidden, ffn, tokens, experts, topk, capacity_factor, dispatcher, args, platform):
    from megatron.core.transformer.moe import moe_utils

    from megatron_moe.moe.grouped_gemm import kernel_name
    from megatron_moe.platform import synchronize

    torch.manual_seed(args.seed)
    config = transformer_config(hidden, ffn, experts, topk, capacity_factor, args.swiglu)
    mcore = build_mcore(config).to(platform.device)
    ours = build_ours(config, mcore, capacity_factor, dispatcher).to(platform.device)
    x = torch.randn(tokens, 1, hidden, device=platform.device, requires_grad=True)
    grad = torch.randn(tokens, 1, hidden, device=platform.device)
    ours_step, mcore_step = fwd_bwd(ours, x, grad), fwd_bwd(mcore, x, grad)

    out_ours, out_mcore = ours_step(), mcore_step()
    moe_utils.clear_aux_losses_tracker()
    sums = ours.stats.sums
    rows = int(sums[experts + 1] - sums[experts])  # routed pairs - dropped = rows the experts computed
    dropped_fraction = float(sums[experts] / sums[experts + 1])
    ideal = make_ideal(tokens, hidden, ffn, experts, rows, args.swiglu)
    # Same weights, same routing: dropless outputs must agree (capacity semantics differ).
    diff = (out_ours - out_mcore).abs().max().item() if not capacity_factor else None

    small = hidden * tokens < 10**6
    repeats = args.repeats if args.repeats is not None else (11 if small else 5)

    def after_round():
        moe_utils.clear_aux_losses_tracker()
        ours.stats.reset()

    times, warmup, faults_timed = measure_rounds({"ours": ours_step, "mcore": mcore_step, "ideal": ideal},
                                                 warmup=args.warmup, max_warmup=args.max_warmup, repeats=repeats,
                                                 after_round=after_round, sync=synchronize)  # fmt: skip
    peak_ours, peak_mcore = peak_bytes(ours_step, platform), peak_bytes(mcore_step, platform)
    moe_utils.clear_aux_losses_tracker()
    layer_ms, mcore_ms, ideal_ms = (statistics.median(times[k]) for k in ("ours", "mcore", "ideal"))
    return {
        "case": name, "hidden": hidden, "ffn": ffn, "tokens": tokens, "experts": experts, "topk": topk,
        "capacity_factor": capacity_factor, "dispatcher": dispatcher,
        "layer_ms": round(layer_ms, 2), "ideal_ms": round(ideal_ms, 2), "efficiency": round(ideal_ms / layer_ms, 3),
        "mcore_ms": round(mcore_ms, 2), "speedup_vs_mcore": round(mcore_ms / layer_ms, 3),
        "peak_mem_bytes": peak_ours, "mcore_peak_mem_bytes": peak_mcore,
        "rows_computed": rows, "dropped_fraction": round(dropped_fraction, 4),
        "max_abs_diff_vs_mcore": diff,
        # Supplementary, for a machine whose speed drifts between rounds: the median of the ratios
        # within each round (the three contenders ran back to back).
        "efficiency_paired": median_ratio(times["ideal"], times["ours"]),
        "speedup_vs_mcore_paired": median_ratio(times["mcore"], times["ours"]),
        "layer_ms_all": [round(t, 1) for t in times["ours"]], "mcore_ms_all": [round(t, 1) for t in times["mcore"]],
        "ideal_ms_all": [round(t, 1) for t in times["ideal"]],
        "kernel": kernel_name(platform.device.type), "threads": torch.get_num_threads(),
        "warmup": warmup, "repeats": repeats, "page_faults_timed": faults_timed, "device": str(platform.device), "dtype": "fp32",
    }  # fmt: skip


def init_single_process():
    from megatron.core import parallel_state

    from megatron_moe.platform import init_platform

    platform = init_platform()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group(backend=platform.backend, rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    return platform


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import warnings

    warnings.filterwarnings("ignore")
    platform = init_single_process()
    try:
        for case in args.cases:
            hidden, ffn, tokens, shapes = CASES[case]
            for experts, topk in shapes:
                for cf in args.capacity_factors:
                    dispatchers = ["alltoallv"] + (["alltoall"] if cf > 0 and args.padded_too else [])
                    for dispatcher in dispatchers:
                        suffix = "" if dispatcher == "alltoallv" else "_padded"
                        name = f"{case}_e{experts}_k{topk}_cf{cf:g}{suffix}"
                        result = run_case(name, hidden, ffn, tokens, experts, topk, cf, dispatcher, args, platform)
                        print(json.dumps(result), flush=True)
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
