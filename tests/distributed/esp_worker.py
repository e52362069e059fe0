"""A shared job's part (job_runner.py, 4 gloo ranks): expert-sharded parallelism (ESP).

1. The collectives `esp_all_gather` / `esp_reduce_scatter` over ESP groups of 2 and 4 ranks, with uneven
   sizes and zero rows: values and gradients against what every rank can compute on its own (all inputs are
   seeded by rank), and the records `issue` sees (kinds esp_ag / esp_rs, their backward marked).
2. Our MoE layer at ESP=2 x EP=2, ESP=2 (x DP=2) and ESP=4 against the single-rank layer holding every expert
   whole, from the same global weights (as moe_worker.py does for EP): outputs, input and router gradients
   equal the reference's on the same rank; an expert slice's gradient equals the reference's gradient of that
   slice summed over the ranks whose tokens it served (the expert-tensor-and-model-parallel group); the
   routing statistics equal the reference's.
3. One host sync per layer forward+backward under ESP, and every collective through `issue`.
4. Checkpoints: saved at ESP=2 x EP=2 (GELU and SwiGLU), loaded at ESP=1 x EP=1, EP=2, EP=4 and ESP=4; saved
   at EP=4, loaded at ESP=2 x EP=2: every rank's weights equal the global weights' slice.
Rank 0 writes `{case: figures}` to $RESULTS.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist

import megatron_moe  # noqa: F401  before megatron-core: its fused functions then compile on first call

warnings.filterwarnings("ignore")

from megatron.core import dist_checkpointing, parallel_state  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402

from megatron_moe import comm  # noqa: E402
from megatron_moe.comm import moe as comm_moe  # noqa: E402
from megatron_moe.comm.transport import all_to_all_single  # noqa: E402
from megatron_moe.moe import MoELayer  # noqa: E402
from megatron_moe.platform import count_host_syncs  # noqa: E402
from tests.distributed.moe_worker import FFN, _inputs, _max, global_weights, layer_config, run  # noqa: E402
from tests.distributed.moe_worker import tconfig as ep_tconfig  # noqa: E402

WIDTH = 5  # columns of the collectives' rows

# name -> layer settings, each run at every ESP layout (training mode).
CASES = {
    "topk_dropless_v": dict(gate="topk"),
    "topk_cap1_v": dict(gate="topk", capacity_factor=1.0),
    "topk_dropless_padded": dict(gate="topk", pad_expert_input_to_capacity=True),
    "topk_cap1_padded": dict(gate="topk", capacity_factor=1.0, pad_expert_input_to_capacity=True),
    "swiglu_v": dict(gate="topk", expert_type="swiglu", aux_loss_coeff=0.01),
    "swiglu_padded_shared": dict(
        gate="topk", expert_type="swiglu", pad_expert_input_to_capacity=True, shared_expert_ffn_hidden_size=24
    ),
    "sigmoid_dense_cap1": dict(gate="sigmoid", capacity_factor=1.0, ordering="dense", z_loss_coeff=0.01),
    "expert_choice_v": dict(gate="expert_choice"),
    "soft_padded": dict(gate="soft", soft_slots=2, pad_expert_input_to_capacity=True),
}
LAYOUTS = {"esp2_ep2": (2, 2), "esp2": (2, 1), "esp4": (4, 1)}  # name -> (ESP, EP)


# ---------------------------------------------------------------------------------------------- 1. collectives


def _rows(rank: int, n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, WIDTH, generator=torch.Generator().manual_seed(1000 * seed + rank))


def collectives(group, ranks: list[int], sizes: list[int], async_op: bool) -> dict:
    """All-gather then reduce-scatter over `group` (global `ranks`), each differentiated; max errors."""
    me = ranks.index(dist.get_rank())
    # All-gather: rank p sends its sizes[p] rows; the gradient each rank feeds is seeded by that rank.
    x = _rows(ranks[me], sizes[me], 1).requires_grad_()
    out = comm.esp_all_gather(x, sizes, group, async_op=async_op).wait()
    expected = torch.cat([_rows(r, n, 1) for r, n in zip(ranks, sizes)])
    grads = [_rows(r, sum(sizes), 2) for r in ranks]
    out.backward(grads[me])
    start = sum(sizes[:me])
    expected_grad = _rank_order_sum([g[start : start + sizes[me]] for g in grads])
    errors = {"ag_value": _err(out, expected), "ag_grad": _err(x.grad, expected_grad)}
    # Reduce-scatter: every rank holds partial sums of all blocks; this rank gets its block's sum in rank order.
    y = _rows(ranks[me], sum(sizes), 3).requires_grad_()
    out = comm.esp_reduce_scatter(y, sizes, group, async_op=async_op).wait()
    expected = _rank_order_sum([_rows(r, sum(sizes), 3)[start : start + sizes[me]] for r in ranks])
    out.backward(_rows(ranks[me], sizes[me], 4))
    expected_grad = torch.cat([_rows(r, n, 4) for r, n in zip(ranks, sizes)])
    errors.update(rs_value=_err(out, expected), rs_grad=_err(y.grad, expected_grad))
    errors["rs_bits_equal"] = 0.0 if torch.equal(out, expected) else 1.0
    return {k: _max(v) for k, v in errors.items()}


def transport_all_to_all() -> dict:
    """`comm.transport.all_to_all_single` (gloo: receives posted, then sends) against torch.distributed's own, on
    uneven splits with zero blocks, synchronous and asynchronous (its future completes, `wait()` after it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mismatches, cases = 0.0, 0
    for shift in (0, 2):
        table = [[(i + j + shift) % 3 for j in range(world)] for i in range(world)]  # table[i][j]: rows i sends j
        in_splits, out_splits = table[rank], [table[r][rank] for r in range(world)]
        x = _rows(rank, sum(in_splits), 5 + shift)
        want, got = x.new_empty(sum(out_splits), WIDTH), x.new_empty(sum(out_splits), WIDTH)
        dist.all_to_all_single(want, x, out_splits, in_splits)
        for async_op in (False, True):
            got.zero_()
            work = all_to_all_single(got, x, out_splits, in_splits, group=dist.group.WORLD, async_op=async_op)
            if async_op:
                work.get_future().wait()
                assert work.is_completed() and work.wait()
            mismatches += 0.0 if torch.equal(got, want) else 1.0
            cases += 1
    return {"mismatches": _max(mismatches), "cases": cases}


def _rank_order_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item() if a.numel() else 0.0


def collective_records(group) -> list[list]:
    """What `issue` sees for one differentiated all-gather and reduce-scatter (kind, purpose, backward)."""
    seen = []
    issue = comm_moe.issue
    comm_moe.issue = lambda record, start: (seen.append(record), issue(record, start))[1]
    try:
        x = torch.ones(2, WIDTH, requires_grad=True)
        comm.esp_reduce_scatter(comm.esp_all_gather(x, [2, 2], group).wait(), [2, 2], group).wait().sum().backward()
    finally:
        comm_moe.issue = issue
    return [[r.kind, r.purpose, r.backward, r.nbytes > 0] for r in seen]


# ------------------------------------------------------------------------------------------ 2. the MoE layer


def f_slice(name: str, full: torch.Tensor, esp_rank: int, esp: int, gated: bool) -> torch.Tensor:
    """This ESP rank's slice of a whole expert weight (E already sliced): weight1 [L, F (2F), H] along F
    (SwiGLU: its gate slice then its up slice), weight2 [L, H, F] along F."""
    f = FFN // esp
    lo, hi = esp_rank * f, (esp_rank + 1) * f
    if name.endswith("weight2"):
        return full[:, :, lo:hi]
    if gated:
        return torch.cat([full[:, lo:hi], full[:, FFN + lo : FFN + hi]], dim=1)
    return full[:, lo:hi]


def load_slices(layer: MoELayer, ref: MoELayer, first: int, esp_rank: int, esp: int) -> None:
    local = layer.num_local_experts
    with torch.no_grad():
        for name, param in layer.named_parameters():
            src = dict(ref.named_parameters())[name]
            if name.startswith("experts."):
                src = f_slice(name, src[first : first + local], esp_rank, esp, layer.cfg.gated)
            param.copy_(src)


def compare(fields: dict, esp: int, solo_group, rank: int) -> dict:
    config = ep_tconfig(1)
    ref = MoELayer(config, layer_config(**fields), ep_group=solo_group, expert_dp_group=solo_group)
    global_weights(ref)
    layer = MoELayer(config, layer_config(**fields), layer_number=1)
    first = parallel_state.get_expert_model_parallel_rank() * layer.num_local_experts
    esp_rank = parallel_state.get_expert_tensor_parallel_rank()
    load_slices(layer, ref, first, esp_rank, esp)
    x, grad = _inputs(rank)
    out_ref, xg_ref, pg_ref = run(ref, x, grad, True)
    out, xg, pg = run(layer, x, grad, True)
    errors = {"output": (out - out_ref).abs().max(), "input_grad": (xg - xg_ref).abs().max()}
    router = [  # relative to the gradient's largest entry: the router's grads sum over every token's choices
        (pg[n] - pg_ref[n]).abs().max() / pg_ref[n].abs().max().clamp_min(1e-30)
        for n in pg
        if not n.startswith("experts.") and pg[n] is not None
    ]
    errors["router_and_shared_grads"] = torch.stack(router).max()
    served = parallel_state.get_expert_tensor_and_model_parallel_group()
    expert_err = []
    for name in ("experts.weight1", "experts.weight2"):
        summed = pg_ref[name].clone()
        dist.all_reduce(summed, group=served)  # a slice's grad collects the tokens of all ranks it served
        local = f_slice(name, summed[first : first + layer.num_local_experts], esp_rank, esp, layer.cfg.gated)
        expert_err.append((pg[name] - local).abs().max())
    errors["expert_grads"] = torch.stack(expert_err).max()
    figures = torch.stack([errors[k].double() for k in errors])
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    result = dict(zip(errors, figures.tolist()))
    result["output_abs_mean"] = out.abs().mean().item()
    result["stats_match"] = _max(0.0 if torch.equal(layer.stats.sums, ref.stats.sums) else 1.0) == 0.0
    result["weight1_shape"] = list(layer.experts.weight1.shape)
    return result


# ------------------------------------------------------------------------------ 3. host syncs, collectives


def host_syncs(fields: dict, rank: int) -> dict:
    layer = MoELayer(ep_tconfig(1), layer_config(**fields), layer_number=1)
    x, grad = _inputs(rank)
    run(layer, x, grad, True)
    with count_host_syncs(torch.device("cpu")) as syncs:
        run(layer, x, grad, True)
    return {"max": _max(syncs.count), "min": -_max(-syncs.count), "events": syncs.events}


def layer_records(fields: dict, rank: int) -> list[list]:
    layer = MoELayer(ep_tconfig(1), layer_config(**fields), layer_number=3)
    x, grad = _inputs(rank)
    seen = []
    issue = comm_moe.issue
    comm_moe.issue = lambda record, start: (seen.append(record), issue(record, start))[1]
    try:
        run(layer, x, grad, True)
    finally:
        comm_moe.issue = issue
    return [[r.kind, r.purpose, r.layer, r.backward] for r in seen]


# ----------------------------------------------------------------------------------------- 4. checkpoints

PREFIX = "decoder.layers.0.mlp."


def save_layer(fields: dict, ckpt_dir: str, solo_group) -> None:
    """This layout's layer holding the global weights' slices, saved."""
    layer = MoELayer(ep_tconfig(1), layer_config(**fields), layer_number=1)
    ref = MoELayer(ep_tconfig(1), layer_config(**fields), ep_group=solo_group, expert_dp_group=solo_group)
    global_weights(ref)
    esp = parallel_state.get_expert_tensor_parallel_world_size()
    first = parallel_state.get_expert_model_parallel_rank() * layer.num_local_experts
    load_slices(layer, ref, first, parallel_state.get_expert_tensor_parallel_rank(), esp)
    dist_checkpointing.save(layer.sharded_state_dict(prefix=PREFIX), ckpt_dir)


def load_layer(fields: dict, ckpt_dir: str, solo_group) -> float:
    """Load into this layout's layer: the largest difference from the global weights' slices (over ranks)."""
    layer = MoELayer(ep_tconfig(1), layer_config(**fields), layer_number=1)
    with torch.no_grad():
        for param in layer.parameters():
            param.fill_(7.0)  # nothing left from the initialisation can pass
    loaded = dist_checkpointing.load(layer.sharded_state_dict(prefix=PREFIX), ckpt_dir)
    layer.load_state_dict({k[len(PREFIX) :]: v for k, v in loaded.items()})
    ref = MoELayer(ep_tconfig(1), layer_config(**fields), ep_group=solo_group, expert_dp_group=solo_group)
    global_weights(ref)
    esp = parallel_state.get_expert_tensor_parallel_world_size()
    first = parallel_state.get_expert_model_parallel_rank() * layer.num_local_experts
    expected = MoELayer(ep_tconfig(1), layer_config(**fields), layer_number=1)
    load_slices(expected, ref, first, parallel_state.get_expert_tensor_parallel_rank(), esp)
    err = max((p - dict(expected.named_parameters())[n]).abs().max().item() for n, p in layer.named_parameters())
    return _max(err)


def checkpoints(solo_group, base: str) -> dict:
    results = {}
    for kind, fields in (("gelu", dict(gate="topk")), ("swiglu", dict(gate="topk", expert_type="swiglu"))):
        for save_at, loads in (((2, 2), [(1, 1), (1, 2), (1, 4), (4, 1), (2, 2)]), ((1, 4), [(2, 2)])):
            ckpt_dir = os.path.join(base, f"{kind}_esp{save_at[0]}_ep{save_at[1]}")
            if dist.get_rank() == 0:
                os.makedirs(ckpt_dir, exist_ok=True)
            dist.barrier()
            _init(*save_at)
            save_layer(fields, ckpt_dir, solo_group)
            parallel_state.destroy_model_parallel()
            for esp, ep in loads:
                _init(esp, ep)
                name = f"checkpoint/{kind}/esp{save_at[0]}_ep{save_at[1]}->esp{esp}_ep{ep}"
                results[name] = load_layer(fields, ckpt_dir, solo_group)
                parallel_state.destroy_model_parallel()
    return results


def _init(esp: int, ep: int) -> None:
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep, expert_tensor_parallel_size=esp)
    model_parallel_cuda_manual_seed(1234)


def _progress(rank: int, name: str) -> None:
    if os.environ.get("MOE_WORKER_VERBOSE"):
        print(f"[rank {rank}] {name} done", file=sys.stderr, flush=True)


def cases() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    solo = [dist.new_group([r]) for r in range(world)][rank]
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair, pair_ranks = pairs[rank // 2], [0, 1] if rank < 2 else [2, 3]
    results = {}
    for sizes in ([3, 5], [0, 4], [2, 0], [0, 0]):
        for async_op in (True, False):
            name = f"collectives/pair/{sizes}/{'async' if async_op else 'sync'}"
            results[name] = collectives(pair, pair_ranks, sizes, async_op)
    for sizes in ([2, 0, 3, 1], [4, 4, 4, 4], [0, 0, 0, 0]):
        results[f"collectives/world/{sizes}"] = collectives(dist.group.WORLD, list(range(world)), sizes, True)
    results["collectives/records"] = collective_records(pair)
    results["transport"] = transport_all_to_all()
    for layout, (esp, ep) in LAYOUTS.items():
        _init(esp, ep)
        for name, fields in CASES.items():
            results[f"{layout}/{name}"] = compare(fields, esp, solo, rank)
            _progress(rank, f"{layout}/{name}")
        for name in ("topk_cap1_v", "topk_cap1_padded", "swiglu_v"):
            results[f"{layout}/host_syncs/{name}"] = host_syncs(CASES[name], rank)
            results[f"{layout}/records/{name}"] = layer_records(CASES[name], rank)
        parallel_state.destroy_model_parallel()
    base = os.path.join(tempfile.gettempdir(), f"esp_worker_ckpt_{os.environ.get('MASTER_PORT', '0')}")
    results.update(checkpoints(solo, base))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)
    return results
