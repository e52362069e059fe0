"""The experts' backward split: input gradients now, weight gradients as closures a store may run later.

For every grouped kernel, exact and padded counts, one run and a run per
expert, GELU and SwiGLU, and every way the fused node keeps x/h/a today:
the weight gradients of closures run after backward are bit-identical to
those run inside it, and both match a plain per-expert loop.
"""

import itertools
import sys
import types

import pytest
import torch

from megatron_moe.activations.engine import SAVE_ALL, FusedKeeping, LayerScope
from megatron_moe.config.activation_policy import ActivationPolicy
from megatron_moe.moe import grouped_gemm
from megatron_moe.moe.experts import FFNExperts, GroupedMLP, mark_expert_params
from megatron_moe.moe.ffn import ffn_activation
from megatron_moe.moe.grouped_gemm import _kernel, forced_kernel

HID, FFN = 32, 48  # x (128 x 32) and h, a (128 x 48) are at or above the quantizer's size floor (4096)
EXACT, PADDED = [40, 0, 70, 18], [32, 32, 32, 32]
KEEPINGS = [  # what LayerScope.fused_keeping can ask of the fused node: x saved or quantized, h and a any way
    (x, h, a) for x, h, a in itertools.product(("save", "quantize"), *[("save", "quantize", "recompute")] * 2)
]
CASES = [
    *((kernel, EXACT) for kernel in ("onednn", "torch._grouped_mm", "mm-loop")),
    *((kernel, PADDED) for kernel in ("bmm", "onednn", "torch._grouped_mm", "mm-loop")),
]


class Deferring:
    """A store that keeps every weight-gradient closure, with the outputs the node offered, to run later (a node
    hands a deferring store one closure per backward, for all its runs, or per GEMM one per weight)."""

    defers = True

    def __init__(self):
        self.kept = []

    def put(self, weight_grad, outs) -> None:  # None: kept, the node returns no weight gradient
        self.kept.append((weight_grad, outs))

    def run(self, own_outs: bool = False) -> list[tuple]:
        """Run the closures in order; `own_outs`: into fresh buffers of ours (as into main_grad) where the node
        offered outputs, instead of the node's."""
        results = []
        for weight_grad, outs in self.kept:
            if own_outs:
                outs = tuple(None if o is None else torch.full_like(o, float("nan")) for o in outs)
            grads = weight_grad(*outs)
            for out, grad in zip(outs, grads):
                assert out is None or grad is out  # written into the output it was given
            results.append(grads)
        return results


def _inputs(counts, gated, dtype=torch.float32):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(sum(counts), HID, generator=g).to(dtype)
    w1 = (torch.randn(len(counts), 2 * FFN if gated else FFN, HID, generator=g) * 0.1).to(dtype)
    w2 = (torch.randn(len(counts), HID, FFN, generator=g) * 0.1).to(dtype)
    return x, w1, w2, torch.randn(sum(counts), HID, generator=g).to(dtype)


def _ffn_experts(num, hidden, ffn, gated):
    sizes = {"num_local_experts": num, "hidden_size": hidden, "ffn_hidden_size": ffn, "gated": gated}
    return FFNExperts(**sizes, init_method=torch.nn.init.zeros_, output_init_method=torch.nn.init.zeros_)


def _runs_here(kernel, x, w1, counts) -> bool:
    with forced_kernel(kernel):
        return _kernel(x, w1.transpose(1, 2), counts, None) == kernel


def _fused(inputs, counts, gated, chunk_bytes, keeping, store=None):
    """(out, dX, dW1, dW2) of GroupedMLP; with a deferring `store`, dW1/dW2 as autograd left them (None)."""
    x, w1, w2, dy = inputs
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2)]
    scope = LayerScope(ActivationPolicy(modes={}))
    keeping = FusedKeeping(*keeping, scope) if keeping else SAVE_ALL
    with scope.active():
        args = (*leaves, counts, gated, chunk_bytes, keeping) + ((store,) if store else ())
        out = GroupedMLP.apply(*args)
    out.backward(dy)
    return [out.detach()] + [t.grad for t in leaves]


def _loop_reference(inputs, counts, gated):
    x, w1, w2, dy = inputs
    leaves = [t.clone().double().requires_grad_() for t in (x, w1, w2)]
    rows = torch.split(leaves[0], counts)
    out = torch.cat([ffn_activation(r @ leaves[1][e].t(), gated) @ leaves[2][e].t() for e, r in enumerate(rows)])
    out.backward(dy.double())
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "swiglu"])
@pytest.mark.parametrize("chunk_bytes", [None, 0], ids=["one_run", "run_per_expert"])
@pytest.mark.parametrize("kernel,counts", CASES, ids=[f"{k}-{'exact' if c is EXACT else 'padded'}" for k, c in CASES])
def test_deferred_weight_grads_bit_identical_and_match_loop(kernel, counts, chunk_bytes, gated):
    inputs = _inputs(counts, gated)
    if not _runs_here(kernel, inputs[0], inputs[1], counts):
        pytest.skip(f"{kernel} does not run here")
    reference = _loop_reference(inputs, counts, gated)
    for keeping in [None, *KEEPINGS]:
        with forced_kernel(kernel):
            now = _fused(inputs, counts, gated, chunk_bytes, keeping)
            store = Deferring()
            later = _fused(inputs, counts, gated, chunk_bytes, keeping, store)
            assert later[2] is None and later[3] is None  # autograd got no weight gradient: the store owns it
            # The graph is gone (its saved tensors freed by backward): the closures own what they read.
            for own_outs in (False, True):
                runs = store.run(own_outs)
                dw1, dw2 = (torch.cat([grads[i] for grads in runs]) for i in (0, 1))
                assert torch.equal(dw1, now[2]) and torch.equal(dw2, now[3]), (keeping, own_outs)
        assert torch.equal(later[0], now[0]) and torch.equal(later[1], now[1]), keeping
        if 0 in counts:
            assert now[2][counts.index(0)].abs().sum() == 0 and now[3][counts.index(0)].abs().sum() == 0
        quantized = keeping is not None and "quantize" in keeping
        for name, got, want in zip(["out", "dx", "dw1", "dw2"], now, reference):
            if quantized and name != "out":  # quantization touches only what backward reads
                rel = ((got.double() - want).norm() / want.norm()).item()
                assert rel < 0.02, (name, keeping, rel)  # test_activations.py's bound for int8
            else:
                torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, msg=f"{name} {keeping}")


PER_GEMM_POLICIES = {
    "recompute_fc2": {"expert_fc2": "recompute"},
    "arctic_recompute_fc2": {"expert_fc1": "quantize", "expert_act": "recompute+quantize", "expert_fc2": "recompute"},
}


@pytest.mark.parametrize("modes", PER_GEMM_POLICIES.values(), ids=PER_GEMM_POLICIES.keys())
@pytest.mark.parametrize("kernel,counts", [("onednn", EXACT), ("mm-loop", EXACT), ("bmm", PADDED)])
def test_per_gemm_nodes_defer_weight_grads_bit_identically(kernel, counts, modes):
    """fc2 recomputed: FFNExperts runs one GroupedLinear node per GEMM; each hands its dW to the store too."""
    x, w1, w2, dy = _inputs(counts, gated=True)
    if not _runs_here(kernel, x, w1, counts):
        pytest.skip(f"{kernel} does not run here")

    def run(store):
        experts = _ffn_experts(len(counts), HID, FFN, gated=True)
        with torch.no_grad():
            experts.weight1.copy_(w1)
            experts.weight2.copy_(w2)
        scope = LayerScope(ActivationPolicy(modes=modes))
        experts.use_activation_scope(scope)
        assert experts.keeping is None  # the per-GEMM path
        if store is not None:
            experts.weight_grad_store = store
        leaf = x.clone().requires_grad_()
        with forced_kernel(kernel), scope.active():
            out = experts(leaf, counts)
        out.backward(dy)
        return out.detach(), leaf.grad, experts.weight1.grad, experts.weight2.grad

    now, store = run(None), Deferring()
    later = run(store)
    assert later[2] is None and later[3] is None
    with forced_kernel(kernel):
        (none1, dw2), (dw1, none2) = store.run()  # autograd runs fc2's backward first
    assert none1 is None and none2 is None  # each per-GEMM closure fills its own weight's place
    assert torch.equal(later[0], now[0]) and torch.equal(later[1], now[1])
    assert torch.equal(dw1, now[2]) and torch.equal(dw2, now[3])


class FakeBackend:
    """A pure-torch `grouped_gemm.backend.gmm` with the package's signature; records its calls."""

    def __init__(self):
        self.calls = []

    def gmm(self, a, b, batch_sizes, trans_a=False, trans_b=False, c=None):
        assert a.is_contiguous() and b.is_contiguous() and not (trans_a and trans_b)
        assert batch_sizes.device.type == "cpu" and batch_sizes.dtype == torch.long
        assert c is None or c.is_contiguous()
        self.calls.append((trans_a, trans_b))
        sizes = batch_sizes.tolist()
        if trans_a:  # [E, a cols, b cols]: a[rows]^T b[rows] per group
            c = a.new_empty(len(sizes), a.shape[1], b.shape[1]) if c is None else c
        else:
            c = a.new_empty(a.shape[0], b.shape[1] if trans_b else b.shape[2]) if c is None else c
        for e, (start, size) in enumerate(zip(itertools.accumulate(sizes, initial=0), sizes)):
            rows = slice(start, start + size)
            if trans_a:
                torch.mm(a[rows].t(), b[rows], out=c[e])
            else:
                torch.mm(a[rows], b[e].t() if trans_b else b[e], out=c[rows])
        return c


@pytest.fixture
def fake_grouped_gemm(monkeypatch):
    backend = FakeBackend()
    package = types.ModuleType("grouped_gemm")
    package.backend = backend
    monkeypatch.setitem(sys.modules, "grouped_gemm", package)
    grouped_gemm._grouped_gemm_backend.cache_clear()
    yield backend
    grouped_gemm._grouped_gemm_backend.cache_clear()


@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "swiglu"])
@pytest.mark.parametrize("chunk_bytes", [None, 0], ids=["one_run", "run_per_expert"])
@pytest.mark.parametrize("counts", [EXACT, PADDED], ids=["exact", "padded"])
def test_grouped_gemm_package_kernel_runs_the_same_split(fake_grouped_gemm, counts, chunk_bytes, gated):
    """The package is a kernel like the others: GroupedMLP calls its gmm with the trans flags of each GEMM
    (y: x W^T; dX: dY W; dW: dY^T x) and gets the mm loop's results; its dW defers like every kernel's.
    In bf16, the one dtype the package takes (test_kernel_choice.py: other dtypes run other kernels)."""
    inputs = _inputs(counts, gated, torch.bfloat16)
    assert _runs_here("grouped_gemm", inputs[0], inputs[1], counts)
    runs = 1 if chunk_bytes is None else sum(1 for c in counts if c)  # an empty expert rides with the one before
    for keeping in [None, ("save", "save", "recompute"), ("quantize", "recompute", "quantize")]:
        with forced_kernel("mm-loop"):
            want = _fused(inputs, counts, gated, chunk_bytes, keeping)
        fake_grouped_gemm.calls.clear()
        with forced_kernel("grouped_gemm"):
            got = _fused(inputs, counts, gated, chunk_bytes, keeping)
        fc1 = [(False, True)] if keeping and keeping[1] == "recompute" else []  # h recomputed as x W1^T
        per_run = fc1 + [(False, False), (False, False), (True, False), (True, False)]  # dA, dX, dW2, dW1
        assert fake_grouped_gemm.calls == [(False, True)] * 2 * runs + per_run * runs, keeping
        for name, g, w in zip(["out", "dx", "dw1", "dw2"], got, want):
            assert torch.equal(g, w), (name, keeping)
        store = Deferring()
        with forced_kernel("grouped_gemm"):
            _fused(inputs, counts, gated, chunk_bytes, keeping, store)
            dw1, dw2 = (torch.cat([grads[i] for grads in store.run()]) for i in (0, 1))
        assert torch.equal(dw1, want[2]) and torch.equal(dw2, want[3]), keeping


def test_mark_expert_params_one_meaning():
    experts = _ffn_experts(2, 8, 16, gated=False)
    assert all(p.allreduce is False and p.sequence_parallel is False for p in experts.parameters())
    mlp = torch.nn.Linear(4, 4)
    mlp.weight.sequence_parallel = True  # as megatron-core marks an experts' output bias
    mark_expert_params(mlp)
    assert mlp.weight.allreduce is False and mlp.weight.sequence_parallel is False
