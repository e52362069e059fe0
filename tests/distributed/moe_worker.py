"""A shared job's part (job_runner.py, 4 gloo ranks): our MoE layer at EP=2 and EP=4 against the EP=1 layer.

The EP=1 reference is the same layout with DP instead of EP: every rank runs a
single-rank layer holding ALL experts on its own tokens. With the same global
weights, the EP layer's output and input/router grads on rank r equal the
reference's on rank r, and its local experts' grads equal the reference's
grads of those experts summed over the EP group (whose tokens they served).
Every figure is the max over ranks; rank 0 writes `{case: figures}` to $RESULTS.
Also: a checkpoint saved at EP=2 (expert-DP replicas) loads at EP=4, the
metric reduction does not hang when half the ranks have no MoE layer, the
host waits for the device once per layer forward+backward, and every
collective the layer issues goes through megatron_moe.comm's choke point.
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist

import megatron_moe  # noqa: F401  before megatron-core: its fused functions then compile on first call

warnings.filterwarnings("ignore")

from megatron.core import dist_checkpointing, parallel_state  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

from megatron_moe.comm import moe as comm_moe  # noqa: E402
from megatron_moe.moe import Bf16OnTheWire, MoELayer, MoELayerConfig, collect_moe_metrics  # noqa: E402
from megatron_moe.platform import count_host_syncs  # noqa: E402

H, FFN, E = 32, 48, 8
S, B = 12, 2

PADDED = {"pad_expert_input_to_capacity": True}  # the capacity-padded all-to-all
# name -> (layer settings, train mode). rts and noisy_topk are random in training: compared in eval.
CASES = {
    "topk_dropless_v": (dict(gate="topk"), True),
    "topk_dropless_padded": (dict(gate="topk", **PADDED), True),
    "topk_cap1_v": (dict(gate="topk", capacity_factor=1.0), True),
    "topk_cap1_padded": (dict(gate="topk", capacity_factor=1.0, **PADDED), True),
    "topk_adaptive_padded": (dict(gate="topk", capacity_factor=-1.0, **PADDED), True),
    "switch_cap125_v": (dict(gate="switch", topk=1, capacity_factor=1.25), True),
    "sigmoid_dropless_v": (dict(gate="sigmoid", z_loss_coeff=0.01), True),
    "xmoe_cap1_padded_dense": (dict(gate="xmoe", capacity_factor=1.0, **PADDED, ordering="dense"), True),
    "cosine_dropless_v_dense": (dict(gate="cosine", ordering="dense"), True),
    "expert_choice_v": (dict(gate="expert_choice"), True),
    "expert_choice_padded": (dict(gate="expert_choice", **PADDED), True),
    "soft_v": (dict(gate="soft", soft_slots=2), True),
    "soft_padded": (dict(gate="soft", soft_slots=2, **PADDED), True),
    "bpr_cap075_v": (dict(gate="bpr", capacity_factor=0.75), True),
    "rts_eval_cap075_padded": (dict(gate="rts", capacity_factor=0.75, **PADDED), False),
    "noisy_eval_v": (dict(gate="noisy_topk"), False),
    "swiglu_shared_v": (dict(gate="topk", expert_type="swiglu", shared_expert_ffn_hidden_size=24), True),
    "bf16_wire_hook_v": (dict(gate="topk"), True),
    # DeepSeek-V3's router (sigmoid, expert bias, group-limited top-k, scaled) with its sequence-level balancing loss
    # and a gated shared expert (Qwen2-MoE); EP=1 equals megatron-core's layer (tests/unit/test_router_deepseek.py).
    "deepseek_seq_aux_gated_shared_v": (
        dict(gate="sigmoid", topk=4, expert_bias=True, num_groups=4, group_topk=2, topk_scaling_factor=2.5,
             load_balancing="seq_aux_loss", aux_loss_coeff=0.1, expert_type="swiglu", shared_expert_ffn_hidden_size=24,
             shared_expert_gate=True),
        True,
    ),
}  # fmt: skip


# name -> layer settings whose host syncs per forward+backward are counted (design: exactly 1, in planning).
SYNC_CASES = {
    "topk_dropless_v": dict(gate="topk"),
    "topk_cap1_v": dict(gate="topk", capacity_factor=1.0),
    "topk_adaptive_v": dict(gate="topk", capacity_factor=-0.5),
    "topk_dropless_padded": dict(gate="topk", **PADDED),
    "topk_cap1_padded": dict(gate="topk", capacity_factor=1.0, **PADDED),
    "topk_adaptive_padded": dict(gate="topk", capacity_factor=-1.0, **PADDED),
    "xmoe_cap1_v_dense": dict(gate="xmoe", capacity_factor=1.0, ordering="dense"),
    "expert_choice_padded": dict(gate="expert_choice", **PADDED),
    "soft_v": dict(gate="soft", soft_slots=2),
    "swiglu_shared_v": dict(gate="topk", expert_type="swiglu", shared_expert_ffn_hidden_size=24),
}


def tconfig(ep: int) -> TransformerConfig:
    return TransformerConfig(
        num_layers=2,
        hidden_size=H,
        ffn_hidden_size=FFN,
        num_attention_heads=4,
        num_moe_experts=E,
        moe_router_topk=2,
        add_bias_linear=False,
        use_cpu_initialization=True,
        expert_model_parallel_size=ep,
    )


def layer_config(**fields) -> MoELayerConfig:
    """A case's layer: tconfig's sizes and top-k, router losses off unless the case sets them."""
    sizes = dict(num_experts=E, hidden_size=H, ffn_hidden_size=FFN, topk=2)
    return MoELayerConfig(**{**sizes, "aux_loss_coeff": 0.0, **fields})


def global_weights(layer: MoELayer) -> None:
    """Overwrite every parameter with values seeded by its name: the same on every rank and layout."""
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if param.dim() == 0:
                continue
            g = torch.Generator().manual_seed(sum(map(ord, name)))
            param.copy_(torch.randn(param.shape, generator=g) * (0.5 if "gate" in name else 0.2))


def load_from_reference(layer: MoELayer, ref: MoELayer, first: int) -> None:
    local = layer.num_local_experts
    with torch.no_grad():
        for name, param in layer.named_parameters():
            src = dict(ref.named_parameters())[name]
            param.copy_(src[first : first + local] if name.startswith("experts.") else src)


def run(layer, x, grad, train):
    layer.train(train)
    x = x.clone().requires_grad_()
    out, _ = layer(x)
    out.backward(grad)
    return out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


def compare(ep: int, fields: dict, train: bool, solo_group, rank: int, hooks=()) -> dict:
    config = tconfig(ep)
    ref = MoELayer(config, layer_config(**fields), ep_group=solo_group, expert_dp_group=solo_group)
    global_weights(ref)
    layer = MoELayer(config, layer_config(**fields), hooks=hooks)
    ep_group = parallel_state.get_expert_model_parallel_group()
    first = ep_group.rank() * layer.num_local_experts
    load_from_reference(layer, ref, first)
    g = torch.Generator().manual_seed(100 + rank)
    # Rank-dependent skew so capacities bind differently on different ranks.
    x = torch.randn(S, B, H, generator=g) + 0.5 * torch.randn(H, generator=g)
    grad = torch.randn(S, B, H, generator=g)
    out_ref, xg_ref, pg_ref = run(ref, x, grad, train)
    out, xg, pg = run(layer, x, grad, train)
    errors = {
        "output": (out - out_ref).abs().max(),
        "input_grad": (xg - xg_ref).abs().max(),
        "output_rel": (out - out_ref).abs().max() / out_ref.abs().max(),
    }
    router = [(pg[n] - pg_ref[n]).abs().max() for n in pg if not n.startswith("experts.") and pg[n] is not None]
    errors["router_and_shared_grads"] = torch.stack(router).max() if router else torch.tensor(0.0)
    expert_err = []
    for name in ("experts.weight1", "experts.weight2"):
        summed = pg_ref[name].clone()
        dist.all_reduce(summed, group=ep_group)  # an expert's grad collects all its EP group's tokens
        expert_err.append((pg[name] - summed[first : first + layer.num_local_experts]).abs().max())
    errors["expert_grads"] = torch.stack(expert_err).max()
    errors["expert_grads_rel"] = errors["expert_grads"] / max(
        pg_ref[n].abs().max() for n in ("experts.weight1", "experts.weight2")
    )
    figures = torch.stack([errors[k].double() for k in errors])
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    result = dict(zip(errors, figures.tolist()))
    result["output_abs_mean"] = out.abs().mean().item()
    if train:
        same_counts = torch.equal(layer.stats.sums[:E], ref.stats.sums[:E])
        result["stats_match"] = bool(_all_true(same_counts))
        result["dropped"] = int(_sum(layer.stats.sums[E].item()))
    return result


DEEPSEEK_MCORE = dict(  # megatron-core's spelling of the deepseek case (64 experts top-8 at the unit tier)
    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_num_groups=4,
    moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5, moe_router_load_balancing_type="seq_aux_loss",
    moe_aux_loss_coeff=0.1, moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=True, moe_router_topk=4,
)  # fmt: skip


def against_megatron_core(ep: int, rank: int) -> dict:
    """The deepseek case: our layer and megatron-core's MoELayer at this EP size with the same weights (this rank's
    experts, the same router, expert bias and gated shared expert) and tokens: output, dX, router/shared/expert dW."""
    from tools.bench_moe_layer import build_mcore, transformer_config

    config = transformer_config(H, FFN, E, 4, None, swiglu=True)
    for key, value in {**DEEPSEEK_MCORE, "expert_model_parallel_size": ep, "moe_router_pre_softmax": False}.items():
        setattr(config, key, value)
    config.__post_init__()
    mcore = build_mcore(config).train()
    ours = MoELayer(config, layer_config(**CASES["deepseek_seq_aux_gated_shared_v"][0]), layer_number=1).train()
    shared, mine = mcore.shared_experts, ours.shared_expert
    pairs = [(ours.gate.weight, None, mcore.router.weight), (mine.weight1, None, shared.linear_fc1.weight)]
    pairs += [(mine.weight2, None, shared.linear_fc2.weight), (mine.gate_weight, None, shared.gate_weight)]
    first = parallel_state.get_expert_model_parallel_rank() * ours.num_local_experts
    with torch.no_grad():
        for i, expert in enumerate(mcore.experts.local_experts):
            pairs += [(ours.experts.weight1, i, expert.linear_fc1.weight)]
            pairs += [(ours.experts.weight2, i, expert.linear_fc2.weight)]
        for seed, (ours_w, i, theirs_w) in enumerate(pairs):
            seed += 10 * first if seed >= 4 else 0  # every expert its own weights
            theirs_w.copy_(torch.randn(theirs_w.shape, generator=torch.Generator().manual_seed(seed)) * 0.2)
            (ours_w if i is None else ours_w[i]).copy_(theirs_w)
        bias_E = torch.randn(E, generator=torch.Generator().manual_seed(5)) * 0.05
        ours.gate.expert_bias.copy_(bias_E)
        mcore.router.expert_bias.copy_(bias_E)
    g = torch.Generator().manual_seed(200 + rank)
    x, grad = torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)
    (out, xg, _), (out_ref, xg_ref, _) = run(ours, x, grad, True), run(mcore, x, grad, True)
    errors = [(out - out_ref).abs().max(), (xg - xg_ref).abs().max()]
    for a, i, b in pairs:
        grad_a = a.grad if i is None else a.grad[i]
        errors.append((grad_a - b.grad).abs().max() / b.grad.abs().max().clamp(min=1e-6))
    figures = torch.stack([e.double() for e in errors[:6]] + [torch.stack(errors[6:]).max().double()])
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    names = ("output", "input_grad", "router_rel", "shared_fc1_rel", "shared_fc2_rel", "shared_gate_rel", "expert_rel")
    return dict(zip(names, figures.tolist()), output_abs_mean=out.abs().mean().item())


def global_aux_against_megatron_core(ep: int, rank: int) -> dict:
    """global_aux_loss (coefficient 0.1) in our layer and megatron-core's MoELayer at this EP size, the same weights,
    each rank its own tokens: a step of 2 micro-batches, the step's reset, a step of 1. After each micro-batch the
    outputs, dX, the accumulated router and expert grads and each rank's tracked loss (ours: its share times the 4
    ranks, `routing.router_losses`); after each step the logged figure (megatron-core's: its tracker summed over the
    TP x DP x CP ranks, averaged over the micro-batches). The counts are summed over all 4 ranks through `issue`."""
    from megatron.core.transformer.moe import moe_utils

    from megatron_moe.moe import finish_router_step
    from megatron_moe.moe.metrics import SCALARS
    from tools.bench_moe_layer import build_mcore, build_ours, transformer_config

    config = transformer_config(H, FFN, E, 2, None, swiglu=False)
    config.moe_router_load_balancing_type, config.moe_aux_loss_coeff = "global_aux_loss", 0.1
    config.expert_model_parallel_size = ep
    config.__post_init__()
    mcore = build_mcore(config).train()
    with torch.no_grad():  # one router on every rank, as after the DP broadcast
        mcore.router.weight.copy_(torch.randn(E, H, generator=torch.Generator().manual_seed(3)))
    ours = build_ours(config, mcore, None, "alltoallv").train()
    pairs = [(ours.gate.weight, None, mcore.router.weight)]  # the router first, then every local expert's
    for i, expert in enumerate(mcore.experts.local_experts):
        pairs += [
            (ours.experts.weight1, i, expert.linear_fc1.weight),
            (ours.experts.weight2, i, expert.linear_fc2.weight),
        ]
    column, world = E + SCALARS.index("load_balancing_sum"), dist.get_world_size()
    moe_utils.clear_aux_losses_tracker()
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()

    def tracked() -> tuple[float, float]:  # (ours, megatron-core's) this rank's sums so far
        theirs = tracker.get("global_load_balancing_loss", {"values": torch.zeros(1)})["values"][0].item()
        return (0.0 if ours.stats.sums is None else ours.stats.sums[column].item()), theirs

    counted, issue = [], comm_moe.issue

    def counting(record, start):
        counted.append(record.purpose == "sum_global_batch_counts")
        return issue(record, start)

    comm_moe.issue, errors = counting, {}
    try:
        for step, micro_batches in enumerate((2, 1)):
            for micro in range(micro_batches):
                g = torch.Generator().manual_seed(300 + 10 * rank + 3 * step + micro)
                x, grad = torch.randn(S, B, H, generator=g) * 2, torch.randn(S, B, H, generator=g)
                before = tracked()
                (out, xg, _), (out_ref, xg_ref, _) = run(ours, x, grad, True), run(mcore, x, grad, True)
                ours_loss, theirs_loss = (now - then for now, then in zip(tracked(), before))
                figures = {
                    "output": (out - out_ref).abs().max().item(),
                    "input_grad": (xg - xg_ref).abs().max().item(),
                    "tracked_loss_rel": abs(ours_loss - world * theirs_loss) / (world * theirs_loss),
                }
                rel = [
                    ((mine.grad if i is None else mine.grad[i]) - theirs.grad).abs().max() / theirs.grad.abs().max()
                    for mine, i, theirs in pairs
                ]
                figures["router_rel"], figures["expert_rel"] = rel[0].item(), max(rel[1:]).item()
                errors |= {k: max(errors.get(k, 0.0), v) for k, v in figures.items()}
            logged = collect_moe_metrics([ours], num_layers=1, num_experts=E)["moe aux loss"]
            theirs_values = tracker["global_load_balancing_loss"]["values"].clone()
            dist.all_reduce(theirs_values)  # megatron-core's reduce_aux_losses_tracker_across_ranks (TP x DP x CP)
            theirs_logged = theirs_values[0].item() / micro_batches
            errors[f"logged_rel_step{step}"] = abs(logged - theirs_logged) / theirs_logged
            moe_utils.clear_aux_losses_tracker()
            mcore.router.reset_global_aux_loss_tracker()  # megatron-core's finalize_model_grads
            finish_router_step([ours])  # our loop's
            for param in (*ours.parameters(), *mcore.parameters()):
                param.grad = None
    finally:
        comm_moe.issue = issue
    figures = torch.tensor([errors[k] for k in sorted(errors)], dtype=torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    result = dict(zip(sorted(errors), figures.tolist()))
    result["count_reductions"] = int(_sum(sum(counted)))  # 3 micro-batches x 4 ranks
    result["logged"] = theirs_logged
    return result


def _all_true(flag: bool) -> bool:
    t = torch.tensor([0 if flag else 1])
    dist.all_reduce(t)
    return int(t) == 0


def _sum(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)


def checkpoint_across_layouts(ep: int, ckpt_dir: str, solo_group) -> dict:
    """EP=2 saves (with expert-DP replicas), EP=4 loads: the experts must equal the global weights."""
    config = tconfig(ep)
    layer = MoELayer(config, layer_config(gate="xmoe"), layer_number=1)
    prefix = "decoder.layers.0.mlp."
    if ep == 2:
        global_weights(layer)  # global weights sliced for this EP rank
        ref = MoELayer(config, layer_config(gate="xmoe"), ep_group=solo_group, expert_dp_group=solo_group)
        global_weights(ref)
        first = parallel_state.get_expert_model_parallel_rank() * layer.num_local_experts
        load_from_reference(layer, ref, first)
        dist_checkpointing.save(layer.sharded_state_dict(prefix=prefix), ckpt_dir)
        return {}
    loaded = dist_checkpointing.load(layer.sharded_state_dict(prefix=prefix), ckpt_dir)
    layer.load_state_dict({k[len(prefix) :]: v for k, v in loaded.items()})
    ref = MoELayer(tconfig(1), layer_config(gate="xmoe"), ep_group=solo_group, expert_dp_group=solo_group)
    global_weights(ref)
    first = parallel_state.get_expert_model_parallel_rank() * layer.num_local_experts
    err = max(
        (
            dict(layer.named_parameters())[n]
            - (p[first : first + layer.num_local_experts] if n.startswith("experts.") else p)
        )
        .abs()
        .max()
        .item()
        for n, p in ref.named_parameters()
    )
    return {"max_abs_error": _max(err)}


def _max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def metrics_with_moe_less_ranks(rank: int, solo_group) -> dict:
    """Ranks 2 and 3 hold no MoE layer (as a pipeline stage without one): same reduction, no hang.

    The layer runs on ranks 0 and 1 alone (a 1-rank EP group each), as a stage's own layers would.
    """
    config = tconfig(1)
    layer = MoELayer(config, layer_config(), layer_number=2, ep_group=solo_group, expert_dp_group=solo_group)
    chunks = [layer] if rank < 2 else []
    if rank < 2:
        out, _ = layer(torch.randn(S, B, H))
        out.sum().backward()
    figures = collect_moe_metrics(chunks, num_layers=4, num_experts=E, max_keys=64)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, figures)
    return {
        "same_on_all_ranks": all(g == gathered[0] for g in gathered),
        "pairs_counted": gathered[0].get("moe/layer_002/tokens_max", 0) > 0,
        "keys": sorted(gathered[0]),
    }


def _inputs(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(S, B, H, generator=g) + 0.5 * torch.randn(H, generator=g), torch.randn(S, B, H, generator=g)


def host_syncs(ep: int, fields: dict, rank: int) -> dict:
    """Host waits in one training forward+backward of the layer (after a warm-up: kernel probes run once)."""
    config = tconfig(ep)
    layer = MoELayer(config, layer_config(**fields), layer_number=1)
    global_weights(layer)
    x, grad = _inputs(rank)
    run(layer, x, grad, True)
    with count_host_syncs(torch.device("cpu")) as syncs:
        run(layer, x, grad, True)
    return {"max": _max(syncs.count), "min": -_max(-syncs.count), "events": syncs.events}


def collectives_through_issue(ep: int, fields: dict, rank: int) -> dict:
    """Every torch.distributed call of a layer forward+backward (all-to-alls, on gloo their sends and receives),
    how many ran outside the `start` of megatron_moe.comm's `issue`, and what `issue` saw."""
    config = tconfig(ep)
    layer = MoELayer(config, layer_config(**fields), layer_number=3)
    global_weights(layer)
    x, grad = _inputs(rank)
    raw, seen, starting = [], [], []
    names = ("all_to_all_single", "all_reduce", "barrier", "isend", "irecv")
    originals = {name: getattr(dist, name) for name in names}

    def counting(name):
        return lambda *args, **kwargs: (raw.append(bool(starting)), originals[name](*args, **kwargs))[1]

    def started(start):
        starting.append(1)
        try:
            return start()
        finally:
            starting.pop()

    issue = comm_moe.issue
    comm_moe.issue = lambda record, start: (seen.append(record), issue(record, lambda: started(start)))[1]
    for name in originals:
        setattr(dist, name, counting(name))
    try:
        run(layer, x, grad, True)
    finally:
        comm_moe.issue = issue
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return {
        "raw_calls": len(raw),
        "raw_outside_issue": raw.count(False),
        "records": [[r.kind, r.purpose, r.layer, r.backward, r.nbytes > 0] for r in seen],
    }


def _progress(rank: int, ep: int, name: str) -> None:
    if os.environ.get("MOE_WORKER_VERBOSE"):
        print(f"[rank {rank}] ep{ep}/{name} done", file=sys.stderr, flush=True)


def cases() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    solo = [dist.new_group([r]) for r in range(world)][rank]  # every rank joins every new_group call
    ckpt_dir = os.path.join(tempfile.gettempdir(), f"moe_worker_ckpt_{os.environ.get('MASTER_PORT', '0')}")
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    results = {}
    for ep in (2, 4):
        parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
        model_parallel_cuda_manual_seed(1234)
        for name, (fields, train) in CASES.items():
            hooks = (Bf16OnTheWire(),) if name.startswith("bf16") else ()
            results[f"ep{ep}/{name}"] = compare(ep, fields, train, solo, rank, hooks)
            _progress(rank, ep, name)
        results[f"ep{ep}/megatron_core/deepseek"] = against_megatron_core(ep, rank)
        results[f"ep{ep}/megatron_core/global_aux_loss"] = global_aux_against_megatron_core(ep, rank)
        for name, fields in SYNC_CASES.items():
            results[f"ep{ep}/host_syncs/{name}"] = host_syncs(ep, fields, rank)
        if ep == 2:
            for name in ("topk_cap1_v", "topk_cap1_padded"):
                results[f"ep2/collectives/{name}"] = collectives_through_issue(ep, SYNC_CASES[name], rank)
        results[f"ep{ep}/checkpoint"] = checkpoint_across_layouts(ep, ckpt_dir, solo)
        _progress(rank, ep, "checkpoint")
        if ep == 4:
            results["ep4/metrics_without_moe_on_half_the_ranks"] = metrics_with_moe_less_ranks(rank, solo)
        parallel_state.destroy_model_parallel()
    dist.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(ckpt_dir, ignore_errors=True)
    return results
