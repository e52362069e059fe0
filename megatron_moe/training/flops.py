"""Model FLOPs per token, counted as Megatron-LM counts them for --log-throughput.

Every matrix multiply of a token's path costs 2 FLOPs per weight forward and 4 backward (input and weight
gradients): 6 x the weights a token meets. A token meets the attention projections, the dense MLPs, in an MoE
layer the router, its top-k experts and the shared expert, and the output layer (the vocabulary, padded); each MTP
layer (--mtp-num-layers) adds its projection (2h x h), a layer of the last layer's kind and the output layer again.
Attention scores and their weighted sum add 2 x 2 x s x h forward per token and layer, 12 x s x h with backward
(the full s x s square, not halved for the causal mask), h being heads x head width (--kv-channels); with MLA
2 x s x n x (q head + v head) forward, so 6 x s x n x (q + v head) with backward. Norms, biases, softmax and
activations are left out. Recomputation is not counted: these are model FLOPs, not hardware FLOPs.
"""

from __future__ import annotations

import logging

from megatron_moe.config import ModelConfig, RunConfig
from megatron_moe.platform import PeakRate

log = logging.getLogger("megatron_moe")


def matmul_params_per_token(cfg: RunConfig, vocab_size: int) -> int:
    """The weights one token's forward multiplies by (module docstring): its active parameters, less norms and
    biases, with the output layer counted even when tied to the embedding."""
    m, moe = cfg.model, cfg.moe
    h = m.hidden_size
    attention = attention_params(m)
    mats = 3 if m.swiglu else 2
    dense = mats * h * m.ffn_width
    pattern = moe.layer_pattern(m.num_layers) if moe.is_moe else [0] * m.num_layers
    pattern += pattern[-1:] * m.mtp_layers  # each MTP layer's transformer layer: the last layer's spec
    total = m.mtp_layers * (2 * h * h + h * vocab_size)  # each MTP layer's projection and output layer
    for is_moe in pattern:
        total += attention
        if not is_moe:
            total += dense
            continue
        expert = mats * h * moe.expert_ffn_width(m)
        total += h * moe.num_experts + moe.moe_router_topk * expert
        if moe.moe_shared_expert_ffn_hidden_size:
            total += mats * h * moe.moe_shared_expert_ffn_hidden_size
    return total + h * vocab_size


def attention_params(m: ModelConfig) -> int:
    """One layer's attention projection weights: Q, K, V and output (heads x --kv-channels wide), or MLA's down-
    and up-projections of its query (or its one query projection) and key/value latents, and its output."""
    n, h = m.num_attention_heads, m.hidden_size
    if not m.multi_latent_attention:
        q, kv = n * m.head_dim, (m.num_query_groups or n) * m.head_dim
        return h * q + 2 * h * kv + q * h
    q_head = m.qk_head_dim + m.qk_pos_emb_head_dim
    query = h * n * q_head if m.q_lora_rank is None else m.q_lora_rank * (h + n * q_head)
    key_value = h * (m.kv_lora_rank + m.qk_pos_emb_head_dim) + m.kv_lora_rank * n * (m.qk_head_dim + m.v_head_dim)
    return query + key_value + n * m.v_head_dim * h


def attention_score_width(m: ModelConfig) -> float:
    """Per token and key, the multiply-adds of scores and their weighted sum over all heads: q.k and p.v widths."""
    if m.multi_latent_attention:
        return m.num_attention_heads * (m.qk_head_dim + m.qk_pos_emb_head_dim + m.v_head_dim) / 2
    return m.num_attention_heads * m.head_dim


def flops_per_token(cfg: RunConfig, vocab_size: int) -> float:
    """Forward and backward model FLOPs of one token (module docstring)."""
    m = cfg.model
    attention_scores = 12 * m.layer_count * m.seq_length * attention_score_width(m)
    return 6.0 * matmul_params_per_token(cfg, vocab_size) + attention_scores


def expert_params_each(cfg: RunConfig) -> int:
    """The weights of one routed expert (its MLP's matrices; our experts have no biases)."""
    m, moe = cfg.model, cfg.moe
    return (3 if m.swiglu else 2) * m.hidden_size * moe.expert_ffn_width(m)


def inactive_params_per_token(cfg: RunConfig) -> int:
    """The routed experts' weights a token does not meet: (E - k) experts in every MoE layer."""
    moe = cfg.moe
    if not moe.is_moe:
        return 0
    layers = moe.moe_layer_count(cfg.model)
    return layers * max(moe.num_experts - moe.moe_router_topk, 0) * expert_params_each(cfg)


class Mfu:
    """MFU against a `PeakRate`, never above 100%.

    A measured rate (CPU) is only as good as its probe: one that shared the cores with another process's start-up
    read slow, and the demo showed 118%. So when a run's FLOP/s pass the rate it is measured again (at most
    `remeasures` times) and the better one kept; if the run is still faster, its own FLOP/s are the best rate this
    device has shown and become the denominator. A data-sheet peak cannot be passed: the FLOPs are overcounted
    (`flops_per_token`), MFU shows 100%. Either way one warning says so, once per run.
    """

    def __init__(self, peak: PeakRate, *, remeasures: int = 2):
        self.peak = peak
        self._remeasures = remeasures
        self._warned = False

    @property
    def what(self) -> str:
        return self.peak.what

    def percent(self, flops_per_s: float) -> float:
        """MFU in percent of the device's rate, `flops_per_s` the run's model FLOP/s per device."""
        peak = self.peak
        if flops_per_s > peak.flops_per_s and peak.remeasure is not None and self._remeasures > 0:
            self._remeasures -= 1
            peak.flops_per_s = max(peak.flops_per_s, peak.remeasure())
        if flops_per_s <= peak.flops_per_s:
            return 100.0 * flops_per_s / peak.flops_per_s
        if not self._warned:
            self._warned = True
            if peak.remeasure is not None:
                log.warning(
                    "MFU: this run's %.3f TFLOP/s per device exceed the %s (%.3f TFLOP/s, measured again now): the "
                    "probe read slow (other processes on the cores?); MFU is now of the best rate seen, the run's own",
                    flops_per_s / 1e12,
                    peak.what,
                    peak.flops_per_s / 1e12,
                )
            else:
                log.warning(
                    "MFU: this run's %.3f TFLOP/s per device exceed the %s (%.3f TFLOP/s): its model FLOPs are "
                    "overcounted (megatron_moe/training/flops.py); MFU shown as 100%%",
                    flops_per_s / 1e12,
                    peak.what,
                    peak.flops_per_s / 1e12,
                )
        if peak.remeasure is not None:
            peak.flops_per_s, peak.what = flops_per_s, "best rate seen"
        return 100.0
