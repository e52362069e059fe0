"""Micro-benchmarks that fit the cost model's lines (`megatron_moe.overlap.cost_model`) on the running cluster.

FSMoE section 6.2 ("performance model"): each collective at several message sizes and torch.matmul at several
shapes, t = alpha + n * beta fitted by least squares. Here, per kind:
- "a2a": all_to_all_single over the EP group, n = bytes each rank sends;
- "ag" / "rs": the ESP group's all-gather (n = bytes of the output) and reduce-scatter (n = bytes of the input),
  timed in their gloo form (`comm.profiling.esp_traffic`: one all_to_all_single of those bytes, plus the local
  sum of the reduce-scatter; on NCCL not yet the native collectives the layer uses for equal blocks);
- "ar": all_reduce over the data-parallel group (the gradient all-reduce), n = bytes reduced;
- "gemm", "gemm_bwd", "gemm_dw": the experts' own work (`ExpertWork`): the chunked pipeline of
  `megatron_moe.moe.pipeline` on this rank alone (no collective: every chunk's all-to-all is the identity) over
  the layer's local experts and rows at each degree r, forward ("gemm") and the input gradients ("gemm_bwd"),
  one point per degree (n = a chunk's multiply-adds, the time / r), so the line's alpha is a chunk's fixed cost
  (its GEMM calls, permutation and copies); and the weight gradients (`mlp_weight_grads`, "gemm_dw") over the
  rows of one chunk at each degree. Bare matmuls left those costs out (predictions 0.15-0.55 of the measured
  layer on CPU).
- "attn", "mlp", "route", "unroute" and their "_bwd" (with `ProfileSettings.dense`, for the operator partition
  planner `megatron_moe.overlap.op_partition`), n = tokens this rank runs, one point per batch size of
  `DenseWork`: one dense megatron-core TransformerLayer (its local spec, as the model's on CPU), its
  `_forward_attention` ("attn") and `_forward_mlp` ("mlp"), forward and backward (input and weight
  gradients); "route" / "unroute" are the MoE layer's operators around the all-to-alls as torch
  ops at the layer's widths (pre-MLP norm, the router's linear, softmax, top-k, the stable sort of the order and
  its gather; the weighted scatter-add back and the residual add), not the MoE module (it needs its process
  groups and a whole MoE config; these are its arithmetic). 2-3 s on 2 shared CPU cores at the defaults.
A kind whose group has one rank (no EP, no ESP, no DP) is not measured: its fit is 0 (the model never uses it).
With an EP group, the pipeline itself runs with the real links at each degree: its time beyond the model at the
degrees > 1 is the "chunk" / "chunk_bwd" line (`overhead_fits`), and what the model then still misses at any
degree, r = 1 included, the largest share of a point, is `ClusterFits.model_error` (`model_error`), the gain a
degree > 1 must be predicted to beat.

Each call runs between world barriers with the device synchronized before and after, timed on the host clock;
one warm-up call per size, then `repeats` timed calls, reduced per size by the median; every rank's figure goes into
one fixed-shape table whose MAX over the world (`comm.profiling.agree_profile`) every rank fits, so all ranks
hold the same lines. `obtain_profile` reuses a saved profile (JSON, `ClusterFits.save`) whose cluster
description (`describe_cluster`: the fingerprint of `megatron_moe.overlap.profile_cache`, code version included)
equals this run's: rank 0 reads the file and decides, every rank gets its decision (and the fits) by one
broadcast, so a file on rank 0's disk alone serves every node. Else every rank measures; a line not to be trusted
(`profile_cache.fit_problems`) makes every rank measure once more (the fits are agreed, so is the decision), and
the profile is written (rank 0, atomically) only when the caller says the run started (`Profile.save`), with
the lines still not trusted judged again by each run that reuses it. `load_or_measure` (the tools) saves at once.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import re
import shutil
import socket
import statistics
import subprocess
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
    gather_group_ranks,
    gather_rank_facts,
    profile_all_reduce,
    profile_all_to_all,
    profile_barrier,
    share_profile_decision,
)
from megatron_moe.config.fields import require
from megatron_moe.files import write_atomic
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
from megatron_moe.overlap.profile_cache import (
    FitCheck,
    cache_path,
    code_version,
    differences,
    fit_problems,
    fits_table,
    newest_differs,
    table_path,
)
from megatron_moe.platform import current_platform, device_name, synchronize

log = logging.getLogger(__name__)

KIB = 1 << 10
PIPELINE_KINDS = ("pipeline", "pipeline_bwd")
DENSE_MEASURED = tuple(kind for base in DENSE_KINDS for kind in (base, f"{base}_bwd"))
MEASURED_KINDS = (*FIT_KINDS, *BACKWARD_KINDS, *PIPELINE_KINDS, *DENSE_MEASURED)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertWork:
    """The experts whose chunk work the "gemm" lines measure: one rank's local experts and rows of one layer."""

    num_local_experts: int = 4
    """L."""
    hidden_size: int = 256
    """H."""
    ffn_hidden_size: int = 256
    """This rank's slice of one expert's width (F / P)."""
    gated: bool = False
    """SwiGLU (fc1 of width 2F)."""
    sources: int = 2
    """X = P x G: the blocks (source rank, ESP peer) whose rows each expert gets (the permutation's work)."""
    rows: tuple[int, ...] = (1024,)
    """Rows the experts compute at r = 1 (rounded down so that every (source, expert) block splits evenly)."""
    degrees: tuple[int, ...] = (1, 2, 4, 8)
    """Pipeline degrees measured on each row count: one point per degree."""

    def block_rows(self, rows: int) -> int:
        """Rows of one (source, expert) block: a multiple of every degree."""
        step = math.lcm(*self.degrees)
        return max(step, rows // (self.num_local_experts * self.sources) // step * step)

    def macs_per_row(self) -> int:
        return self.hidden_size * self.ffn_hidden_size * (3 if self.gated else 2)

    def validate(self) -> None:
        for name in ("num_local_experts", "hidden_size", "ffn_hidden_size", "sources"):
            require(getattr(self, name) >= 1, f"experts.{name}", getattr(self, name), "an integer >= 1")
        require(self.rows and min(self.rows) >= 1, "experts.rows", self.rows, "row counts >= 1, e.g. (1024,)")
        require(min(self.degrees) >= 1, "experts.degrees", self.degrees, "degrees >= 1, e.g. (1, 2, 4, 8)")
        chunks = {self.block_rows(q) // r for q in self.rows for r in self.degrees}
        require(len(chunks) >= 2, "experts", (self.rows, self.degrees), "2 or more distinct chunk sizes to fit")
        pipelined = {r for r in self.degrees if r > 1}
        require(len(pipelined) >= 2, "experts.degrees", self.degrees, "2 or more degrees > 1, e.g. (1, 2, 4, 8)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DenseWork:
    """The operators around the experts whose lines the partition planner needs, at one run's widths."""

    hidden_size: int = 128
    """H."""
    num_attention_heads: int = 4
    num_query_groups: int | None = None
    """None: as many as heads."""
    ffn_hidden_size: int = 256
    """A dense layer's MLP width."""
    gated: bool = False
    """SwiGLU."""
    normalization: str = "LayerNorm"
    """"LayerNorm" or "RMSNorm" (--normalization)."""
    seq_length: int = 64
    """S: the pieces split the batch, not the sequence, so the attention's S^2 term is per sequence."""
    batches: tuple[int, ...] = (1, 2, 4)
    """Batch sizes measured: one point per size, n = batch x S / (TP under sequence parallelism)."""
    sequence_parallel: bool = False
    num_experts: int = 4
    """E: the router's width."""
    topk: int = 2
    repeats: int = 3
    """Timed calls per size after one warm-up (fewer than the collectives': these lines only rank pieces)."""

    def validate(self) -> None:
        for name in (
            "hidden_size",
            "num_attention_heads",
            "ffn_hidden_size",
            "seq_length",
            "num_experts",
            "topk",
            "repeats",
        ):
            require(getattr(self, name) >= 1, f"dense.{name}", getattr(self, name), "an integer >= 1")
        distinct = len(set(self.batches)) >= 2 and min(self.batches) >= 1
        require(distinct, "dense.batches", self.batches, "2 or more distinct batch sizes >= 1, e.g. (1, 2, 4)")
        require(self.topk <= self.num_experts, "dense.topk", self.topk, f"<= num_experts = {self.num_experts}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfileSettings:
    """What the micro-benchmarks measure (small enough for CPU CI by default; FSMoE used 1-24 MiB messages and
    2^19..12 x 2^19-element GEMMs, 5 runs each)."""

    comm_bytes: tuple[int, ...] = (256 * KIB, 512 * KIB, 768 * KIB, 1024 * KIB)
    """Message sizes per rank (rounded down to whole float32 elements split evenly over the group)."""
    experts: ExpertWork = ExpertWork()
    """The expert work the "gemm" lines are fitted on."""
    repeats: int = 5
    """Timed calls per size, after one warm-up call."""
    dense: DenseWork | None = None
    """The attention / dense MLP / route / unroute lines' work (None: not measured, as before those lines)."""

    def validate(self) -> None:
        require(len(set(self.comm_bytes)) >= 2, "comm_bytes", self.comm_bytes, "2 or more distinct sizes")
        require(min(self.comm_bytes) >= 64, "comm_bytes", self.comm_bytes, "sizes >= 64 bytes")
        self.experts.validate()
        require(self.repeats >= 1, "repeats", self.repeats, "an integer >= 1, e.g. 5")
        if self.dense is not None:
            self.dense.validate()

    def to_json(self) -> dict:
        """As JSON; without "dense" when None, so that a profile saved before it still describes these settings."""
        out = _as_json(dataclasses.asdict(self))
        if self.dense is None:
            del out["dense"]
        return out


def layer_profile_settings(
    sizes: LayerSizes,
    *,
    hidden_size: int,
    ffn_hidden_size: int,
    num_experts: int,
    gated: bool = False,
    dense: DenseWork | None = None,
) -> ProfileSettings:
    """Micro-benchmarks at the sizes the solver asks about for one MoE layer: messages of one chunk at degrees 1,
    2, 4, 8 of the layer's all-to-all (or all-gather under ESP alone), and the pipeline's expert work on this
    rank's local experts and rows (width `ffn_hidden_size` / ESP). Used by the training set-up and
    tools/bench_pipeline.py."""
    whole = max(sizes.n_a2a, sizes.n_ag, 64 * KIB)
    comm_bytes = tuple(sorted({max(int(whole) // r, 4 * KIB) for r in (1, 2, 4, 8)}))
    width = ffn_hidden_size // sizes.esp
    rows = int(sizes.n_exp) // (hidden_size * width * (3 if gated else 2))
    experts = ExpertWork(
        num_local_experts=num_experts // sizes.ep,
        hidden_size=hidden_size,
        ffn_hidden_size=width,
        gated=gated,
        sources=sizes.ep * sizes.esp,
        rows=(max(rows, 64),),
    )
    return ProfileSettings(comm_bytes=comm_bytes, experts=experts, dense=dense)


@dataclasses.dataclass(frozen=True)
class ProfileGroups:
    """The process groups whose traffic is measured (None: the kind is not measured)."""

    ep: Any = None
    """All-to-all: the expert-model-parallel group."""
    esp: Any = None
    """All-gather / reduce-scatter: the expert-tensor-parallel (ESP) group."""
    dp: Any = None
    """Gradient all-reduce: the data-parallel group."""

    @classmethod
    def from_parallel_state(cls) -> ProfileGroups:
        """megatron-core's groups of this run (its parallel state must be initialized)."""
        from megatron.core import parallel_state as ps

        return cls(
            ep=ps.get_expert_model_parallel_group(),
            esp=ps.get_expert_tensor_parallel_group(),
            dp=ps.get_data_parallel_group(),
        )

    def sizes(self) -> dict[str, int]:
        return {name: _size(getattr(self, name)) for name in ("ep", "esp", "dp")}


def _size(group) -> int:
    return 0 if group is None else group_size(group)


def describe_cluster(
    groups: ProfileGroups, settings: ProfileSettings, link: str | None = None, *, dtype: str | None = None
) -> dict:
    """What a saved profile must match to be reused (the fingerprint, `megatron_moe.overlap.profile_cache`): world
    size, group sizes, every rank's host name, node rank and ranks per node (torchrun's GROUP_RANK and
    LOCAL_WORLD_SIZE: an emulated cluster's nodes share one host name), the EP and ESP groups' ranks
    (--expert-placement moves them between nodes), backend, device type and name, the link (`link`, e.g. "tc 1
    Gbit/s" given by the caller, else each rank's `link_description`), the run's dtype, the settings (the
    measured shapes) and the code version. As JSON reads it back (lists, not tuples), so that it compares equal
    to a saved one. Collective: every rank calls it."""
    facts = gather_rank_facts(
        {
            "host": socket.gethostname(),
            "node": os.environ.get("GROUP_RANK"),
            "local_world": os.environ.get("LOCAL_WORLD_SIZE"),
            "device_name": device_name(),
            "link": link if link is not None else link_description(),
        }
    )
    return _as_json(
        {
            "world": dist.get_world_size(),
            **groups.sizes(),
            "hosts": [fact["host"] for fact in facts],
            "nodes": [fact["node"] for fact in facts],
            "ranks_per_node": [fact["local_world"] for fact in facts],
            "ep_groups": gather_group_ranks(groups.ep),  # --expert-placement: which all-to-alls cross nodes
            "esp_groups": gather_group_ranks(groups.esp),
            "backend": dist.get_backend(),
            "device": current_platform().device.type,
            "device_name": sorted({fact["device_name"] for fact in facts}),
            "link": link if link is not None else sorted({fact["link"] for fact in facts}),
            "dtype": dtype,
            "settings": settings.to_json(),
            "code": code_version(),
        }
    )


LINK_INTERFACE_ENVS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


def link_description() -> str:
    """This rank's link as far as the host tells: the root queueing discipline and speed of the interface
    NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME names (the emulated cluster's shaped links are a tbf qdisc with
    their rate; its handle and the interface's name are left out, they change from run to run), and NCCL's
    transport settings (NCCL_* but NCCL_DEBUG*). "default" when nothing is set."""
    parts = []
    iface = next((os.environ[name] for name in LINK_INTERFACE_ENVS if os.environ.get(name)), None)
    if iface:
        iface = iface.split(",")[0].lstrip("^=")
        try:
            with open(f"/sys/class/net/{iface}/speed") as stream:
                parts.append(f"speed {stream.read().strip()}")
        except OSError:
            pass
        if shutil.which("tc"):
            shown = subprocess.run(["tc", "qdisc", "show", "dev", iface], capture_output=True, text=True, timeout=5)
            root = next((line for line in shown.stdout.splitlines() if " root " in line), "")
            if root:
                parts.append(re.sub(r"^qdisc (\S+) \S+ root( refcnt \d+)?", r"\1", root.strip()))
    parts += sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("NCCL_") and "DEBUG" not in k)
    return "; ".join(parts) or "default"


def _as_json(value):
    return json.loads(json.dumps(value))


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
    if _size(groups.ep) > 1:
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
    """(tokens, ms) points of `DENSE_MEASURED` at each batch size (module docstring)."""
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

    g_size, p_size = _size(groups.ep), max(_size(groups.esp), 1)
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
    g_size, p_size = _size(groups.ep), max(_size(groups.esp), 1)
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
    module docstring of `megatron_moe.overlap.cost_model`)."""
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
        if _size(group) > 1:  # else no such collective on this cluster: a zero fit (every rank has the same sizes)
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


def log_fits(fits: ClusterFits, source: str) -> None:
    """The fits, R^2 and points, one line per kind (rank 0: every rank holds the same)."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    log.info("%s", fits_table(fits, source).rstrip())


@dataclasses.dataclass(kw_only=True)
class Profile:
    """The cost-model profile a run got (`obtain_profile`): the same on every rank."""

    fits: ClusterFits
    path: str | None
    """Where it was read, or is written by `save` (None: nowhere)."""
    measured: bool
    why: str
    """Why it was measured ("none saved at ...", "--cost-profile-remeasure", "the saved one differs in code,
    hosts"), or "the fingerprint matches"."""
    problems: dict[str, str]
    """Kind -> why its line is not to be trusted, after the one re-measure (empty: every line is trusted)."""
    seconds: float = 0.0
    """Spent measuring."""
    saved: bool = False

    @property
    def trusted(self) -> bool:
        return not self.problems

    def save(self) -> None:
        """Rank 0 writes a measured profile to `path` (atomically: tmp + rename), once; the caller calls it when
        the run has started (its first iteration done), so that a launch that fails earlier leaves no profile for
        the next run to reuse. An untrusted one too: the next run reads the same verdict from its points and
        takes the same defaults, without measuring (--cost-profile-remeasure tries again). Not collective."""
        if self.saved or not self.measured or self.path is None:
            return
        if dist.get_rank() == 0:
            if os.path.dirname(self.path):
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self.fits.save(self.path)
        self.saved = True


def _saved_decision(path: str | None, description: dict, remeasure: bool) -> tuple[dict | None, str]:
    """Rank 0's decision: (the saved fits as JSON, why) to reuse them, (None, why) to measure."""
    if path is None:
        return None, "no profile file"
    if remeasure:
        return None, "--cost-profile-remeasure"
    if not os.path.exists(path):
        return None, f"none saved at {path}{newest_differs(os.path.dirname(path) or '.', description)}"
    try:
        saved = ClusterFits.load(path)
    except (OSError, ValueError, KeyError) as error:
        return None, f"the saved one is unreadable ({error})"
    changed = differences(saved.cluster, description)
    if changed:
        return None, f"the saved one differs in {', '.join(changed)}"
    return saved.to_json(), "the fingerprint matches"


def obtain_profile(
    path: str | None,
    groups: ProfileGroups,
    settings: ProfileSettings = ProfileSettings(),
    *,
    cache_dir: str | None = None,
    link: str | None = None,
    dtype: str | None = None,
    remeasure: bool = False,
    check: FitCheck | None = None,
) -> Profile:
    """The cluster's profile: the one saved at `path` (None: in `cache_dir` under this cluster's fingerprint;
    both None: none) when its description is this run's, else measured, and once more where a line is not to
    be trusted (`Profile.problems`: the lines still not trusted, also of a saved one). Nothing is written here
    but the table beside `path` (rank 0, for people); `Profile.save` writes the profile. Every rank of the world
    calls it, and issues the same collectives: the description's gathers, rank 0's decision (one broadcast),
    then the benchmarks where measured."""
    check = check or FitCheck()
    description = describe_cluster(groups, settings, link, dtype=dtype)
    if path is None and cache_dir is not None:
        path = cache_path(cache_dir, description)
    decision = _saved_decision(path, description, remeasure) if dist.get_rank() == 0 else None
    saved, why = share_profile_decision(decision)
    if saved is not None:  # its lines are judged again (this run's --cost-profile-min-r2): the same on every rank
        fits = ClusterFits.from_json(saved)
        return Profile(fits=fits, path=path, measured=False, why=why, problems=fit_problems(fits, check))
    started = time.perf_counter()
    fits = measure_fits(groups, settings, cluster=description)
    problems = fit_problems(fits, check)
    if problems:  # agreed fits, so every rank takes this branch: measured once more
        why += f"; measured twice ({', '.join(problems)} unreliable the first time)"
        fits = measure_fits(groups, settings, cluster=description)
        problems = fit_problems(fits, check)
    profile = Profile(
        fits=fits, path=path, measured=True, why=why, problems=problems, seconds=time.perf_counter() - started
    )
    if path is not None and dist.get_rank() == 0:
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        write_atomic(table_path(path), fits_table(fits, f"measured: {why}"))
    return profile


def load_or_measure(
    path: str | None,
    groups: ProfileGroups,
    settings: ProfileSettings = ProfileSettings(),
    *,
    link: str | None = None,
) -> tuple[ClusterFits, bool]:
    """The tools' form (tools/profile_cluster.py, bench_pipeline.py): `obtain_profile` without the fit check,
    saved at once. The cluster's fits and whether they were measured now. Every rank of the world must call it."""
    profile = obtain_profile(path, groups, settings, link=link, check=FitCheck(min_r2=0.0))
    if profile.measured:
        profile.save()
        profile_barrier()  # the file is complete before any rank goes on (a later run's ranks read it)
    log_fits(profile.fits, f"measured, saved to {path}" if profile.measured else f"loaded from {path}")
    return profile.fits, profile.measured
