"""A shared job's part (4 gloo ranks): the chunked pipeline of our MoE layer against the same layer unpipelined.

Each case builds one EP layer (the same global weights on every rank), runs a training forward+backward with
degrees (1, 1), then with each pair of degrees (r_f, r_b) from the same inputs; the figures are the largest
differences over ranks, absolute and relative to the largest value, per output, input gradient, router (and
shared expert) gradients and expert weight gradients, and whether each is bit-identical. Also: the host waits
once per forward+backward with the pipeline on; the records of its collectives (forward and backward all-to-alls,
per chunk); a deferring weight-gradient store with a backward overlap (Lancet's protocol) changes no bit and sees
the expert dW under the last backward all-to-all; the same at ESP=2 x EP=2 (expert-sharded). Rank 0 writes
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
from megatron_moe.overlap.wgrad_queue import deliver  # noqa: E402
from megatron_moe.platform import count_host_syncs  # noqa: E402
from tests.distributed.moe_worker import _inputs, global_weights, layer_config, tconfig  # noqa: E402

PADDED = {"pad_expert_input_to_capacity": True}
CASES = {
    "gelu_dropless_v": dict(gate="topk"),
    "gelu_dropless_padded": dict(gate="topk", **PADDED),
    "gelu_cap1_v": dict(gate="topk", capacity_factor=1.0),
    "swiglu_cap1_padded": dict(gate="topk", capacity_factor=1.0, expert_type="swiglu", **PADDED),
    "swiglu_shared_dropless_v": dict(gate="topk", expert_type="swiglu", shared_expert_ffn_hidden_size=24),
    "aux_loss_cap125_v": dict(gate="topk", capacity_factor=1.25, aux_loss_coeff=0.01, z_loss_coeff=0.01),
}
DEGREES = [(2, 2), (4, 1), (1, 4), (3, 2)]
ESP_CASES = ("gelu_dropless_v", "swiglu_cap1_padded", "swiglu_shared_dropless_v")


def run(layer, x, grad):
    layer.train(True)
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out, _ = layer(x)
    out.backward(grad)
    return {"output": out.detach(), "input_grad": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}


def differences(got: dict, want: dict) -> dict:
    """Per group of tensors: the largest absolute and relative difference over ranks, and whether all are equal."""
    groups = {"output": ["output"], "input_grad": ["input_grad"]}
    groups["expert_grads"] = [n for n in want if n.startswith("experts.")]
    groups["router_and_shared_grads"] = [n for n in want if n not in ("output", "input_grad") and "experts." not in n]
    out = {}
    for group, names in groups.items():
        diffs = [(got[n] - want[n]).abs().max().double() for n in names if want[n] is not None and want[n].numel()]
        scale = max(want[n].abs().max().double() for n in names if want[n] is not None and want[n].numel())
        equal = all(torch.equal(got[n], want[n]) for n in names if want[n] is not None)
        figures = torch.stack(
            [torch.stack(diffs).max(), torch.stack(diffs).max() / scale, torch.tensor(0.0 if equal else 1.0).double()]
        )
        dist.all_reduce(figures, op=dist.ReduceOp.MAX)
        out[f"{group}_abs"], out[f"{group}_rel"], out[f"{group}_equal"] = (
            figures[0].item(),
            figures[1].item(),
            figures[2].item() == 0,
        )
    return out


def equivalence(fields: dict, rank: int) -> dict:
    layer = MoELayer(tconfig(2), layer_config(**fields), layer_number=1)
    global_weights(layer)
    x, grad = _inputs(rank)
    want = run(layer, x, grad)
    results = {"scale": want["output"].abs().mean().item()}
    for degrees in DEGREES:
        layer.set_pipeline_degrees(*degrees)
        results[f"{degrees[0]}x{degrees[1]}"] = differences(run(layer, x, grad), want)
    return results


class _Deferring:
    """Lancet's protocol in small: the store keeps each dW closure; the overlap runs them under the next backward
    all-to-all it is given (recording which) and hands the gradients over as the Trainer's queue does (`deliver`:
    added to `.grad`), then waits."""

    defers = True

    def __init__(self, layer: MoELayer):
        self.layer, self.pending, self.ran_under = layer, [], []

    def put(self, weight_grad, outs):
        self.pending.append(weight_grad)

    def run_under(self, record, handle):
        for weight_grad in self.pending:
            deliver(self.layer.experts, weight_grad())
            self.ran_under.append([record.kind, record.backward])
        self.pending = []
        return handle.wait()


def deferred_store(degrees, rank: int) -> dict:
    layer = MoELayer(tconfig(2), layer_config(gate="topk"), layer_number=1)
    global_weights(layer)
    x, grad = _inputs(rank)
    layer.set_pipeline_degrees(*degrees)
    want = run(layer, x, grad)
    store = _Deferring(layer)
    layer.experts.weight_grad_store = store
    layer.dispatcher.backward_overlap = store
    got = run(layer, x, grad)
    return {**differences(got, want), "ran_under": store.ran_under, "left": len(store.pending)}


def host_syncs(degrees, rank: int) -> dict:
    layer = MoELayer(tconfig(2), layer_config(gate="topk", capacity_factor=1.0), layer_number=1)
    global_weights(layer)
    layer.set_pipeline_degrees(*degrees)
    return host_syncs_of(layer, rank)


def host_syncs_of(layer: MoELayer, rank: int) -> dict:
    """The most and fewest host waits over ranks in one training forward+backward of `layer` (after a warm-up)."""
    x, grad = _inputs(rank)
    run(layer, x, grad)
    with count_host_syncs(torch.device("cpu")) as syncs:
        run(layer, x, grad)
    t = torch.tensor([syncs.count, -syncs.count])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {"max": int(t[0]), "min": -int(t[1])}


def collectives(degrees, rank: int) -> list:
    layer = MoELayer(tconfig(2), layer_config(gate="topk"), layer_number=3)
    global_weights(layer)
    layer.set_pipeline_degrees(*degrees)
    x, grad = _inputs(rank)
    seen, issue = [], comm_moe.issue
    comm_moe.issue = lambda record, start: (seen.append(record), issue(record, start))[1]
    try:
        run(layer, x, grad)
    finally:
        comm_moe.issue = issue
    return [[r.kind, r.purpose, r.layer, r.backward] for r in seen]


def cases() -> dict:
    rank = dist.get_rank()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    model_parallel_cuda_manual_seed(1234)
    results = {name: equivalence(fields, rank) for name, fields in CASES.items()}
    results["deferred_store"] = {f"{f}x{b}": deferred_store((f, b), rank) for f, b in ((1, 3), (3, 2))}
    results["host_syncs"] = {f"{f}x{b}": host_syncs((f, b), rank) for f, b in ((1, 1), (3, 2))}
    results["collectives"] = {f"{f}x{b}": collectives((f, b), rank) for f, b in ((1, 1), (3, 2))}
    parallel_state.destroy_model_parallel()
    # Expert-sharded parallelism: ESP=2 inside each EP=2 rank pair (the ESP all-gather and reduce-scatter per chunk).
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2, expert_tensor_parallel_size=2)
    model_parallel_cuda_manual_seed(1234)
    for name in ESP_CASES:
        results[f"esp2_ep2/{name}"] = equivalence(CASES[name], rank)
    results["esp2_ep2/deferred_store"] = {"3x2": deferred_store((3, 2), rank)}
    results["esp2_ep2/host_syncs"] = {"3x2": host_syncs((3, 2), rank)}
    results["esp2_ep2/collectives"] = {f"{f}x{b}": collectives((f, b), rank) for f, b in ((1, 1), (3, 2))}
    parallel_state.destroy_model_parallel()
    return results
