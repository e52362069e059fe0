"""What a checkpoint holds: the training state (`TrainState`), the sharded model and optimizer state
(`sharded_state`: megatron-core's sharded state dicts, one per model chunk, and the optimizer's in its
layout-independent form), the layout it was written in and each rank's RNG states, and the flags that must
match for its weights to mean anything (`SHAPE_FIELDS`).
"""

from __future__ import annotations

import dataclasses
import logging
import random

import numpy as np
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_moe.platform import current_platform
from megatron_moe.platform.rng import get_rng_states, set_rng_states

log = logging.getLogger("megatron_moe")


# "fully_reshardable": the distributed optimizer gathers its state into model-parameter
# space on save, so it loads into any TP/PP/EP/DP layout (0.16.1 cannot save the
# "fully_sharded_model_space" format: flattened ranges are no longer supported).
# No "chained_N." key prefix: with EP>1 megatron chains a dense and an expert
# optimizer, and the keys must not depend on that for a checkpoint to move layouts.
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
OPTIMIZER_STATE_AT = "parameter"
"""Saved in each checkpoint (`optimizer_state_at`) since the distributed optimizer's state is saved at each
parameter's own offsets (platform/upstream_fixes.py, the Patch reshardable_bucket_offsets); older saves lack it
(load.py's `misplaced_optimizer_state`)."""


# Flags whose change makes a checkpoint's weights meaningless for this model.
SHAPE_FIELDS = {
    "model": (
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "position_embedding_type",
        "normalization",
        "swiglu",
        "disable_bias_linear",
        "untie_embeddings_and_output_weights",
        "kv_channels",
        "qk_layernorm",
        "add_qkv_bias",
        "multi_latent_attention",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_head_dim",
        "qk_pos_emb_head_dim",
        "v_head_dim",
    ),
    "moe": ("num_experts", "moe_layer_freq", "moe_ffn_hidden_size"),
}


@dataclasses.dataclass
class TrainState:
    """Where training stands: restored exactly on resume."""

    iteration: int = 0
    consumed_train_samples: int = 0


def current_layout() -> dict[str, int]:
    """This run's parallel layout (world, tp, pp, vpp, ep, esp), as a checkpoint records it."""
    return {
        "world": dist.get_world_size(),
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "vpp": parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1,
        "ep": parallel_state.get_expert_model_parallel_world_size(),
        "esp": parallel_state.get_expert_tensor_parallel_world_size(),
    }


def _rng_state() -> dict:
    """Python's, numpy's and torch's RNG states, the device's too (its generator and the tracker's streams)."""
    return {
        "random": random.getstate(),
        "np": np.random.get_state(),
        "device_type": current_platform().device.type,
        **get_rng_states(),
    }


def restore_rng_state(state: dict) -> bool:
    """Restore `state`; False (nothing restored) when it was saved on another kind of device."""
    saved_on = state.get("device_type", "cpu")  # checkpoints from before GPU runs: CPU, "torch" for "cpu"
    if saved_on != current_platform().device.type:
        return False
    random.setstate(state["random"])
    np.random.set_state(state["np"])
    set_rng_states(
        {
            "cpu": state.get("cpu", state.get("torch")),
            "tracker": state["tracker"],
            **({"device": state["device"]} if "device" in state else {}),
        }
    )
    return True


def model_state_keys(model) -> list[str]:
    """Where each model chunk's state sits in a checkpoint's state dict, as Megatron-LM stores it: "model" for one
    chunk, "model0", "model1", ... for the chunks of an interleaved pipeline. Only the nesting differs: the sharded
    tensors' own keys number the layers globally (megatron-core's offset per rank and virtual stage), so a
    checkpoint loads into any PP and virtual-pipeline layout, optimizer state included."""
    return ["model"] if len(model) == 1 else [f"model{i}" for i in range(len(model))]


def sharded_state(model, optimizer, *, with_optimizer: bool, with_rng: bool, is_loading: bool) -> dict:
    """The sharded state dict to save or to request on load: each model chunk's, the optimizer's, the RNG states."""
    # metadata={} (not None): megatron-core fills in its dp_cp_group in place, which GPTModel then reads to tie the
    # MTP stage's embedding copy (with None its own sharded_state_dict indexes None at PP > 1).
    state = {key: chunk.module.sharded_state_dict(metadata={}) for key, chunk in zip(model_state_keys(model), model)}
    if with_optimizer:
        # The optimizer's keys come from the parameters' sharded tensors, found in every chunk's state.
        state["optimizer"] = optimizer.sharded_state_dict(
            dict(state), is_loading=is_loading, metadata=OPTIMIZER_SHARDING
        )
    if with_rng:
        rank, world = dist.get_rank(), dist.get_world_size()
        state["rng_state"] = ShardedObject("rng_state", _rng_state(), (world,), (rank,), replica_id=0)
    return state
