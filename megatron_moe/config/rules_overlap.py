"""Batch-level overlap's flag checks (--overlap-moe-expert-parallel-comm, --delay-wgrad-compute), in the flag pass.

In: the RunConfig (model, moe, parallel and activations passed their own checks). Out: a ConfigError naming the
flag, its value and a valid choice, before any process group or model exists. Megatron-LM's rules are kept where
they mean the same here (expert parallelism, no full recompute, --delay-wgrad-compute only with the overlap); not
its virtual stages under PP (the one chunk runs the interleaved schedule), nor its bf16/fp16 and dispatcher rules,
which are megatron-core's layer's.
How it runs: overlap/batch.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_moe.config.fields import require

if TYPE_CHECKING:
    from megatron_moe.config import RunConfig

FLAG = "--overlap-moe-expert-parallel-comm"


def check_batch_overlap(cfg: RunConfig) -> None:
    """What batch-level overlap needs beyond the flag's `applies` (our MoE layer, EP > 1): no full recompute;
    --delay-wgrad-compute: the overlap and Lancet's queue."""
    moe = cfg.moe
    if moe.delay_wgrad_compute:
        require(
            moe.overlap_moe_expert_parallel_comm,
            "--delay-wgrad-compute",
            True,
            f"only with {FLAG} (Megatron-LM's rule; weight gradients are deferred by --overlap-wgrad without it)",
        )
        require(
            moe.overlap_wgrad != "off",
            "--overlap-wgrad",
            moe.overlap_wgrad,
            "greedy or all-under-next-a2a with --delay-wgrad-compute (Lancet's queue is what defers them here)",
        )
    if not moe.overlap_moe_expert_parallel_comm:
        return
    require(
        not cfg.activations.full_recompute,
        FLAG,
        True,
        "off with full activation recompute (each layer's forward, its all-to-alls included, would run again inside "
        "the backward, where no other micro-batch runs); selective --recompute-modules compose with it",
    )


def check_pipelined_micro_batches(cfg: RunConfig, micro_batches: int) -> None:
    """PP > 1 without virtual stages runs megatron-core's interleaved schedule with the one chunk (Megatron-LM
    asks for virtual stages instead): its one group of micro-batches needs at least PP of them."""
    pp = cfg.parallel.pipeline_model_parallel_size
    if not cfg.moe.overlap_moe_expert_parallel_comm or pp == 1:
        return
    require(
        micro_batches >= pp,
        "--global-batch-size",
        cfg.training.global_batch_size,
        f"at least --pipeline-model-parallel-size={pp} micro-batches a step with {FLAG} (megatron-core's combined "
        f"1F1B schedule; this gives {micro_batches})",
    )
