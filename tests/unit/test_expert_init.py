"""Issue 25, item 1 in one process: the experts' initial weights come from (seed, layer, expert) alone.

The layouts (EP, ESP) and the GPU-like tracker across ranks: tests/distributed/test_expert_init.py.
"""

import torch

from megatron_moe.config import parse_args
from megatron_moe.model.builder import moe_layer
from megatron_moe.moe import MoELayerConfig
from megatron_moe.moe.experts import FFNExperts
from megatron_moe.platform.rng import host_rng_keyed, keyed_seed
from tests.unit.gpu_emulation import device_generator_apart

SIZES = dict(num_local_experts=4, hidden_size=16, ffn_hidden_size=24, gated=True)


def experts(init_seed=1234, layer_number=1) -> FFNExperts:
    def init(w):
        return torch.nn.init.normal_(w, std=0.02)

    return FFNExperts(
        **SIZES, init_method=init, output_init_method=init, init_seed=init_seed, layer_number=layer_number
    )


def test_the_run_seed_reaches_the_layer():
    flags = ["--data-path", "d", "--tokenizer-model", "t.model", "--num-experts", "8"]
    assert moe_layer(parse_args([*flags, "--seed", "7"])).init_seed == 7
    assert (
        moe_layer(parse_args(flags)).init_seed
        == 1234
        == MoELayerConfig(num_experts=8, hidden_size=8, ffn_hidden_size=8).init_seed
    )


def test_weights_do_not_depend_on_the_generators_state_and_leave_it_alone():
    torch.manual_seed(1)
    a = experts()
    after_a = torch.rand(3)  # the host generator continues as if nothing had been drawn
    torch.manual_seed(1)
    expected_after = torch.rand(3)
    torch.manual_seed(2)
    with device_generator_apart():  # and whatever the tracker points at
        b = experts()
    assert torch.equal(after_a, expected_after)
    assert torch.equal(a.weight1, b.weight1) and torch.equal(a.weight2, b.weight2)


def test_experts_layers_and_seeds_all_differ():
    base = experts()
    w1 = base.weight1.detach()
    assert all(not torch.equal(w1[i], w1[j]) for i in range(4) for j in range(i + 1, 4))
    assert not torch.equal(experts(layer_number=2).weight1, base.weight1)
    assert not torch.equal(experts(init_seed=99).weight1, base.weight1)


def test_keyed_seed_depends_on_every_key():
    seeds = {keyed_seed(s, layer, e) for s in (0, 1) for layer in (0, 1, 2) for e in range(8)}
    assert len(seeds) == 2 * 3 * 8 and all(0 <= s < 2**63 for s in seeds)
    with host_rng_keyed(5, 1, 2):
        first = torch.randn(4)
    with host_rng_keyed(5, 1, 2):
        assert torch.equal(torch.randn(4), first)
