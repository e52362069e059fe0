"""Wiring the overlap runtime into a built model, before megatron-core's DDP wraps it.

Inputs: model chunks (or one MoE layer), Lancet's queue, the runtime (`runtime.OverlapRuntime.attach` calls here).
Outputs: every deferrable module (`DeferrableWeights`) of every transformer layer gets the queue as its store and
a schedule key "L{layer}.{name}", its weights marked `skip_backward_post_hook`; an untied LM head becomes
deferrable in place ("L{num_layers}.output"); every MoE dispatcher gets the runtime as its `backward_overlap`.
Invariant: `set_dispatchers` is the one writer of `backward_overlap`, called once per model.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_moe.moe.dispatch import Dispatcher
from megatron_moe.moe.weight_grad import DeferrableWeights
from megatron_moe.overlap.linears import DeferrableColumnParallelLinear
from megatron_moe.overlap.wgrad_queue import WgradQueue
from megatron_moe.platform.cpu_compat import Patch, source

MOE_NAMES = {"experts": "experts", "shared_expert": "shared_expert", "gate": "router"}
"""An MoE layer's deferrable submodules (their path in the MoE layer) and their names in the schedule."""
NAMES = {
    "self_attention.linear_qkv": "attn_qkv",
    "self_attention.linear_proj": "attn_proj",
    "mlp.linear_fc1": "mlp_fc1",
    "mlp.linear_fc2": "mlp_fc2",
    **{f"mlp.{path}": name for path, name in MOE_NAMES.items()},
}
"""A transformer layer's deferrable submodules (their path in the layer) and their names in the schedule."""


def deferrable_modules(model: torch.nn.Module) -> list[tuple[str, DeferrableWeights]]:
    """(schedule key, module) of every deferrable module of the model's transformer layers, in model order, then the
    untied LM head, made deferrable in place (`_make_head_deferrable`)."""
    found = []
    for layer in model.modules():
        if not isinstance(layer, TransformerLayer):
            continue
        for path, module in layer.named_modules():
            if isinstance(module, DeferrableWeights) and path in NAMES:
                found.append((f"L{layer.layer_number}.{NAMES[path]}", module))
    head = _make_head_deferrable(model)
    if head is not None:
        found.append((f"L{model.config.num_layers}.output", head))
    return found


def _make_head_deferrable(model: torch.nn.Module) -> DeferrableWeights | None:
    """The model's LM head as a deferrable linear, when it has its own weight (untied) and is megatron-core's
    local ColumnParallelLinear. Its class becomes the deferrable subclass in place (same module, weights and
    state dict keys): GPTModel builds the head itself, not from our layer spec. A tied head's weight also
    gets the embedding's gradient through autograd, so it stays as it is."""
    head = getattr(model, "output_layer", None)
    tied = getattr(model, "share_embeddings_and_output_weights", True)
    if tied or type(head) is not ColumnParallelLinear or head.weight is None:
        return None
    head.__class__ = DeferrableColumnParallelLinear
    return head


def moe_layer_modules(moe_layer: torch.nn.Module) -> list[tuple[str, DeferrableWeights]]:
    """(schedule key, module) of one MoE layer's deferrable submodules, keyed "L{moe_layer.layer_number}.{name}"
    (a MoE layer with no transformer layer around it: a benchmark, a test)."""
    return [
        (f"L{moe_layer.layer_number}.{MOE_NAMES[path]}", module)
        for path, module in moe_layer.named_modules()
        if isinstance(module, DeferrableWeights) and path in MOE_NAMES
    ]


def install_stores(
    modules: list[tuple[str, DeferrableWeights]], queue: WgradQueue
) -> list[tuple[str, DeferrableWeights]]:
    """Each (key, module): its weight gradients go through `queue` under `key`; its weights are marked
    `skip_backward_post_hook` (DDP with `delay_wgrad_compute` hands their hooks to the module). Returns `modules`."""
    for key, module in modules:
        module.store_key = key
        module.weight_grad_store = queue.store_for(module)
        for param in module.deferred_params():
            param.skip_backward_post_hook = True
    return modules


def set_dispatchers(model: torch.nn.Module, overlap) -> None:
    """Every MoE dispatcher of `model` runs `overlap` (a `comm.BackwardOverlap`: the run's `OverlapRuntime`) under
    its backward all-to-alls. The only writer of `Dispatcher.backward_overlap` in the library."""
    for module in model.modules():
        dispatcher = getattr(module, "dispatcher", None)
        if isinstance(dispatcher, Dispatcher):
            dispatcher.backward_overlap = overlap


def _gpt_head_is_a_local_column_parallel_linear() -> bool:
    gpt = source("megatron.core.models.gpt.gpt_model", "GPTModel")
    return "self.output_layer = tensor_parallel.ColumnParallelLinear(" in gpt and "self.output_layer(" in gpt


PROBES: tuple[Patch, ...] = (
    Patch(
        "untied_head_class_swap",
        "overlap/install.py: an untied LM head's class becomes DeferrableColumnParallelLinear in place; GPTModel "
        "builds it itself (self.output_layer, a ColumnParallelLinear), not from our layer spec.",
        None,
        _gpt_head_is_a_local_column_parallel_linear,
    ),
)
