"""A shared job's part (job_runner.py, 4 gloo ranks): our MoE layer with shadow experts against the same layer without.

Per layout (EP=2 with expert-DP 2; EP=4) and case (GELU dropless; SwiGLU with a shared expert and router losses),
one layer (the same weights on every rank, `moe_worker.global_weights`), a training forward+backward with
--moe-shadow-experts off, then with N in (1, 2, 3) shadowed experts at pipeline degrees (1, 1) and (2, 2), and with a
deferring weight-gradient store (Lancet's protocol: the experts' dW closure run under the next backward all-to-all
and delivered as the Trainer's queue delivers it, `overlap.wgrad_queue.deliver`) at (1, 1) and (2, 2). The figures are
the largest differences over ranks per output, input gradient, expert weight gradients and router / shared
gradients (`pipeline_worker.differences`), the shadowed experts (every rank's must agree) and the records of the
shadow collectives; also the host waits once per forward+backward with shadowing on. Rank 0 writes
`{case: figures}` to $RESULTS.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

import megatron_moe  # noqa: F401  before megatron-core: its fused functions then compile on first call

warnings.filterwarnings("ignore")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402

from megatron_moe.comm import moe as comm_moe  # noqa: E402
from megatron_moe.moe import MoELayer  # noqa: E402
from tests.distributed.moe_worker import _inputs, global_weights, layer_config, tconfig  # noqa: E402
from tests.distributed.pipeline_worker import _Deferring, differences, host_syncs_of, run  # noqa: E402

CASES = {
    "gelu": dict(gate="topk"),
    "swiglu_shared_losses": dict(  # the shared expert gated (Qwen2-MoE), the balancing loss per sequence (DeepSeek)
        gate="topk",
        expert_type="swiglu",
        shared_expert_ffn_hidden_size=24,
        shared_expert_gate=True,
        load_balancing="seq_aux_loss",
        aux_loss_coeff=0.01,
        z_loss_coeff=0.01,
    ),  # fmt: skip
}
SHADOWED = (1, 2, 3)
DEGREES = ((1, 1), (2, 2))


def _recorded(fn) -> tuple[object, list]:
    """fn()'s result and the shadow collectives it issued: (purpose, backward)."""
    seen, issue = [], comm_moe.issue

    def tap(record, start):
        if record.kind == "shadow":
            seen.append([record.purpose, record.backward])
        return issue(record, start)

    comm_moe.issue = tap
    try:
        return fn(), seen
    finally:
        comm_moe.issue = issue


def _agreed(values: list[int]) -> bool:
    """Every rank of this rank's EP group has the same `values`."""
    t = torch.tensor(values + [-1] * (8 - len(values)), dtype=torch.long)
    low, high = t.clone(), t.clone()
    group = parallel_state.get_expert_model_parallel_group()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    return torch.equal(low, high)


def equivalence(ep: int, fields: dict, rank: int) -> dict:
    layer = MoELayer(tconfig(ep), layer_config(**fields), layer_number=1)
    global_weights(layer)
    x, grad = _inputs(rank)
    want = run(layer, x, grad)
    results = {"scale": want["output"].abs().mean().item()}
    for n in SHADOWED:
        for degrees in DEGREES:
            layer.set_pipeline_degrees(*degrees)
            layer.shadow.mode = n
            got, seen = _recorded(lambda: run(layer, x, grad))
            shadowed = list(layer.last_shadowed)
            figures = differences(got, want)
            figures |= {"shadowed": shadowed, "agreed": _agreed(shadowed), "collectives": seen}
            results[f"N{n}/{degrees[0]}x{degrees[1]}"] = figures
            layer.shadow.mode = "off"
    for degrees in DEGREES:  # Lancet's deferring store
        layer.set_pipeline_degrees(*degrees)
        layer.shadow.mode = 2
        store = _Deferring(layer)
        layer.experts.weight_grad_store = layer.dispatcher.backward_overlap = store
        figures = differences(run(layer, x, grad), want)
        results[f"deferred/{degrees[0]}x{degrees[1]}"] = figures | {"ran_under": store.ran_under}
        layer.experts.weight_grad_store, layer.dispatcher.backward_overlap = type(layer.experts).weight_grad_store, None
        layer.shadow.mode = "off"
    return results


def host_syncs(ep: int, rank: int) -> dict:
    layer = MoELayer(tconfig(ep), layer_config(gate="topk", shadow_experts=2), layer_number=1)
    global_weights(layer)
    return host_syncs_of(layer, rank)


def cases() -> dict:
    rank = dist.get_rank()
    results = {}
    for ep in (2, 4):
        parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
        model_parallel_cuda_manual_seed(1234)
        for name, fields in CASES.items():
            results[f"ep{ep}/{name}"] = equivalence(ep, fields, rank)
        results[f"ep{ep}/host_syncs"] = host_syncs(ep, rank)
        parallel_state.destroy_model_parallel()
    return results
