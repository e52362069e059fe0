"""Router losses in backward (micro-batch invariance) and the per-layer metrics for the log."""

import pytest
import torch
from megatron.core.transformer import TransformerConfig

from megatron_moe.moe import MoELayer, MoELayerConfig, collect_moe_metrics, set_moe_aux_loss_scale

H, E = 16, 4


def make_layers(n=1, **fields):
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=max(n, 2),
        hidden_size=H,
        num_attention_heads=2,
        ffn_hidden_size=8,
        num_moe_experts=E,
        moe_router_topk=2,
        add_bias_linear=False,
    )
    sizes = dict(num_experts=E, hidden_size=H, ffn_hidden_size=8, topk=2)
    moe_config = MoELayerConfig(**{**sizes, "aux_loss_coeff": 0.1, "z_loss_coeff": 0.01, **fields})
    layers = torch.nn.ModuleList(MoELayer(config, moe_config, layer_number=i + 1) for i in range(n))
    for layer in layers[1:]:
        layer.load_state_dict(layers[0].state_dict())
    return layers


def batch(seed, s=8, b=2):
    return torch.randn(s, b, H, generator=torch.Generator().manual_seed(seed))


def aux_only_router_grad(layer, micro_batches):
    """Router grad from the router losses alone (output grad zero), as the loop would scale it."""
    layer.zero_grad(set_to_none=True)
    set_moe_aux_loss_scale([layer], 1.0 / len(micro_batches))
    for x in micro_batches:
        out, _ = layer(x)
        out.backward(torch.zeros_like(out))
    return layer.gate.weight.grad.clone()


def test_router_loss_gradient_and_log_are_invariant_to_micro_batching():
    (layer,) = make_layers()
    x = batch(1)
    one = aux_only_router_grad(layer, [x])
    one_figures = collect_moe_metrics([layer], num_layers=2, num_experts=E)
    four = aux_only_router_grad(layer, [x, x, x, x])
    four_figures = collect_moe_metrics([layer], num_layers=2, num_experts=E)
    assert one.abs().sum() > 0
    torch.testing.assert_close(four, one)
    assert four_figures["moe aux loss"] == pytest.approx(one_figures["moe aux loss"])
    assert four_figures["moe z loss"] == pytest.approx(one_figures["moe z loss"])
    # Different micro-batches: the step's gradient is the mean of the micro-batch gradients.
    y = batch(2)
    mixed = aux_only_router_grad(layer, [x, y])
    torch.testing.assert_close(mixed, (aux_only_router_grad(layer, [x]) + aux_only_router_grad(layer, [y])) / 2)
    # Without the loop's scale two micro-batches would count twice: the bug the scale prevents.
    layer.zero_grad(set_to_none=True)
    set_moe_aux_loss_scale([layer], 1.0)
    for micro in (x, y):
        out, _ = layer(micro)
        out.backward(torch.zeros_like(out))
    torch.testing.assert_close(layer.gate.weight.grad, 2 * mixed)


def test_router_losses_stay_out_of_the_output():
    (with_aux,) = make_layers()
    (without,) = make_layers(aux_loss_coeff=0.0, z_loss_coeff=0.0)
    without.load_state_dict(with_aux.state_dict())
    x = batch(3)
    torch.testing.assert_close(with_aux(x)[0], without(x)[0])


def test_metrics_count_tokens_drops_and_dead_experts():
    (layer,) = make_layers(capacity_factor=0.5)
    x = batch(4)
    out, _ = layer(x)
    routing = layer.route(x.reshape(-1, H))
    counts = torch.bincount(routing.expert_N, minlength=E).double()
    figures = collect_moe_metrics([layer], num_layers=2, num_experts=E)
    assert figures["moe/layer_001/tokens_min"] == counts.min().item()
    assert figures["moe/layer_001/tokens_max"] == counts.max().item()
    cv = (counts.std(unbiased=False) / counts.mean()).item()
    assert figures["moe/layer_001/tokens_cv"] == pytest.approx(cv)
    capacity = 4  # ceil(0.5 * 2 * 16 / 4)
    dropped = sum(max(0, int(c) - capacity) for c in counts)
    assert figures["moe dropped fraction"] == pytest.approx(dropped / 32)
    assert figures["moe/layer_001/dead_experts"] == float((counts == 0).sum())
    assert 0 < figures["moe router entropy"] <= torch.log(torch.tensor(float(E))).item() + 1e-6
    assert figures["moe aux loss"] > 0 and "moe/layer_002/tokens_cv" not in figures
    assert collect_moe_metrics([layer], num_layers=2, num_experts=E) == {}  # reset after reading


def test_evaluation_and_recompute_first_pass_are_not_counted():
    (layer,) = make_layers()
    with torch.no_grad():
        layer(batch(5))
    layer.eval()
    layer(batch(5))
    assert collect_moe_metrics([layer], num_layers=2, num_experts=E) == {}


def test_metric_keys_are_capped_with_a_stable_layer_subset():
    layers = make_layers(n=12)
    x = batch(6)
    for layer in layers:
        layer(x)[0].sum().backward()
    figures = collect_moe_metrics([layers], num_layers=12, num_experts=E, max_keys=31)
    assert len(figures) <= 31
    shown = sorted({k.split("/")[1] for k in figures if k.startswith("moe/layer_")})
    assert shown == ["layer_001", "layer_007", "layer_012"]  # first, middle, last
    for layer in layers:
        layer(x)
    all_keys = collect_moe_metrics([layers], num_layers=12, num_experts=E, max_keys=1000)
    assert len(all_keys) == 7 + 12 * 8


def test_a_model_without_moe_layers_reports_nothing():
    assert collect_moe_metrics([torch.nn.Linear(2, 2)], num_layers=4, num_experts=E) == {}


def test_router_losses_that_are_not_computed_stay_out_of_the_log():
    from megatron_moe.training.loop import computed_losses_only

    figures = {
        "moe aux loss": 1.1,
        "moe z loss": 0.0,
        "moe tokens cv": 0.3,
        "moe/layer_002/aux_loss": 1.1,
        "moe/layer_002/z_loss": 0.0,
        "moe/layer_002/tokens_cv": 0.3,
    }
    assert computed_losses_only(figures, aux=True, z=True) == figures
    assert computed_losses_only(figures, aux=True, z=False) == {
        "moe aux loss": 1.1,
        "moe tokens cv": 0.3,
        "moe/layer_002/aux_loss": 1.1,
        "moe/layer_002/tokens_cv": 0.3,
    }
    assert computed_losses_only(figures, aux=False, z=True) == {
        "moe z loss": 0.0,
        "moe tokens cv": 0.3,
        "moe/layer_002/z_loss": 0.0,
        "moe/layer_002/tokens_cv": 0.3,
    }
