"""RunConfig -> megatron-core TransformerConfig -> GPTModel chunks (a pipeline stage, or its virtual stages)."""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnBackend

from megatron_moe.activations.apply import apply_activation_policy
from megatron_moe.config import MoELayerConfig, RunConfig
from megatron_moe.config.fields import raise_errors
from megatron_moe.config.kernels import Kernels, kernel_errors, uses_transformer_engine
from megatron_moe.model import attention
from megatron_moe.model.fusions import Fusions, choose_fusions
from megatron_moe.model.spec import block_spec, mtp_block_spec
from megatron_moe.moe.experts import mark_expert_params
from megatron_moe.overlap import batch
from megatron_moe.platform import current_platform
from megatron_moe.platform.fusions import batch_p2p_sync, fused_kernels


def params_dtype(cfg: RunConfig) -> torch.dtype:
    if cfg.training.bf16:
        return torch.bfloat16
    if cfg.training.fp16:
        return torch.float16
    return torch.float32


def use_transformer_engine(cfg: RunConfig) -> bool:
    """--transformer-impl: transformer-engine's modules where asked for, or by default where it is installed on a
    GPU; a flag whose kernel this machine lacks (the first pass's `config.kernels` checks, here with the
    platform's own answers) is refused."""
    kernels = platform_kernels()
    raise_errors(kernel_errors(cfg, kernels))
    return uses_transformer_engine(cfg, kernels)


def platform_kernels() -> Kernels:
    """The kernels this process has: `config.kernels.Kernels` with the platform's answer for the GPU."""
    return Kernels(
        gpu=current_platform().is_accelerator,
        transformer_engine=importlib.util.find_spec("transformer_engine") is not None,
        grouped_gemm=importlib.util.find_spec("grouped_gemm") is not None,
    )


def run_fusions(cfg: RunConfig) -> Fusions:
    """megatron-core's fusions this run turns on here (the platform's kernels, the run's settings and flags)."""
    return choose_fusions(cfg, fused_kernels(), transformer_engine=use_transformer_engine(cfg))


def transformer_config(cfg: RunConfig, fusions: Fusions | None = None) -> TransformerConfig:
    """The megatron-core TransformerConfig for this run (parallel sizes included); `fusions`: `run_fusions(cfg)`
    unless given."""
    m, moe, p, t = cfg.model, cfg.moe, cfg.parallel, cfg.training
    te = use_transformer_engine(cfg)  # refuses what this machine cannot run (--context-parallel-size included)
    fusions = run_fusions(cfg) if fusions is None else fusions
    dtype = params_dtype(cfg)
    on_cpu = not current_platform().is_accelerator
    interleaved = p.virtual_pipeline_size(m.num_layers) is not None or batch.one_chunk_pipeline(cfg)
    moe_kwargs = {}
    if moe.is_moe:
        # Where the MoE layers sit and their sizes; how they route only for megatron-core's own layer
        # (our layer is configured by moe_layer(cfg) alone).
        moe_kwargs = dict(
            num_moe_experts=moe.num_experts,
            moe_router_topk=moe.moe_router_topk,
            moe_ffn_hidden_size=moe.expert_ffn_width(m),
            moe_layer_freq=moe.layer_pattern(m.num_layers),
        )
        if not moe.own_layer:
            moe_kwargs.update(_mcore_moe_settings(cfg))
        elif moe.moe_router_topk == 1:  # our top-1 weight is the softmax over all experts: megatron-core's
            moe_kwargs["moe_router_pre_softmax"] = True  # pre-softmax, which its config requires at k = 1
    config = attention.config_class(m)(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_width,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        normalization=m.normalization,
        layernorm_epsilon=m.norm_epsilon,
        add_bias_linear=not m.disable_bias_linear,
        gated_linear_unit=m.swiglu,
        activation_func=F.silu if m.swiglu else F.gelu,
        **fusions.transformer_config_kwargs(),
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_size(m.num_layers),
        pipeline_model_parallel_layout=p.pipeline_model_parallel_layout,
        expert_model_parallel_size=p.expert_model_parallel_size,
        # The ESP group comes from parallel_state (training/initialize.py). megatron-core's modules read this
        # field to refuse expert biases with ESP > 1 in its own MoE layer (its expert tensor parallelism, over
        # that same group); ours shards its experts by the group alone.
        expert_tensor_parallel_size=p.expert_tensor_parallel if not moe.own_layer else 1,
        context_parallel_size=p.context_parallel_size,
        sequence_parallel=p.sequence_parallel,
        use_cpu_initialization=on_cpu,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=t.bf16,
        fp16=t.fp16,
        # Megatron-LM's p2p settings: the interleaved schedule overlaps its p2p with compute (non-batched isend/
        # irecv). Batched, a PP=2 pair would post its sends to the one peer in the order send-prev, send-next and
        # its receives recv-prev, recv-next: gloo (and NCCL) match them in order, swapping activation and gradient.
        # Unbatched, megatron-core sends the two directions over two communicators at PP=2.
        overlap_p2p_comm=interleaved,
        batch_p2p_comm=not interleaved,
        batch_p2p_sync=batch_p2p_sync(),  # a device-wide sync after each batched p2p only where torch needs it
        # The interleaved schedule frees a sent activation before its isend is waited: on a GPU the allocator's
        # stream order protects it, on CPU gloo could read freed memory, so there it is kept until backward.
        deallocate_pipeline_outputs=not (interleaved and on_cpu),
        attention_softmax_in_fp32=m.attention_softmax_in_fp32,
        recompute_granularity="full" if cfg.activations.full_recompute else None,
        recompute_method="uniform" if cfg.activations.full_recompute else None,
        recompute_num_layers=1 if cfg.activations.full_recompute else None,
        attention_backend=AttnBackend.flash if m.use_flash_attn and te else AttnBackend.auto,  # CPU: `cpu_stand_ins`
        **attention.config_kwargs(m),  # head width, q/k norms, MLA and its RoPE
        # Multi-token prediction: None (not 0) without it, as megatron-core tests `is not None`.
        mtp_num_layers=m.mtp_num_layers or None,
        mtp_loss_scaling_factor=m.mtp_loss_scaling_factor,
        **moe_kwargs,
    )
    if moe.own_layer and moe.overlap_moe_expert_parallel_comm:  # set after its checks: ours are rules_overlap.py's
        config.overlap_moe_expert_parallel_comm = True  # megatron-core's schedules take their combined 1F1B path
        batch.install()  # which runs on our MoE layers' stages
    return config


def _mcore_moe_settings(cfg: RunConfig) -> dict:
    """How megatron-core's own MoE layer (--moe-layer-impl mcore) routes, dispatches and computes."""
    moe = cfg.moe
    factor = moe.moe_expert_capacity_factor
    return dict(
        # megatron-core's sinkhorn routing asserts no balancing loss (it balances by its choice of experts)
        moe_aux_loss_coeff=0.0 if moe.moe_router_load_balancing_type == "sinkhorn" else moe.moe_aux_loss_coeff,
        moe_z_loss_coeff=moe.moe_z_loss_coeff,
        moe_router_load_balancing_type=moe.moe_router_load_balancing_type,
        moe_token_dispatcher_type=moe.moe_token_dispatcher_type,
        moe_expert_capacity_factor=factor if factor is not None and factor > 0 else None,  # 0, < 0: dropless
        moe_pad_expert_input_to_capacity=moe.moe_pad_expert_input_to_capacity,
        moe_grouped_gemm=moe.moe_grouped_gemm,
        moe_router_dtype="fp32",
        moe_router_score_function=moe.moe_router_score_function or "softmax",
        moe_router_pre_softmax=moe.moe_router_pre_softmax,
        moe_router_topk_scaling_factor=moe.moe_router_topk_scaling_factor,
        moe_token_drop_policy=moe.moe_token_drop_policy or "probs",  # megatron-core's own default
        # Its finalize_model_grads moves the bias after each step (megatron-core's own all-reduce of the loads).
        moe_router_enable_expert_bias=moe.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=moe.moe_router_bias_update_rate,
        moe_router_num_groups=moe.moe_router_num_groups if moe.moe_router_group_topk else None,
        moe_router_group_topk=moe.moe_router_group_topk,
        moe_shared_expert_intermediate_size=moe.moe_shared_expert_ffn_hidden_size or None,  # never dropped
        moe_shared_expert_gate=moe.moe_shared_expert_gate,
        moe_router_force_load_balancing=moe.moe_router_force_load_balancing,
    )


def moe_layer(cfg: RunConfig) -> MoELayerConfig | None:
    """Our MoE layer's settings, or None to use megatron-core's MoELayer (or for a dense model)."""
    return cfg.moe.layer_config(cfg.model, seed=cfg.training.seed) if cfg.moe.own_layer else None


def padded_vocab_size(vocab_size: int, cfg: RunConfig) -> int:
    """Pad the vocabulary to a multiple of --make-vocab-size-divisible-by.

    Unlike Megatron-LM the padding does not grow with TP (the multiple must be
    divisible by TP instead), so the output layer, and so the loss, is the same
    in every layout and a checkpoint moves between TP sizes unchanged.
    """
    multiple = cfg.model.make_vocab_size_divisible_by
    return -(-vocab_size // multiple) * multiple


def build_model_chunks(cfg: RunConfig, config: TransformerConfig, vocab_size: int) -> list[GPTModel]:
    """This rank's model chunks: one per virtual pipeline stage (`config.virtual_pipeline_model_parallel_size`,
    Megatron-LM's get_model), else the one pipeline stage."""
    reset_loss_trackers()
    chunks = config.virtual_pipeline_model_parallel_size
    if chunks is None:
        return [build_model(cfg, config, vocab_size)]
    return [build_model(cfg, config, vocab_size, vp_stage=stage) for stage in range(chunks)]


def reset_loss_trackers() -> None:
    """Empty megatron-core's process-wide loss trackers (its MoE aux losses, its MTP losses) before a model is built.

    Each sizes a tracked name's slots by the layer count of the first model that records it, so an earlier model
    in this process (a test, a notebook) would leave slots too few for a deeper one, or another's figures."""
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    moe_utils.get_moe_layer_wise_logging_tracker().clear()
    MTPLossLoggingHelper.tracker.clear()


def build_model(cfg: RunConfig, config: TransformerConfig, vocab_size: int, vp_stage: int | None = None) -> GPTModel:
    """This rank's pipeline stage of the GPT-MoE (with `vp_stage`: that virtual stage's chunk), on this platform's
    device. Its layers carry their global numbers (megatron-core's offset for this rank and virtual stage)."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    m = cfg.model
    pattern = cfg.moe.layer_pattern(m.num_layers) if cfg.moe.is_moe else [0] * m.num_layers
    te, ours = use_transformer_engine(cfg), moe_layer(cfg)
    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec(
            config, pattern, use_transformer_engine=te, pp_rank=pp_rank, vp_stage=vp_stage, moe_layer=ours
        ),
        mtp_block_spec=mtp_block_spec(config, pattern, use_transformer_engine=te, vp_stage=vp_stage, moe_layer=ours),
        vocab_size=padded_vocab_size(vocab_size, cfg),
        max_sequence_length=m.max_position_embeddings or m.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
        position_embedding_type=m.position_embedding_type,
        rotary_base=m.rotary_base,
        rotary_percent=m.rotary_percent,
        vp_stage=vp_stage,
    )
    if model.mtp_process and model.post_process and not model.pre_process and model.share_embeddings_and_output_weights:
        # megatron-core 0.16.1 allocates the head's own weight on the MTP stage, yet uses the stage's embedding copy
        # there (shared_embedding_or_output_weight) and asserts the head has none in its sharded state dict.
        model.output_layer.weight = None
    model.to(current_platform().device)  # megatron-core puts its own modules there already, ours follow
    for experts in (module for name, module in model.named_modules() if name.endswith(".experts")):
        mark_expert_params(experts)  # ours and megatron-core's
    policy = cfg.activation_policy()
    if policy is not None:
        apply_activation_policy(model, policy)
    return model
