"""A shared job's part (4 gloo ranks): the routed experts' initial weights depend on neither layout nor device.

Global expert e of layer l starts from (seed, l, e) alone: built at EP=1 (x DP=4), EP=2,
EP=4 and ESP=2 x EP=2, every rank's slices gathered into whole experts equal the single-process layer's
experts exactly, and no two experts are alike. The router and the shared expert are the same on every rank.
Each layout runs twice: with the tracker as the CPU platform has it (its fork swaps the host generator) and as
on a GPU (`device_generator_apart`: its fork swaps a generator the host-side init never draws from, where the
old init gave every EP rank the same experts). Rank 0 writes `{case: figures}` to $RESULTS.

`broadcast_params` (EP=2 on 4 ranks: dense DP 4, expert DP 2): our coalesced broadcast of the replicas' start
leaves every rank's parameters as megatron-core DDP's per-parameter `broadcast_params` does, bit for bit, from
parameters that differ on every rank (fp32 and bf16, dense and expert).
"""

from __future__ import annotations

import contextlib
import itertools
import warnings

import torch
import torch.distributed as dist

import megatron_moe  # noqa: F401  before megatron-core: its fused functions then compile on first call

warnings.filterwarnings("ignore")

from megatron.core import parallel_state  # noqa: E402

from megatron_moe.moe import MoELayer  # noqa: E402
from megatron_moe.platform.rng import seed_model_parallel  # noqa: E402
from tests.distributed.moe_worker import layer_config, tconfig  # noqa: E402
from tests.unit.gpu_emulation import device_generator_apart  # noqa: E402

SEED, LAYER = 1234, 3
LAYOUTS = {"ep1": (1, 1), "ep2": (1, 2), "ep4": (1, 4), "esp2_ep2": (2, 2)}  # name -> (ESP, EP)
CASES = {
    "gelu": dict(gate="topk"),
    "swiglu_shared": dict(gate="topk", expert_type="swiglu", shared_expert_ffn_hidden_size=24),
}
RNG_MODES = {"cpu_tracker": contextlib.nullcontext, "gpu_like_tracker": device_generator_apart}


def build(fields: dict, layer_number: int = LAYER, **groups) -> MoELayer:
    """The layer as training builds it: the host generator seeded alike on every rank of the stage, the tracker's
    streams seeded from the same seed (`set_seed`)."""
    torch.manual_seed(SEED)
    seed_model_parallel(SEED)
    return MoELayer(tconfig(1), layer_config(**fields, init_seed=SEED), layer_number=layer_number, **groups)


def whole_experts(layer: MoELayer, esp: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """On rank 0: every rank's slices of weight1 [E, F (2F), H] and weight2 [E, H, F] put back together."""
    mine = (
        parallel_state.get_expert_model_parallel_rank(),
        parallel_state.get_expert_tensor_parallel_rank(),
        layer.experts.weight1.detach().clone(),
        layer.experts.weight2.detach().clone(),
    )
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    if dist.get_rank() != 0:
        return None
    local, gated = layer.num_local_experts, layer.cfg.gated
    slices: dict[int, dict[int, tuple]] = {}
    for ep_rank, esp_rank, w1, w2 in parts:  # expert-DP replicas overwrite each other: checked equal below
        slices.setdefault(ep_rank, {})[esp_rank] = (w1, w2)
    w1s, w2s = [], []
    for ep_rank in sorted(slices):
        shards = [slices[ep_rank][p] for p in range(esp)]
        if gated:  # each slice is [its gate rows; its up rows]: all gate slices, then all up slices
            halves = [w1.chunk(2, dim=1) for w1, _ in shards]
            w1s.append(torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=1))
        else:
            w1s.append(torch.cat([w1 for w1, _ in shards], dim=1))
        w2s.append(torch.cat([w2 for _, w2 in shards], dim=2))
    assert len(w1s) * local == layer.cfg.num_experts
    return torch.cat(w1s), torch.cat(w2s)


def replicas_agree(layer: MoELayer) -> bool:
    """Every expert-DP replica of this rank's slices holds the same numbers."""
    w = torch.cat([layer.experts.weight1.detach().flatten(), layer.experts.weight2.detach().flatten()])
    low, high = w.clone(), w.clone()
    group = parallel_state.get_expert_data_parallel_group()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    return bool(torch.equal(low, high))


def same_on_every_rank(layer: MoELayer, prefix: str) -> bool:
    tensors = [p.detach().flatten() for n, p in layer.named_parameters() if n.startswith(prefix)]
    if not tensors:
        return True
    w = torch.cat(tensors)
    low, high = w.clone(), w.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return bool(torch.equal(low, high))


def experts_distinct(w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """No two experts share weight1 or weight2 (the smallest difference between any two is far from zero)."""
    return all(
        not torch.equal(w1[a], w1[b]) and not torch.equal(w2[a], w2[b])
        for a, b in itertools.combinations(range(len(w1)), 2)
    )


def check(fields: dict, esp: int, reference: MoELayer) -> dict:
    layer = build(fields)
    whole = whole_experts(layer, esp)
    result = {
        "replicas_agree": replicas_agree(layer),
        "router_same_on_every_rank": same_on_every_rank(layer, "gate."),
        "shared_same_on_every_rank": same_on_every_rank(layer, "shared_expert."),
    }
    if whole is not None:
        w1, w2 = whole
        ref1, ref2 = reference.experts.weight1.detach(), reference.experts.weight2.detach()
        result["experts_equal_single_process"] = bool(torch.equal(w1, ref1) and torch.equal(w2, ref2))
        result["experts_max_diff"] = max((w1 - ref1).abs().max().item(), (w2 - ref2).abs().max().item())
        result["experts_distinct"] = experts_distinct(w1, w2)
        result["experts_std"] = w1.std().item()
        shared = {n: p for n, p in reference.named_parameters() if not n.startswith("experts.")}
        result["router_and_shared_equal_single_process"] = all(
            torch.equal(p.detach(), shared[n].detach()) for n, p in layer.named_parameters() if n in shared
        )
    return result


def broadcast_params_cases() -> dict:
    """Our `comm.broadcast_params` against megatron-core DDP's own on the same start (each rank's own numbers)."""
    from types import SimpleNamespace

    from megatron.core.distributed import DistributedDataParallel

    from megatron_moe import comm

    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    groups = dict(
        dp_cp_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
        expt_dp_group=parallel_state.get_expert_data_parallel_group(),
    )
    results = {}
    for name, broadcast in (
        ("ours", comm.broadcast_params),
        ("megatron_core", DistributedDataParallel.broadcast_params),
    ):
        torch.manual_seed(100 + dist.get_rank())  # every rank starts elsewhere
        module = torch.nn.Module()
        module.dense = torch.nn.Parameter(torch.randn(37, 5))
        module.dense_bf16 = torch.nn.Parameter(torch.randn(11).bfloat16())
        module.expert = torch.nn.Parameter(torch.randn(3, 7))
        module.expert.allreduce = False
        module.bias = torch.nn.Parameter(torch.randn(5))
        broadcast(SimpleNamespace(module=module, **groups))
        results[name] = [p.detach().float().tolist() for p in module.parameters()]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    parallel_state.destroy_model_parallel()
    return {
        "ours_equals_megatron_core": all(r["ours"] == r["megatron_core"] for r in gathered),
        "dense_from_rank_0": all(r["ours"][0] == gathered[0]["ours"][0] for r in gathered),
        "experts_per_expert_dp_group": [
            r["ours"][2] == gathered[rank % 2]["ours"][2] for rank, r in enumerate(gathered)
        ],
        "experts_differ_across_ep": gathered[0]["ours"][2] != gathered[1]["ours"][2],
    }


def cases() -> dict:
    solo = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    results = {}
    for mode, rng in RNG_MODES.items():
        with rng():
            for layout, (esp, ep) in LAYOUTS.items():
                parallel_state.initialize_model_parallel(expert_model_parallel_size=ep, expert_tensor_parallel_size=esp)
                for case, fields in CASES.items():
                    reference = build(fields, ep_group=solo, expert_dp_group=solo)
                    results[f"{mode}/{layout}/{case}"] = check(fields, esp, reference)
                    if layout == "ep1":  # the layer's number is part of the key: another layer starts elsewhere
                        other = build(fields, layer_number=LAYER + 1, ep_group=solo, expert_dp_group=solo)
                        results[f"{mode}/other_layer/{case}"] = not torch.equal(
                            other.experts.weight1, reference.experts.weight1
                        )
                parallel_state.destroy_model_parallel()
    return results | {"broadcast_params": broadcast_params_cases()}
