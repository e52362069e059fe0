"""--moe-router-load-balancing-type global_aux_loss in our layer: megatron-core 0.16.1's formula over the
micro-batches of a step (f_e: the running mean of the routed counts, P_e: this micro-batch's), reset per step."""

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func

from megatron_moe.moe import MoELayerConfig, build_gate, finish_router_step
from tests.unit.mcore_router import router_groups

H, E, K, T, COEFF = 16, 8, 2, 24, 0.01


def gate_of(**fields):
    sizes = dict(num_experts=E, hidden_size=H, ffn_hidden_size=8, topk=K, load_balancing="global_aux_loss")
    return build_gate(MoELayerConfig(**sizes | dict(aux_loss_coeff=COEFF) | fields).validate())


def x_TH(seed: int) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed)) * 4  # skewed loads: f_e differ


def mcore_global_aux_loss(weight_EH, x_TH, running_E, steps, valid_T=None):
    """megatron-core 0.16.1's TopKRouter._apply_global_aux_loss written out, one rank (TP x DP x CP = 1): the
    micro-batch's routing map of the scores' own top-k (padding masked), added to the running counts; the loss with
    their mean (`switch_load_balancing_loss_func`). Returns (loss, the new running counts)."""
    scores_TE = torch.softmax(x_TH @ weight_EH.t(), dim=-1)
    routing_map_TE = torch.zeros(T, E, dtype=torch.bool).scatter(1, torch.topk(scores_TE, K, dim=1).indices, True)
    total = T
    if valid_T is not None:
        routing_map_TE, scores_TE = routing_map_TE * valid_T.unsqueeze(-1), scores_TE * valid_T.unsqueeze(-1)
        total = routing_map_TE.sum() / K
    running_E = running_E + routing_map_TE.sum(dim=0)
    loss = switch_load_balancing_loss_func(scores_TE, running_E / steps, total, K, E, COEFF)
    return loss, running_E


def test_global_aux_loss_is_megatron_cores_over_three_micro_batches_and_resets():
    gate = gate_of()
    weight = gate.weight.detach().clone().requires_grad_()
    running_E = torch.zeros(E)
    for step, valid_T in enumerate([None, torch.arange(T) < T - 5, None], start=1):  # the second one padded
        x = x_TH(step)
        routing = gate(x, valid_T)
        theirs, running_E = mcore_global_aux_loss(weight, x, running_E, step, valid_T)
        torch.testing.assert_close(routing.aux_loss, theirs, rtol=1e-6, atol=0)
        torch.testing.assert_close(routing.losses["load_balancing"], theirs.detach() / COEFF, rtol=1e-6, atol=0)
        (ours_grad,) = torch.autograd.grad(routing.aux_loss, gate.weight)
        (theirs_grad,) = torch.autograd.grad(theirs, weight)
        torch.testing.assert_close(ours_grad, theirs_grad, rtol=1e-5, atol=1e-9)
        assert gate.ga_steps.item() == step
    # f_e is the running mean: the third micro-batch's loss is not what it would be alone
    alone = mcore_global_aux_loss(weight, x_TH(3), torch.zeros(E), 1)[0]
    assert not torch.allclose(routing.aux_loss, alone, rtol=1e-4)
    finish_router_step([gate])  # after the step's backward, as the loop does
    assert gate.ga_steps.item() == 0 and not gate.global_tokens_per_expert.any()
    torch.testing.assert_close(gate(x_TH(3)).aux_loss, alone, rtol=1e-6, atol=0)


def test_only_a_weighted_training_forward_with_grad_counts():
    """As megatron-core: evaluation, a no-grad forward (a recomputed router's replay, full recompute's first pass)
    and a zero coefficient neither count nor compute it (nor communicate)."""
    gate = gate_of()
    gate.eval()
    assert gate(x_TH(0)).aux_loss is None and gate.ga_steps.item() == 0
    gate.train()
    with torch.no_grad():
        assert "load_balancing" not in gate(x_TH(0)).losses and gate.ga_steps.item() == 0
    assert gate(x_TH(0)).aux_loss is not None and gate.ga_steps.item() == 1
    unweighted = gate_of(aux_loss_coeff=0.0)
    assert unweighted.ga_steps is None and unweighted(x_TH(0)).losses == {}
    assert not MoELayerConfig(num_experts=E, hidden_size=H, ffn_hidden_size=8, load_balancing="global_aux_loss",
                              aux_loss_coeff=0.0).has_balancing_loss  # fmt: skip


def test_the_counts_stay_fp32_and_out_of_the_checkpoint():
    gate = gate_of().to(torch.bfloat16)
    assert gate.global_tokens_per_expert.dtype == gate.ga_steps.dtype == torch.float32
    assert not any("global_tokens_per_expert" in k or "ga_steps" in k for k in gate.state_dict())


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_our_layer_equals_megatron_cores_router_over_a_step(score, megatron_world1, monkeypatch):
    """Our MoE layer's router and megatron-core's TopKRouter (global_aux_loss) on the same weights and micro-batches
    (one padded): the same tracked loss and router-weight gradient after each, and after the step's reset."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_moe.moe import MoELayer

    s, b = 6, 4
    config = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=2, ffn_hidden_size=8, num_moe_experts=E, add_bias_linear=False,
        moe_router_dtype="fp32", moe_router_topk=K, moe_router_load_balancing_type="global_aux_loss",
        moe_aux_loss_coeff=COEFF, moe_router_score_function=score,
    )  # fmt: skip
    gate = "sigmoid" if score == "sigmoid" else "topk"
    ours = dict(gate=gate, topk=K, load_balancing="global_aux_loss", aux_loss_coeff=COEFF)
    layer = MoELayer(config, MoELayerConfig(num_experts=E, hidden_size=H, ffn_hidden_size=8, **ours), layer_number=1)
    router = TopKRouter(config, pg_collection=router_groups()).train()
    router.set_layer_number(1)
    # its aux-loss gradient scale as a schedule sets it ([1]), undone after (the loop tests' schedules set theirs)
    monkeypatch.setattr(moe_utils.MoEAuxLossAutoScaler, "main_loss_backward_scale", torch.ones(1))
    router.weight.data.copy_(layer.gate.weight.data)
    layer.train()
    moe_utils.clear_aux_losses_tracker()
    tracked = 0.0
    for step in range(4):
        x_SBH = torch.randn(s, b, H, generator=torch.Generator().manual_seed(step)) * 4
        padding_SB = torch.zeros(s, b, dtype=torch.bool)
        padding_SB[-2:, 1] = step == 1  # micro-batch 1: the last two positions of sequence 1 are padding
        theirs_probs, _ = router(x_SBH, padding_SB)
        (theirs_probs.sum() * 0).backward()  # only the attached aux loss's gradient reaches the router
        routing = layer.route(x_SBH.reshape(-1, H), ~padding_SB.reshape(-1))
        routing.aux_loss.backward()
        now = moe_utils.get_moe_layer_wise_logging_tracker()["global_load_balancing_loss"]["values"][0].item()
        assert routing.losses["load_balancing"].item() == pytest.approx(now - tracked, rel=1e-6)
        tracked = now
        torch.testing.assert_close(layer.gate.weight.grad, router.weight.grad, rtol=1e-5, atol=1e-9)
        if step == 2:  # the step ends: megatron-core's finalize_model_grads resets, our loop likewise
            router.reset_global_aux_loss_tracker()
            finish_router_step([layer])
            assert layer.gate.ga_steps.item() == 0
    assert layer.gate.ga_steps.item() == router.ga_steps.item() == 1
    moe_utils.clear_aux_losses_tracker()


@pytest.mark.parametrize("impl", ["megatron_moe", "mcore"])
def test_the_loop_resets_the_counts_after_each_step_and_logs_the_loss(impl, megatron_world1):
    """Two steps of 2 micro-batches: our layer's counts run over the step's micro-batches (1, 2) and start afresh
    the next step, as megatron-core's finalize_model_grads resets its router's; `moe aux loss` is logged for both
    layers (megatron-core's tracks it as global_load_balancing_loss)."""
    from megatron.core.utils import unwrap_model

    from megatron_moe.moe.gates import _TopKGateBase
    from tests.unit.one_rank_run import one_rank_trainer

    flags = ["--moe-router-load-balancing-type", "global_aux_loss", "--moe-aux-loss-coeff", "0.01"]
    flags += ["--moe-layer-impl", impl] + (["--disable-bias-linear"] if impl == "mcore" else [])
    _, trainer = one_rank_trainer("--train-iters", "2", *flags)
    seen = []
    for module in unwrap_model(trainer.model[0]).modules():
        if isinstance(module, _TopKGateBase) or type(module).__name__ == "TopKRouter":
            module.register_forward_hook(lambda m, args, out: seen.append(int(m.ga_steps)))
    steps = [trainer.train_step() for _ in range(2)]
    assert seen == [1, 1, 2, 2] * 2  # 2 MoE layers (--num-layers 2), each micro-batch through both
    assert all(step["aux"]["moe aux loss"] > 0.5 for step in steps), steps


def test_megatron_cores_global_loss_is_logged_summed_over_the_stages_ranks(megatron_world1, monkeypatch):
    """megatron-core's layer: each rank tracks its share of global_load_balancing_loss, which megatron-core sums over
    its TP x DP x CP group (the stage's ranks); load_balancing_loss is a whole loss per rank, averaged."""
    import torch.distributed as dist
    from megatron.core.transformer.moe import moe_utils

    from megatron_moe.training.moe_metrics import pop_moe_aux_losses

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)  # one stage of 4 ranks, the table reduced
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    tracker.clear()
    tracker["global_load_balancing_loss"] = {"values": torch.tensor([0.0, 4 * 2 * 0.3])}  # 4 ranks x 2 micro-batches
    tracker["load_balancing_loss"] = {"values": torch.tensor([0.0, 4 * 2 * 1.1])}
    figures = pop_moe_aux_losses(num_layers=2, num_moe_layers=1, num_microbatches=2)
    assert figures["global_load_balancing_loss"] == pytest.approx(4 * 0.3)
    assert figures["load_balancing_loss"] == pytest.approx(1.1)
    tracker.clear()
