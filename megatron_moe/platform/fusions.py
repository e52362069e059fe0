"""Which of megatron-core's fused kernels this process can run, and torch facts that change megatron-core's syncs.

Probes only: what a run turns on also depends on its settings (`megatron_moe.model.fusions` decides). Each
probe is megatron-core 0.16.1's own requirement for the fusion:

- bias + activation and bias + dropout + add: megatron-core's `jit_fuser` (torch.compile) elementwise kernels, on
  an accelerator (on CPU they would compile with the host's C++ toolchain per shape, for no gain);
- gradient-accumulation fusion: apex's `fused_weight_gradient_mlp_cuda` (tensor_parallel/layers.py imports it and
  its ColumnParallelLinear, also GPTModel's output layer under transformer-engine, refuses the fusion without it);
- masked-softmax fusion: the `scaled_masked_softmax_cuda` / `scaled_upper_triang_masked_softmax_cuda` kernels
  (apex's build of megatron's softmax extensions) that fusions/fused_softmax.py imports when the fused path runs;
- RoPE fusion: transformer-engine's fused rotary kernel, found as TransformerConfig does (rope_utils'
  `fused_apply_rotary_pos_emb` is not None).
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch

from megatron_moe.platform.device import current_platform

GRAD_ACCUM_KERNEL = "fused_weight_gradient_mlp_cuda"
SOFTMAX_KERNELS = ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda")
MISSING = {
    "accelerator": "no GPU",
    "grad_accum": f"no {GRAD_ACCUM_KERNEL} (apex built with --cuda_ext)",
    "masked_softmax": f"no fused softmax kernels (apex's {SOFTMAX_KERNELS[0]})",
    "rope": "no fused RoPE kernel (transformer-engine's)",
}
"""What the start-up summary says where a `FusedKernels` field is False."""
BATCH_P2P_WAITS_SINCE = (2, 4)
"""torch release from which batch_isend_irecv's handles wait for the whole batch on NCCL (see `batch_p2p_sync`)."""


@dataclasses.dataclass(frozen=True)
class FusedKernels:
    """The fused kernels megatron-core can use in this process (all False on CPU)."""

    accelerator: bool
    """A GPU: megatron-core's jit-fused elementwise ops (bias + activation, bias + dropout + add) run there."""
    grad_accum: bool
    """apex's fused_weight_gradient_mlp_cuda on an accelerator."""
    masked_softmax: bool
    """megatron's fused scaled (upper-triangular) masked softmax kernels on an accelerator."""
    rope: bool
    """transformer-engine's fused RoPE on an accelerator."""


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _te_fused_rope() -> bool:
    """TransformerConfig's own test for apply_rope_fusion (it imports transformer-engine's kernel, if any)."""
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils.fused_apply_rotary_pos_emb is not None


def fused_kernels() -> FusedKernels:
    """Probe this process: an accelerator, and the kernels' modules importable."""
    if not current_platform().is_accelerator:
        return FusedKernels(accelerator=False, grad_accum=False, masked_softmax=False, rope=False)
    return FusedKernels(
        accelerator=True,
        grad_accum=_importable(GRAD_ACCUM_KERNEL),
        masked_softmax=all(_importable(name) for name in SOFTMAX_KERNELS),
        rope=_importable("transformer_engine") and _te_fused_rope(),
    )


def batch_p2p_sync(torch_version: str = torch.__version__) -> bool:
    """Whether megatron-core must synchronize the device after each batched pipeline p2p (its `batch_p2p_sync`).

    The sync works around batch_isend_irecv handles that did not wait for the NCCL group (fixed in torch 1.13,
    pytorch#82450); the coalescing manager batch_isend_irecv runs in got its last work-handle fixes in 2.4
    (pytorch#122807). From 2.4 on the schedule's `req.wait()` orders the transfers with compute and the device-wide
    sync after every p2p only stalls the host (on CPU the sync is a no-op either way).
    """
    release = tuple(int(part) for part in torch_version.split("+")[0].split(".")[:2])
    return release < BATCH_P2P_WAITS_SINCE
