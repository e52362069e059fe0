"""--moe-router-load-balancing-type seq_aux_loss in our router: megatron-core's per-sequence formula."""

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func

from megatron_moe.moe.routing import load_balancing_loss, router_losses, seq_load_balancing_loss


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
