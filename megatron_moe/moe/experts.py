"""Experts: the local experts' computation on rows grouped by expert.

Legend: L = local experts, R = rows (all local experts), C = rows per expert when padded, H = hidden,
F = expert ffn width (x2 for SwiGLU's gate and up), P = expert-sharded (ESP) group size.

Any `torch.nn.Module` with `num_local_experts` and `forward(rows_RH, counts)` is an expert module (`Experts`).
Built in: `FFNExperts` (GELU or SwiGLU; one fused autograd node `GroupedMLP`, bmm when padded, grouped GEMM
otherwise; its backward hands the dW GEMMs to a `WeightGradStore`) and `ModuleListExperts` (one module per
expert). Checkpoint layout, whatever the kernel and the EP / ESP sizes: `weight1` [E, F (2F for SwiGLU: gate
rows then up rows), H], `weight2` [E, H, F], sharded along E (offset: the global expert index) and along F by
the ESP rank; under ESP a rank's output is a partial sum the dispatcher's reduce-scatter completes.
Details: docs/internals/moe.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

from megatron_moe import comm
from megatron_moe.activations.engine import SAVE_ALL, FusedKeeping
from megatron_moe.moe.ffn import ffn_activation, ffn_activation_backward_
from megatron_moe.moe.grouped_gemm import SMALL_EXPERT_WEIGHT, grouped_linear, grouped_mm, grouped_weight_grad
from megatron_moe.moe.weight_grad import RUN_NOW, DeferrableWeights, WeightGrad, WeightGradStore, at_position
from megatron_moe.platform import current_platform
from megatron_moe.platform.rng import host_rng_keyed


@runtime_checkable
class Experts(Protocol):
    """The expert interface: rows grouped by local expert in, same-shaped rows out."""

    num_local_experts: int

    def forward(self, rows_RH: torch.Tensor, counts: list[int]) -> torch.Tensor: ...


class Keeping(Protocol):
    """How `GroupedMLP` keeps x (fc1's input), h (fc1's output) and a (act's output) for backward.

    `SAVE_ALL` keeps each as it is; an activation policy's `FusedKeeping` may
    keep one quantized or not at all. The node itself knows how to recompute
    what `fetch` does not give back: h = fc1(x), a = act(h).
    """

    def keep(self, name: str, t: torch.Tensor, numel: int | None = None) -> Any:
        """Forward: what to keep of tensor `name` (part of a tensor of `numel` elements): a tensor (the node
        saves it for backward), something opaque (the node holds it), or None (recompute it)."""
        ...

    def fetch(self, kept: Any, start: int, end: int) -> torch.Tensor | None:
        """Backward: rows [start, end) of what `keep` returned, or None: recompute them."""
        ...


def mark_expert_params(module: torch.nn.Module) -> None:
    """Mark every parameter of `module` an expert parameter: reduced over the expert-data-parallel group only.

    `allreduce=False`: megatron-core DDP reduces it over the expert-data-parallel
    group. megatron-core marks its experts so only when EP>1, which makes the
    optimizer a single one at EP=1 but a dense+expert chain at EP>1, and
    optimizer checkpoints could not move between the two. With EP=1 the
    expert-data-parallel group holds the same ranks the dense gradient reduce
    uses, so the gradients are the same either way.

    `sequence_parallel=False` (megatron-core marks the experts' output bias
    so): the expert-data-parallel reduce already spans the TP ranks, and a
    second all-reduce over TP doubled that bias's gradient.
    """
    for param in module.parameters():
        param.allreduce = False
        param.sequence_parallel = False


def expert_chunks(counts: list[int], row_bytes: int, budget: int | None) -> list[tuple[int, int, int, int]]:
    """(first expert, end expert, first row, end row) of runs of consecutive experts.

    Each run's rows take at most `budget` bytes at `row_bytes` per row, or are
    a single expert; `budget` None is one run of all experts, 0 one run per
    expert. An expert without rows joins the run before it.
    """
    if budget is None:
        return [(0, len(counts), 0, sum(counts))]
    runs, e0, r0, rows = [], 0, 0, 0
    for e, count in enumerate(counts):
        if e > e0 and count and (rows + count) * row_bytes > budget:
            runs.append((e0, e, r0, r0 + rows))
            e0, r0, rows = e, r0 + rows, 0
        rows += count
    runs.append((e0, len(counts), r0, r0 + rows))
    return runs


def fc1(x_RH: torch.Tensor, w1_EFH: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """h = x W1[e]^T per expert's rows (the experts' first GEMM; the pipeline's chunks run it too)."""
    return grouped_mm(x_RH, w1_EFH.transpose(1, 2), counts)


def mlp_weight_grads(grad_RH, x_RH, a_RF, grad_h_RF, counts, needs: tuple[bool, bool]) -> WeightGrad:
    """The weight-gradient GEMMs of one run of experts as a closure over the tensors they read:
    (out_w1, out_w2) -> (dW1 = dH^T x, dW2 = dY^T a), None where not needed."""
    need_w1, need_w2 = needs

    def weight_grads(out_w1=None, out_w2=None):
        with torch.no_grad():  # also when a store runs it after backward (x is the node's input: it requires grad)
            grad_w2 = grouped_weight_grad(grad_RH, a_RF, counts, out_w2) if need_w2 else None
            grad_w1 = grouped_weight_grad(grad_h_RF, x_RH, counts, out_w1) if need_w1 else None
        return grad_w1, grad_w2

    return weight_grads


def save_kept(ctx, weights: tuple, kept: list) -> None:
    """Plain kept tensors go through save_for_backward (and so through any saved-tensor hooks); others are ours."""
    ctx.save_for_backward(*weights, *(k for k in kept if torch.is_tensor(k)))
    ctx.kept = [None if torch.is_tensor(k) else (k,) for k in kept]  # (packed,) or (None,) for recompute


def saved_kept(ctx, num_weights: int) -> tuple[list, list]:
    """(weights, kept) as `save_kept` stored them."""
    weights, plain = ctx.saved_tensors[:num_weights], iter(ctx.saved_tensors[num_weights:])
    return list(weights), [next(plain) if k is None else k[0] for k in ctx.kept]


class GroupedMLP(torch.autograd.Function):
    """y = act(x W1[e]^T) W2[e]^T for each expert's rows: two grouped GEMMs and the activation in one node.

    The same arithmetic as grouped_linear -> activation -> grouped_linear, with
    less memory traffic and a lower peak:
    - forward and backward run over the same runs of whole experts (at most
      `chunk_bytes` of [rows, F] activation each; None = one run): each run's
      h, a and their gradients are made and used while they are in cache;
    - backward computes the activation's gradient in the buffer of dA (fc2's
      input gradient), not a fresh one, and SwiGLU keeps h and act(h) (3F
      per row) instead of autograd's 4F;
    - what is kept of x, h and a is up to `keeping` (`Keeping`; an activation
      policy keeps some quantized, h and a run by run as they are made, or
      recomputes them run by run).
    Backward, per run: the input gradients (dA, dH, dX), then
    the weight-gradient GEMMs (`mlp_weight_grads`: dW2, dW1) as a closure handed
    to `store` (`megatron_moe.moe.weight_grad`), which runs it now. A store that
    defers (Lancet) gets one closure for all runs after the last dX, which
    fills whole dW1/dW2 run by run when it runs.
    """

    @staticmethod
    def forward(ctx, x_RH, w1_EFH, w2_EHF, counts, gated, chunk_bytes, keeping=SAVE_ALL, store=RUN_NOW):
        runs = expert_chunks(counts, w2_EHF.shape[2] * x_RH.element_size(), chunk_bytes)
        y_RH = None if len(runs) == 1 else x_RH.new_empty(x_RH.shape[0], w2_EHF.shape[1])
        kept_h, kept_a = [], []
        for e0, e1, r0, r1 in runs:
            run_counts = counts[e0:e1]
            h = grouped_mm(x_RH[r0:r1], w1_EFH[e0:e1].transpose(1, 2), run_counts)  # fc1
            a = ffn_activation(h, gated)
            out = None if y_RH is None else y_RH[r0:r1]
            y = grouped_mm(a, w2_EHF[e0:e1].transpose(1, 2), run_counts, out)
            kept_h.append(keeping.keep("h", h, numel=x_RH.shape[0] * h.shape[1]))  # worth it as a whole
            kept_a.append(keeping.keep("a", a, numel=x_RH.shape[0] * a.shape[1]))
        save_kept(ctx, (w1_EFH, w2_EHF), [keeping.keep("x", x_RH), *kept_h, *kept_a])
        ctx.counts, ctx.gated, ctx.runs, ctx.keeping, ctx.store = counts, gated, runs, keeping, store
        return y if y_RH is None else y_RH

    @staticmethod
    def backward(ctx, grad_RH):
        (w1_EFH, w2_EHF), (x_RH, *kept) = saved_kept(ctx, 2)
        runs, keeping, gated = ctx.runs, ctx.keeping, ctx.gated
        need_x, need_w1, need_w2 = needs = ctx.needs_input_grad[:3]
        grad_RH = grad_RH.contiguous()
        grads = [None] * 3
        if len(runs) > 1:  # the kernels allocate their outputs when there is one run (torch._grouped_mm has no out=)
            grads = [torch.empty_like(t) if need else None for t, need in zip((grad_RH, w1_EFH, w2_EHF), needs)]
        store = runs_store = ctx.store
        if store.defers:  # the closures of every run, collected here and handed over as one
            grads[1:] = None, None
            runs_store = _Collect()
        for (e0, e1, r0, r1), kept_h, kept_a in zip(runs, kept[: len(runs)], kept[len(runs) :]):
            # One run of experts, written into slices of `grads` where given. x is always kept; h and a are
            # recomputed if not.
            rows, experts, counts = slice(r0, r1), slice(e0, e1), ctx.counts[e0:e1]
            grad, w1, w2 = grad_RH[rows], w1_EFH[experts], w2_EHF[experts]
            out_x, out_w1, out_w2 = (None if g is None else g[part] for g, part in zip(grads, (rows, experts, experts)))
            x = keeping.fetch(x_RH, r0, r1)
            h = keeping.fetch(kept_h, 0, r1 - r0)
            h = fc1(x, w1, counts) if h is None else h
            a = keeping.fetch(kept_a, 0, r1 - r0)
            a = ffn_activation(h, gated) if a is None else a
            # dA = dY W2, dH = act'(h) dA (in dA's buffer), dX = dH W1; then dW1, dW2 through the store.
            grad_h = ffn_activation_backward_(grouped_mm(grad, w2, counts), h, gated)
            grad_x = grouped_mm(grad_h, w1, counts, out_x) if need_x else None
            grad_w = (None, None)
            if need_w1 or need_w2:
                weight_grads = mlp_weight_grads(grad, x, a, grad_h, counts, (need_w1, need_w2))
                grad_w = runs_store.put(weight_grads, (out_w1, out_w2))
            if len(runs) == 1:
                grads = [grad_x, *(grad_w or (None, None))]
        if store.defers:  # the store owns the weight gradients
            store.put(_all_runs(runs_store.closures, runs, w1_EFH, w2_EHF, needs[1:]), (None, None))
            grads[1] = grads[2] = None
        return (*grads, None, None, None, None, None)


class _Collect:
    """A store that keeps a node's per-run closures for `_all_runs`."""

    defers = True

    def __init__(self):
        self.closures: list[WeightGrad] = []

    def put(self, weight_grad: WeightGrad, outs: tuple) -> None:
        self.closures.append(weight_grad)


def _all_runs(closures: list[WeightGrad], runs, w1_EFH, w2_EHF, needs) -> WeightGrad:
    """One closure for the weight-gradient GEMMs of every run: each writes its experts' slice of dW1/dW2 (the
    outputs given, else fresh tensors of the weights' shapes; one run: the run's closure itself)."""
    if len(runs) == 1:
        return closures[0]

    def weight_grads(out_w1=None, out_w2=None):
        outs = [
            (torch.empty_like(w) if out is None else out) if need else None
            for w, out, need in zip((w1_EFH, w2_EHF), (out_w1, out_w2), needs)
        ]
        for (e0, e1, _, _), weight_grad in zip(runs, closures):
            weight_grad(*(None if out is None else out[e0:e1] for out in outs))
        return tuple(outs)

    return weight_grads


class FFNExperts(torch.nn.Module, DeferrableWeights):
    """L experts of one MLP each (GELU or SwiGLU), weights stacked along the expert dim."""

    def __init__(
        self,
        *,
        num_local_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        gated: bool,
        init_method: Callable,
        output_init_method: Callable,
        ep_group=None,
        expert_dp_group=None,
        esp_group=None,
        params_dtype: torch.dtype = torch.float32,
        init_seed: int = 0,
        layer_number: int = 0,
    ):
        super().__init__()
        self.num_local_experts, self.gated = num_local_experts, gated
        self.ep_group, self.expert_dp_group, self.esp_group = ep_group, expert_dp_group, esp_group
        esp_size = comm.group_size(esp_group)
        assert ffn_hidden_size % esp_size == 0, (ffn_hidden_size, esp_size)
        ffn_local = ffn_hidden_size // esp_size  # this ESP rank's slice of every expert's width
        width = 2 * ffn_local if gated else ffn_local
        self.weight1 = torch.nn.Parameter(torch.empty(num_local_experts, width, hidden_size, dtype=params_dtype))
        self.weight2 = torch.nn.Parameter(torch.empty(num_local_experts, hidden_size, ffn_local, dtype=params_dtype))
        self._initialize(init_method, output_init_method, ffn_hidden_size, (init_seed, layer_number))
        mark_expert_params(self)
        if esp_size > 1:  # sharded over the ESP group: the grad norm counts every rank's slice
            set_tensor_model_parallel_attributes(self.weight1, True, 1, 1)
            set_tensor_model_parallel_attributes(self.weight2, True, 2, 1)
        self.region: Callable | None = None
        """Set by an activation policy: region(name, fn, *args) runs fn as expert_fc1/expert_act/expert_fc2."""
        self.keeping: FusedKeeping | None = SAVE_ALL
        """What the fused node keeps of x, h, a; None: run fc1/act/fc2 as separate regions."""
        self.chunk_bytes = current_platform().expert_chunk_bytes
        if width * hidden_size < SMALL_EXPERT_WEIGHT:  # one run on CPU too: one activation call, less Python
            self.chunk_bytes = None
        self.weight_grad_store: WeightGradStore = RUN_NOW
        """Where backward hands the weight-gradient GEMMs (`megatron_moe.moe.weight_grad`); the default runs them."""

    @torch.no_grad()
    def _initialize(self, init_method: Callable, output_init_method: Callable, ffn_hidden_size: int, key: tuple):
        """Global expert e's whole weights drawn on the host from a generator seeded by (seed, layer, e) alone,
        then this rank's ESP slice copied in: the same numbers on any device and under any EP and ESP sizes.

        Invariant: expert e starts the same in every layout, and experts differ. The tracker's expert-parallel
        stream cannot give it: on a GPU its fork swaps the CUDA generator only, while these weights are made on
        the host, so every EP rank drew the same numbers and under ESP every rank the same slice (an expert
        effectively F/P wide). Each expert is drawn whole (Megatron-LM's --use-cpu-initialization: master
        weights, then the rank's slice): P x the draws under ESP, once, at start-up.
        """
        ffn_local = self.weight2.shape[2]
        esp_rank, hidden = comm.group_rank(self.esp_group), self.weight2.shape[1]
        f_slice = slice(esp_rank * ffn_local, (esp_rank + 1) * ffn_local)
        first = comm.group_rank(self.ep_group) * self.num_local_experts
        rows = 2 * ffn_hidden_size if self.gated else ffn_hidden_size
        for local in range(self.num_local_experts):
            w1_FH = torch.empty(rows, hidden, dtype=self.weight1.dtype)
            w2_HF = torch.empty(hidden, ffn_hidden_size, dtype=self.weight2.dtype)
            with host_rng_keyed(*key, first + local):
                init_method(w1_FH)
                output_init_method(w2_HF)
            if self.gated:  # this slice of the gate rows, then the same slice of the up rows
                gate_FH, up_FH = w1_FH.chunk(2)
                w1_FH = torch.cat([gate_FH[f_slice], up_FH[f_slice]])
            else:
                w1_FH = w1_FH[f_slice]
            self.weight1[local].copy_(w1_FH)
            self.weight2[local].copy_(w2_HF[:, f_slice])

    def deferred_params(self) -> list[torch.nn.Parameter]:
        return [self.weight1, self.weight2]

    def use_activation_scope(self, scope) -> None:
        """Run under an activation policy (`megatron_moe.activations.engine.LayerScope`)."""
        self.region = scope.call
        self.keeping = scope.fused_keeping("expert_fc1", "expert_act", "expert_fc2")

    def _call(self, name: str, fn: Callable, *args):
        return fn(*args) if self.region is None else self.region(name, fn, *args)

    def forward(self, rows_RH: torch.Tensor, counts: list[int], store: WeightGradStore | None = None) -> torch.Tensor:
        """`store`: where this call's node hands its dW closure (None: `weight_grad_store`; shadowing passes one
        that adds the shadows' gradients)."""
        store = self.weight_grad_store if store is None else store
        # Without rows too: one node whose backward hands one closure (dW1, dW2) to the store, as on every rank,
        # so DDP hears of weight1 and weight2 in the same order everywhere (the reductions' order must agree).
        if self.keeping is not None:
            options = (self.gated, self.chunk_bytes, self.keeping, store)
            return GroupedMLP.apply(rows_RH, self.weight1, self.weight2, counts, *options)
        # Per-GEMM nodes, each its own region of an activation policy.
        h_RF = self._call("expert_fc1", grouped_linear, rows_RH, self.weight1, counts, at_position(store, 0, 2))
        h_RF = self._call("expert_act", ffn_activation, h_RF, self.gated)
        return self._call("expert_fc2", grouped_linear, h_RF, self.weight2, counts, at_position(store, 1, 2))

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """weight1/weight2 as ShardedTensors: global expert offset = EP rank x L, F offset = ESP rank x F/P
        (SwiGLU's weight1: its gate and up slices, two fragments of the one [E, 2F, H] tensor, as megatron-core's
        `apply_swiglu_sharded_factory` saves them)."""
        ep_rank, ep_size = comm.group_rank(self.ep_group), comm.group_size(self.ep_group)
        esp_rank, esp_size = comm.group_rank(self.esp_group), comm.group_size(self.esp_group)
        axis = len(sharded_offsets)
        # (PP, TP, DP): the ESP slices are distinct shards, not replicas; copies differ by expert-DP rank.
        replica_id = (0, 0, comm.group_rank(self.expert_dp_group))
        experts = (axis, ep_rank, ep_size)

        def sharded(key: str, param: torch.Tensor, *f_offsets, replica_id=replica_id) -> ShardedTensor:
            return ShardedTensor.from_rank_offsets(
                key, param, *sharded_offsets, experts, *f_offsets, replica_id=replica_id, prepend_axis_num=axis
            )

        out = {}
        for name, param, f_axis in (("weight1", self.weight1, 1), ("weight2", self.weight2, 2)):
            key = f"{prefix}{name}"
            if esp_size == 1:
                out[key] = sharded(key, param)
            elif name == "weight1" and self.gated:
                out[key] = _swiglu_factory(key, param, sharded, (axis + 1, esp_rank, esp_size), replica_id)
            else:
                out[key] = sharded(key, param, (axis + f_axis, esp_rank, esp_size))
        return out


def _swiglu_factory(key: str, weight1: torch.Tensor, sharded: Callable, f_offset: tuple, replica_id):
    """SwiGLU's weight1 slice [L, 2F/P, H] = [gate rows F/P; up rows F/P]: on disk the gate slice p is part p of
    2P along [E, 2F, H]'s F axis, the up slice part P + p (chunked on save, concatenated on load)."""
    f_axis, rank, size = f_offset

    @torch.no_grad()
    def build(key: str, t: torch.Tensor, replica_id, flattened_range):
        assert flattened_range is None, "the expert weights are not saved flattened"
        gate, up = torch.chunk(t, 2, dim=1)
        return [
            sharded(key, gate, (f_axis, rank, 2 * size), replica_id=replica_id),
            sharded(key, up, (f_axis, size + rank, 2 * size), replica_id=replica_id),
        ]

    def merge(parts):
        with torch.no_grad():
            return torch.cat(parts, dim=1)

    return ShardedTensorFactory(key, weight1, build, merge, replica_id)


class ModuleListExperts(torch.nn.Module):
    """Custom experts: one module per local expert, each mapping [n, H] -> [n, H]."""

    def __init__(self, experts: list[torch.nn.Module], *, ep_group=None, expert_dp_group=None):
        super().__init__()
        self.local_experts = torch.nn.ModuleList(experts)
        self.num_local_experts = len(experts)
        self.ep_group, self.expert_dp_group = ep_group, expert_dp_group
        mark_expert_params(self)

    def forward(self, rows_RH: torch.Tensor, counts: list[int]) -> torch.Tensor:
        chunks = torch.split(rows_RH, counts)
        return torch.cat([expert(chunk) for expert, chunk in zip(self.local_experts, chunks)])

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """Each expert under its global index: `{prefix}local_experts.{global e}.{param}`."""
        first = comm.group_rank(self.ep_group) * self.num_local_experts
        replica_id = (0, 0, comm.group_rank(self.expert_dp_group))
        out = {}
        for local, expert in enumerate(self.local_experts):
            for name, param in expert.state_dict(keep_vars=True).items():
                # The dict key is this module's path; the checkpoint key names the global expert.
                global_key = f"{prefix}local_experts.{first + local}.{name}"
                out[f"{prefix}local_experts.{local}.{name}"] = ShardedTensor.from_rank_offsets(
                    global_key, param, *sharded_offsets, replica_id=replica_id, prepend_axis_num=len(sharded_offsets)
                )
        return out
