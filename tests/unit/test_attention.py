"""The attention flags (--kv-channels, --qk-layernorm, multi-latent attention and its YaRN RoPE, --rotary-percent):
the flag pass takes DeepSeek-V2-Lite's, DeepSeek-V3's and Qwen3's and refuses bad values by name; our spec's model
equals megatron-core's own local spec's given the same weights; a tiny MLA + YaRN + q/k-norm MoE model trains."""

from __future__ import annotations

import functools

import pytest

from megatron_moe.config import ConfigError, parse_args

BASE = ["--data-path", "d", "--tokenizer-model", "t"]
DEEPSEEK_V2_LITE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --kv-channels 16 --multi-latent-attention "
    "--kv-lora-rank 32 --v-head-dim 16 --qk-head-dim 16 --qk-layernorm --qk-pos-emb-head-dim 8 --rotary-percent 1.0 "
    "--rotary-base 10000 --rotary-scaling-factor 40 --mscale 0.707 --mscale-all-dim 0.707 --normalization RMSNorm "
    "--position-embedding-type rope --swiglu --disable-bias-linear"
).split()
"""Megatron-LM's DeepSeek-V2-Lite attention flags (examples/post_training/modelopt/conf), sizes shrunk."""
DEEPSEEK_V3 = [*DEEPSEEK_V2_LITE, "--q-lora-rank", "48"]
QWEN3 = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2 --kv-channels 32 --qk-layernorm "
    "--normalization RMSNorm --position-embedding-type rope --rotary-base 1000000 --swiglu --disable-bias-linear"
).split()
"""Megatron-LM's Qwen3-30B-A3B attention flags: heads wider than hidden / heads (4 x 32 > 64), GQA, q/k norms."""


def config(*flags: str, world_size: int = 1):
    cfg = parse_args([*BASE, *flags])
    cfg.validate(world_size)
    return cfg


@pytest.mark.parametrize("flags", [DEEPSEEK_V2_LITE, DEEPSEEK_V3, QWEN3], ids=["v2-lite", "v3", "qwen3"])
def test_the_flag_pass_takes_megatron_lm_attention_flags(flags):
    cfg = config(*flags)
    m = cfg.model
    assert m.qk_layernorm
    if m.multi_latent_attention:
        assert (m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim) == (32, 16, 8, 16)
        assert m.mla_rope_type == "yarn" and m.rotary_scaling_factor == 40 and m.mscale_all_dim == 0.707
        assert m.q_lora_rank == (48 if "--q-lora-rank" in flags else None)
        assert any(n.startswith("--kv-channels 16: changes nothing") for n in cfg.notes)  # MLA's heads are its own
    else:
        assert m.head_dim == 32 and m.num_query_groups == 2


def test_megatron_lm_defaults():
    m = config().model
    assert (m.kv_channels, m.qk_layernorm, m.multi_latent_attention, m.q_lora_rank, m.kv_lora_rank) == (
        None,
        False,
        False,
        None,
        32,
    )
    assert (m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim, m.rope_type, m.rotary_percent) == (
        128,
        64,
        128,
        None,
        1,
    )
    assert (m.rotary_scaling_factor, m.mscale, m.mscale_all_dim) == (1.0, 1.0, 0.0)


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--kv-channels", "0"], "--kv-channels=0"),
        (["--multi-latent-attention", "--kv-lora-rank", "-1"], "--kv-lora-rank=-1"),
        (["--multi-latent-attention", "--qk-pos-emb-head-dim", "7"], "--qk-pos-emb-head-dim=7"),
        (["--multi-latent-attention", "--q-lora-rank", "0"], "--q-lora-rank=0"),
        (["--multi-latent-attention", "--v-head-dim", "0"], "--v-head-dim=0"),
        (["--multi-latent-attention", "--position-embedding-type", "learned_absolute"], "--position-embedding-type"),
        (["--multi-latent-attention", "--num-query-groups", "2"], "--num-query-groups=2"),
        (["--multi-latent-attention", "--mscale-all-dim", "-1"], "--mscale-all-dim=-1"),
        (["--rope-type", "yarn"], "--rope-type=yarn"),
        (["--rotary-percent", "0"], "--rotary-percent=0"),
        (["--rotary-percent", "1.5"], "--rotary-percent=1.5"),
        (["--hidden-size", "64", "--num-attention-heads", "4", "--rotary-percent", "0.1"], "--rotary-percent=0.1"),
        (["--hidden-size", "60", "--num-attention-heads", "8"], "--hidden-size=60"),
    ],
)
def test_bad_attention_values_are_refused_by_name(flags, named):
    with pytest.raises(ConfigError, match=named.replace("-", r"\-")):
        config(*flags)


def test_hidden_not_a_multiple_of_heads_is_fine_with_kv_channels():
    assert config("--hidden-size", "60", "--num-attention-heads", "8", "--kv-channels", "16").model.head_dim == 16


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--q-lora-rank", "33"], "--q-lora-rank=33"),
        (["--kv-lora-rank", "31"], "--kv-lora-rank=31"),  # 31 + 8 outputs
        (["--qk-layernorm"], "--qk-layernorm"),  # its latent norm's gradient needs sequence parallelism
    ],
)
def test_mla_under_tensor_parallelism_is_checked_by_name(flags, named):
    mla = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--multi-latent-attention"]
    mla += ["--qk-pos-emb-head-dim", "8", "--tensor-model-parallel-size", "2"]
    with pytest.raises(ConfigError, match=named):
        config(*mla, *flags, world_size=2)
    config(*mla, "--sequence-parallel", "--q-lora-rank", "32", world_size=2)  # and a layout that fits passes


def test_refusals_of_these_flags_are_gone():
    from megatron_moe.config import megatron_lm

    for flag in ("--kv-channels", "--qk-layernorm"):
        assert flag not in megatron_lm.REFUSED
    assert "--rotary-percent" not in megatron_lm.NOT_NEEDED_WITH
    assert config("--rotary-percent", "0.5").model.rotary_percent == 0.5


def test_flops_count_the_attention_flags():
    from megatron_moe.training.flops import matmul_params_per_token

    plain = matmul_params_per_token(config("--hidden-size", "64", "--num-attention-heads", "4"), 128)
    wide = matmul_params_per_token(
        config("--hidden-size", "64", "--num-attention-heads", "4", "--kv-channels", "32"), 128
    )
    assert wide - plain == 4 * 4 * (64 * 64)  # 4 layers; Q, K, V and O each 64 x 128 instead of 64 x 64
    mla = config(*DEEPSEEK_V2_LITE, "--num-layers", "4", "--q-lora-rank", "48")
    h, n = 64, 4
    attention = 48 * h + 48 * n * 24 + h * (32 + 8) + 32 * n * (16 + 16) + n * 16 * h  # q down/up, kv down/up, o
    dense = 3 * h * 4 * h
    assert matmul_params_per_token(mla, 128) == 4 * (attention + dense) + h * 128


MODELS = {
    "qwen3": QWEN3,
    "v2-lite": DEEPSEEK_V2_LITE,
    "qwen2-qkv-bias": [
        *("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2"),
        *("--disable-bias-linear", "--add-qkv-bias", "--normalization", "RMSNorm", "--swiglu"),
    ],
    "v3-rope": [*DEEPSEEK_V3, "--rope-type", "rope", "--rotary-percent", "0.5"],
    "partial-rope": [
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--rotary-percent",
        "0.5",
    ],
}


def gpt_models(cfg):
    """(ours, megatron-core's): one GPTModel from our block spec, one from get_gpt_layer_local_spec, same weights."""
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_moe.model import build_model, transformer_config
    from megatron_moe.model.attention import LatentDotProductAttention

    config = transformer_config(cfg)
    torch.manual_seed(0)
    ours = build_model(cfg, config, 128)
    m = cfg.model
    spec = get_gpt_layer_local_spec(
        qk_layernorm=m.qk_layernorm, multi_latent_attention=m.multi_latent_attention, normalization=m.normalization
    )
    if m.multi_latent_attention:  # 0.16.1's local MLA cannot build: its DotProductAttention takes no head widths
        spec.submodules.self_attention.submodules.core_attention = LatentDotProductAttention
    theirs = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=128,
        max_sequence_length=m.seq_length,
        position_embedding_type="rope",
        rotary_base=m.rotary_base,
        rotary_percent=m.rotary_percent,
        share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
    )
    mine, other = ours.state_dict(), theirs.state_dict()
    assert mine.keys() == other.keys()
    theirs.load_state_dict(mine)
    return ours, theirs


@pytest.mark.parametrize("name", list(MODELS))
def test_our_attention_equals_megatron_core_local_spec(megatron_world1, name):
    import torch

    cfg = config(*MODELS[name], "--seq-length", "16")
    ours, theirs = gpt_models(cfg)
    if cfg.model.add_qkv_bias:  # Qwen2: biases on linear_qkv alone
        assert [k for k in ours.state_dict() if k.endswith(".bias")] == [
            f"decoder.layers.{i}.self_attention.linear_qkv.bias" for i in range(2)
        ]
    if cfg.model.qk_layernorm:
        assert any("layernorm" in k and ("q_" in k or "k_" in k or "kv_" in k) for k in ours.state_dict())
    tokens = torch.randint(0, 128, (2, 16))
    position_ids = torch.arange(16).expand(2, 16)
    losses = []
    for model in (ours, theirs):
        loss = model(tokens, position_ids, None, labels=tokens).sum()
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    for (key, a), b in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7, msg=key)


def test_latent_core_attention_is_causal_attention_with_mla_head_widths(megatron_world1):
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_moe.model import transformer_config
    from megatron_moe.model.attention import LatentDotProductAttention

    mla = transformer_config(config(*DEEPSEEK_V2_LITE))
    core = LatentDotProductAttention(
        config=mla,
        layer_number=1,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        softmax_scale=0.3,
        k_channels=24,
        v_channels=16,
    )
    s, b, n = 8, 2, 4
    q, k, v = torch.randn(s, b, n, 24), torch.randn(s, b, n, 24), torch.randn(s, b, n, 16)
    out_SBV = core(q, k, v, None)
    ref_BNSV = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True, scale=0.3)
    torch.testing.assert_close(out_SBV, ref_BNSV.permute(2, 0, 1, 3).reshape(s, b, n * 16))


MLA_MOE = (
    "--multi-latent-attention --q-lora-rank 32 --kv-lora-rank 32 --qk-head-dim 16 --qk-pos-emb-head-dim 8 "
    "--v-head-dim 16 --qk-layernorm --rotary-scaling-factor 40 --mscale 0.707 --mscale-all-dim 0.707 "
    "--normalization RMSNorm --swiglu --disable-bias-linear"
).split()
"""A DeepSeek-V3-shaped attention (q and kv latents with their norms, YaRN) on one_rank_run's tiny MoE model."""


class SameBatches:
    """One fixed batch every step, so that the loss must fall."""

    def __init__(self):
        import torch

        from tests.unit.one_rank_run import MICRO, SEQ, VOCAB

        tokens = torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(0))
        self.batch = {
            "tokens": tokens,
            "labels": tokens.roll(-1, dims=1),
            "loss_mask": torch.ones(MICRO, SEQ),
            "position_ids": torch.arange(SEQ).expand(MICRO, SEQ),
        }
        self.train_iterator = self.valid_iterator()

    def valid_iterator(self):
        while True:
            yield self.batch


@pytest.mark.parametrize("extra", [[], ["--recompute-granularity", "selective", "--recompute-modules", "qkv"]])
def test_a_tiny_mla_yarn_qk_norm_model_trains(megatron_world1, extra):
    """Through the real trainer (megatron-core's DDP, optimizer, schedule): finite, falling losses; also with the
    activation policy recomputing MLA's q/kv projections (`--recompute-modules qkv` covers them)."""
    import math

    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from tests.unit.one_rank_run import one_rank_trainer

    cfg, trainer = one_rank_trainer(*MLA_MOE, *extra, "--train-iters", "4", "--lr", "1e-2", "--lr-warmup-iters", "0")
    trainer.data = SameBatches()
    model = trainer.model[0]
    assert any(isinstance(m, MLASelfAttention) for m in model.modules())
    names = [name for name, _ in model.named_parameters()]
    assert any("q_layernorm" in n for n in names) and any("kv_layernorm" in n for n in names)
    losses = [step["lm loss"] for step in trainer.train()]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0] - 0.1, losses
    if extra:  # the activation policy's `qkv` region holds MLA's four q/kv projections
        for layer in model.module.decoder.layers:
            attention = layer.self_attention
            for name in ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj"):
                forward = getattr(attention, name).forward
                assert isinstance(forward, functools.partial) and forward.args[0] == "qkv", name


def test_a_checkpoint_of_another_attention_is_refused_and_an_older_one_loads():
    from megatron_moe.checkpointing import check_compatible

    saved = config(*DEEPSEEK_V2_LITE).to_dict()
    with pytest.raises(ConfigError, match="--q-lora-rank: checkpoint None, now 48"):
        check_compatible(saved, config(*DEEPSEEK_V3), "ckpt")
    older = config().to_dict()  # saved before the attention flags: none of their keys
    for name in ("kv_channels", "qk_layernorm", "multi_latent_attention", "kv_lora_rank", "qk_head_dim"):
        del older["model"][name]
    check_compatible(older, config(), "ckpt")
    with pytest.raises(ConfigError, match="--qk-layernorm: checkpoint False, now True"):
        check_compatible(older, config("--qk-layernorm"), "ckpt")


@pytest.mark.parametrize("mla", [False, True])
def test_the_transformer_engine_spec_is_megatron_cores_with_our_norms(mla):
    """megatron-core's TE spec (get_gpt_layer_with_transformer_engine_spec, which cannot be called without
    transformer-engine): TELinear down-projections, TE column/row-parallel linears and attention; here with
    `SequenceParallelNorm` q/k (latent) norms where it fuses them into TELayerNormColumnParallelLinear / TENorm."""
    from megatron.core.extensions import transformer_engine as te
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

    from megatron_moe.model import transformer_config
    from megatron_moe.model.spec import layer_spec
    from megatron_moe.platform.norms import SequenceParallelNorm

    cfg = config(*(DEEPSEEK_V3 if mla else QWEN3))
    attention = layer_spec(transformer_config(cfg), moe=False, backend=TESpecProvider()).submodules.self_attention
    s = attention.submodules
    assert s.core_attention is te.TEDotProductAttention and s.linear_proj is te.TERowParallelLinear
    if mla:
        assert s.linear_q_down_proj is te.TELinear and s.linear_kv_down_proj is te.TELinear
        assert s.linear_q_up_proj is te.TEColumnParallelLinear and s.linear_kv_up_proj is te.TEColumnParallelLinear
        assert s.q_layernorm is SequenceParallelNorm and s.kv_layernorm is SequenceParallelNorm
    else:
        assert s.linear_qkv is te.TEColumnParallelLinear
        assert s.q_layernorm is SequenceParallelNorm and s.k_layernorm is SequenceParallelNorm


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--multi-latent-attention", "--qk-pos-emb-head-dim", "8"], "--multi-latent-attention"),
        (["--qk-layernorm"], "--qk-layernorm"),
        (["--kv-channels", "32"], "--kv-channels=32"),
        (["--rotary-percent", "0.5"], "--rotary-percent=0.5"),
    ],
)
def test_export_to_mixtral_refuses_attention_it_cannot_write(flags, named):
    from megatron_moe.checkpointing import hf_families

    mixtral = "--num-experts 4 --moe-layer-freq 1 --swiglu --normalization RMSNorm --disable-bias-linear"
    cfg = config(*mixtral.split(), "--untie-embeddings-and-output-weights", "--hidden-size", "64", *flags)
    assert hf_families.incompatibilities(config(*mixtral.split(), "--untie-embeddings-and-output-weights")) == []
    (problem,) = hf_families.incompatibilities(cfg, hf_families.MIXTRAL)
    assert named in problem


def test_mla_rope_fusion_only_with_yarn_and_megatron_cores_mla_kernel(monkeypatch):
    """megatron-core refuses apply_rope_fusion for MLA with plain RoPE, and MLA's fused YaRN needs its triton kernel."""
    from megatron_moe.model import fusions
    from megatron_moe.platform.fusions import FusedKernels

    every = FusedKernels(accelerator=True, grad_accum=True, masked_softmax=True, rope=True)
    monkeypatch.setattr(fusions, "mla_fused_rope", lambda: True)
    assert fusions.choose_fusions(config(*DEEPSEEK_V3), every, transformer_engine=True).rope
    chosen = fusions.choose_fusions(config(*DEEPSEEK_V3, "--rope-type", "rope"), every, transformer_engine=True)
    assert not chosen.rope and "YaRN" in chosen.off["rope"]
    monkeypatch.setattr(fusions, "mla_fused_rope", lambda: False)
    assert not fusions.choose_fusions(config(*DEEPSEEK_V3), every, transformer_engine=True).rope
    assert fusions.choose_fusions(config(*QWEN3), every, transformer_engine=True).rope  # not MLA: TE's kernel


@pytest.mark.parametrize(
    "overlap",
    [
        ["--moe-partition-pieces", "2", "--moe-partition-range", "all"],  # Lancet's operator partition
        ["--moe-pipeline-degree", "2", "--moe-bp-pipeline-degree", "2"],  # the chunked pipeline
        ["--recompute-granularity", "full"],
        ["--recompute-granularity", "selective", "--recompute-modules", "qkv", "core_attention", "attn_proj"],
    ],
    ids=["operator-partition", "chunked-pipeline", "full-recompute", "selective-recompute"],
)
def test_mla_composes_with_the_moe_overlaps_and_recompute(megatron_world1, overlap):
    """The same MLA + q/k-norm MoE model, from the same initial weights, trains to the same losses and grad norms
    with the feature on as off (the partition's pieces split the batch: attention runs per piece)."""
    import torch

    from megatron_moe.model.partition import PartitionedTransformerBlock
    from megatron_moe.platform.rng import seed_model_parallel
    from megatron_moe.training.setup import install_operator_partition
    from tests.unit.one_rank_run import one_rank_trainer

    histories = []
    for flags in ([], overlap):
        torch.manual_seed(0)
        seed_model_parallel(0)
        cfg, trainer = one_rank_trainer(*MLA_MOE, *flags, "--train-iters", "3", "--lr", "1e-2")
        trainer.data = SameBatches()
        if install_operator_partition(cfg, trainer.model, None):  # as training/setup.py does at start-up
            assert isinstance(trainer.model[0].module.decoder, PartitionedTransformerBlock)
        histories.append(trainer.train())
    if "--moe-pipeline-degree" in overlap:
        assert histories[1][0]["pipeline_degrees"] == {"1": [2, 2], "2": [2, 2]}
    elif "--moe-partition-pieces" in overlap:
        assert isinstance(trainer.model[0].module.decoder, PartitionedTransformerBlock)
    off, on = histories
    for a, b in zip(off, on):
        assert b["lm loss"] == pytest.approx(a["lm loss"], rel=1e-5), (a["lm loss"], b["lm loss"])
        assert b["grad norm"] == pytest.approx(a["grad norm"], rel=1e-4), (a["grad norm"], b["grad norm"])


def test_query_key_layer_scaling_is_the_same_attention(megatron_world1):
    """--apply-query-key-layer-scaling (Megatron-LM's fp16 aid): Q.K^T / layer number, the softmax in fp32 scaled
    back; in fp32 the same losses and gradients as without it, to rounding."""
    import torch

    from megatron_moe.model import build_model, transformer_config

    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16"]
    models = []
    for extra in ([], ["--apply-query-key-layer-scaling"]):
        cfg = config(*flags, *extra)
        config_ = transformer_config(cfg)
        assert config_.apply_query_key_layer_scaling == bool(extra)
        torch.manual_seed(0)
        models.append(build_model(cfg, config_, 128))
    models[1].load_state_dict(models[0].state_dict())
    tokens = torch.randint(0, 128, (2, 16))
    position_ids = torch.arange(16).expand(2, 16)
    losses = [model(tokens, position_ids, None, labels=tokens).sum() for model in models]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=0)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
