"""Lancet's operator partition (section 5): a range of transformer layers runs as pieces of the micro-batch, so that
the MoE layers' forward all-to-alls run under the other pieces' attention, router, experts and dense layers.

Legend: S = sequence (this TP rank's shard), B = micro-batch, B_i = piece i's sequences, H = hidden, k = pieces.
In: a range's input [S, B, H] (`--moe-partition-range`); out: the same [S, B, H], made by k pieces [S, B_i, H] that
run the range's layers as stage generators (`_layer_stages`: megatron-core's attention half, then the dense MLP or
our `MoELayer.stages`), interleaved in Lancet's order (`pieces.run_interleaved`), then concatenated along B.
Invariants: the gate routes each token alone (`config.rules.check_partition`), the router losses and statistics
are the whole micro-batch's; every rank builds the same graph, so the collectives are issued in the same order;
results equal unpartitioned up to kernel summation order (fp32: 1e-6 relative). Evaluation, no-grad forwards and
full recompute run the block whole. The steps and the backward's order: docs/internals/moe.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
from contextlib import nullcontext

import torch
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import make_viewless_tensor

from megatron_moe.moe.layer import MoELayer
from megatron_moe.moe.pieces import Piece, piece_sizes, run_interleaved
from megatron_moe.platform.cpu_compat import Patch
from megatron_moe.platform.rng import rng_tracker


@dataclasses.dataclass(frozen=True)
class PartitionRange:
    """Local layer indices [start, stop) of a model chunk's block that run as `pieces` pieces."""

    start: int
    stop: int
    pieces: int


class PartitionedTransformerBlock(TransformerBlock):
    """megatron-core's TransformerBlock whose forward runs `partition` ranges as pieces (module docstring); with no
    range, or where the partition does not apply, megatron-core's forward as it is."""

    partition: tuple[PartitionRange, ...] = ()

    def forward(self, hidden_states, attention_mask, *args, **kwargs):
        if not self._partitions(args, kwargs):
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        # megatron-core's forward, its training path without fp8, CPU offloading or cross-attention:
        if not self.pre_process:
            hidden_states = self.input_tensor
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        sequence_parallel = self.config.sequence_parallel
        with rng_tracker().fork() if sequence_parallel else nullcontext():
            hidden_states = self._run_layers(hidden_states, attention_mask, kwargs)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
            hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        if not self.pre_process and len(self.layers) == 0 and not self.final_layernorm:
            hidden_states = hidden_states.clone()
        return hidden_states

    def _partitions(self, args, kwargs) -> bool:
        if not self.partition or not (self.training and torch.is_grad_enabled()) or args:
            return False
        if kwargs.get("inference_context") is not None or kwargs.get("inference_params") is not None:
            return False
        if self.config.recompute_granularity == "full" or self.config.fp8 or self.config.cpu_offloading:
            return False
        return kwargs.get("context") is None and kwargs.get("packed_seq_params") is None

    def _run_layers(self, hidden_SBH, attention_mask, kwargs) -> torch.Tensor:
        inputs = {name: kwargs.get(name) for name in _LAYER_INPUTS}
        index, ranges = 0, list(self.partition)
        while index < len(self.layers):
            if ranges and ranges[0].start == index:
                span = ranges.pop(0)
                layers = self.layers[span.start : span.stop]
                hidden_SBH = _run_pieces(layers, hidden_SBH, attention_mask, inputs, span.pieces)
                index = span.stop
                continue
            hidden_SBH, _ = self.layers[index](hidden_states=hidden_SBH, attention_mask=attention_mask, **inputs)
            index += 1
        return hidden_SBH


_LAYER_INPUTS = (
    "rotary_pos_emb",
    "rotary_pos_cos",
    "rotary_pos_sin",
    "attention_bias",
    "sequence_len_offset",
    "padding_mask",
)
"""The block's inputs its layers take (the padding mask is split per piece, like the attention mask)."""


def _run_pieces(layers, hidden_SBH, attention_mask, inputs: dict, count: int) -> torch.Tensor:
    """Steps 1-4 of the module docstring over `layers`."""
    sizes = piece_sizes(hidden_SBH.shape[1], count)
    pieces_SBH = [piece.contiguous() for piece in torch.split(hidden_SBH, sizes, dim=1)]
    masks = _split_batch(attention_mask, sizes)
    inputs = dict(inputs)
    padding = _split_batch(inputs.pop("padding_mask"), sizes)
    routings: dict = {}
    stages = [
        _piece_stages(layers, pieces_SBH[i], masks[i], padding[i], inputs, Piece(i, count, routings))
        for i in range(count)
    ]
    return torch.cat(run_interleaved(stages), dim=1)


def _split_batch(tensor: torch.Tensor | None, sizes: list[int]) -> list:
    """A [B, ...] tensor's pieces along B; one broadcast over B (or None) serves every piece."""
    if tensor is None or tensor.shape[0] != sum(sizes) or sum(sizes) == 1:
        return [tensor] * len(sizes)
    return list(torch.split(tensor, sizes, dim=0))


def _piece_stages(layers, hidden_SBH, attention_mask, padding_mask, inputs: dict, piece: Piece):
    for layer in layers:
        hidden_SBH = yield from _layer_stages(layer, hidden_SBH, attention_mask, padding_mask, inputs, piece)
    return hidden_SBH


def _layer_stages(layer, hidden_SBH, attention_mask, padding_mask, inputs: dict, piece: Piece):
    """One TransformerLayer on one piece: megatron-core's attention half, then its MLP half, or for our MoE layer
    the same half with the layer's stages (megatron-core's `_forward_mlp` less what a training forward skips)."""
    hidden_SBH, _ = layer._forward_attention(
        hidden_states=hidden_SBH, attention_mask=attention_mask, padding_mask=padding_mask, **inputs
    )
    if not isinstance(layer.mlp, MoELayer):
        return layer._forward_mlp(hidden_SBH, None, padding_mask=padding_mask)
    residual = hidden_SBH
    normed_SBH = layer._forward_pre_mlp_layernorm(hidden_SBH)
    output_with_bias = yield from layer.mlp.stages(normed_SBH, padding_mask, piece)
    return layer._forward_post_mlp(output_with_bias, residual)


def moe_layer_blocker(layer) -> str | None:
    """Why one of our MoE layers cannot run as pieces (None: it can)."""
    if getattr(layer, "recompute_mlp", False):
        return "megatron-core recomputes the whole MLP (--recompute-modules mlp)"
    if not layer.mlp.gate.routes_pieces:
        return f"its gate {type(layer.mlp.gate).__name__} routes with the whole batch"
    return None


def install_partition(decoder: TransformerBlock, ranges: list[tuple[int, int, int]]) -> list[PartitionRange]:
    """Give `decoder` (one model chunk's block) the partition `ranges`: (first, last, pieces), layer numbers from
    1, clipped to its layers; a range with no MoE layer of ours here, or of 1 piece, is left whole. Returns the
    installed `PartitionRange`s."""
    numbers = [layer.layer_number for layer in decoder.layers]
    installed = []
    for first, last, pieces in ranges:
        local = [i for i, number in enumerate(numbers) if first <= number <= last]
        moe_layers = [i for i in local if isinstance(decoder.layers[i].mlp, MoELayer)]
        if pieces <= 1 or not moe_layers:
            continue
        for i in moe_layers:
            blocker = moe_layer_blocker(decoder.layers[i])
            if blocker is not None:
                raise ValueError(f"--moe-partition-pieces {pieces}: layer {numbers[i]} cannot run as pieces: {blocker}")
        installed.append(PartitionRange(local[0], local[-1] + 1, pieces))
    if installed:
        decoder.__class__ = PartitionedTransformerBlock
        decoder.partition = tuple(installed)
    return installed


UPSTREAM_SHA256 = {
    "TransformerBlock.forward": "f72b6c393aa4462153926906372ac84df791b3ead109d4869673268cb3f489db",
    "TransformerLayer.forward": "a858d1d13f9f323e697ad7a7adb470c7bb9c753634c22d463d46ecefa365e604",
    "TransformerLayer._forward_mlp": "9125341d2e12d7f0046a5b80baaf4596842c333df25168877aca792bbd401258",
}
"""megatron-core 0.16.1's methods that `PartitionedTransformerBlock.forward` and `_layer_stages` follow: the block's
forward (its training path, copied) and the layer's forward and MLP half (split into the attention half, the
pre-MLP norm, the MLP and the post-MLP half): any other text is a change they have not seen."""


def _upstream_unchanged() -> bool:
    methods = {
        "TransformerBlock.forward": TransformerBlock.forward,
        "TransformerLayer.forward": TransformerLayer.forward,
        "TransformerLayer._forward_mlp": TransformerLayer._forward_mlp,
    }
    return all(hashlib.sha256(inspect.getsource(methods[name]).encode()).hexdigest() == digest
               for name, digest in UPSTREAM_SHA256.items())  # fmt: skip


PROBES: tuple[Patch, ...] = (
    Patch(
        "partitioned_transformer_block",
        "model/partition.py: PartitionedTransformerBlock (a class swap) runs megatron-core's "
        "TransformerBlock.forward's training path over pieces, and each TransformerLayer as its halves "
        "(--moe-partition-pieces).",
        None,
        _upstream_unchanged,
    ),
)
