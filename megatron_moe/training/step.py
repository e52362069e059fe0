"""One micro-batch: its tensors, the model call and the language-model loss."""

from __future__ import annotations

from functools import partial

import torch
from megatron.core.utils import unwrap_model

from megatron_moe.platform import current_platform


def get_batch(data_iterator, *, first: bool, last: bool) -> dict[str, torch.Tensor] | None:
    """The next micro-batch on this rank's device, or None for a model chunk that neither embeds the tokens
    (`first`) nor computes the loss (`last`): a middle pipeline stage, or a middle virtual stage.

    Every rank of a TP/CP group reads the same samples from its own loader
    (deterministic sampler), so no broadcast is needed. Every chunk reads its micro-batch (its own iterator under
    the interleaved pipeline), so all chunks stay at the same micro-batch.
    """
    batch = next(data_iterator)
    if not (first or last):
        return None
    device = current_platform().device
    return {k: batch[k].to(device, non_blocking=True) for k in ("tokens", "labels", "loss_mask", "position_ids")}


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of masked token losses, the token count, and the pair for reporting.

    megatron-core's schedule divides by the token count and the number of
    micro-batches, so the gradient is that of the mean token loss of the step.
    The MoE auxiliary losses are not in here: the MoE layers attach them to
    the backward pass themselves and they are logged separately.
    """
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    """megatron-core schedule callback: run the model on the next micro-batch."""
    chunk = unwrap_model(model)  # its pre_process / post_process: this (virtual) stage embeds, or computes the loss
    batch = get_batch(data_iterator, first=chunk.pre_process, last=chunk.post_process)
    if batch is None:  # middle stage: input comes from the previous stage
        output = model(None, None, None)
        return output, None
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])
