"""torchrun worker (8 gloo ranks, emulated nodes of 2 ranks: LOCAL_WORLD_SIZE=2): our MoE layer with Tutel's 2DH
all-to-all against the same layer with the linear one.

Layouts: EP=4 (2 EP groups, each 2 nodes x 2 ranks: "2x2") and EP=8 (4 nodes x 2 ranks: "4x2"). Per case (GELU
dropless; SwiGLU capacity-padded; capacity 1.25 with a shared expert and router losses), two layers with the same
weights (`moe_worker.global_weights`), --moe-a2a-algorithm linear and 2dh, one training forward+backward each from
the same inputs at pipeline degrees (1, 1) and (2, 2), with a deferring weight-gradient store (Lancet's protocol,
`pipeline_worker._Deferring`) at (1, 1) and (2, 2), and (dropless) with 2 shadow experts. The figures are
`pipeline_worker.differences` (bit-identical flags per output, input gradient, expert and router/shared gradients),
the dispatch/combine records' messages and bytes across nodes, forward and backward, and the host waits per
forward+backward under 2DH. Then training (pretrain, 2 steps at EP=4, the pipeline at 2 / 2) with
--moe-a2a-algorithm linear, 2dh and auto: the steps' computed figures and the EP groups start-up made 2DH groups
for. Rank 0 writes `{case: figures}` to $RESULTS. Arguments: DATA_PREFIX TOKENIZER.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist

import megatron_moe  # noqa: F401  before megatron-core: its fused functions then compile on first call

warnings.filterwarnings("ignore")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402

from megatron_moe import comm  # noqa: E402
from megatron_moe.comm import moe as comm_moe  # noqa: E402
from megatron_moe.moe import MoELayer  # noqa: E402
from megatron_moe.platform import init_platform  # noqa: E402
from tests.distributed.launcher import computed, finish_job, train_in_job  # noqa: E402
from tests.distributed.moe_worker import _inputs, global_weights, layer_config, tconfig  # noqa: E402
from tests.distributed.pipeline_worker import _Deferring, differences, host_syncs_of, run  # noqa: E402

RANKS_PER_NODE = 2
CASES = {
    "gelu_dropless": dict(gate="topk"),
    "swiglu_padded": dict(gate="topk", capacity_factor=1.0, expert_type="swiglu", pad_expert_input_to_capacity=True),
    "shared_losses_cap125": dict(
        gate="topk", capacity_factor=1.25, shared_expert_ffn_hidden_size=24, aux_loss_coeff=0.01, z_loss_coeff=0.01
    ),
}
DEGREES = ((1, 1), (2, 2))


def _recorded(fn):
    """fn()'s result and its dispatch/combine records: [purpose, backward, inter-node (messages, bytes)]."""
    seen, issue = [], comm_moe.issue

    def tap(record, start):
        if record.purpose in ("dispatch_all_to_all", "combine_all_to_all"):
            seen.append([record.purpose, record.backward, list(record.inter_node or ())])
        return issue(record, start)

    comm_moe.issue = tap
    try:
        return fn(), seen
    finally:
        comm_moe.issue = issue


def _pair(ep: int, fields: dict) -> tuple[MoELayer, MoELayer]:
    layers = tuple(
        MoELayer(tconfig(ep), layer_config(**fields, a2a_algorithm=a), layer_number=1) for a in ("linear", "2dh")
    )
    for layer in layers:
        global_weights(layer)
    return layers


def _compare(linear: MoELayer, two_level: MoELayer, x, grad, setup) -> dict:
    for layer in (linear, two_level):
        setup(layer)
    want, seen_linear = _recorded(lambda: run(linear, x, grad))
    got, seen = _recorded(lambda: run(two_level, x, grad))
    # the bytes that cross nodes, summed over every rank and record: each row crosses once either way
    crossing = torch.tensor([sum(r[2][1] for r in records) for records in (seen_linear, seen)], dtype=torch.long)
    dist.all_reduce(crossing)
    return differences(got, want) | {
        "records_linear": seen_linear,
        "records_2dh": seen,
        "crossing_bytes": crossing.tolist(),
        "two_level": two_level.dispatcher.hierarchy is not None and linear.dispatcher.hierarchy is None,
    }


def equivalence(ep: int, fields: dict, rank: int, shadows: bool) -> dict:
    linear, two_level = _pair(ep, fields)
    x, grad = _inputs(rank)
    results = {}
    for f, b in DEGREES:
        results[f"{f}x{b}"] = _compare(
            linear, two_level, x, grad, lambda layer, f=f, b=b: layer.set_pipeline_degrees(f, b)
        )
    for f, b in DEGREES:

        def deferring(layer, f=f, b=b):
            layer.set_pipeline_degrees(f, b)
            store = _Deferring(layer)
            layer.experts.weight_grad_store = layer.dispatcher.backward_overlap = store

        figures = _compare(linear, two_level, x, grad, deferring)
        results[f"deferred/{f}x{b}"] = figures | {"ran_under": two_level.dispatcher.backward_overlap.ran_under}
        for layer in (linear, two_level):
            layer.experts.weight_grad_store, layer.dispatcher.backward_overlap = (
                type(layer.experts).weight_grad_store,
                None,
            )
    if shadows:

        def shadowing(layer):
            layer.set_pipeline_degrees(1, 1)
            layer.shadow.mode = 2

        results["shadow2"] = _compare(linear, two_level, x, grad, shadowing) | {
            "shadowed": list(two_level.last_shadowed)
        }
    return results


def _train_flags(data: str, tokenizer: str, algorithm: str) -> list[str]:
    """A tiny MoE at EP=4 over the 8 ranks (DP 2): each EP group 2 emulated nodes x 2 ranks."""
    return [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size", "4",
        "--micro-batch-size", "1", "--global-batch-size", "8", "--lr", "1e-3", "--train-iters", "2",
        "--eval-iters", "0", "--eval-interval", "0", "--log-interval", "1", "--data-path", data,
        "--tokenizer-model", tokenizer, "--split", "98,2,0", "--seed", "7", "--moe-pipeline-degree", "2",
        "--moe-bp-pipeline-degree", "2", "--grad-reduce-schedule", "megatron", "--moe-a2a-algorithm", algorithm,
    ]  # fmt: skip


def training(data: str, tokenizer: str) -> dict:
    """Training steps (pretrain: start-up's `make_a2a_groups`) with linear, 2dh and auto: their computed figures,
    and the EP groups each run's start-up made 2DH groups for."""
    made, make = [], comm.make_hierarchy_groups

    def recording(group, timeout=None):
        made.append(dist.get_process_group_ranks(group))
        return make(group, timeout)

    comm.make_hierarchy_groups = recording
    results = {}
    try:
        for algorithm in ("linear", "2dh", "auto"):
            made.clear()
            steps = computed(train_in_job(_train_flags(data, tokenizer, algorithm)))
            results[algorithm] = {"steps": steps, "made": list(made)}
    finally:
        comm.make_hierarchy_groups = make
    return results


def main() -> None:
    os.environ["LOCAL_WORLD_SIZE"] = str(RANKS_PER_NODE)  # emulated nodes: what torchrun says on a real cluster
    init_platform()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    for ep, name in ((4, "2x2"), (8, "4x2")):
        parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
        model_parallel_cuda_manual_seed(1234)
        hierarchy = comm.make_hierarchy_groups(parallel_state.get_expert_model_parallel_group())
        results[f"{name}/layout"] = [hierarchy.layout.nodes, hierarchy.layout.per_node]
        for case, fields in CASES.items():
            results[f"{name}/{case}"] = equivalence(ep, fields, rank, shadows=case == "gelu_dropless")
        _, two_level = _pair(ep, CASES["gelu_dropless"])
        results[f"{name}/host_syncs"] = host_syncs_of(two_level, rank)
        parallel_state.destroy_model_parallel()
        comm.forget_hierarchies()
    comm.destroy_groups_but_world()
    results["training"] = training(*sys.argv[1:3])
    finish_job(results)


if __name__ == "__main__":
    main()
