"""Wire Lancet's weight-gradient queue into a built model, before megatron-core's DDP wraps it.

Every deferrable module (`DeferrableWeights`) of every transformer layer gets
the queue as its store and a schedule key "L{layer}.{name}"; its weights are
marked `skip_backward_post_hook` (DDP with `delay_wgrad_compute` then hands
their hooks to the module); every MoE dispatcher gets the queue as the work
to run under its backward all-to-alls. An untied LM head becomes deferrable too
("L{num_layers}.output": its dW is the first in backward, ready before any
all-to-all). `install_on_moe_layer` does the same for one MoE layer without a
transformer layer around it (a benchmark, a test).
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_moe.moe.dispatch import set_backward_overlap
from megatron_moe.moe.weight_grad import DeferrableWeights
from megatron_moe.overlap.linears import DeferrableColumnParallelLinear
from megatron_moe.overlap.runtime import WgradQueue
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


def install_wgrad_overlap(
    model_chunks: list[torch.nn.Module], queue: WgradQueue
) -> list[tuple[str, DeferrableWeights]]:
    """Make `queue` the store of every deferrable module and the backward overlap of every dispatcher; returns
    the (key, module) pairs. Call before wrapping the chunks in DDP (with `delay_wgrad_compute=True`)."""
    installed = []
    for chunk in model_chunks:
        for key, module in deferrable_modules(chunk):
            _install(key, module, queue)
            installed.append((key, module))
        set_backward_overlap(chunk, queue)
    return installed


def install_on_moe_layer(moe_layer: torch.nn.Module, queue: WgradQueue) -> list[tuple[str, DeferrableWeights]]:
    """`install_wgrad_overlap` for one MoE layer with no transformer layer around it: its deferrable
    submodules get keys "L{moe_layer.layer_number}.{name}"; returns the (key, module) pairs."""
    installed = []
    for path, module in moe_layer.named_modules():
        if isinstance(module, DeferrableWeights) and path in MOE_NAMES:
            key = f"L{moe_layer.layer_number}.{MOE_NAMES[path]}"
            _install(key, module, queue)
            installed.append((key, module))
    set_backward_overlap(moe_layer, queue)
    return installed


def _install(key: str, module: DeferrableWeights, queue: WgradQueue) -> None:
    module.store_key = key
    module.weight_grad_store = queue.store_for(module)
    for param in module.deferred_params():
        param.skip_backward_post_hook = True


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
