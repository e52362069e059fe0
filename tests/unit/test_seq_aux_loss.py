"""--moe-router-load-balancing-type seq_aux_loss in our router: megatron-core's per-sequence formula."""

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func

from megatron_moe.moe.routing import load_balancing_loss, router_losses, seq_load_balancing_loss
from tests.unit.mcore_router import router_groups


def mcore_seq_aux_loss(probs_TE, expert_TK, seq, batch, coeff):
    """megatron-core 0.16.1's TopKRouter._apply_seq_aux_loss, one rank, no padding (its reshape and division)."""
    num_experts, topk = probs_TE.shape[1], expert_TK.shape[1]
    routing_map = torch.zeros_like(probs_TE, dtype=torch.bool).scatter(1, expert_TK, True)
    scores = probs_TE.reshape(seq, -1)
    tokens_per_expert = routing_map.reshape(seq, -1).sum(dim=0)
    loss = switch_load_balancing_loss_func(scores, tokens_per_expert, seq, topk, num_experts, coeff)
    return loss / batch


def routed(seq=6, batch=3, experts=8, topk=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(seq * batch, experts, generator=g), -1).requires_grad_()
    return probs, torch.topk(probs.detach(), topk, dim=-1).indices


@pytest.mark.parametrize("batch", [1, 3])
def test_seq_aux_loss_is_megatron_cores(batch):
    probs, expert = routed(batch=batch)
    ours = router_losses(None, probs, expert, kind="seq_aux_loss", aux_coeff=0.01, z_coeff=0.0, batch=batch)[0]
    theirs = mcore_seq_aux_loss(probs, expert, 6, batch, 0.01)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    (g_ours,) = torch.autograd.grad(ours, probs)
    (g_theirs,) = torch.autograd.grad(theirs, probs)
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-6, atol=1e-7)


def test_seq_aux_loss_is_the_mean_of_each_sequences_loss():
    probs, expert = routed(batch=3)
    per_seq = [load_balancing_loss(probs[b::3], expert[b::3], "aux_loss") for b in range(3)]
    torch.testing.assert_close(seq_load_balancing_loss(probs, expert, 3), torch.stack(per_seq).mean())
    # with one sequence it is aux_loss; with several it is not (each sequence balanced on its own)
    torch.testing.assert_close(
        seq_load_balancing_loss(probs, expert, 1), load_balancing_loss(probs, expert, "aux_loss")
    )
    assert not torch.allclose(seq_load_balancing_loss(probs, expert, 3), load_balancing_loss(probs, expert, "aux_loss"))


def test_padding_counts_as_megatron_core_counts_it():
    probs, expert = routed(batch=2)
    valid = torch.ones(12, dtype=torch.bool)
    torch.testing.assert_close(
        seq_load_balancing_loss(probs, expert, 2, valid), seq_load_balancing_loss(probs, expert, 2)
    )
    valid[-2:] = False  # the last position of both sequences is padding
    kept = seq_load_balancing_loss(probs[:-2], expert[:-2], 2)
    torch.testing.assert_close(seq_load_balancing_loss(probs, expert, 2, valid), kept)


DEEPSEEK_V3 = dict(  # megatron-core's names; ours below
    moe_router_enable_expert_bias=True, moe_router_num_groups=8, moe_router_group_topk=4,
    moe_router_topk_scaling_factor=2.5,
)  # fmt: skip


@pytest.mark.parametrize("score, deepseek", [("softmax", False), ("sigmoid", False), ("sigmoid", True)])
def test_our_layer_routes_and_balances_per_sequence_as_megatron_cores_router(score, deepseek, megatron_world1):
    """64 experts top-8 (fine-grained): the same experts, weights, seq_aux_loss and its router-weight gradient.
    DeepSeek-V3's routing (expert bias, 8 groups of which 4, scaling 2.5): the experts are picked with the bias
    within the groups, while the balancing loss counts the loss scores' own top-k, as megatron-core's."""

    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_moe.config import MoELayerConfig
    from megatron_moe.moe import MoELayer

    h, e, k, s, b, coeff = 32, 64, 8, 10, 3, 0.01
    config = TransformerConfig(
        num_layers=1, hidden_size=h, num_attention_heads=2, ffn_hidden_size=8, num_moe_experts=e, add_bias_linear=False,
        moe_router_dtype="fp32", moe_router_topk=k, moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=coeff, moe_router_score_function=score, **(DEEPSEEK_V3 if deepseek else {}),
    )  # fmt: skip
    ours = dict(gate="sigmoid" if score == "sigmoid" else "topk", topk=k, load_balancing="seq_aux_loss")
    if deepseek:
        ours |= dict(expert_bias=True, num_groups=8, group_topk=4, topk_scaling_factor=2.5)
    layer = MoELayer(
        config, MoELayerConfig(num_experts=e, hidden_size=h, ffn_hidden_size=8, aux_loss_coeff=coeff, **ours)
    )
    router = TopKRouter(config, pg_collection=router_groups()).train()
    router.weight.data.copy_(layer.gate.weight.data)
    if deepseek:  # a bias that changes the choices
        bias_E = torch.randn(e, generator=torch.Generator().manual_seed(4)) * 0.05
        layer.gate.expert_bias.copy_(bias_E)
        router.expert_bias.copy_(bias_E)
    x_SBH = torch.randn(s, b, h, generator=torch.Generator().manual_seed(3))
    theirs_probs, theirs_map = router(x_SBH)
    (theirs_probs.sum() * 0).backward()  # only the attached aux loss's gradient reaches the router
    layer.gate.seq_batch = b  # as the layer's forward sets it
    routing = layer.train().route(x_SBH.reshape(-1, h))
    token_N = torch.arange(routing.num_tokens).repeat(k)
    ours_map = torch.zeros(s * b, e, dtype=torch.bool).index_put_((token_N, routing.expert_N), torch.tensor(True))
    ours_probs = torch.zeros(s * b, e).index_put_((token_N, routing.expert_N), routing.weight_N.detach())
    assert torch.equal(ours_map, theirs_map)
    torch.testing.assert_close(ours_probs, theirs_probs.detach(), rtol=0, atol=1e-6)
    routing.aux_loss.backward()
    assert layer.gate.weight.grad.abs().sum() > 0
    torch.testing.assert_close(layer.gate.weight.grad, router.weight.grad, rtol=1e-5, atol=1e-8)
