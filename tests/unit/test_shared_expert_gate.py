"""--moe-shared-expert-gate (Qwen2-MoE) in our shared expert; a shared expert is never dropped under mcore."""

import torch

from megatron_moe.model.builder import transformer_config
from megatron_moe.moe.shared import SharedExpert
from tests.unit.test_config import cfg


def shared(gate: bool, seed=0):
    torch.manual_seed(seed)
    init = torch.nn.init.normal_
    return SharedExpert(
        hidden_size=8, ffn_hidden_size=6, gated=True, init_method=init, output_init_method=init,
        sequence_parallel=False, gate=gate,
    )  # fmt: skip


def test_the_gate_scales_the_output_by_sigmoid_of_x_dot_g_under_megatron_cores_name():
    gated, plain = shared(True), shared(False)
    plain.load_state_dict({k: v for k, v in gated.state_dict().items() if k != "gate_weight"})
    assert gated.gate_weight.shape == (1, 8) and "gate_weight" in gated.state_dict()
    x = torch.randn(5, 8, requires_grad=True)
    out = gated(x)
    torch.testing.assert_close(out, plain(x) * torch.sigmoid(x @ gated.gate_weight.t()))
    out.sum().backward()
    assert gated.gate_weight.grad is not None and gated.gate_weight.grad.abs().sum() > 0


def test_flags_reach_our_layer_and_megatron_cores():
    c = cfg("--moe-shared-expert-ffn-hidden-size", "64", "--moe-shared-expert-gate")
    assert c.moe.layer_config(c.model).shared_expert_gate
    c = cfg("--moe-layer-impl", "mcore", "--moe-shared-expert-ffn-hidden-size", "64", "--moe-shared-expert-gate")
    config = transformer_config(c)  # megatron-core's SharedExpertMLP: the shared expert is not dropped
    assert config.moe_shared_expert_intermediate_size == 64 and config.moe_shared_expert_gate is True
    assert transformer_config(cfg("--moe-layer-impl", "mcore")).moe_shared_expert_intermediate_size is None


def test_the_gate_and_seq_aux_loss_compose_with_the_chunked_pipeline():
    """The same output and gradients (the gate's included) with the FSMoE pipeline on (degrees 2, 2) or off."""
    from tests.unit.test_moe_stages import make_layer, run, tokens

    fields = dict(shared_expert_ffn_hidden_size=16, shared_expert_gate=True, load_balancing="seq_aux_loss")
    base = make_layer(aux_loss_coeff=0.01, **fields)
    out0, dx0, grads0 = run(base, tokens())
    piped = make_layer(aux_loss_coeff=0.01, like=base, **fields)
    piped.set_pipeline_degrees(2, 2)
    out1, dx1, grads1 = run(piped, tokens())
    assert torch.equal(out0, out1) and torch.equal(dx0, dx1)
    assert grads0.keys() == grads1.keys() and "shared_expert.gate_weight" in grads0
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-6, atol=1e-7, msg=name)
    assert base.gate.seq_batch == 3  # the layer told the router its sequences
