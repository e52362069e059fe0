"""--moe-router-load-balancing-type sinkhorn in our layer (the sinkhorn gate): megatron-core's sinkhorn routing, the
same experts and weights as its TopKRouter in training (top-k of the Sinkhorn-balanced scores) and in evaluation
(top-k of the weights), k = 1 (sigmoid) and k = 2 (softmax), with no balancing loss; 24 of Megatron-LM's MoE
functional-test configs route this way."""

import pytest
import torch

from megatron_moe.config import parse_args
from tests.unit.mcore_router import router_groups


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("topk", [1, 2])
def test_the_sinkhorn_gate_routes_as_megatron_core(megatron_world1, topk, training):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_moe.config import MoELayerConfig
    from megatron_moe.moe import MoELayer

    h, e, s, b = 32, 8, 10, 3
    config = TransformerConfig(
        num_layers=1, hidden_size=h, num_attention_heads=2, ffn_hidden_size=8, num_moe_experts=e, add_bias_linear=False,
        moe_router_dtype="fp32", moe_router_topk=topk, moe_router_load_balancing_type="sinkhorn",
        moe_aux_loss_coeff=0.0,
    )  # fmt: skip
    layer = MoELayer(
        config, MoELayerConfig(num_experts=e, hidden_size=h, ffn_hidden_size=8, gate="sinkhorn", topk=topk)
    )
    router = TopKRouter(config, pg_collection=router_groups()).train(training)
    router.weight.data.copy_(layer.gate.weight.data)
    x_SBH = torch.randn(s, b, h, generator=torch.Generator().manual_seed(3))
    theirs_probs, theirs_map = router(x_SBH)
    routing = layer.train(training).route(x_SBH.reshape(-1, h))
    token_N = torch.arange(routing.num_tokens).repeat(topk)
    ours_map = torch.zeros(s * b, e, dtype=torch.bool).index_put_((token_N, routing.expert_N), torch.tensor(True))
    ours_probs = torch.zeros(s * b, e).index_put_((token_N, routing.expert_N), routing.weight_N.detach())
    assert torch.equal(ours_map, theirs_map)
    torch.testing.assert_close(ours_probs, theirs_probs.detach(), rtol=0, atol=1e-6)
    assert routing.aux_loss is None or float(routing.aux_loss) == 0.0


def test_sinkhorn_picks_the_sinkhorn_gate_with_no_balancing_loss():
    cfg = parse_args(["--mock-data", "--num-experts", "4", "--moe-router-topk", "1"])
    sinkhorn = parse_args(
        ["--mock-data", "--num-experts", "4", "--moe-router-topk", "1", "--moe-router-load-balancing-type", "sinkhorn"]
    )
    assert cfg.moe.gate == "topk" and sinkhorn.moe.gate == "sinkhorn"
    layer = sinkhorn.moe.layer_config(sinkhorn.model)
    assert layer.gate == "sinkhorn" and not layer.has_balancing_loss
    assert sinkhorn.moe.logged_router_losses(sinkhorn.model) == (False, False)
