"""GPU speed defaults: megatron-core's fusions where the platform has their kernels, the batched
p2p sync only where torch needs it, pinned data-loader batches on a GPU, and one device read for a step's MoE
metrics. The GPU is faked: the platform's probes answer as a GPU machine with or without each kernel would."""

import logging
import re
import types

import pytest
import torch

from megatron_moe.config import parse_args
from megatron_moe.model import transformer_config
from megatron_moe.platform import Platform, count_host_syncs

# The fusion API is imported inside the tests that use it, so that each test fails on its own on a tree without it.
BASE = ["--data-path", "d", "--tokenizer-model", "t", "--num-layers", "2", "--hidden-size", "64"]
GPU = Platform(device=torch.device("cuda", 0), backend="nccl")
FIELDS = (
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "masked_softmax_fusion",
    "apply_rope_fusion",
    "gradient_accumulation_fusion",
)


def cfg(*flags):
    return parse_args([*BASE, *flags])


NAMES = {"bias_activation", "bias_dropout", "masked_softmax", "rope", "gradient_accumulation"}


def on(fused) -> set[str]:
    return {name for name in NAMES if getattr(fused, name)}


def choose(c, *, te=False, kernels=None):
    """The run's fusions on a GPU with every kernel (`kernels`: with these)."""
    from megatron_moe.model.fusions import choose_fusions
    from megatron_moe.platform.fusions import FusedKernels

    every = FusedKernels(accelerator=True, grad_accum=True, masked_softmax=True, rope=True)
    return choose_fusions(c, kernels or every, transformer_engine=te)


@pytest.fixture
def fake_gpu(monkeypatch):
    """The platform probes as a GPU machine; `importable` is the set of kernel modules it has."""
    from megatron_moe.platform import fusions

    importable: set[str] = set()
    monkeypatch.setattr(fusions, "current_platform", lambda: GPU)
    monkeypatch.setattr(fusions, "_importable", lambda module: module in importable)
    monkeypatch.setattr(fusions, "_te_fused_rope", lambda: "transformer_engine" in importable)
    return importable


def test_cpu_turns_every_fusion_off_with_its_reason():
    from megatron_moe.model import run_fusions
    from megatron_moe.platform.fusions import FusedKernels, fused_kernels

    c = cfg("--bf16", "--swiglu")
    fused = run_fusions(c)
    assert fused_kernels() == FusedKernels(accelerator=False, grad_accum=False, masked_softmax=False, rope=False)
    assert on(fused) == set() and set(fused.off.values()) == {"no GPU"}
    config = transformer_config(c, fused)
    assert not any(getattr(config, field) for field in (*FIELDS, "persist_layer_norm"))


def test_a_gpu_turns_on_what_its_kernels_allow(fake_gpu):
    from megatron_moe.platform.fusions import FusedKernels, fused_kernels

    assert fused_kernels() == FusedKernels(accelerator=True, grad_accum=False, masked_softmax=False, rope=False)
    bare = choose(cfg("--bf16"), kernels=fused_kernels())
    assert on(bare) == {"bias_activation", "bias_dropout"}  # megatron-core's jit kernels need only the GPU
    assert bare.off == {
        "masked_softmax": "no fused softmax kernels (apex's scaled_masked_softmax_cuda)",
        "rope": "no fused RoPE kernel (transformer-engine's)",
        "gradient_accumulation": "no fused_weight_gradient_mlp_cuda (apex built with --cuda_ext)",
    }
    fake_gpu.update(
        {"fused_weight_gradient_mlp_cuda", "scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda"}
    )
    fake_gpu.add("transformer_engine")
    assert fused_kernels() == FusedKernels(accelerator=True, grad_accum=True, masked_softmax=True, rope=True)
    assert on(choose(cfg("--bf16"), kernels=fused_kernels())) == NAMES
    fake_gpu.discard("scaled_upper_triang_masked_softmax_cuda")  # the causal kernel missing: no fused softmax
    assert not fused_kernels().masked_softmax


@pytest.mark.parametrize(
    "flags, te, off, why",
    [
        (["--disable-bias-linear"], False, "bias_activation", "GELU without biases"),
        (["--activation-policy", "arctic"], False, "bias_activation", "the activation policy acts on mlp_act"),
        (["--num-experts", "4", "--moe-layer-freq", "1"], False, "bias_activation", "no megatron-core MLP"),
        (["--num-experts", "4", "--moe-layer-impl", "mcore"], False, "bias_activation", "GELU experts of megatron"),
        ([], False, "masked_softmax", "fp32: the kernel takes bf16/fp16 scores only"),
        (["--bf16"], True, "masked_softmax", "transformer-engine's attention has its own softmax"),
        (["--position-embedding-type", "learned_absolute"], False, "rope", "learned positions"),
        (["--num-experts", "4", "--expert-model-parallel-size", "2"], False, "gradient_accumulation", "--overlap"),
    ],
)
def test_settings_megatron_core_or_this_stack_cannot_fuse_keep_a_fusion_off(flags, te, off, why):
    c = cfg(*flags)
    c.validate(world_size=2)
    fused = choose(c, te=te)
    assert off not in on(fused) and fused.off[off].startswith(why)


def test_settings_that_fuse_keep_them_on():
    swiglu_without_bias = cfg("--bf16", "--swiglu", "--disable-bias-linear")
    assert "bias_activation" in on(choose(swiglu_without_bias))  # megatron-core fuses SwiGLU without a bias
    mcore_swiglu = cfg("--swiglu", "--num-experts", "4", "--moe-layer-impl", "mcore")
    assert "bias_activation" in on(choose(mcore_swiglu))  # and SwiGLU experts with the router's probabilities
    lancet_off = cfg("--num-experts", "4", "--expert-model-parallel-size", "2", "--overlap-wgrad", "off")
    assert choose(lancet_off).gradient_accumulation


def test_megatron_core_accepts_the_fusions_a_gpu_turns_on(monkeypatch):
    from megatron.core.models.common.embeddings import rope_utils

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *a, **k: None)  # what TE would provide
    for flags in (["--bf16"], ["--bf16", "--swiglu", "--disable-bias-linear"]):
        c = cfg(*flags)
        config = transformer_config(c, choose(c))
        assert all(getattr(config, field) for field in FIELDS) and not config.persist_layer_norm


@pytest.mark.parametrize(
    "flag, name",
    [
        ("--no-bias-gelu-fusion", "bias_activation"),
        ("--no-bias-dropout-fusion", "bias_dropout"),
        ("--no-masked-softmax-fusion", "masked_softmax"),
        ("--no-rope-fusion", "rope"),
        ("--no-gradient-accumulation-fusion", "gradient_accumulation"),
    ],
)
def test_megatron_lms_flags_turn_a_fusion_off(flag, name):
    fused = choose(cfg("--bf16", flag))
    assert on(fused) == NAMES - {name}
    assert fused.off == {name: flag}
    swiglu = choose(cfg("--swiglu", "--no-bias-swiglu-fusion"))
    assert swiglu.off["bias_activation"] == "--no-bias-swiglu-fusion"


@pytest.mark.parametrize(
    "flags, applies",
    [
        (["--swiglu", "--no-bias-gelu-fusion"], "not --swiglu"),
        (["--disable-bias-linear", "--no-bias-gelu-fusion"], "that has biases"),
        (["--num-experts", "4", "--moe-layer-impl", "mcore", "--no-bias-gelu-fusion"], "no megatron-core MoE layer"),
        (["--no-bias-swiglu-fusion"], "with --swiglu"),
        (["--no-masked-softmax-fusion"], "with --fp16 or --bf16"),
        (["--position-embedding-type", "learned_absolute", "--no-rope-fusion"], "with --position-embedding-type rope"),
        (["--num-experts", "4", "--expert-model-parallel-size", "2", "--no-gradient-accumulation-fusion"], "--overlap"),
    ],
)
def test_a_fusion_flag_that_would_do_nothing_is_accepted_with_one_line(flags, applies):
    (line,) = cfg(*flags).notes
    assert re.search(f"^{flags[-1]}: changes nothing in this run \\(it applies only .*{applies}", line), line


def test_persist_layer_norm_is_answered_as_not_needed():
    assert any("--no-persist-layer-norm: not needed here" in note for note in cfg("--no-persist-layer-norm").notes)


def test_the_start_up_summary_names_the_fusions_on_and_why_the_others_are_off(caplog):
    from megatron_moe.training.summary import log_startup_summary

    c = cfg("--swiglu", "--train-iters", "3")
    c.validate(world_size=1)
    fused = choose(c)
    tokenizer = types.SimpleNamespace(description="SentencePieceTokenizer t", vocab_size=128)
    with caplog.at_level(logging.INFO, logger="megatron_moe"):
        log_startup_summary(c, {"total": 1, "active_per_token": 1, "this_rank": 1}, tokenizer, {}, fused)
    assert (
        "fusions: on: bias+activation, bias+dropout+add, RoPE, gradient accumulation; "
        "off: masked softmax (fp32: the kernel takes bf16/fp16 scores only)"
    ) in caplog.text


def test_the_batched_p2p_sync_is_off_where_torch_waits_for_the_batch(monkeypatch):
    assert not transformer_config(cfg()).batch_p2p_sync  # torch 2.13 here
    from megatron_moe.platform.fusions import batch_p2p_sync

    assert batch_p2p_sync("2.3.1+cu121") and batch_p2p_sync("1.12.0")
    assert not batch_p2p_sync("2.4.0") and not batch_p2p_sync("2.13.0a0+git1234")
    from megatron_moe.model import builder

    monkeypatch.setattr(builder, "batch_p2p_sync", lambda: True)
    assert transformer_config(cfg()).batch_p2p_sync


def test_the_platform_decides_pinned_data_loader_batches(monkeypatch):
    from megatron.core import parallel_state

    from megatron_moe.training import data

    loaders = []  # the keyword arguments of each data loader built
    monkeypatch.setattr(data, "build_gpt_datasets", lambda **kwargs: (object(), None, None))
    monkeypatch.setattr(data, "build_data_loader", lambda *args, **kwargs: loaders.append(kwargs) or [])
    monkeypatch.setattr(data, "dataset_sizes", lambda d: None)
    monkeypatch.setattr(parallel_state, "get_data_parallel_rank", lambda: 0)
    monkeypatch.setattr(parallel_state, "get_data_parallel_world_size", lambda: 1)
    c = cfg("--train-iters", "2", "--micro-batch-size", "1", "--global-batch-size", "1")
    c.validate(world_size=1)
    data.build_run_data(c, tokenizer=None, consumed_train_samples=0)
    monkeypatch.setattr(data, "current_platform", lambda: GPU)
    data.build_run_data(c, tokenizer=None, consumed_train_samples=0)
    assert [kwargs["pin_memory"] for kwargs in loaders] == [False, True]
    from megatron_moe.data.sampler import build_data_loader

    assert build_data_loader(list(range(4)), 0, 2, 0, 1, pin_memory=True).pin_memory


@pytest.mark.parametrize("num_layers", [2, 6])
def test_the_step_reads_its_moe_metrics_from_the_device_once_whatever_the_layers(num_layers):
    from megatron.core.transformer import TransformerConfig

    from megatron_moe.moe import MoELayer, MoELayerConfig, collect_moe_metrics

    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=num_layers, hidden_size=16, num_attention_heads=2, num_moe_experts=4, add_bias_linear=False
    )
    moe = MoELayerConfig(num_experts=4, hidden_size=16, ffn_hidden_size=8, topk=2, capacity_factor=1.0)
    layers = torch.nn.ModuleList(MoELayer(config, moe, layer_number=i + 1) for i in range(num_layers))
    for layer in layers:
        layer(torch.randn(8, 2, 16))
    counts = {}
    with count_host_syncs(torch.device("cpu")) as syncs:
        figures = collect_moe_metrics([layers], num_layers=num_layers, num_experts=4, expert_counts=counts)
    assert syncs.count == 1, syncs.events
    assert sorted(counts) == list(range(1, num_layers + 1)) and all(sum(c) == 32 for c in counts.values())
    assert figures["moe dead experts"] >= 0 and f"moe/layer_{num_layers:03d}/tokens_cv" in figures
