"""The profiler's micro-benchmarks and their fits: each kind's (n, ms) points measured on the running cluster,
agreed over the world, fitted to the cost model's lines (`cost_model.fit_linear`).

Inputs: `ProfileGroups` (a kind whose group has one rank is not measured: its fit is 0) and `ProfileSettings`.
Outputs: `measure_fits` -> `ClusterFits`, the same on every rank (the table's MAX over the world); `model_error`,
`overhead_fits`. Invariant: every call runs between world barriers with the device synchronized; one warm-up,
then the median of `repeats` timed calls. Collective: every rank calls `measure_fits`. What each kind times and
why: docs/internals/overlap.md ("The profiler").
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import build_module

from megatron_moe.comm.core import group_size
from megatron_moe.comm.profiling import (
    agree_profile,
    esp_traffic,
    profile_all_reduce,
    profile_all_to_all,
    profile_barrier,
)
from megatron_moe.overlap.cost_model import (
    BACKWARD_KINDS,
    DENSE_KINDS,
    FIT_KINDS,
    ClusterFits,
    LayerSizes,
    LinearFit,
    fit_linear,
    layer_time_ms,
)
from megatron_moe.overlap.profile_settings import DenseWork, ExpertWork, ProfileGroups, ProfileSettings, size_of
from megatron_moe.platform import current_platform, synchronize

PIPELINE_KINDS = ("pipeline", "pipeline_bwd")
DENSE_MEASURED = tuple(kind for base in DENSE_KINDS for kind in (base, f"{base}_bwd"))
MEASURED_KINDS = (*FIT_KINDS, *BACKWARD_KINDS, *PIPELINE_KINDS, *DENSE_MEASURED)


def timed_ms(calls: Sequence[Callable[[], Any]], repeats: int) -> list[float]:
    """One warm-up round, then `repeats` rounds of the calls in order, each call between world barriers with the
    device synchronized: the median of each call's times."""
    times: list[list[float]] = [[] for _ in calls]
    for i in range(repeats + 1):
        for call, kept in zip(calls, times):
            profile_barrier()
            synchronize()
            start = time.perf_counter()
            call()
            synchronize()
            if i > 0:
                kept.append(1000.0 * (time.perf_counter() - start))
    return [statistics.median(kept) for kept in times]


def comm_calls(kind: str, group, nbytes: int, device) -> tuple[int, Callable[[], Any]]:
    """(the bytes actually moved, the call) for one message size of `kind`."""
    p = group_size(group)
    numel = max(1, nbytes // 4 // p) * p
    buffer = torch.ones(numel, dtype=torch.float32, device=device)
    scratch = torch.empty_like(buffer)
    if kind == "a2a":
        return numel * 4, lambda: profile_all_to_all(buffer, scratch, group)
    if kind == "ar":
        return numel * 4, lambda: profile_all_reduce(buffer, group)
    return numel * 4, lambda: esp_traffic(kind, buffer, scratch, group)


def _expert_points(
    work: ExpertWork, groups: ProfileGroups, repeats: int, device
) -> dict[str, list[tuple[float, float]]]:
    """(n, ms) points of "gemm", "gemm_bwd" (per chunk: a chunk's multiply-adds, the pipeline's time / r) and
    "gemm_dw" (the weight gradients over one chunk's rows at each degree), measured on this rank alone; with an
    EP group, also "pipeline" / "pipeline_bwd" (r, ms): the same pipeline with the real all-to-alls (and ESP
    collectives), forward and input gradients at each degree, on the first row count."""
    from megatron_moe.moe.experts import FFNExperts, mlp_weight_grads
    from megatron_moe.moe.pipeline import Links, pipelined_experts

    def init(weight):
        return torch.nn.init.normal_(weight, std=0.02)

    l_size, x_size, h_size = work.num_local_experts, work.sources, work.hidden_size
    experts = FFNExperts(
        num_local_experts=l_size,
        hidden_size=h_size,
        ffn_hidden_size=work.ffn_hidden_size,
        gated=work.gated,
        init_method=init,
        output_init_method=init,
    ).to(device)
    experts.requires_grad_(False)  # the pipeline's backward then runs the input gradients alone
    alone = Links(None, None, None, None)  # no group: every all-to-all is the identity
    macs = work.macs_per_row()
    points: dict[str, list[tuple[float, float]]] = {kind: [] for kind in ("gemm", "gemm_bwd", "gemm_dw")}
    out: list[torch.Tensor] = []  # the forward's output, until the backward call takes it

    def forward_backward(rows_RH, counts, received_XL, r, links, esp_rank=0):
        grad_RH = torch.randn_like(rows_RH)
        run = functools.partial(pipelined_experts, rows_RH, experts, counts, received_XL, (r, r), links)
        return [lambda: out.append(run(esp_rank=esp_rank)), lambda: out.pop().backward(grad_RH)]

    for rows in work.rows:
        block = work.block_rows(rows)
        q = block * l_size * x_size
        counts, received_XL = [block * x_size] * l_size, [[block] * l_size for _ in range(x_size)]
        x_QH = torch.randn(q, h_size, device=device, requires_grad=True)
        width = experts.weight1.shape[1]
        operands = [torch.randn(q, n, device=device) for n in (h_size, h_size, work.ffn_hidden_size, width)]
        for r in work.degrees:
            chunk_counts = [c // r for c in counts]
            dy, x, a, dh = (t[: sum(chunk_counts)] for t in operands)
            weight_grads = mlp_weight_grads(dy, x, a, dh, chunk_counts, (True, True))
            calls = [*forward_backward(x_QH, counts, received_XL, r, alone), weight_grads]
            forward_ms, backward_ms, dw_ms = timed_ms(calls, repeats)
            chunk_macs = q // r * macs
            points["gemm"].append((chunk_macs, forward_ms / r))
            points["gemm_bwd"].append((chunk_macs, backward_ms / r))
            points["gemm_dw"].append((chunk_macs, dw_ms))
    if size_of(groups.ep) > 1:
        points |= _pipeline_points(work, groups, forward_backward, repeats, device)
    return points


def _dense_layer(work: DenseWork, device):
    """One dense megatron-core TransformerLayer on its local backend (megatron-core's own local spec: the model's
    `megatron_moe.model.spec` differs in the norm class and the linears' dW store, not in the arithmetic, and
    overlap/ sits below model/), on this run's TP group from megatron-core's parallel state (which must be
    initialized), and the router's linear."""
    from megatron.core import parallel_state as ps

    config = TransformerConfig(
        num_layers=1,
        hidden_size=work.hidden_size,
        ffn_hidden_size=work.ffn_hidden_size,
        num_attention_heads=work.num_attention_heads,
        num_query_groups=work.num_query_groups,
        normalization=work.normalization,
        gated_linear_unit=work.gated,
        activation_func=F.silu if work.gated else F.gelu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        sequence_parallel=work.sequence_parallel,
        use_cpu_initialization=device.type == "cpu",
    )
    spec = get_gpt_layer_local_spec(normalization=work.normalization)
    layer = build_module(spec, config=config, layer_number=1)
    gate = torch.nn.Linear(work.hidden_size, work.num_experts, bias=False)
    return layer.to(device), gate.to(device), ps.get_tensor_model_parallel_world_size()


def _dense_points(work: DenseWork, device) -> dict[str, list[tuple[float, float]]]:
    """(tokens, ms) points of `DENSE_MEASURED` at each batch size (docs/internals/overlap.md)."""
    layer, gate, tp = _dense_layer(work, device)
    points: dict[str, list[tuple[float, float]]] = {kind: [] for kind in DENSE_MEASURED}
    out: list[torch.Tensor] = []

    def route(x_SBH):  # pre-MLP norm, router, top-k, the order's sort and gather: the rows the dispatch sends
        h_TH = layer.pre_mlp_layernorm(x_SBH).reshape(-1, work.hidden_size)
        probs_TE = torch.softmax(gate(h_TH), dim=-1)
        weights_TK, experts_TK = torch.topk(probs_TE, work.topk, dim=-1)
        order_R = torch.argsort(experts_TK.reshape(-1), stable=True)
        return h_TH.index_select(0, order_R // work.topk) * weights_TK.reshape(-1)[order_R, None], order_R

    def unroute(x_SBH, rows_RH, order_R):  # the weighted rows back to their tokens, and the residual add
        out_TH = torch.zeros(x_SBH.numel() // work.hidden_size, work.hidden_size, device=device)
        return out_TH.index_add(0, order_R // work.topk, rows_RH).view_as(x_SBH) + x_SBH

    def pair(forward):  # the forward, then its backward from a gradient of ones (input and weight gradients)
        return [lambda: out.append(forward()), lambda: (y := out.pop()).backward(torch.ones_like(y))]

    split = tp if work.sequence_parallel else 1
    for batch in work.batches:
        x_SBH = torch.randn(work.seq_length // split, batch, work.hidden_size, device=device, requires_grad=True)
        rows_RH, order_R = (t.detach() for t in route(x_SBH))
        rows_RH.requires_grad_(True)
        calls = [
            *pair(lambda x=x_SBH: layer._forward_attention(x, attention_mask=None)[0]),
            *pair(lambda x=x_SBH: layer._forward_mlp(x)),
            *pair(lambda x=x_SBH: route(x)[0]),
            *pair(lambda x=x_SBH, r=rows_RH, o=order_R: unroute(x, r, o)),
        ]
        times = timed_ms(calls, work.repeats)
        tokens = batch * work.seq_length // split
        for kind, ms in zip(DENSE_MEASURED, times):
            points[kind].append((tokens, ms))
    return points


def _pipeline_points(work: ExpertWork, groups: ProfileGroups, forward_backward, repeats, device):
    """ "pipeline" / "pipeline_bwd" (r, ms): every rank sends `block` rows to each expert of the EP group (so each
    expert gets `block` from every source, as in `_expert_points`), through the real links."""
    from megatron_moe.moe.pipeline import Links

    g_size, p_size = size_of(groups.ep), max(size_of(groups.esp), 1)
    esp = groups.esp if p_size > 1 else None
    links = Links(groups.ep, esp, None, None)
    block = work.block_rows(work.rows[0])
    counts = [block] * (g_size * work.num_local_experts)
    received_XL = [[block] * work.num_local_experts for _ in range(g_size * p_size)]
    rows_RH = torch.randn(sum(counts), work.hidden_size, device=device, requires_grad=True)
    esp_rank = dist.get_rank(esp) if esp is not None else 0
    points = {"pipeline": [], "pipeline_bwd": []}
    for r in work.degrees:
        forward_ms, backward_ms = timed_ms(forward_backward(rows_RH, counts, received_XL, r, links, esp_rank), repeats)
        points["pipeline"].append((r, forward_ms))
        points["pipeline_bwd"].append((r, backward_ms))
    return points


def profile_layer_sizes(work: ExpertWork, groups: ProfileGroups) -> LayerSizes:
    """The `LayerSizes` of the work `_pipeline_points` runs (float32 rows), for the model's part of its time."""
    g_size, p_size = size_of(groups.ep), max(size_of(groups.esp), 1)
    sent = work.block_rows(work.rows[0]) * g_size * work.num_local_experts
    row_bytes = work.hidden_size * 4
    return LayerSizes(
        n_a2a=float(sent * row_bytes),
        n_ag=float(p_size * sent * row_bytes) if p_size > 1 else 0.0,
        n_rs=float(p_size * sent * row_bytes) if p_size > 1 else 0.0,
        n_exp=float(p_size * sent * work.macs_per_row()),
        ep=g_size,
        esp=p_size,
    )


def overhead_fits(fits: ClusterFits, sizes: LayerSizes, measured: dict[str, list[tuple[float, float]]]) -> dict:
    """The "chunk" / "chunk_bwd" lines: the pipeline's measured time beyond the model's (without them) at each
    degree r > 1, t = alpha + (r - 1) beta; "unchunked" / "unchunked_bwd": the same at r = 1, alpha alone (the
    docs/internals/overlap.md)."""
    lines = {}
    for suffix, raw, direction in (("", "pipeline", "forward"), ("_bwd", "pipeline_bwd", "backward")):
        residual = [
            (r - 1, ms - layer_time_ms(fits, sizes, r, direction, dw_in_backward=False)[0]) for r, ms in measured[raw]
        ]
        lines["chunk" + suffix] = fit_linear([(n, ms) for n, ms in residual if n > 0])
        at_1 = [ms for n, ms in residual if n == 0]
        if at_1:
            lines["unchunked" + suffix] = LinearFit(alpha=at_1[0], beta=0.0, points=((0.0, at_1[0]),))
    return lines


def _kind_group(kind: str, groups: ProfileGroups):
    return {"a2a": groups.ep, "ag": groups.esp, "rs": groups.esp, "ar": groups.dp}.get(kind)


def measure_fits(groups: ProfileGroups, settings: ProfileSettings, *, cluster: dict | None = None) -> ClusterFits:
    """Run the micro-benchmarks on every rank (all must call it) and fit one line per kind, the same on all."""
    settings.validate()
    device = current_platform().device
    points = _expert_points(settings.experts, groups, settings.repeats, device)
    if settings.dense is not None:
        points |= _dense_points(settings.dense, device)
    for kind in ("a2a", "ag", "rs", "ar"):
        group = _kind_group(kind, groups)
        if size_of(group) > 1:  # else no such collective on this cluster: a zero fit (every rank has the same sizes)
            calls = [comm_calls(kind, group, n, device) for n in settings.comm_bytes]
            times = timed_ms([call for _, call in calls], settings.repeats)
            points[kind] = [(n, ms) for (n, _), ms in zip(calls, times)]
    width = max(len(p) for p in points.values())
    table = torch.zeros(len(MEASURED_KINDS), width, dtype=torch.float64)  # ms per (kind, size), this rank's
    for row, kind in enumerate(MEASURED_KINDS):
        for col, (_, ms) in enumerate(points.get(kind, ())):
            table[row, col] = ms
    agreed_rows = agree_profile(table.to(device)).cpu().tolist()
    agreed = {
        kind: [(n, ms) for (n, _), ms in zip(points.get(kind, ()), row)]
        for kind, row in zip(MEASURED_KINDS, agreed_rows)
    }
    fits = {
        kind: fit_linear(agreed[kind]) if agreed[kind] else LinearFit(alpha=0.0, beta=0.0)
        for kind in (*FIT_KINDS, *BACKWARD_KINDS)
    }
    fits |= {kind: fit_linear(agreed[kind]) for kind in DENSE_MEASURED if agreed[kind]}
    fits = ClusterFits(fits=fits, cluster=dict(cluster or {}))
    if not agreed["pipeline"]:  # no EP group: nothing is pipelined
        return fits
    sizes = profile_layer_sizes(settings.experts, groups)
    fits = dataclasses.replace(fits, fits={**fits.fits, **overhead_fits(fits, sizes, agreed)})
    return dataclasses.replace(fits, model_error=model_error(fits, sizes, agreed))


def model_error(fits: ClusterFits, sizes: LayerSizes, measured: dict[str, list[tuple[float, float]]]) -> dict:
    """ "forward" / "backward": the model's (overhead lines included) largest |measured - model| / measured over
    the profiled degrees of the pipeline: the smallest gain the solver can tell from noise on this cluster
    (`megatron_moe.overlap.cost_model.required_gain`)."""
    errors = {}
    for raw, direction in (("pipeline", "forward"), ("pipeline_bwd", "backward")):
        model = [(ms, layer_time_ms(fits, sizes, r, direction, dw_in_backward=False)[0]) for r, ms in measured[raw]]
        errors[direction] = max(abs(ms - predicted) / ms for ms, predicted in model if ms > 0)
    return errors
