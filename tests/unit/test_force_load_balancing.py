"""--moe-router-force-load-balancing (megatron-core's RandomSTE) in our router."""

import pytest
import torch

from megatron_moe.config import MoELayerConfig
from megatron_moe.config.moe_layer import MoEConfigError
from megatron_moe.model.builder import transformer_config
from megatron_moe.moe.gates import build_gate
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
