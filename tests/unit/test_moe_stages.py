"""MoE layer: dense equivalence, orderings, hooks, custom experts, attributes, checkpoint layout, spec.

Single process, on the host (the one test through megatron-core's TransformerLayer
on the platform's device). Shapes are tiny; every comparison is against a real
reference (megatron-core's MLP, the other ordering, a hand-written loop).
"""

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig

from megatron_moe.moe import (
    HOOK_POINTS,
    Bf16OnTheWire,
    ModuleListExperts,
    MoEConfigError,
    MoEHook,
    MoELayer,
    MoELayerConfig,
    moe_layer_spec,
)
from megatron_moe.platform import current_platform

H, FFN, E = 32, 48, 4


def tconfig(**kw):
    base = dict(
        num_layers=2,
        hidden_size=H,
        ffn_hidden_size=FFN,
        num_attention_heads=4,
        num_moe_experts=E,
        moe_router_topk=2,
        add_bias_linear=False,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        gradient_accumulation_fusion=False,
    )
    base.update(kw)
    return TransformerConfig(**base)


def layer_config(config=None, **fields):
    """The settings of a test layer: `config`'s sizes, top-k and activation, no router losses, then `fields`."""
    config = config or tconfig()
    base = dict(
        num_experts=config.num_moe_experts,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.ffn_hidden_size,
        topk=config.moe_router_topk,
        expert_type="swiglu" if config.gated_linear_unit else "gelu",
        aux_loss_coeff=0.0,
    )
    return MoELayerConfig(**{**base, **fields})


def make_layer(seed=0, config=None, like=None, **fields):
    """A layer; `like`: copy that layer's weights (the expert init draws from megatron's RNG tracker)."""
    torch.manual_seed(seed)
    config = config or tconfig()
    layer = MoELayer(config, layer_config(config, **fields), layer_number=1)
    if like is not None:
        layer.load_state_dict(like.state_dict())
    return layer


def run(layer, x, grad=None):
    """Output and grads of input and every parameter after one backward."""
    x = x.clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    out, bias = layer(x)
    assert bias is None
    out.backward(torch.randn_like(out, generator=torch.Generator().manual_seed(7)) if grad is None else grad)
    return out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


def tokens(s=6, b=3, seed=1):
    return torch.randn(s, b, H, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- fused expert MLP


@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "swiglu"])
@pytest.mark.parametrize("chunk_bytes", [None, 0], ids=["one_run", "run_per_expert"])
@pytest.mark.parametrize(
    "kernel,counts",
    [
        *((kernel, [5, 0, 9, 2]) for kernel in ("onednn", "torch._grouped_mm", "mm-loop")),  # exact rows
        *((kernel, [4, 4, 4, 4]) for kernel in ("bmm", "onednn", "torch._grouped_mm", "mm-loop")),  # padded
    ],
)
def test_fused_expert_mlp_equals_per_gemm_nodes(gated, kernel, chunk_bytes, counts):
    """With each grouped GEMM kernel: GroupedMLP (one node, activation grad in place, backward in runs of
    experts) == per-GEMM autograd nodes == a loop over experts of plain matmuls."""
    from megatron_moe.moe.experts import GroupedMLP
    from megatron_moe.moe.ffn import ffn_activation
    from megatron_moe.moe.grouped_gemm import _kernel, forced_kernel, grouped_linear

    g = torch.Generator().manual_seed(3)
    hidden, ffn = 32, 24
    x = torch.randn(sum(counts), hidden, generator=g)
    w1 = torch.randn(len(counts), 2 * ffn if gated else ffn, hidden, generator=g) * 0.3
    with forced_kernel(kernel):
        if _kernel(x, w1.transpose(1, 2), counts, None) != kernel:
            pytest.skip(f"{kernel} does not run here")
    w2 = torch.randn(len(counts), hidden, ffn, generator=g) * 0.3
    dy = torch.randn(sum(counts), hidden, generator=g)

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2)]
        out = fn(*leaves)
        out.backward(dy)
        return [out.detach()] + [t.grad for t in leaves]

    def loop(a, b, c):
        rows = torch.split(a, counts)
        return torch.cat([ffn_activation(r @ b[e].t(), gated) @ c[e].t() for e, r in enumerate(rows)])

    with forced_kernel(kernel):
        fused = grads(lambda a, b, c: GroupedMLP.apply(a, b, c, counts, gated, chunk_bytes))
        nodes = grads(lambda a, b, c: grouped_linear(ffn_activation(grouped_linear(a, b, counts), gated), c, counts))
    reference = grads(loop)
    for name, f, n, r in zip(["out", "dx", "dw1", "dw2"], fused, nodes, reference):
        torch.testing.assert_close(f, r, rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(n, r, rtol=1e-5, atol=1e-5, msg=name)
    if 0 in counts:
        assert fused[2][counts.index(0)].abs().sum() == 0  # an expert with no rows gets a zero weight gradient


ROWS, HID, FFN = 128, 64, 96  # of the test below; an int8 row takes a 4-byte scale


@pytest.mark.parametrize(
    "recompute,quantize,kept_bytes",
    [
        (
            ["expert_act"],
            ["expert_act", "expert_fc1", "expert_fc2"],
            ROWS * (HID + 4) + ROWS * (FFN + 4),
        ),  # arctic: int8 x, h
        (["expert_fc1", "expert_act"], [], ROWS * HID * 4),  # x only
        ([], ["expert_fc2"], ROWS * HID * 4 + ROWS * FFN * 4 + ROWS * (FFN + 4)),  # x, h, int8 a
    ],
    ids=["arctic", "recompute_fc1_act", "quantize_fc2"],
)
@pytest.mark.parametrize("chunk_bytes", [None, 0], ids=["one_run", "run_per_expert"])
def test_fused_expert_mlp_keeps_what_the_policy_says(recompute, quantize, kept_bytes, chunk_bytes):
    """Under a policy the fused node keeps x/h/a as the policy says, with the numbers of the three separate regions."""
    from megatron_moe.activations.engine import LayerScope, SavedBytes
    from megatron_moe.config.activation_policy import build_policy
    from megatron_moe.moe.experts import GroupedMLP
    from megatron_moe.moe.ffn import ffn_activation
    from megatron_moe.moe.grouped_gemm import grouped_linear

    g = torch.Generator().manual_seed(5)
    counts, hidden, ffn = [40, 0, 70, 18], HID, FFN  # rows x ffn above the quantizer's size floor
    x = torch.randn(sum(counts), hidden, generator=g)
    w1, w2 = (
        torch.randn(len(counts), ffn, hidden, generator=g) * 0.1,
        torch.randn(len(counts), hidden, ffn, generator=g) * 0.1,
    )
    dy = torch.randn(sum(counts), hidden, generator=g)
    policy = build_policy(preset="none", recompute=recompute, quantize=quantize, quant_format="int8_row")

    def run(fused: bool):
        counter = SavedBytes()
        scope = LayerScope(policy, counter)
        leaves = [x.clone().requires_grad_(), torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())]
        with scope.active():
            if fused:
                out = GroupedMLP.apply(
                    *leaves, counts, False, chunk_bytes, scope.fused_keeping("expert_fc1", "expert_act", "expert_fc2")
                )
            else:
                h = scope.call("expert_fc1", grouped_linear, leaves[0], leaves[1], counts)
                a = scope.call("expert_act", ffn_activation, h, False)
                out = scope.call("expert_fc2", grouped_linear, a, leaves[2], counts)
        out.backward(dy)
        return [out.detach()] + [t.grad for t in leaves], counter.bytes

    (fused, fused_bytes), (apart, apart_bytes) = run(True), run(False)
    for name, f, n in zip(["out", "dx", "dw1", "dw2"], fused, apart):
        torch.testing.assert_close(f, n, rtol=1e-5, atol=1e-5, msg=name)
    assert fused_bytes == kept_bytes
    assert fused_bytes <= apart_bytes  # the regions' chain of recipes keeps h for act's recompute too


def test_expert_chunks_cover_every_expert_once_within_budget():
    from megatron_moe.moe.experts import expert_chunks

    counts = [3, 0, 5, 2, 9, 1]
    runs = expert_chunks(counts, row_bytes=10, budget=70)
    assert runs == [(0, 2, 0, 3), (2, 4, 3, 10), (4, 5, 10, 19), (5, 6, 19, 20)]  # 9 rows alone exceed it
    assert expert_chunks(counts, row_bytes=10, budget=None) == [(0, 6, 0, 20)]
    per_expert = [(0, 2, 0, 3), (2, 3, 3, 8), (3, 4, 8, 10), (4, 5, 10, 19), (5, 6, 19, 20)]
    assert expert_chunks(counts, row_bytes=10, budget=0) == per_expert  # the empty expert 1 rides with 0


# ---------------------------------------------------------------------------- dense equivalence


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_one_expert_moe_equals_megatron_dense_mlp(swiglu, padded, megatron_world1):
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
    from megatron.core.transformer.spec_utils import build_module

    config = tconfig(
        num_moe_experts=1,
        moe_router_topk=1,
        moe_router_pre_softmax=True,
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu,
    )
    layer = make_layer(config=config, pad_expert_input_to_capacity=padded)
    from megatron.core import parallel_state

    dense = build_module(
        get_mlp_module_spec_for_backend(LocalSpecProvider()),
        config=config,
        tp_group=parallel_state.get_tensor_model_parallel_group(),
    )
    with torch.no_grad():
        layer.experts.weight1[0].copy_(dense.linear_fc1.weight)
        layer.experts.weight2[0].copy_(dense.linear_fc2.weight)
    x = tokens()
    out, x_grad, grads = run(layer, x)
    xd = x.clone().requires_grad_()
    ref, _ = dense(xd)
    ref.backward(torch.randn_like(ref, generator=torch.Generator().manual_seed(7)))
    torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x_grad, xd.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads["experts.weight1"][0], dense.linear_fc1.weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads["experts.weight2"][0], dense.linear_fc2.weight.grad, rtol=1e-5, atol=1e-6)


def test_moe_output_matches_a_per_token_python_reference():
    layer = make_layer(gate="topk", capacity_factor=None)
    x = tokens()
    out, _, _ = run(layer, x)
    x_TH = x.reshape(-1, H)
    probs = torch.softmax(x_TH @ layer.gate.weight.t(), -1)
    w, idx = probs.topk(2, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    ref = torch.zeros_like(x_TH)
    for t in range(x_TH.shape[0]):
        for j in range(2):
            e = idx[t, j]
            h = F.gelu(x_TH[t] @ layer.experts.weight1[e].t())
            ref[t] += w[t, j] * (h @ layer.experts.weight2[e].t())
    torch.testing.assert_close(out.reshape(-1, H), ref.detach(), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- orderings


@pytest.mark.parametrize(
    "gate,capacity",
    [
        ("topk", None),
        ("topk", 0.5),
        ("bpr", 0.75),
        ("sigmoid", -0.5),
        ("expert_choice", None),
        ("soft", None),
        ("xmoe", 1.0),
    ],
)
def test_dense_and_sparse_orderings_agree(gate, capacity):
    x = tokens(8, 2)
    sparse = make_layer(seed=3, gate=gate, capacity_factor=capacity, ordering="sparse")
    dense = make_layer(seed=3, gate=gate, capacity_factor=capacity, ordering="dense", like=sparse)
    results = [run(sparse, x), run(dense, x)]
    (o1, g1, p1), (o2, g2, p2) = results
    torch.testing.assert_close(o1, o2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-6)
    for name in p1:
        torch.testing.assert_close(p1[name], p2[name], rtol=1e-5, atol=1e-6, msg=name)
    assert o1.abs().sum() > 0


@pytest.mark.parametrize("capacity", [None, 0.5, -0.75])
def test_padded_and_exact_dispatchers_agree(capacity):
    x = tokens(8, 2)
    exact = make_layer(seed=4, capacity_factor=capacity)
    padded = make_layer(seed=4, capacity_factor=capacity, pad_expert_input_to_capacity=True, like=exact)
    a, b = run(exact, x), run(padded, x)
    for u, v in zip(a[:2], b[:2]):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- hooks and custom experts


class Recorder(MoEHook):
    def __init__(self, log):
        self.log = log

    def __getattribute__(self, name):
        if name in HOOK_POINTS:
            log = object.__getattribute__(self, "log")
            return lambda t, ctx: (log.append((name, tuple(t.shape), ctx.layer_number)), t)[1]
        return object.__getattribute__(self, name)


class Double(MoEHook):
    def after_combine(self, rows, ctx):
        return rows * 2


def test_hooks_fire_in_order_and_can_change_tensors():
    layer = make_layer(shared_expert_ffn_hidden_size=16)
    x = tokens()
    base, _, _ = run(layer, x)
    log = []
    handle = layer.register_moe_hook(Recorder(log))
    run(layer, x)
    assert [name for name, _, _ in log] == list(HOOK_POINTS)
    assert all(number == 1 for _, _, number in log)
    assert log[0][1] == (18, H) and log[1][1][1] == H
    handle.remove()
    log.clear()
    run(layer, x)
    assert log == []

    layer.register_moe_hook(Bf16OnTheWire())
    compressed, x_grad, _ = run(layer, x)
    torch.testing.assert_close(compressed, base, rtol=2e-2, atol=2e-3)
    assert not torch.equal(compressed, base)  # the bf16 round trip really happened
    assert torch.isfinite(x_grad).all()

    layer.hooks.clear()
    layer.register_moe_hook(Double())
    doubled, _, _ = run(layer, x)
    shared = layer.shared_expert(x.reshape(-1, H)).detach().view_as(x)
    torch.testing.assert_close(doubled - shared, 2 * (base - shared), rtol=1e-5, atol=1e-6)


def test_custom_experts_module_plugs_in():
    def experts_builder(num_local_experts, moe_config, ep_group, expert_dp_group):
        mlps = [
            torch.nn.Sequential(torch.nn.Linear(H, 8, bias=False), torch.nn.Tanh(), torch.nn.Linear(8, H, bias=False))
            for _ in range(num_local_experts)
        ]
        return ModuleListExperts(mlps, ep_group=ep_group, expert_dp_group=expert_dp_group)

    torch.manual_seed(0)
    config = tconfig()
    layer = MoELayer(config, layer_config(config), experts=experts_builder)
    out, x_grad, grads = run(layer, tokens())
    assert out.shape == (6, 3, H) and out.abs().sum() > 0
    expert_grads = [g for n, g in grads.items() if "local_experts" in n]
    assert len(expert_grads) == 2 * E and all(g is not None and g.abs().sum() > 0 for g in expert_grads)
    assert all(p.allreduce is False for p in layer.experts.parameters())

    with pytest.raises(TypeError, match="num_local_experts"):
        MoELayer(config, layer_config(config), experts=lambda **kw: torch.nn.Linear(H, H))


# ---------------------------------------------------------------------------- attributes, checkpoint, spec


def test_parameter_attributes_for_megatron_grad_reduction():
    layer = make_layer(config=tconfig(sequence_parallel=False), gate="xmoe", shared_expert_ffn_hidden_size=16)
    assert {p.sequence_parallel for p in layer.gate.parameters()} == {False}
    config = tconfig()
    config.sequence_parallel = True  # megatron refuses SP at TP=1 in the constructor; the layer only reads it
    layer = make_layer(config=config, gate="xmoe", shared_expert_ffn_hidden_size=16)
    assert all(p.sequence_parallel is True for p in layer.gate.parameters())
    assert all(p.sequence_parallel is True for p in layer.shared_expert.parameters())
    assert all(p.allreduce is False for p in layer.experts.parameters())
    assert all(getattr(p, "allreduce", True) for p in layer.gate.parameters())


def test_sharded_state_dict_uses_one_global_expert_layout():
    layer = make_layer(config=tconfig(gated_linear_unit=True, activation_func=F.silu))
    sd = layer.sharded_state_dict(prefix="decoder.layers.0.mlp.")
    w1, w2 = sd["decoder.layers.0.mlp.experts.weight1"], sd["decoder.layers.0.mlp.experts.weight2"]
    assert w1.global_shape == (E, 2 * FFN, H) and w2.global_shape == (E, H, FFN)
    assert w1.global_offset == (0, 0, 0) and w1.replica_id == (0, 0, 0)
    assert w1.data is layer.experts.weight1
    assert sd["decoder.layers.0.mlp.gate.weight"].global_shape == (E, H)

    # Under a prepended layer axis the expert axis moves right, the offset stays the global expert.
    sd = layer.experts.sharded_state_dict("e.", sharded_offsets=((0, 1, 2),))
    assert sd["e.weight1"].global_shape == (2, E, 2 * FFN, H) and sd["e.weight1"].global_offset == (1, 0, 0, 0)


def test_layer_plugs_into_a_megatron_transformer_layer(megatron_world1):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    config = tconfig()
    spec = get_gpt_layer_local_spec(num_experts=E)
    spec.submodules.mlp = moe_layer_spec(layer_config(config, gate="topk", capacity_factor=1.0))
    device = current_platform().device  # megatron-core builds its modules there, ours on the host
    layer = build_module(spec, config=config, layer_number=2).to(device)
    assert isinstance(layer.mlp, MoELayer) and layer.mlp.layer_number == 2
    x = tokens().to(device).requires_grad_()
    out, _ = layer(x, attention_mask=None)
    out.sum().backward()
    assert out.shape == x.shape and layer.mlp.gate.weight.grad is not None
    assert layer.mlp.stats.sums is not None


def test_bad_settings_name_the_flag():
    with pytest.raises(MoEConfigError, match=r"--moe-router-topk=5: must be between 1 and --num-experts=4"):
        layer_config(topk=5).validate()
    with pytest.raises(MoEConfigError, match=r"--moe-expert-capacity-factor=1.25: --moe-gate=expert_choice"):
        layer_config(gate="expert_choice", capacity_factor=1.25).validate()
    with pytest.raises(MoEConfigError, match=r"--moe-gate=gshard: choose one of topk, noisy_topk"):
        layer_config(gate="gshard").validate()
    with pytest.raises(MoEConfigError, match=r"--moe-router-topk=2: --moe-gate=switch"):
        layer_config(gate="switch").validate()
    implements = r"--moe-router-load-balancing-type=switch: megatron_moe's layer implements aux_loss, top1"
    with pytest.raises(MoEConfigError, match=implements):
        make_layer(load_balancing="switch")
    with pytest.raises(TypeError, match="dispatcher"):  # now --moe-pad-expert-input-to-capacity
        layer_config(dispatcher="alltoall")


def test_activation_policy_runs_the_stages_as_regions():
    """Recomputing the expert activation changes no number; int8 GEMM inputs stay close."""
    from megatron_moe.activations.engine import LayerScope, SavedBytes
    from megatron_moe.config.activation_policy import build_policy

    base = make_layer(shared_expert_ffn_hidden_size=16, capacity_factor=1.0)
    x = tokens(64, 4)  # big enough that the saved expert inputs pass the quantizer's size floor
    ref = run(base, x)
    kept = {}
    cases = (([], [], 0.0), (["expert_act", "router"], [], 1e-6), ([], ["expert_fc1", "expert_fc2"], 5e-2))
    for recompute, quantize, tol in cases:
        layer = make_layer(shared_expert_ffn_hidden_size=16, capacity_factor=1.0, like=base)
        counter = SavedBytes()
        scope = LayerScope(
            build_policy(preset="none", recompute=recompute, quantize=quantize, quant_format="int8_row"), counter
        )
        layer.use_activation_scope(scope)
        with scope.active():
            got = run(layer, x)
        kept[bool(recompute), bool(quantize)] = counter.bytes
        for a, b in zip(got[:2], ref[:2]):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
        torch.testing.assert_close(got[2]["experts.weight1"], ref[2]["experts.weight1"], rtol=tol, atol=tol)
        if quantize:  # the expert GEMMs really ran in their regions: their saved inputs were int8
            assert not torch.equal(got[2]["experts.weight1"], ref[2]["experts.weight1"])
    # The regions really kept less than with no policy: recompute drops the activation's and router's inputs.
    assert 0 < kept[True, False] < kept[False, False] and 0 < kept[False, True] < kept[False, False], kept
