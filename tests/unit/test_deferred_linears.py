"""Deferrable linear layers outside the routed experts: bit-identical weight gradients when deferred.

For megatron-core's Column/RowParallelLinear subclasses, the router (every gate
whose projection is `self.weight`, fp32 and bf16 parameters) and the shared
expert (gated and not): the gradients of a run whose store queues the
weight-gradient closures and runs them after backward are `torch.equal` to the
plain run's (RUN_NOW); with RUN_NOW our linears equal megatron-core's own. A
store that keeps the closures leaves the weights' `.grad` None. megatron-core's
DDP (`delay_wgrad_compute`) hands each module the hook of each of its marked
parameters. Single process (TP=1); tests/distributed/test_deferred_linears_tp.py
runs TP=2 with sequence parallelism.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig

from megatron_moe.moe import MoELayerConfig
from megatron_moe.moe.deferred_linear import store_linear
from megatron_moe.moe.gates import build_gate
from megatron_moe.moe.routing import router_linear
from megatron_moe.moe.shared import SharedExpert
from megatron_moe.moe.weight_grad import RUN_NOW
from megatron_moe.overlap.linears import DeferrableColumnParallelLinear, DeferrableRowParallelLinear

H, OUT, E, S, B = 16, 24, 4, 6, 2


class Queue:
    """A store that keeps every closure; `run` runs them after backward and sets `.grad` as autograd would."""

    defers = True

    def __init__(self):
        self.kept = []

    def put(self, weight_grad, outs):
        self.kept.append((weight_grad, outs))
        return None

    def run(self, module) -> None:
        params = module.deferred_params()
        for weight_grad, outs in self.kept:
            grads = weight_grad(*outs)
            assert len(grads) == len(params)
            for param, grad in zip(params, grads):
                if grad is not None:
                    assert grad.dtype == param.dtype and grad.shape == param.shape
                    param.grad = grad if param.grad is None else param.grad + grad
        self.kept.clear()


class Immediate:
    """A deferring store that runs each closure at once: the module's own autograd function, dW to autograd."""

    defers = True

    def put(self, weight_grad, outs):
        return weight_grad(*outs)


def tconfig(**kw) -> TransformerConfig:
    base = dict(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=4,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
    )
    return TransformerConfig(**{**base, **kw})


def _grads(module, *tensors):
    return {name: p.grad for name, p in module.named_parameters()}, [t.grad for t in tensors]


def _assert_same(a, b):
    params_a, inputs_a = a
    params_b, inputs_b = b
    assert params_a.keys() == params_b.keys()
    for name in params_a:
        assert params_a[name] is not None and torch.equal(params_a[name], params_b[name]), name
    for ga, gb in zip(inputs_a, inputs_b):
        assert ga is not None and torch.equal(ga, gb)


# ----------------------------------------------------------------------------- tensor-parallel linears


def _linear_pair(kind: str, bias: bool, skip_bias_add: bool):
    """(megatron-core's linear, ours) with the same weights."""
    config = tconfig()
    mcore_cls, ours_cls = {
        "column": (ColumnParallelLinear, DeferrableColumnParallelLinear),
        "row": (RowParallelLinear, DeferrableRowParallelLinear),
    }[kind]
    extra = {"input_is_parallel": True} if kind == "row" else {"gather_output": False}
    kwargs = dict(config=config, init_method=torch.nn.init.normal_, bias=bias, skip_bias_add=skip_bias_add, **extra)
    mcore, ours = mcore_cls(H, OUT, **kwargs), ours_cls(H, OUT, **kwargs)
    with torch.no_grad():
        ours.weight.copy_(mcore.weight)
        if bias:
            mcore.bias.normal_()
            ours.bias.copy_(mcore.bias)
    return mcore, ours


def _run_linear(module, x, dy, store=None):
    if store is not None:
        module.weight_grad_store = store
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out, out_bias = module(x)
    loss = (out * dy).sum() + (0.0 if out_bias is None else out_bias.square().sum())
    loss.backward()
    return out.detach(), x


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("bias,skip_bias_add", [(False, False), (True, False), (True, True)])
def test_parallel_linear_deferred_equals_megatron_core(kind, bias, skip_bias_add, megatron_world1):
    mcore, ours = _linear_pair(kind, bias, skip_bias_add)
    g = torch.Generator().manual_seed(3)
    x, dy = torch.randn(S, B, H, generator=g), torch.randn(S, B, OUT, generator=g)
    assert ours.weight_grad_store is RUN_NOW and ours.deferred_params() == [ours.weight]

    out_ref, x_ref = _run_linear(mcore, x, dy)
    reference = _grads(mcore, x_ref)
    out, x_now = _run_linear(ours, x, dy)  # RUN_NOW: megatron-core's own code path
    assert torch.equal(out, out_ref)
    _assert_same(_grads(ours, x_now), reference)

    out, x_imm = _run_linear(ours, x, dy, Immediate())  # our copy of megatron-core's function
    assert torch.equal(out, out_ref)
    _assert_same(_grads(ours, x_imm), reference)

    queue = Queue()
    out, x_q = _run_linear(ours, x, dy, queue)
    assert torch.equal(out, out_ref)
    assert ours.weight.grad is None and len(queue.kept) == 1  # the store owns it
    if bias and not skip_bias_add:
        assert torch.equal(ours.bias.grad, mcore.bias.grad)  # bias grads stay with autograd
    queue.run(ours)
    _assert_same(_grads(ours, x_q), reference)


def test_parallel_linear_accumulates_over_micro_batches_like_autograd(megatron_world1):
    mcore, ours = _linear_pair("column", bias=True, skip_bias_add=False)
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(S, B, H, generator=g), torch.randn(S, B, OUT, generator=g)) for _ in range(3)]
    queue = Queue()
    ours.weight_grad_store = queue
    for x, dy in batches:
        for module in (mcore, ours):
            out, _ = module(x.clone().requires_grad_())
            (out * dy).sum().backward()
    assert ours.weight.grad is None and len(queue.kept) == 3
    queue.run(ours)
    assert torch.equal(ours.weight.grad, mcore.weight.grad) and torch.equal(ours.bias.grad, mcore.bias.grad)


# ----------------------------------------------------------------------------- router


def _gate(name: str, dtype: torch.dtype, **fields):
    cfg = MoELayerConfig(
        num_experts=E, hidden_size=H, ffn_hidden_size=OUT, topk=2, gate=name, aux_loss_coeff=0.01, **fields
    )
    torch.manual_seed(0)
    return build_gate(cfg).to(dtype)


def _run_gate(gate, x, store):
    gate.weight_grad_store = store
    gate.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    torch.manual_seed(1)  # noisy_topk draws noise in training
    routing = gate(x)
    g = torch.Generator().manual_seed(9)
    loss = (routing.weight_N * torch.randn(routing.weight_N.shape, generator=g)).sum() + routing.probs_TE.square().sum()
    if routing.aux_loss is not None:
        loss = loss + routing.aux_loss
    loss.backward()
    return x


@pytest.mark.parametrize("name,fields", [("topk", {}), ("noisy_topk", {}), ("sigmoid", {"z_loss_coeff": 0.01}),
                                         ("expert_choice", {"z_loss_coeff": 0.01})])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_deferred_weight_grad_is_bit_identical(name, fields, dtype):
    gate = _gate(name, dtype, **fields)
    assert gate.deferred_params() == [gate.weight]
    x = torch.randn(S * B, H, generator=torch.Generator().manual_seed(2)).to(dtype)
    reference = _grads(gate, _run_gate(gate, x, RUN_NOW))
    _assert_same(_grads(gate, _run_gate(gate, x, Immediate())), reference)
    queue = Queue()
    x_q = _run_gate(gate, x, queue)
    assert gate.weight.grad is None and len(queue.kept) == 1
    if name == "noisy_topk":
        assert torch.equal(gate.noise_weight.grad, reference[0]["noise_weight"])  # not deferred
    queue.run(gate)
    _assert_same(_grads(gate, x_q), reference)


@pytest.mark.parametrize("layout", ["contiguous", "column_major", "3d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_linear_matches_autograd_for_any_input_layout(layout, dtype):
    g = torch.Generator().manual_seed(4)
    weight = torch.nn.Parameter(torch.randn(E, H, generator=g).to(dtype))
    x = {
        "contiguous": torch.randn(S * B, H, generator=g),
        "column_major": torch.randn(H, S * B, generator=g).t(),
        "3d": torch.randn(S, B, H, generator=g),
    }[layout].to(dtype)
    dy = torch.randn(*x.shape[:-1], E, generator=g)
    results = []
    for store in (RUN_NOW, Queue()):
        weight.grad = None
        leaf = x.detach().clone() if layout != "column_major" else x.detach().t().clone().t()
        leaf.requires_grad_()
        (router_linear(leaf, weight, store) * dy).sum().backward()
        if isinstance(store, Queue):
            assert weight.grad is None
            (grad_w,) = store.kept[0][0](None)
            weight.grad = grad_w
        results.append((weight.grad, leaf.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_store_linear_writes_into_a_given_output():
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(8, H, generator=g), torch.nn.Parameter(torch.randn(OUT, H, generator=g))
    queue = Queue()
    store_linear(x, w, queue, slot=1, slots=2).sum().backward()
    out = torch.full_like(w, float("nan"))
    grads = queue.kept[0][0](None, out)
    assert grads[0] is None and grads[1] is out and torch.equal(out, torch.ones(8, OUT).t() @ x)


# ----------------------------------------------------------------------------- shared expert


def _shared(gated: bool) -> SharedExpert:
    torch.manual_seed(0)
    init = torch.nn.init.normal_
    return SharedExpert(
        hidden_size=H, ffn_hidden_size=OUT, gated=gated, init_method=init, output_init_method=init,
        sequence_parallel=False,
    )  # fmt: skip


def _run_shared(module, x, dy, store):
    module.weight_grad_store = store
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    (module(x) * dy).sum().backward()
    return x


@pytest.mark.parametrize("gated", [False, True])
def test_shared_expert_deferred_weight_grads_are_bit_identical(gated):
    module = _shared(gated)
    assert module.deferred_params() == [module.weight1, module.weight2]
    g = torch.Generator().manual_seed(8)
    x, dy = torch.randn(S * B, H, generator=g), torch.randn(S * B, H, generator=g)
    reference = _grads(module, _run_shared(module, x, dy, RUN_NOW))
    _assert_same(_grads(module, _run_shared(module, x, dy, Immediate())), reference)
    queue = Queue()
    x_q = _run_shared(module, x, dy, queue)
    assert module.weight1.grad is None and module.weight2.grad is None
    fc2, fc1 = (weight_grad(*outs) for weight_grad, outs in queue.kept)  # backward: fc2's closure first
    assert fc1[1] is None and fc2[0] is None and fc1[0] is not None and fc2[1] is not None
    queue.run(module)
    _assert_same(_grads(module, x_q), reference)


# ----------------------------------------------------------------------------- megatron-core DDP hooks


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        config = tconfig()
        self.column = DeferrableColumnParallelLinear(H, OUT, config=config, init_method=torch.nn.init.normal_)
        self.row = DeferrableRowParallelLinear(
            OUT, H, config=config, init_method=torch.nn.init.normal_, bias=False, input_is_parallel=True,
            skip_bias_add=True,
        )  # fmt: skip
        self.shared = _shared(gated=True)
        self.gate = _gate("topk", torch.float32)

    def deferrable(self):
        return [self.column, self.row, self.shared, self.gate]


def test_ddp_hands_each_module_the_hook_of_each_marked_param(megatron_world1):
    model = _Model()
    marked = [p for m in model.deferrable() for p in m.deferred_params()]
    for param in marked:
        param.skip_backward_post_hook = True
    ddp = DistributedDataParallel(
        tconfig(), DistributedDataParallelConfig(delay_wgrad_compute=True, overlap_grad_reduce=False), model
    )
    for module in model.deferrable():
        for param in module.deferred_params():
            hook = module.wgrad_hook(param)
            assert hook is not None
            grad = torch.randn_like(param)
            before = param.main_grad.clone()
            param.grad = grad
            hook()  # DDP's hook of *this* parameter: main_grad += grad, grad released
            assert param.grad is None and torch.equal(param.main_grad, before + grad)
    unmarked = [model.column.bias, model.gate.noise_weight]
    assert all(model.column.wgrad_hook(p) is None for p in unmarked if p is not None)
    assert ddp.module is model


# ----------------------------------------------------------------------------- layer spec


def test_local_spec_uses_the_deferrable_linears_with_unchanged_checkpoint_keys(megatron_world1):
    import dataclasses

    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.spec_utils import build_module

    from megatron_moe.model.spec import layer_spec

    config = tconfig(num_layers=1, ffn_hidden_size=OUT, add_bias_linear=True, bias_activation_fusion=False)
    ours = layer_spec(config, moe=False, backend=LocalSpecProvider())
    attention, mlp = ours.submodules.self_attention.submodules, ours.submodules.mlp.submodules
    deferrable = (DeferrableColumnParallelLinear, DeferrableRowParallelLinear)
    assert (attention.linear_qkv, attention.linear_proj) == deferrable
    assert (mlp.linear_fc1, mlp.linear_fc2) == deferrable
    plain_attention = dataclasses.replace(attention, linear_qkv=ColumnParallelLinear, linear_proj=RowParallelLinear)
    plain = dataclasses.replace(
        ours,
        submodules=dataclasses.replace(
            ours.submodules,
            self_attention=dataclasses.replace(ours.submodules.self_attention, submodules=plain_attention),
            mlp=dataclasses.replace(
                ours.submodules.mlp,
                submodules=dataclasses.replace(mlp, linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            ),
        ),
    )
    layers = [build_module(spec, config=config, layer_number=1) for spec in (ours, plain)]
    assert isinstance(layers[0].mlp.linear_fc1, DeferrableColumnParallelLinear)
    assert not isinstance(layers[1].mlp.linear_fc1, DeferrableColumnParallelLinear)
    assert layers[0].state_dict().keys() == layers[1].state_dict().keys()
    sharded = [layer.sharded_state_dict(prefix="layer.", metadata={"dp_cp_group": None}) for layer in layers]
    assert sharded[0].keys() == sharded[1].keys()
    assert "layer.self_attention.linear_qkv.weight" in sharded[0]


# ----------------------------------------------------------------------------- inside the MoE layer


class _Stores:
    """One queue per deferrable module of a layer; `run` runs each module's closures after backward."""

    def __init__(self, modules):
        self.queues = {module: Queue() for module in modules}
        for module, queue in self.queues.items():
            module.weight_grad_store = queue

    def run(self):
        for module, queue in self.queues.items():
            queue.run(module)


@pytest.mark.parametrize("policy", ["none", "arctic", "recompute_router_and_shared"])
def test_moe_layer_router_and_shared_expert_deferred_are_bit_identical(policy, megatron_world1):
    """Router (with aux and z losses) and shared expert of our MoE layer, under activation policies."""
    from megatron_moe.activations.engine import LayerScope
    from megatron_moe.config.activation_policy import build_policy
    from megatron_moe.moe import MoELayer

    config = tconfig(num_moe_experts=E, moe_router_topk=2, ffn_hidden_size=OUT, add_bias_linear=False)
    cfg = MoELayerConfig(
        num_experts=E, hidden_size=H, ffn_hidden_size=OUT, topk=2, gate="topk", aux_loss_coeff=0.01,
        z_loss_coeff=0.001, expert_type="swiglu", shared_expert_ffn_hidden_size=OUT,
    )  # fmt: skip
    torch.manual_seed(0)
    layer = MoELayer(config, cfg, layer_number=1)
    if policy != "none":
        recompute = ["router", "shared_expert"] if policy == "recompute_router_and_shared" else []
        preset = "arctic" if policy == "arctic" else "none"
        layer.use_activation_scope(
            LayerScope(build_policy(preset=preset, recompute=recompute, quantize=[], quant_format="int8_row"))
        )
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
    dy = torch.randn(S, B, H, generator=torch.Generator().manual_seed(7))

    def run(stores=None):
        layer.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        out, _ = layer(leaf)
        out.backward(dy)
        if stores is not None:
            assert layer.gate.weight.grad is None and layer.shared_expert.weight1.grad is None
            stores.run()
        return out.detach(), leaf.grad, {n: p.grad for n, p in layer.named_parameters()}

    reference = run()
    deferred = run(_Stores([layer.gate, layer.shared_expert]))
    assert torch.equal(deferred[0], reference[0]) and torch.equal(deferred[1], reference[1])
    assert deferred[2].keys() == reference[2].keys()
    for name, grad in reference[2].items():
        assert grad is not None and torch.equal(deferred[2][name], grad), name


def test_deferring_refuses_megatron_cores_fused_wgrad_accumulation(megatron_world1):
    from megatron_moe.config.fields import ConfigError

    _, ours = _linear_pair("column", bias=False, skip_bias_add=False)
    ours.weight_grad_store = Queue()
    ours.gradient_accumulation_fusion = True  # what TransformerConfig(gradient_accumulation_fusion=True) sets
    with pytest.raises(ConfigError, match="TransformerConfig.gradient_accumulation_fusion=True: must be False"):
        ours(torch.randn(S, B, H))
