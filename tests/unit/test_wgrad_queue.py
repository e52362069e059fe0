"""Lancet's weight-gradient queue (megatron_moe/overlap/wgrad_queue.py) in one process, with fake deferrable modules.

A `FakeLinear` is a leaf `DeferrableWeights` whose backward computes dX and hands its dW closure to its store; a
`fake_a2a` is an identity whose backward calls `queue.run_under` with a `FakeHandle`, as `comm.moe._AllToAll` does
with a started all-to-all. Every closure run and every `wait()` is appended to a log, so the tests check the order.
The chain of the tests (forward): x -> L1.experts -> dispatch a2a -> L1.shared_expert -> combine a2a -> L1.router;
in backward: router dW, combine a2a, shared_expert dW, dispatch a2a, experts dW (the last after every a2a).
Last, megatron-core's real DistributedDataParallel (`delay_wgrad_compute`) with the queue, against no queue.
"""

import pytest
import torch

from megatron_moe.comm.core import Collective
from megatron_moe.moe.weight_grad import RUN_NOW, DeferrableWeights
from megatron_moe.overlap import wgrad_schedule
from megatron_moe.overlap.runtime import OverlapRuntime
from megatron_moe.overlap.wgrad_queue import MIB, PROFILE_ITERATION, WgradQueue, deliver, held_bytes
from megatron_moe.platform.timing import HostStamps

KEYS = ("L1.experts", "L1.shared_expert", "L1.router")  # forward order; backward runs them in reverse
H = 4


class FakeClock:
    """Seconds; advanced only by the fake dW closures and the fake all-to-all waits."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, module):
        ctx.save_for_backward(x, weight)
        ctx.module = module
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        module = ctx.module

        def weight_grad(out=None):
            module.log.append(("dW", module.store_key))
            module.clock.now += module.dw_ms / 1000.0
            return (torch.mm(grad_y.t(), x, out=out) if out is not None else grad_y.t() @ x,)

        grads = module.weight_grad_store.put(weight_grad, (None,))
        return grad_y @ weight, None if grads is None else grads[0], None


class FakeLinear(torch.nn.Module, DeferrableWeights):
    def __init__(self, key: str, log: list, clock: FakeClock, dw_ms: float, seed: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(H, H, generator=torch.Generator().manual_seed(seed)))
        self.store_key, self.log, self.clock, self.dw_ms = key, log, clock, dw_ms

    def deferred_params(self):
        return [self.weight]

    def forward(self, x):
        return _Linear.apply(x, self.weight, self)


class FakeHandle:
    def __init__(self, result, log, key, clock, ms):
        self.result, self.log, self.key, self.clock, self.ms = result, log, key, clock, ms

    def wait(self):
        self.log.append(("wait", self.key))
        self.clock.now += self.ms / 1000.0
        return self.result


class _FakeA2A(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, chain, kind):
        ctx.chain, ctx.kind = chain, kind
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        chain = ctx.chain
        record = Collective(f"a2a_{ctx.kind}", "fake", layer=chain.layer, backward=True)
        handle = FakeHandle(grad.clone(), chain.log, f"L{chain.layer}.{ctx.kind}", chain.clock, chain.a2a_ms[ctx.kind])
        out = handle.wait() if chain.queue is None else chain.queue.run_under(record, handle)
        return out, None, None


class Chain:
    """x -> experts -> dispatch a2a -> shared_expert -> combine a2a -> router; dW ms 4, 3, 2; a2a ms 3, 2.5."""

    a2a_ms = {"dispatch": 3.0, "combine": 2.5}

    def __init__(self, queue: WgradQueue | None, layer: int = 1, clock: FakeClock | None = None):
        self.log, self.clock, self.queue, self.layer = [], clock or FakeClock(), queue, layer
        keys = [key.replace("L1.", f"L{layer}.") for key in KEYS]
        self.layers = [
            FakeLinear(key, self.log, self.clock, ms, seed) for seed, (key, ms) in enumerate(zip(keys, (4, 3, 2)))
        ]
        if queue is not None:
            queue._stamps = HostStamps(self.clock)  # the profile times come from the fake clock
            for layer in self.layers:
                layer.weight_grad_store = queue.store_for(layer)

    def step(self, x):
        for layer in self.layers:
            layer.weight.grad = None
        x.grad = None
        experts, shared, router = self.layers
        y = router(_FakeA2A.apply(shared(_FakeA2A.apply(experts(x), self, "dispatch")), self, "combine"))
        y.square().sum().backward()
        return [x.grad] + [layer.weight.grad for layer in self.layers]


def _x():
    return torch.randn(3, H, generator=torch.Generator().manual_seed(7), requires_grad=True)


def _reference() -> list[torch.Tensor]:
    return Chain(None).step(_x())


def _assert_same(grads, reference):
    assert len(grads) == len(reference)
    for got, want in zip(grads, reference):
        assert got is not None and torch.equal(got, want)


def test_without_a_queue_every_dw_runs_inside_its_backward():
    chain = Chain(None)
    chain.step(_x())
    assert chain.log == [
        ("dW", "L1.router"), ("wait", "L1.combine"), ("dW", "L1.shared_expert"), ("wait", "L1.dispatch"),
        ("dW", "L1.experts"),
    ]  # fmt: skip
    assert all(layer.weight_grad_store is RUN_NOW for layer in chain.layers)


def test_greedy_without_a_plan_runs_every_dw_at_its_natural_place():
    queue = WgradQueue("greedy", max_mb=None, num_layers=1)
    chain = Chain(queue)
    _assert_same(chain.step(_x()), _reference())
    assert chain.log == [
        ("dW", "L1.router"), ("wait", "L1.combine"), ("dW", "L1.shared_expert"), ("wait", "L1.dispatch"),
        ("dW", "L1.experts"),
    ]  # fmt: skip
    assert queue.counts == {"under_a2a": 0, "natural": 3, "at_backward_end": 0, "over_cap": 0}
    assert queue.peak_held_bytes == 0 and queue.stats()["peak_held_mb"] == 0.0


def test_all_under_next_a2a_runs_each_dw_before_the_next_wait_and_the_rest_at_the_backwards_end():
    queue = WgradQueue("all-under-next-a2a", max_mb=None, num_layers=1)
    chain = Chain(queue)
    grads = chain.step(_x())
    _assert_same(grads, _reference())
    assert chain.log == [
        ("dW", "L1.router"), ("wait", "L1.combine"), ("dW", "L1.shared_expert"), ("wait", "L1.dispatch"),
        ("dW", "L1.experts"),
    ]  # fmt: skip
    # The same order as without the queue here, but each dW ran from the queue (two under an a2a, one at the end):
    assert queue.counts == {"under_a2a": 2, "natural": 0, "at_backward_end": 1, "over_cap": 0}
    assert queue._pending == [] and queue._pending_bytes == 0  # flushed by the engine callback
    assert queue.peak_held_bytes > 0


def test_all_under_next_a2a_holds_a_dw_across_other_backward_work_until_the_a2a():
    """A dW put while another module's backward is still to run waits: it runs right before the next wait."""
    queue = WgradQueue("all-under-next-a2a", max_mb=None, num_layers=1)
    chain = Chain(queue)
    experts, shared, router = chain.layers
    x = _x()
    # Two deferrable modules back to back before the combine: both dW wait for the combine's all-to-all.
    y = router(shared(_FakeA2A.apply(experts(x), chain, "combine")))
    y.square().sum().backward()
    assert chain.log == [("dW", "L1.router"), ("dW", "L1.shared_expert"), ("wait", "L1.combine"), ("dW", "L1.experts")]
    assert queue.counts == {"under_a2a": 2, "natural": 0, "at_backward_end": 1, "over_cap": 0}


def test_greedy_with_a_plan_queues_only_planned_keys_and_runs_them_under_their_own_a2a():
    events = (
        wgrad_schedule.Event("wgrad", "L1.router", 2.0),
        wgrad_schedule.Event("a2a", "L1.combine", 2.5),
        wgrad_schedule.Event("wgrad", "L1.shared_expert", 3.0),
        wgrad_schedule.Event("a2a", "L1.dispatch", 3.0),
        wgrad_schedule.Event("wgrad", "L1.experts", 4.0),
    )
    queue = WgradQueue("greedy", max_mb=None, num_layers=1)
    queue.schedule = wgrad_schedule.WgradSchedule(policy="greedy", under={"L1.router": "L1.dispatch"}, events=events)
    chain = Chain(queue)
    _assert_same(chain.step(_x()), _reference())
    # The router's dW skips the combine (not its a2a) and runs under the dispatch; the others at their place.
    assert chain.log == [
        ("wait", "L1.combine"), ("dW", "L1.shared_expert"), ("dW", "L1.router"), ("wait", "L1.dispatch"),
        ("dW", "L1.experts"),
    ]  # fmt: skip
    assert queue.counts == {"under_a2a": 1, "natural": 2, "at_backward_end": 0, "over_cap": 0}
    stats = queue.stats()
    assert stats["planned"] == 1 and stats["policy"] == "greedy"
    assert stats["plan_a2a_ms"] == 5.5 and stats["plan_wgrad_ms"] == 9.0 and stats["plan_hidden_ms"] == 2.0


def test_the_memory_cap_runs_a_dws_gemms_at_once_when_queueing_it_would_pass_max_mb():
    """Each closure holds x [3, H] and grad_y [3, H] fp32 (96 bytes); a cap of 1.5 closures queues one at a time.
    No DDP here: a closure over the cap delivers its gradients at once (nothing collective waits for them)."""
    one = 2 * 3 * H * 4
    queue = WgradQueue("all-under-next-a2a", max_mb=1.5 * one / MIB, num_layers=1)
    chain = Chain(queue)
    experts, shared, router = chain.layers
    y = router(shared(_FakeA2A.apply(experts(_x()), chain, "combine")))
    y.square().sum().backward()
    # router queued (one closure's bytes); shared_expert would make two: at once; experts after the a2a: queued.
    assert chain.log == [("dW", "L1.shared_expert"), ("dW", "L1.router"), ("wait", "L1.combine"), ("dW", "L1.experts")]
    assert queue.counts == {"under_a2a": 1, "natural": 0, "at_backward_end": 1, "over_cap": 1}
    assert queue.peak_held_bytes == one
    queue.max_mb = 2 * one / MIB  # room for both
    chain.log.clear()
    queue.start_iteration(2)
    y = router(shared(_FakeA2A.apply(experts(_x()), chain, "combine")))
    y.square().sum().backward()
    assert queue.counts == {"under_a2a": 2, "natural": 0, "at_backward_end": 1, "over_cap": 0}
    assert queue.peak_held_bytes == 2 * one


def test_flush_runs_at_the_end_of_autograds_backward():
    """No all-to-all in the graph: every closure waits, and the engine callback runs them before backward returns."""
    queue = WgradQueue("all-under-next-a2a", max_mb=None, num_layers=1)
    chain = Chain(queue)
    experts, shared, router = chain.layers
    x = _x()
    router(shared(experts(x))).square().sum().backward()
    assert chain.log == [("dW", "L1.router"), ("dW", "L1.shared_expert"), ("dW", "L1.experts")]
    assert queue.counts == {"under_a2a": 0, "natural": 0, "at_backward_end": 3, "over_cap": 0} and queue._pending == []
    plain = Chain(None)
    y = _x()
    plain.layers[2](plain.layers[1](plain.layers[0](y))).square().sum().backward()
    _assert_same([x.grad] + [m.weight.grad for m in chain.layers], [y.grad] + [m.weight.grad for m in plain.layers])
    # The callback is queued once per backward pass: a second backward flushes again.
    router(shared(experts(_x()))).square().sum().backward()
    assert queue.counts["at_backward_end"] == 6 and queue._pending == []


class TwoWeights(torch.nn.Module, DeferrableWeights):
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))

    def deferred_params(self):
        return [self.w1, self.w2]


def test_deliver_accumulates_into_grad_and_calls_each_parameters_own_ddp_hook_once():
    module = TwoWeights()
    calls = []
    for param in module.deferred_params():
        param.skip_backward_post_hook = True
    for name in ("w1", "w2"):  # as DDP does: one call per marked parameter, in parameters() order
        module.register_wgrad_accumulation_and_reduce_hooks(lambda name=name: calls.append(name))
    g1, g2 = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0, 5.0])
    deliver(module, (g1, None))
    assert calls == ["w1"] and torch.equal(module.w1.grad, g1) and module.w2.grad is None
    deliver(module, (g1, g2))
    assert calls == ["w1", "w1", "w2"]
    assert torch.equal(module.w1.grad, g1 + g1) and torch.equal(module.w2.grad, g2)
    assert module.wgrad_hook(module.w1) is not module.wgrad_hook(module.w2)
    plain = TwoWeights()  # no DDP: no hooks, the gradients still land in .grad
    deliver(plain, (None, g2))
    assert plain.w1.grad is None and torch.equal(plain.w2.grad, g2) and plain.wgrad_hook(plain.w2) is None


def test_held_bytes_counts_each_storage_once_through_nested_closures():
    a, b = torch.zeros(10), torch.zeros(4, dtype=torch.float64)
    view = a[2:5]  # same storage as a

    def inner():
        return a, [view, (b,)]

    def outer(out=None):
        return inner(), view, b

    assert held_bytes(inner) == 10 * 4 + 4 * 8
    assert held_bytes(outer) == 10 * 4 + 4 * 8
    assert held_bytes(lambda: None) == 0
    c = torch.zeros(5)
    assert held_bytes(lambda: (outer, c)) == 10 * 4 + 4 * 8 + 5 * 4


def test_greedy_profiles_iteration_2_and_plans_iteration_3_from_it():
    queue = WgradQueue("greedy", max_mb=None, num_layers=1)
    chain = Chain(queue)
    reference = _reference()
    natural = [
        ("dW", "L1.router"), ("wait", "L1.combine"), ("dW", "L1.shared_expert"), ("wait", "L1.dispatch"),
        ("dW", "L1.experts"),
    ]  # fmt: skip
    for iteration in (1, PROFILE_ITERATION):
        queue.start_iteration(iteration)
        chain.log.clear()
        _assert_same(chain.step(_x()), reference)
        assert chain.log == natural and queue.counts["natural"] == 3 and queue.schedule is None
        queue.end_iteration()
    schedule = queue.schedule
    assert schedule is not None and schedule.policy == "greedy"
    # The profile, on the fake clock: each dW's and each all-to-all's time, in backward order; agree() with no
    # process group keeps the events as they are.
    assert [(e.kind, e.key) for e in schedule.events] == [
        ("wgrad", "L1.router"), ("a2a", "L1.combine"), ("wgrad", "L1.shared_expert"), ("a2a", "L1.dispatch"),
        ("wgrad", "L1.experts"),
    ]  # fmt: skip
    assert [round(e.ms, 6) for e in schedule.events] == [2.0, 2.5, 3.0, 3.0, 4.0]
    one = 2 * 3 * H * 4 / MIB
    assert [e.held_mb for e in schedule.events if e.kind == "wgrad"] == [one] * 3
    assert wgrad_schedule.agree(list(schedule.events), 1) == list(schedule.events)
    # Algorithm 1: the router (2 ms) under the combine (2.5), the shared expert (3) under the dispatch (3).
    assert schedule.under == {"L1.router": "L1.combine", "L1.shared_expert": "L1.dispatch"}
    queue.start_iteration(PROFILE_ITERATION + 1)
    assert queue.first_planned_iteration()
    chain.log.clear()
    _assert_same(chain.step(_x()), reference)
    assert chain.log == natural
    assert queue.counts == {"under_a2a": 2, "natural": 1, "at_backward_end": 0, "over_cap": 0}
    stats = queue.stats()
    assert stats["planned"] == 2 and stats["plan_hidden_ms"] == pytest.approx(5.0)
    assert stats["plan_a2a_ms"] == pytest.approx(5.5) and stats["plan_wgrad_ms"] == pytest.approx(9.0)
    assert queue.peak_held_bytes == 2 * 3 * H * 4  # one closure at a time: each ran under the next a2a
    queue.end_iteration()
    assert queue.schedule is schedule  # planned once


def test_greedy_plans_each_model_chunks_passes_on_their_own():
    """The interleaved pipeline: each model chunk's backward of a micro-batch is a pass of its own layers (here layer
    2's chunk, then layer 1's, twice each, as 2 micro-batches run). Passes of one chunk are merged; each chunk's dW
    are planned under its own all-to-alls only."""
    queue, clock = WgradQueue("greedy", max_mb=None, num_layers=2), FakeClock()
    chunks = [Chain(queue, layer=2, clock=clock), Chain(queue, layer=1, clock=clock)]  # backward order
    for iteration in (1, PROFILE_ITERATION):
        queue.start_iteration(iteration)
        for _ in range(2):  # micro-batches
            for chain in chunks:
                chain.step(_x())
        queue.end_iteration()
    schedule = queue.schedule
    assert [e.key for e in schedule.events][:5] == [
        "L2.router",
        "L2.combine",
        "L2.shared_expert",
        "L2.dispatch",
        "L2.experts",
    ]
    assert schedule.under == {
        "L2.router": "L2.combine",
        "L2.shared_expert": "L2.dispatch",
        "L1.router": "L1.combine",
        "L1.shared_expert": "L1.dispatch",
    }
    queue.start_iteration(PROFILE_ITERATION + 1)
    reference = _reference()
    for chain in chunks:
        _assert_same(chain.step(_x()), reference)
    assert queue.counts == {"under_a2a": 4, "natural": 2, "at_backward_end": 0, "over_cap": 0}


# ----------------------------------------------------------------------------- megatron-core's DDP, one rank


def _ddp_model(run, queue):
    from megatron_moe.model import transformer_config
    from megatron_moe.training.setup import build_ddp_model

    (model,) = build_ddp_model(run, transformer_config(run), 128, overlap=OverlapRuntime(queue))
    return model


def _cfg(*extra: str):
    from megatron_moe.config import parse_args

    flags = [
        "--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4", "--num-experts", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2",
        "--expert-model-parallel-size", "1", *extra,
    ]  # fmt: skip
    run = parse_args(["--data-path", "d", "--tokenizer-model", "t", *flags])
    run.validate(world_size=1)
    return run


def _forward_backward(model, seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 128, (2, 32), generator=g)
    labels = torch.randint(0, 128, (2, 32), generator=g)
    position_ids = torch.arange(32).unsqueeze(0).expand(2, 32)
    model.zero_grad_buffer()
    loss = model(tokens, position_ids, None, labels=labels)
    loss.float().sum().backward()
    return loss.detach()


def test_megatron_core_ddp_delay_wgrad_compute_gives_bit_identical_main_grads(megatron_world1):
    from megatron_moe.moe.experts import FFNExperts

    run = _cfg()
    plain = _ddp_model(run, None)
    queue = WgradQueue("all-under-next-a2a", max_mb=None, num_layers=1)
    deferred = _ddp_model(run, queue)
    with torch.no_grad():
        for (name, a), (other, b) in zip(plain.module.named_parameters(), deferred.module.named_parameters()):
            assert name == other
            b.copy_(a)
    experts = [m for m in deferred.module.modules() if isinstance(m, FFNExperts)]
    assert len(experts) == 1 and experts[0].store_key == "L1.experts"
    assert experts[0].weight_grad_store is not RUN_NOW
    params = experts[0].deferred_params()
    assert all(p.skip_backward_post_hook for p in params)
    # DDP took the delay_wgrad_compute path: the experts' hooks were handed to the module, not to autograd.
    assert all(callable(experts[0].wgrad_hook(p)) for p in params)
    # Every deferrable module of the layers (attention, router, experts, ...) likewise.
    marked = [p for p in deferred.module.parameters() if getattr(p, "skip_backward_post_hook", False)]
    assert set(map(id, params)) <= set(map(id, marked))
    assert len(deferred.grad_accs) == len(plain.grad_accs) - len(marked)
    plain_experts = next(m for m in plain.module.modules() if isinstance(m, FFNExperts))
    assert plain_experts.weight_grad_store is RUN_NOW and plain_experts.wgrad_hook(plain_experts.weight1) is None

    for micro_batch in range(2):  # the second accumulates onto the first's main_grad
        queue.start_iteration(1)
        assert torch.equal(_forward_backward(plain, micro_batch), _forward_backward(deferred, micro_batch))
        # EP=1: no backward all-to-all; every closure (qkv, proj, router, experts) ran at the backward's end,
        # then DDP's hook.
        assert (
            queue.counts == {"under_a2a": 0, "natural": 0, "at_backward_end": 4, "over_cap": 0} and queue._pending == []
        )
        assert all(p.grad is None for p in marked)  # the hooks moved them into main_grad
        for (name, a), (_, b) in zip(plain.module.named_parameters(), deferred.module.named_parameters()):
            assert torch.equal(a.main_grad, b.main_grad), name
        assert all(p.main_grad.abs().sum() > 0 for p in params)


def test_over_the_cap_megatron_core_ddp_hears_where_planned_and_main_grads_are_bit_identical(megatron_world1):
    """megatron-core's real DDP (--overlap-grad-reduce: its hook marks bucket readiness and asserts a .grad) with a
    cap no closure fits: every dW's GEMMs run at once into main_grad (its `grad_added_to_main_grad` protocol), and
    DDP's hooks run at the backward's end, where the uncapped queue runs them: the same readiness order, the same
    main_grad bits (and autograd's without a queue), and no flag or placeholder gradient left behind."""
    run = _cfg("--overlap-grad-reduce")
    plain = _ddp_model(run, None)
    queues = {cap: WgradQueue("all-under-next-a2a", max_mb=cap, num_layers=1) for cap in (None, 1e-9)}
    models = {cap: _ddp_model(run, queue) for cap, queue in queues.items()}
    names = {}
    for model in (plain, *models.values()):
        with torch.no_grad():
            for (_, a), (name, b) in zip(plain.module.named_parameters(), model.module.named_parameters()):
                b.copy_(a)
                names[b] = name
    orders = {cap: [] for cap in models}
    for cap, model in models.items():
        for group in model.bucket_groups + model.expert_parallel_bucket_groups:
            ready = group.register_grad_ready

            def noted(param, *args, ready=ready, order=orders[cap]):
                order.append(names[param])
                return ready(param, *args)

            group.register_grad_ready = noted
    for micro_batch in range(2):
        losses = []
        for cap, model in ((0, plain), *models.items()):
            if cap != 0:
                queues[cap].start_iteration(1)
            losses.append(_forward_backward(model, micro_batch))
            model.finish_grad_sync()
        assert all(torch.equal(loss, losses[0]) for loss in losses)
        assert queues[1e-9].counts == {"under_a2a": 0, "natural": 0, "at_backward_end": 0, "over_cap": 4}
        assert queues[None].counts == {"under_a2a": 0, "natural": 0, "at_backward_end": 4, "over_cap": 0}
        assert orders[None] and orders[1e-9] == orders[None]
        for model in models.values():
            for (name, a), (_, b) in zip(plain.module.named_parameters(), model.module.named_parameters()):
                assert torch.equal(a.main_grad, b.main_grad), name
                assert b.grad is None and not getattr(b, "grad_added_to_main_grad", False), name


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("boom")


def test_a_backward_that_raised_does_not_stop_the_next_iterations_flush():
    """The engine drops the callbacks of a backward that raised: the next iteration starts with nothing pending
    and its backward queues its own flush (before the fix every later closure stayed pending: no gradient)."""
    queue = WgradQueue("all-under-next-a2a", max_mb=None, num_layers=1)
    chain = Chain(queue)
    experts, shared, router = chain.layers
    queue.start_iteration(1)
    with pytest.raises(RuntimeError, match="boom"):
        router(_Boom.apply(_x())).sum().backward()  # the router's dW is put, then the backward raises
    assert len(queue._pending) == 1
    queue.start_iteration(2)
    assert queue._pending == [] and queue._pending_bytes == 0
    chain.log.clear()
    x = _x()
    shared(x).square().sum().backward()
    assert chain.log == [("dW", "L1.shared_expert")] and queue.counts["at_backward_end"] == 1
    plain = Chain(None)
    y = _x()
    plain.layers[1](y).square().sum().backward()
    _assert_same([x.grad, shared.weight.grad], [y.grad, plain.layers[1].weight.grad])


# ----------------------------------------------------------------------------- the memory cap on ranks of one stage


class _ReadyLog:
    """megatron-core's bucket group as DDP's hook sees it: notes each parameter it is told is ready."""

    def __init__(self, log: list, names: dict):
        self.log, self.names = log, names

    def register_grad_ready(self, param, force_all_reduce=False):
        self.log.append(("ready", self.names[param]))


class OneWeight(torch.nn.Module, DeferrableWeights):
    def __init__(self, key: str):
        super().__init__()
        self.store_key = key
        self.w = torch.nn.Parameter(torch.zeros(2))

    def deferred_params(self):
        return [self.w]


def _with_ddp_hooks(modules: list[OneWeight], log: list) -> None:
    """megatron-core DDP's own backward post-hook (`_make_backward_post_hook`, with --overlap-grad-reduce) for every
    module's weight, on a stand-in DDP whose one bucket group notes readiness; main_grad as DDP sets it up."""
    from types import SimpleNamespace

    from megatron.core.distributed import DistributedDataParallel

    names = {module.w: module.store_key for module in modules}
    stand_in = SimpleNamespace(
        param_to_bucket_group=dict.fromkeys(names, _ReadyLog(log, names)),
        ddp_config=SimpleNamespace(overlap_grad_reduce=True),
        force_all_reduce=False,
    )
    for module in modules:
        module.w.main_grad = torch.zeros_like(module.w)
        module.w.grad_added_to_main_grad = False
        module.w.skip_backward_post_hook = True
        hook = DistributedDataParallel._make_backward_post_hook(stand_in, module.w)
        module.register_wgrad_accumulation_and_reduce_hooks(hook)


# One micro-batch's backward through two MoE layers, the same on every rank of a stage: the all-to-alls started and
# the dW closures put, in order. The greedy schedule holds layer 2's experts past layer 1's (a schedule from agreed
# figures may do that), so where a rank runs layer 2's experts changes the order of their bucket groups.
BACKWARD = (
    ("a2a", "L2.combine"), ("put", "L2.experts"), ("a2a", "L2.dispatch"), ("put", "L2.router"),
    ("a2a", "L1.combine"), ("put", "L1.experts"), ("a2a", "L1.dispatch"), ("put", "L1.router"),
)  # fmt: skip
PLAN = {"L2.experts": "L1.dispatch", "L2.router": "L1.combine"}


def _weight_grad(module: OneWeight, rows: torch.Tensor, value: float, log: list):
    """A dW closure holding `rows` (the saved tensors: their bytes differ per rank under dropless routing)."""

    def weight_grad(out=None):
        log.append(("dW", module.store_key, rows.numel()))
        return (torch.full_like(module.w, value),)

    return weight_grad


def _simulated_rank(policy: str, max_mb: float | None, held: list[dict[str, int]]):
    """One rank's queue through len(held) micro-batches of `BACKWARD`, the closure of key k in micro-batch m
    holding held[m][k] bytes; returns (queue, modules, log of dW runs, all-to-all starts and waits, DDP readiness)."""
    log: list = []
    modules = {key: OneWeight(key) for kind, key in BACKWARD if kind == "put"}
    _with_ddp_hooks(list(modules.values()), log)
    queue = WgradQueue(policy, max_mb=max_mb, num_layers=2)
    if policy == "greedy":
        events = tuple(wgrad_schedule.Event("wgrad" if kind == "put" else "a2a", key, 1.0) for kind, key in BACKWARD)
        queue.schedule = wgrad_schedule.WgradSchedule(policy="greedy", under=PLAN, events=events)
    for micro_batch, sizes in enumerate(held):
        for kind, key in BACKWARD:
            if kind == "a2a":
                log.append(("start", key))
                layer, name = wgrad_schedule.parse_key(key)
                record = Collective(f"a2a_{name}", "fake", layer=layer, backward=True)
                queue.run_under(record, FakeHandle(None, log, key, FakeClock(), 0.0))
            else:
                rows = torch.empty(sizes[key], dtype=torch.uint8)
                value = 1.0 + list(modules).index(key) + 10.0 * micro_batch
                queue.store_for(modules[key]).put(_weight_grad(modules[key], rows, value, log), (None,))
        queue.flush()  # autograd's engine callback
    return queue, modules, log


def _ddp_order(log: list) -> list:
    """What the rank's collectives follow: all-to-alls and DDP's readiness, not where its GEMMs ran."""
    return [entry for entry in log if entry[0] != "dW"]


@pytest.mark.parametrize("policy", ["all-under-next-a2a", "greedy"])
def test_ranks_holding_different_bytes_tell_ddp_of_their_gradients_in_the_same_order(policy):
    """Dropless routing: an experts closure holds the rows its rank received. In micro-batch 1, rank 0 got most of
    layer 2's rows (64 KiB, over the 8 KiB cap), rank 1 few (1 KiB); in micro-batch 2 both few. Before the fix rank
    0 ran that closure at its natural place and told DDP there, rank 1 under its all-to-all: their bucket groups
    became ready, and their reductions started, in different orders (a hang, or the wrong layers summed). Now where
    DDP hears of each gradient is the schedule's on both ranks (and without a cap); the cap moves only rank 0's
    GEMMs."""
    few, many, cap = 1 << 10, 64 << 10, 8 << 10
    small = dict.fromkeys(("L2.experts", "L2.router", "L1.experts", "L1.router"), few)
    rank0 = _simulated_rank(policy, cap / MIB, [{**small, "L2.experts": many}, small])
    rank1 = _simulated_rank(policy, cap / MIB, [small, small])
    uncapped = _simulated_rank(policy, None, [{**small, "L2.experts": many}, small])
    assert _ddp_order(rank0[2]) == _ddp_order(rank1[2]) == _ddp_order(uncapped[2])
    # rank 0 ran layer 2's experts' GEMMs at once in micro-batch 1 (holding nothing), rank 1 where planned
    for (_, _, log), rows, ran_first in ((rank0, many, True), (rank1, few, False)):
        assert (log.index(("dW", "L2.experts", rows)) < log.index(("start", "L2.dispatch"))) is ran_first
    assert rank0[0].counts["over_cap"] == 1 and rank1[0].counts["over_cap"] == 0
    assert rank0[0].peak_held_bytes <= cap < uncapped[0].peak_held_bytes
    for _, modules, _ in (rank0, rank1, uncapped):
        for index, module in enumerate(modules.values()):  # both micro-batches in main_grad, once each
            assert torch.equal(module.w.main_grad, torch.full((2,), (1.0 + index) + (11.0 + index)))
            assert module.w.grad is None and module.w.grad_added_to_main_grad is False


def _profiled_schedule(order: tuple[str, ...]) -> wgrad_schedule.WgradSchedule:
    """greedy's schedule from a profiled pass whose dW in `order` (router 2 ms, shared expert 3 ms; 96 bytes each, under
    a cap of 1.5 of them) come before the combine's all-to-all (2.5 ms), then the experts' dW."""
    clock, log = FakeClock(), []
    ms = {"L1.router": 2.0, "L1.shared_expert": 3.0, "L1.experts": 4.0}
    modules = {key: OneWeight(key) for key in ms}
    queue = WgradQueue("greedy", max_mb=1.5 * 96 / MIB, num_layers=1)
    queue._stamps = HostStamps(clock)

    def put(key: str) -> None:
        rows = torch.empty(96, dtype=torch.uint8)

        def weight_grad(out=None):
            log.append(("dW", key, rows.numel()))
            clock.now += ms[key] / 1000.0
            return (torch.zeros(2),)

        queue.store_for(modules[key]).put(weight_grad, (None,))

    queue.start_iteration(PROFILE_ITERATION)
    for key in order:
        put(key)
    record = Collective("a2a_combine", "fake", layer=1, backward=True)
    queue.run_under(record, FakeHandle(None, log, "L1.combine", clock, 2.5))
    put("L1.experts")
    queue.flush()
    queue.end_iteration()
    return queue.schedule


def test_ranks_that_profiled_a_window_in_different_orders_make_the_same_plan():
    """Best-fit ties (|2.5 - 2| = |2.5 - 3|) and the cap's walk read the order of the dW before the combine; two
    ranks whose autograd ran the router's and the shared expert's backward in other orders plan alike."""
    schedules = [
        _profiled_schedule(order) for order in (("L1.router", "L1.shared_expert"), ("L1.shared_expert", "L1.router"))
    ]
    assert schedules[0].under == schedules[1].under == {"L1.shared_expert": "L1.combine"}
    assert schedules[0].events == schedules[1].events
