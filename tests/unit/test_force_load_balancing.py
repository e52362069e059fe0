"""--moe-router-force-load-balancing (megatron-core's RandomSTE) in our router."""

import pytest
import torch

from megatron_moe.config import MoELayerConfig
from megatron_moe.config.moe_layer import MoEConfigError
from megatron_moe.model.builder import transformer_config
from megatron_moe.moe.gates import build_gate
from megatron_moe.moe.routing import ForcedBias
from tests.unit.test_config import cfg


def gate(force: bool, experts=8, **fields):
    torch.manual_seed(0)
    fields = dict(num_experts=experts, hidden_size=16, ffn_hidden_size=8, topk=2, force_load_balancing=force) | fields
    return build_gate(MoELayerConfig(**fields).validate())


def test_random_logits_balance_the_load_and_pass_the_gradient_straight_through():
    x = torch.randn(4096, 16)
    x[:, 0] += 50.0  # a strongly skewed router: a few experts take every token
    for name in ("topk", "sigmoid"):
        forced, plain = gate(True, gate=name), gate(False, gate=name)
        forced.load_state_dict(plain.state_dict())
        load_forced = torch.bincount(forced(x).expert_N, minlength=8).float()
        load_plain = torch.bincount(plain(x).expert_N, minlength=8).float()
        assert load_forced.max() / load_forced.mean() < 1.2 < load_plain.max() / load_plain.mean()
        logits = forced.router_logits(x[:64])
        logits.sum().backward()  # straight through: d(sum)/dW = sum of x per expert row
        torch.testing.assert_close(forced.weight.grad, x[:64].sum(0).expand(8, 16).contiguous())


def test_the_flag_reaches_both_layers_and_is_refused_for_gates_without_logits():
    assert cfg("--moe-router-force-load-balancing").moe.layer_config(cfg().model).force_load_balancing
    assert transformer_config(
        cfg("--moe-layer-impl", "mcore", "--moe-router-force-load-balancing")
    ).moe_router_force_load_balancing
    with pytest.raises(
        MoEConfigError, match=r"--moe-router-force-load-balancing=True: --moe-gate=expert_choice has no"
    ):
        MoELayerConfig(
            num_experts=8, hidden_size=16, ffn_hidden_size=8, gate="expert_choice", force_load_balancing=True
        ).validate()


def seed_model_parallel(seed: int) -> None:
    """The tracker's data-parallel stream seeded from --seed alone, as megatron-core seeds it on every rank."""
    from megatron_moe.platform import init_platform
    from megatron_moe.platform.rng import data_parallel_stream, rng_tracker

    init_platform()  # on the CPU the tracker's streams are the host generator's
    rng_tracker().reset()
    rng_tracker().add(data_parallel_stream(), seed)


def test_force_biased_skews_the_load_by_a_bias_every_rank_draws_alike():
    """--moe-router-force-biased: random logits plus N(0, |STD|) per expert. STD > 0: a new bias each forward from
    megatron-core's data-parallel stream (seeded alike on every rank: two 'ranks' seeded alike draw the same);
    STD < 0: one bias per (--seed, layer), whatever the stream."""
    x = torch.randn(8192, 16)
    biases = {}
    for rank in range(2):  # the streams of two ranks: seeded from the same --seed, whatever the rank
        forced = gate(False, gate="topk", force_biased=3.0)
        seed_model_parallel(1234)
        torch.manual_seed(100 + rank)  # the ranks' own streams differ (random logits: EP stream on a GPU)
        biases[rank] = [forced.forced_bias.bias_E(x) for _ in range(2)]
    torch.testing.assert_close(biases[0], biases[1], rtol=0, atol=0)
    assert not torch.equal(biases[0][0], biases[0][1])  # a new bias each forward
    seed_model_parallel(1234)
    unit = ForcedBias(1.0, 8).bias_E(x)
    torch.testing.assert_close(biases[0][0], 3.0 * unit)  # N(0, STD): the same draws scaled

    skewed = gate(False, gate="topk", force_biased=-3.0)
    skewed.forced_bias.key = (1234, 3)
    load = torch.bincount(skewed(x).expert_N, minlength=8).float()
    assert load.max() / load.mean() > 1.5  # a bias of std 3 on N(0, 1) logits: a few experts take most tokens
    first = skewed.forced_bias.bias_E(x)
    torch.manual_seed(7), seed_model_parallel(99)  # neither stream moves the kept bias
    torch.testing.assert_close(skewed.forced_bias.bias_E(x), first, rtol=0, atol=0)
    other = gate(False, gate="topk", force_biased=-3.0)
    other.forced_bias.key = (1234, 3)
    torch.testing.assert_close(other.forced_bias.bias_E(x), first, rtol=0, atol=0)  # a resumed run's
    other.forced_bias.key, other.forced_bias._kept_E = (1234, 4), None
    assert not torch.equal(other.forced_bias.bias_E(x), first)  # another layer's

    logits = skewed.router_logits(x[:64])
    logits.sum().backward()  # the gradient straight through, as megatron-core's RandomSTEShared
    torch.testing.assert_close(skewed.weight.grad, x[:64].sum(0).expand(8, 16).contiguous())


def test_force_biased_is_our_layers_and_names_what_it_needs():
    from megatron_moe.config import ConfigError, parse_and_validate
    from tests.unit.test_flags_megatron_core_refuses import BASE

    layer = parse_and_validate([*BASE, "--moe-router-force-biased", "-0.5"], 1).moe.layer_config(cfg().model)
    assert layer.force_biased == -0.5
    with pytest.raises(ConfigError, match=r"--moe-router-force-biased=0.5: megatron-core 0.16.1's router has no"):
        parse_and_validate([*BASE, "--moe-layer-impl", "mcore", "--moe-router-force-biased", "0.5"], 1)
    with pytest.raises(MoEConfigError, match=r"--moe-router-force-biased=0.0: a standard deviation"):
        MoELayerConfig(num_experts=8, hidden_size=16, ffn_hidden_size=8, force_biased=0.0).validate()
    with pytest.raises(MoEConfigError, match=r"--moe-router-force-biased=1.0: --moe-gate=expert_choice has no"):
        MoELayerConfig(
            num_experts=8, hidden_size=16, ffn_hidden_size=8, gate="expert_choice", force_biased=1.0
        ).validate()
