"""Gates, capacity and slot assignment: who gets which slot and who is dropped, for every gate."""

import math

import pytest
import torch
from megatron.core.transformer import TransformerConfig

from megatron_moe.config.moe_layer import GATES, LOAD_BALANCING
from megatron_moe.moe import MoELayer, MoELayerConfig, build_gate, capacity_limit, expert_capacity
from megatron_moe.moe.ordering import make_row_map
from megatron_moe.moe.routing import Routing, load_balancing_loss

H, E = 16, 4


def cfg(**kw):
    base = dict(num_experts=E, hidden_size=H, ffn_hidden_size=8, topk=2)
    base.update(kw)
    return MoELayerConfig(**base).validate()


def x_TH(t=32, seed=0):
    return torch.randn(t, H, generator=torch.Generator().manual_seed(seed))


def kept_pairs(row_map):
    """{(token, expert)} of the pairs that got a slot."""
    return set(zip(row_map.token_of_row.tolist(), row_map.expert_of_row.tolist()))


# ---------------------------------------------------------------------------- capacity formula


def test_capacity_formula_follows_tutel():
    assert capacity_limit(1.25, num_tokens=100, topk=2, num_experts=8) == math.ceil(1.25 * 2 * 100 / 8) == 32
    assert expert_capacity(1.25, num_tokens=100, topk=2, num_experts=8, largest_count=50) == 32  # fixed
    assert expert_capacity(0.0, num_tokens=100, topk=2, num_experts=8, largest_count=50) is None  # dropless
    assert expert_capacity(None, num_tokens=100, topk=2, num_experts=8, largest_count=50) is None
    assert expert_capacity(-1.25, num_tokens=100, topk=2, num_experts=8, largest_count=50) == 32  # capped
    assert expert_capacity(-1.25, num_tokens=100, topk=2, num_experts=8, largest_count=20) == 20  # adaptive
    assert capacity_limit(0.01, num_tokens=4, topk=1, num_experts=8) == 1


def test_topk_may_change_between_iterations():
    config = TransformerConfig(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=2,
        ffn_hidden_size=8,
        num_moe_experts=E,
        moe_router_topk=2,
        add_bias_linear=False,
    )
    layer = MoELayer(config, cfg(capacity_factor=1.0, pad_expert_input_to_capacity=True, aux_loss_coeff=0.0))
    x = x_TH(40)
    assert layer.arrange(layer.route(x))[0].capacity == 20  # ceil(1.0 * 2 * 40 / 4)
    layer.gate.topk = 1
    row_map, _ = layer.arrange(layer.route(x))
    assert row_map.capacity == 10 and int(row_map.routed_E.sum()) == 40
    out, _ = layer(x.view(40, 1, H))
    assert out.shape == (40, 1, H)


# ---------------------------------------------------------------------------- claim order and dropping


def test_gshard_order_first_choices_claim_slots_before_second_choices():
    # 4 tokens, 2 experts, top-2. Expert 0 is everyone's first choice except token 2.
    expert_TK = torch.tensor([[0, 1], [0, 1], [1, 0], [0, 1]])
    routing = Routing(
        num_tokens=4,
        num_experts=2,
        probs_TE=torch.full((4, 2), 0.5),
        expert_N=expert_TK.t().reshape(-1),
        weight_N=torch.full((8,), 0.5),
    )
    row_map = make_row_map(routing, capacity=2, padded=False)
    # Expert 0: first choices of tokens 0, 1 fill it; token 3's first and token 2's second choice drop.
    # Expert 1: token 2's first choice, then token 0's second choice; tokens 1 and 3 drop.
    assert kept_pairs(row_map) == {(0, 0), (1, 0), (2, 1), (0, 1)}
    assert row_map.dropped == 4 and row_map.counts == [2, 2]
    padded = make_row_map(routing, capacity=3, padded=True)
    assert padded.counts == [3, 3] and padded.row_index.tolist() == [0, 1, 2, 3, 4, 5]
    # Capacity 3: expert 0 takes the first choices of tokens 0, 1, 3 (token 2's second choice drops),
    # expert 1 token 2's first choice, then the second choices of tokens 0 and 1 (token 3's drops).
    assert kept_pairs(padded) == {(0, 0), (1, 0), (3, 0), (2, 1), (0, 1), (1, 1)} and padded.dropped == 2


def test_bpr_drops_the_least_important_tokens_first():
    gate = build_gate(cfg(gate="bpr", topk=1))
    routing = gate(x_TH(64))
    row_map = make_row_map(routing, capacity=8, padded=False)
    importance = routing.probs_TE.max(dim=-1).values
    assert row_map.dropped > 0
    kept = kept_pairs(row_map)
    for e in range(E):
        chose_e = [t for t in range(64) if routing.expert_N[t] == e]
        kept_imp = [importance[t] for t in chose_e if (t, e) in kept]
        lost_imp = [importance[t] for t in chose_e if (t, e) not in kept]
        if kept_imp and lost_imp:
            assert min(kept_imp) >= max(lost_imp)
    # Plain top-k keeps by token order instead: the earliest tokens win.
    gate_tok = build_gate(cfg(gate="topk", topk=1))
    gate_tok.load_state_dict(gate.state_dict())
    row_map_tok = make_row_map(gate_tok(x_TH(64)), capacity=8, padded=False)
    for e in range(E):
        chose_e = [t for t in range(64) if routing.expert_N[t] == e]
        assert [t for t in chose_e if (t, e) in kept_pairs(row_map_tok)] == chose_e[:8]
    assert kept_pairs(row_map_tok) != kept


def test_random_token_selection_randomises_claims_in_training_only():
    gate = build_gate(cfg(gate="rts", topk=1))
    x = x_TH(64)
    torch.manual_seed(1)
    first = kept_pairs(make_row_map(gate(x), capacity=8, padded=False))
    torch.manual_seed(2)
    second = kept_pairs(make_row_map(gate(x), capacity=8, padded=False))
    assert first != second and len(first) == len(second)
    gate.eval()
    assert kept_pairs(make_row_map(gate(x), capacity=8, padded=False)) == kept_pairs(
        make_row_map(gate(x), capacity=8, padded=False)
    )


def test_expert_choice_gives_each_expert_its_top_tokens():
    gate = build_gate(cfg(gate="expert_choice", topk=2))
    routing = gate(x_TH(30))
    slots = math.ceil(2 * 30 / E)
    row_map = make_row_map(routing, capacity=routing.slots_per_expert, padded=False)
    assert row_map.counts == [slots] * E and row_map.dropped == 0
    for e in range(E):
        chosen = {t for t, ex in kept_pairs(row_map) if ex == e}
        assert chosen == set(torch.topk(routing.probs_TE[:, e], slots).indices.tolist())


def test_dropless_keeps_every_pair_and_fixed_capacity_caps_each_expert():
    routing = build_gate(cfg(gate="topk", topk=2))(x_TH(50))
    dropless = make_row_map(routing, capacity=None, padded=False)
    assert dropless.dropped == 0 and sum(dropless.counts) == 100
    assert dropless.counts == routing_counts(routing)
    capped = make_row_map(routing, capacity=20, padded=False)
    assert capped.counts == [min(c, 20) for c in routing_counts(routing)]
    assert capped.dropped == sum(max(0, c - 20) for c in routing_counts(routing))


def routing_counts(routing):
    return torch.bincount(routing.expert_N, minlength=E).tolist()


# ---------------------------------------------------------------------------- gate functions


def test_switch_and_topk_weights():
    switch = build_gate(cfg(gate="switch", topk=1))
    r = switch(x_TH())
    torch.testing.assert_close(r.weight_N, r.probs_TE.max(-1).values)  # Switch keeps the raw probability
    topk = build_gate(cfg(gate="topk", topk=2))
    r = topk(x_TH())
    torch.testing.assert_close(r.weight_N.view(2, -1).sum(0), torch.ones(32))  # GShard renormalises


def test_sigmoid_gate_scores_are_independent_sigmoids():
    gate = build_gate(cfg(gate="sigmoid", topk=2, normalize_topk=False))
    x = x_TH()
    r = gate(x)
    scores = torch.sigmoid(x @ gate.weight.t())
    torch.testing.assert_close(r.weight_N.view(2, -1).t(), scores.topk(2, -1).values)
    torch.testing.assert_close(r.probs_TE.sum(-1), torch.ones(32))


def test_noisy_topk_is_random_in_training_and_learns_its_noise():
    gate = build_gate(cfg(gate="noisy_topk", aux_loss_coeff=0.01))
    x = x_TH()
    a, b = gate(x), gate(x)
    assert not torch.equal(a.probs_TE, b.probs_TE)
    a.aux_loss.backward()
    assert gate.noise_weight.grad is not None and gate.noise_weight.grad.abs().sum() > 0
    gate.eval()
    assert torch.equal(gate(x).probs_TE, gate(x).probs_TE)


@pytest.mark.parametrize("name,dim", [("xmoe", 16), ("cosine", 256)])
def test_cosine_gates_bound_their_logits(name, dim):
    gate = build_gate(cfg(gate=name, z_loss_coeff=1.0))
    assert gate.proj_weight.shape == (dim, H) and gate.expert_embedding.shape == (E, dim)
    with torch.no_grad():
        gate.log_scale.fill_(20.0)  # far past the clamp
    r = gate(x_TH() * 1000)
    logits = torch.log(r.probs_TE)  # up to a per-token constant; the spread is bounded by 2 x 100
    assert (logits.max(-1).values - logits.min(-1).values).max() <= 200 + 1e-3
    r.aux_loss.backward()
    assert gate.proj_weight.grad is not None and gate.expert_embedding.grad is not None


def test_soft_gate_mixes_tokens_into_slots():
    gate = build_gate(cfg(gate="soft", soft_slots=3))
    r = gate(x_TH(20))
    assert r.dispatch_TZ.shape == (20, E * 3)
    torch.testing.assert_close(r.dispatch_TZ.sum(0), torch.ones(E * 3))
    torch.testing.assert_close(r.combine_TZ.sum(1), torch.ones(20))
    row_map = make_row_map(r, capacity=None, padded=True)
    assert row_map.counts == [3] * E and row_map.dropped == 0


def test_router_math_is_fp32_for_bf16_inputs():
    gate = build_gate(cfg(gate="topk")).to(torch.bfloat16)
    r = gate(x_TH().to(torch.bfloat16))
    assert r.probs_TE.dtype == torch.float32 and r.weight_N.dtype == torch.float32


# ---------------------------------------------------------------------------- router losses


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("balancing", LOAD_BALANCING)
@pytest.mark.parametrize("z_coeff", [0.0, 0.01])
def test_the_config_knows_which_router_losses_each_gate_computes(gate, balancing, z_coeff):
    """What the log shows (`has_balancing_loss`, `has_z_loss`) is what the gate really computes."""
    layer = cfg(gate=gate, topk=1 if gate == "switch" else 2, load_balancing=balancing, z_loss_coeff=z_coeff)
    losses = build_gate(layer)(x_TH()).losses
    assert ("load_balancing" in losses, "z_loss" in losses) == (layer.has_balancing_loss, layer.has_z_loss)


def test_top1_aux_loss_counts_first_choices_only():
    # Every token's first choice is expert 0, its second expert 1: all-k counting sees a balanced load,
    # first-choice counting sees expert 0 take everything.
    probs_TE = torch.tensor([[0.6, 0.4, 0.0, 0.0]] * 8)
    expert_TK = torch.tensor([[0, 1]] * 8)
    assert load_balancing_loss(probs_TE, expert_TK, "aux_loss").item() == pytest.approx(4 * (0.5 * 0.6 + 0.5 * 0.4))
    assert load_balancing_loss(probs_TE, expert_TK, "top1_aux_loss").item() == pytest.approx(4 * 0.6)
