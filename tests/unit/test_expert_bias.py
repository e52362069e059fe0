"""Aux-loss-free balancing and group-limited routing against megatron-core 0.16.1's own router, single process."""

import pytest
import torch
from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias, reset_model_temporary_tensors
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter

from megatron_moe.config import ConfigError, parse_args
from megatron_moe.config.megatron_lm import REFUSED
from megatron_moe.model.builder import transformer_config
from megatron_moe.moe import MoELayer, MoELayerConfig, group_limited_topk, update_expert_biases
from tests.unit.mcore_router import router_groups

H, E, S, B = 16, 8, 6, 4

FLAGS = {  # our layer's fields -> megatron-core's TransformerConfig fields
    "sigmoid, bias": (
        dict(gate="sigmoid", topk=2, expert_bias=True, bias_update_rate=0.02),
        dict(moe_router_score_function="sigmoid", moe_router_topk=2, moe_router_enable_expert_bias=True,
             moe_router_bias_update_rate=0.02),
    ),
    "sigmoid, bias, groups": (
        dict(gate="sigmoid", topk=4, expert_bias=True, bias_update_rate=0.02, num_groups=4, group_topk=2),
        dict(moe_router_score_function="sigmoid", moe_router_topk=4, moe_router_enable_expert_bias=True,
             moe_router_bias_update_rate=0.02, moe_router_num_groups=4, moe_router_group_topk=2),
    ),
    "softmax, groups": (
        dict(gate="topk", topk=4, num_groups=4, group_topk=2),
        dict(moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=2),
    ),
    "softmax pre-softmax, groups": (
        dict(gate="topk", topk=4, num_groups=2, group_topk=1, normalize_topk=False),
        dict(moe_router_topk=4, moe_router_num_groups=2, moe_router_group_topk=1, moe_router_pre_softmax=True),
    ),
}  # fmt: skip


def tconfig(**kw):
    base = dict(num_layers=1, hidden_size=H, num_attention_heads=2, ffn_hidden_size=8, num_moe_experts=E)
    base.update(add_bias_linear=False, moe_router_dtype="fp32", moe_aux_loss_coeff=0.0, **kw)
    return TransformerConfig(moe_router_load_balancing_type="none", **base)


def both(name):
    ours, theirs = FLAGS[name]
    config = tconfig(**theirs)
    layer = MoELayer(
        config, MoELayerConfig(num_experts=E, hidden_size=H, ffn_hidden_size=8, load_balancing="none", **ours)
    )
    router = TopKRouter(config, pg_collection=router_groups())
    router.weight.data.copy_(layer.gate.weight.data)
    return layer.train(), router.train(), config


def dense(routing):
    """Our pairs as megatron-core's [T, E] (probs, routing map)."""
    token_N = torch.arange(routing.num_tokens).repeat(routing.expert_N.numel() // routing.num_tokens)
    probs = torch.zeros(routing.num_tokens, E).index_put_((token_N, routing.expert_N), routing.weight_N.detach())
    chosen = probs.new_zeros(probs.shape, dtype=torch.bool).index_put_((token_N, routing.expert_N), torch.tensor(True))
    return probs, chosen


@pytest.mark.parametrize("name", sorted(FLAGS))
def test_routing_weights_and_bias_after_steps_equal_megatron_cores_router(name, megatron_world1):
    layer, router, config = both(name)
    biased = layer.gate.expert_bias is not None
    changed = 0
    for step in range(6):
        for micro in range(2):
            x_SBH = torch.randn(S, B, H, generator=torch.Generator().manual_seed(10 * step + micro))
            theirs_probs, theirs_map = router(x_SBH)
            routing = layer.route(x_SBH.reshape(-1, H))
            probs, routing_map = dense(routing)
            assert torch.equal(routing_map, theirs_map)  # the same experts for every token
            torch.testing.assert_close(probs, theirs_probs.detach(), rtol=0, atol=1e-6)
            layer(x_SBH)[0].sum().backward()  # a training forward: counts the load
            if biased:
                unbiased_TK = torch.topk(x_SBH.reshape(-1, H) @ layer.gate.weight.t(), layer.gate.topk)[1]
                changed += int(not torch.equal(routing_map.sum(0), dense_count(unbiased_TK)))
        if biased:
            assert torch.equal(layer.gate.local_tokens_per_expert, router.local_tokens_per_expert)
            assert float(layer.gate.local_tokens_per_expert.sum()) == 2 * S * B * layer.gate.topk
            assert update_expert_biases([layer]) == 1
            _update_router_expert_bias([router], config)
            reset_model_temporary_tensors(config, [router])
            assert torch.equal(layer.gate.expert_bias, router.expert_bias)
            assert float(layer.gate.local_tokens_per_expert.abs().sum()) == 0
    if biased:
        assert layer.gate.expert_bias.abs().max() >= 0.02  # it moved: steps of +-0.02, equal to megatron-core's
        assert layer.gate.expert_bias.dtype == torch.float32
        assert changed > 0  # the bias changed some token's experts


def test_padding_tokens_and_evaluation_are_not_counted(megatron_world1):
    layer, _, _ = both("sigmoid, bias")
    x_SBH = torch.randn(S, B, H, generator=torch.Generator().manual_seed(5))
    padding_BS = torch.zeros(B, S, dtype=torch.bool)
    padding_BS[0, :2] = True
    with torch.no_grad():
        layer(x_SBH, padding_mask=padding_BS)  # no grad (evaluation, a recompute's first pass): nothing counted
    assert float(layer.gate.local_tokens_per_expert.sum()) == 0
    layer(x_SBH, padding_mask=padding_BS)
    valid_T = ~padding_BS.t().reshape(-1)
    expert_TK = layer.route(x_SBH.reshape(-1, H)).expert_N.view(2, -1).t()[valid_T]
    assert torch.equal(layer.gate.local_tokens_per_expert, dense_count(expert_TK).float())
    assert float(layer.gate.local_tokens_per_expert.sum()) == (S * B - 2) * 2


def dense_count(expert_TK):
    ones = torch.ones(expert_TK.numel(), dtype=torch.long)
    return torch.zeros(E, dtype=torch.long).scatter_add_(0, expert_TK.reshape(-1), ones)


def test_the_bias_picks_the_experts_and_the_scores_weight_them(megatron_world1):
    layer, _, _ = both("sigmoid, bias")
    x_TH = torch.randn(S * B, H, generator=torch.Generator().manual_seed(3))
    before = layer.route(x_TH)
    layer.gate.expert_bias.copy_(torch.tensor([10.0, 10.0, 0, 0, 0, 0, 0, 0]))
    after = layer.route(x_TH)
    assert set(after.expert_N.tolist()) == {0, 1} and set(before.expert_N.tolist()) != {0, 1}
    scores_TE = torch.sigmoid(x_TH @ layer.gate.weight.t())
    expected = scores_TE[:, :2] / scores_TE[:, :2].sum(-1, keepdim=True)  # unbiased scores, renormalised
    probs, _ = dense(after)
    torch.testing.assert_close(probs[:, :2], expected, rtol=0, atol=1e-6)


def test_the_bias_stays_fp32_under_bf16_and_is_a_checkpoint_entry(megatron_world1):
    layer, _, _ = both("sigmoid, bias")
    layer.to(torch.bfloat16)
    assert layer.gate.expert_bias.dtype == torch.float32 and layer.gate.weight.dtype == torch.bfloat16
    assert "gate.expert_bias" in layer.state_dict() and "gate.local_tokens_per_expert" not in layer.state_dict()
    sharded = layer.sharded_state_dict(prefix="decoder.layers.0.mlp.")
    entry = sharded["decoder.layers.0.mlp.gate.expert_bias"]
    assert entry.global_shape == (E,) and entry.local_shape == (E,)  # replicated, whatever EP


@pytest.mark.parametrize("experts, groups, group_topk, topk", [(8, 4, 2, 4), (16, 4, 1, 2), (64, 8, 4, 8)])
def test_group_limited_topk_equals_megatron_cores(experts, groups, group_topk, topk):
    scores_TE = torch.rand(50, experts, generator=torch.Generator().manual_seed(experts))
    ours = group_limited_topk(scores_TE, topk, groups, group_topk)
    _, theirs = moe_utils.group_limited_topk(scores_TE, topk, 50, experts, groups, group_topk)
    assert torch.equal(ours, theirs)
    chosen_groups = (ours // (experts // groups)).sort(dim=1).values
    assert all(len(set(row)) <= group_topk for row in chosen_groups.tolist())


BASE = ["--data-path", "d", "--tokenizer-model", "t.model", "--num-experts", "8"]


def error(*flags):
    with pytest.raises(ConfigError) as caught:
        parse_args([*BASE, *flags]).validate(world_size=1)
    return str(caught.value)


@pytest.mark.parametrize(
    "flags, message",
    [
        ("--moe-router-enable-expert-bias", "--moe-router-enable-expert-bias=True: aux-loss-free balancing biases "
         "sigmoid scores only; add --moe-router-score-function sigmoid"),
        ("--moe-router-enable-expert-bias --moe-layer-impl mcore", "--moe-router-enable-expert-bias=True: "
         "aux-loss-free balancing biases sigmoid scores only; add --moe-router-score-function sigmoid"),
        ("--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-expert-capacity-factor 1.5",
         "--moe-expert-capacity-factor=1.5: the expert bias counts every routed pair (dropless); leave the capacity "
         "factor unset with --moe-router-enable-expert-bias"),
        ("--moe-router-group-topk 2", "--moe-router-group-topk=2: needs --moe-router-num-groups"),
        ("--moe-router-num-groups 3 --moe-router-group-topk 1", "--moe-router-num-groups=3: must divide "
         "--num-experts=8"),
        ("--moe-router-num-groups 4 --moe-router-group-topk 5 --moe-router-topk 8", "--moe-router-group-topk=5: "
         "must be between 1 and --moe-router-num-groups=4"),
        ("--moe-router-num-groups 4 --moe-router-group-topk 1 --moe-router-topk 4", "--moe-router-group-topk=1: "
         "1 groups of 2 experts hold fewer than --moe-router-topk=4; choose at least 2"),
    ],
)  # fmt: skip
def test_bad_combinations_name_the_flag_the_value_and_a_choice(flags, message):
    assert error(*flags.split()).startswith(message)


ROUTER_FLAGS_THAT_CHANGE_NOTHING = [
    (
        "--moe-router-bias-update-rate 0.1",
        "--moe-router-bias-update-rate 0.1: changes nothing in this run (it applies only with "
        "--moe-router-enable-expert-bias)",
    ),
    (
        "--moe-router-num-groups 4",
        "--moe-router-num-groups 4: changes nothing in this run (it applies only with --moe-router-group-topk)",
    ),
    (
        "--moe-gate cosine --moe-router-group-topk 2",
        "--moe-router-group-topk 2: changes nothing in this run (it applies only with --num-experts and a top-k gate",
    ),
]


@pytest.mark.parametrize("flags, message", ROUTER_FLAGS_THAT_CHANGE_NOTHING)
def test_a_router_flag_that_changes_nothing_is_accepted_with_one_line(flags, message):
    (line,) = parse_args([*BASE, *flags.split()]).notes
    assert line.startswith(message)


def test_megatron_lm_launch_lines_with_these_flags_pass():
    assert not {
        "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate",
        "--moe-router-num-groups",
        "--moe-router-group-topk",
    } & set(REFUSED)
    flags = "--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3 "
    flags += "--moe-router-topk 4 --moe-router-num-groups 4 --moe-router-group-topk 2"
    for impl in ("megatron_moe", "mcore"):
        c = parse_args([*BASE, *flags.split(), "--moe-layer-impl", impl])
        c.validate(world_size=1)
        if impl == "megatron_moe":
            layer = c.moe.layer_config(c.model)
            assert (layer.gate, layer.expert_bias, layer.bias_update_rate) == ("sigmoid", True, 1e-3)
            assert (layer.num_groups, layer.group_topk) == (4, 2)
            assert not transformer_config(c).moe_router_enable_expert_bias  # ours moves it, not megatron-core's
        else:  # megatron-core's layer: its router and finalize_model_grads do it all
            t = transformer_config(c)
            assert (t.moe_router_enable_expert_bias, t.moe_router_bias_update_rate) == (True, 1e-3)
            assert (t.moe_router_num_groups, t.moe_router_group_topk, t.moe_router_score_function) == (4, 2, "sigmoid")


def test_the_bias_is_saved_and_loaded(megatron_world1, tmp_path):
    from tests.unit.test_checkpoint_safety import Run

    flags = ("--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias")
    saved = Run(tmp_path, flags=flags)
    (gate,) = [m for m in saved.model[0].modules() if getattr(m, "expert_bias", None) is not None]
    bias = torch.tensor([0.003, -0.001, 0.002, -0.004])
    gate.expert_bias.copy_(bias)
    saved.save(1)
    loaded = Run(tmp_path, flags=flags)
    (gate,) = [m for m in loaded.model[0].modules() if getattr(m, "expert_bias", None) is not None]
    assert float(gate.expert_bias.abs().sum()) == 0
    loaded.load()
    assert torch.equal(gate.expert_bias, bias) and gate.expert_bias.dtype == torch.float32


def test_the_pieces_of_a_partitioned_micro_batch_count_the_micro_batchs_load(megatron_world1):
    from megatron_moe.moe.pieces import Piece, piece_sizes, run_interleaved

    layer, _, _ = both("sigmoid, bias, groups")
    layer.gate.expert_bias.copy_(torch.linspace(-0.05, 0.05, E))
    x_SBH = torch.randn(S, B, H, generator=torch.Generator().manual_seed(7))
    whole_SBH = layer(x_SBH)[0]
    whole_E = layer.gate.local_tokens_per_expert.clone()
    layer.gate.local_tokens_per_expert.zero_()
    pieces, routings = torch.split(x_SBH, piece_sizes(B, 2), dim=1), {}
    outs = run_interleaved([layer.stages(p, piece=Piece(i, 2, routings)) for i, p in enumerate(pieces)])
    assert torch.equal(layer.gate.local_tokens_per_expert, whole_E)
    assert float(whole_E.sum()) == S * B * 4
    torch.testing.assert_close(torch.cat([o for o, _ in outs], dim=1), whole_SBH, rtol=0, atol=1e-6)
