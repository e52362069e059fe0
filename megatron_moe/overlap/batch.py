"""Batch-level overlap: one micro-batch's forward beside another's backward (Megatron-LM's
--overlap-moe-expert-parallel-comm), on our MoE layer's stages.

megatron-core's combined 1F1B schedules pair the micro-batches and call `combined_forward_backward_step`, which
`install` points at `combined_step`: the pipeline's receives; the forward started on a `Coroutine` (a thread that
runs only while its caller waits) until its first MoE all-to-all is in flight (`at_yield`, from `MoELayer.forward`);
the backward here, each of its MoE all-to-alls running the forward's next stage under it (`under_backward_comm`,
from `OverlapRuntime.run_under`); the forward's rest; the pipeline's sends, in megatron-core's order.
Invariants: one thread runs at a time and hands over only at those points, which every rank of a stage reaches in
the same order, so every rank issues its collectives in the same order; each micro-batch's arithmetic and the
gradients' accumulation order are the sequential schedule's (bit-identical results). No CUDA side streams (a
deviation from megatron-core): the all-to-alls are asynchronous collectives (NCCL's stream, gloo's threads), so one
code path overlaps on CPU and GPU. The stage pairing, the measurements: docs/overlap.md.
"""

from __future__ import annotations

from megatron_moe.moe import handover
from megatron_moe.moe.handover import run_paired
from megatron_moe.platform.patch import Patch, source_sha256


def combined_step(
    forward_step_func,
    data_iterator,
    f_model,
    num_microbatches,
    input_tensor,
    forward_data_store,
    b_model,
    b_input_tensor,
    b_output_tensor,
    b_output_tensor_grad,
    config,
    f_model_chunk_id=None,
    pre_forward=None,
    pre_backward=None,
    post_forward=None,
    post_backward=None,
    collect_non_loss_data=False,
    checkpoint_activations_microbatch=None,
    is_first_microbatch=False,
    current_microbatch=None,
    encoder_decoder_xattn=False,
):
    """megatron-core's `combined_forward_backward_step` (its arguments and returns: (forward output, tokens,
    input gradient)): the receives, the forward and backward paired (`run_paired`) with megatron-core's own forward and
    backward steps, the sends."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.utils import get_model_type

    assert checkpoint_activations_microbatch is None, "partial activation checkpoints: not with batch-level overlap"
    if f_model is not None and pre_forward is not None:
        pre_forward(None)
    if b_model is not None and pre_backward is not None:
        pre_backward(None)

    # which of the forward's passes run alone (their MoE layers chunked as FSMoE's degrees say; the paired ones
    # whole): its forward where no backward comes with it; its backward, in the schedule without pipelining, where
    # it is the last micro-batch's (megatron-core's plan); under PP not known here, so the degrees stand
    lone_backward = None
    if parallel_state.get_pipeline_model_parallel_world_size() == 1 and current_microbatch is not None:
        lone_backward = current_microbatch == num_microbatches - 1

    def forward():
        vp_size = config.virtual_pipeline_model_parallel_size
        last = f_model_chunk_id is None or (
            parallel_state.is_pipeline_last_stage(ignore_virtual=True)
            and (vp_size is None or f_model_chunk_id == vp_size - 1)
        )
        return schedules.forward_step(
            forward_step_func,
            data_iterator,
            f_model,
            num_microbatches,
            input_tensor,
            forward_data_store,
            config,
            parallel_state.get_context_parallel_world_size(),
            collect_non_loss_data,
            is_first_microbatch=is_first_microbatch,
            current_microbatch=current_microbatch,
            vp_stage=f_model_chunk_id,
            is_last_stage=last,
        )

    def forward_marked():  # on the thread that runs the forward (the coroutine's when paired)
        with handover.alone(b_model is None, lone_backward):
            return forward()

    def backward():
        return schedules.backward_step(
            b_input_tensor, b_output_tensor, b_output_tensor_grad, get_model_type(b_model), config
        )

    output_tensor = num_tokens = input_tensor_grad = None
    if b_model is None:
        output_tensor, num_tokens = forward_marked()
    elif f_model is None:
        input_tensor_grad = backward()
    else:
        (output_tensor, num_tokens), input_tensor_grad = run_paired(forward_marked, backward)
    if f_model is not None and post_forward is not None:
        post_forward(output_tensor, None)
    if b_model is not None and post_backward is not None:
        post_backward(input_tensor_grad, None)
    return output_tensor, num_tokens, input_tensor_grad


def one_chunk_pipeline(cfg) -> bool:
    """Batch-level overlap with PP > 1 and no virtual stages: megatron-core pairs a forward with a backward only in
    its interleaved schedule, so this run's one model chunk runs there (`schedule`), with its p2p settings."""
    par = cfg.parallel
    return (
        cfg.moe.own_layer
        and cfg.moe.overlap_moe_expert_parallel_comm
        and par.pipeline_model_parallel_size > 1
        and par.virtual_pipeline_size(cfg.model.num_layers) is None
    )


def schedule(cfg, config, num_microbatches: int):
    """megatron-core's forward-backward function for this run; under `one_chunk_pipeline` its interleaved schedule
    with one chunk: while it runs, `config` (the model's) says one virtual stage, in one group of every micro-batch
    (the schedule table is then the plain order; megatron-core adds its one warm-up forward for the pairing), and
    says none again after it, for what else reads it (the checkpoint's layer offsets, the model's own)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_with_interleaving

    if not one_chunk_pipeline(cfg):
        return get_forward_backward_func()

    def one_chunk(**kwargs):
        saved = config.virtual_pipeline_model_parallel_size, config.microbatch_group_size_per_vp_stage
        config.virtual_pipeline_model_parallel_size = 1
        config.microbatch_group_size_per_vp_stage = num_microbatches
        try:
            return forward_backward_pipelining_with_interleaving(**kwargs)
        finally:
            config.virtual_pipeline_model_parallel_size, config.microbatch_group_size_per_vp_stage = saved

    return one_chunk


def _no_streams(comp_stream=None, comm_stream=None) -> None:
    """megatron-core's `set_streams` for the combined schedules: no side streams here (module docstring)."""


def install() -> None:
    """Route megatron-core's combined 1F1B schedules (taken where a model config's
    `overlap_moe_expert_parallel_comm` is set) through `combined_step`; idempotent."""
    from megatron.core.pipeline_parallel import combined_1f1b

    combined_1f1b.combined_forward_backward_step = combined_step
    combined_1f1b.set_streams = _no_streams


UPSTREAM_SHA256 = {
    "combined_forward_backward_step": "16a89f2f584635ddab967f6dd1e1e196fc4a915a624e212c7678378d5234777b",
    "combined_1f1b_schedule_for_no_pipelining": "373db48b10878ca361baf5d7efa0ff036bbc1933f0c51e3a64806e432466678b",
    "combined_1f1b_schedule_for_interleaved_pipelining": (
        "ab8a2cd7c1a9709f1db1801ea58e145c635c6554af3c36b0a5f16682a1f701a3"
    ),
}
"""megatron-core 0.16.1's combined 1F1B: the step `combined_step` stands in for (its arguments and returns) and the
two schedules that call it by that module-level name and pair the micro-batches."""


def _upstream_unchanged() -> bool:
    module = "megatron.core.pipeline_parallel.combined_1f1b"
    return all(source_sha256(module, name) == digest for name, digest in UPSTREAM_SHA256.items())


PROBES: tuple[Patch, ...] = (
    Patch(
        "combined_1f1b_step",
        "overlap/batch.py: megatron-core's combined 1F1B schedules (--overlap-moe-expert-parallel-comm) call "
        "combined_step, which runs one micro-batch's forward beside another's backward on our MoE layers' stages.",
        None,
        _upstream_unchanged,
    ),
)
