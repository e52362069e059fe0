"""Lancet on one GPU: its stream mechanics with an emulated transfer. Skipped without CUDA.

One GPU cannot run an EP group, so the "all-to-all" is a stand-in with the same shape in time
(`gpu_emulation.py`): the backward gradient's bytes go device -> pinned host -> device on a side stream, and
`wait()` makes the compute stream wait for the copy's event (no host sync). The experts'
weight-gradient closure is queued by `WgradQueue` (all-under-next-a2a) and runs between start and wait: CUDA events
show its GEMMs running while the copy is in flight, and every gradient equals the run without deferral.
"""

import json

import pytest
import torch

from megatron_moe.comm.core import Collective
from megatron_moe.moe.experts import FFNExperts
from megatron_moe.overlap.wgrad_queue import WgradQueue
from tests.unit.gpu_emulation import emulated_transfer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROWS, HIDDEN, FFN, EXPERTS = 8192, 1024, 4096, 4
COPIES = 8  # device->host->device round trips of the gradient: a transfer of ~2 x 8 x 32 MiB


class EmulatedAllToAll(torch.autograd.Function):
    """Identity forward; backward: the emulated transfer with the queue's work between start and wait."""

    @staticmethod
    def forward(ctx, x, queue, timeline):
        ctx.queue, ctx.timeline = queue, timeline
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        handle, start, end = emulated_transfer(grad, COPIES)
        ctx.timeline["transfer"] = (start, end)
        record = Collective("a2a_dispatch", "emulated_transfer", None, 1, backward=True)
        received = handle.wait() if ctx.queue is None else ctx.queue.run_under(record, handle)
        return received, None, None


def run(deferred: bool):
    torch.manual_seed(0)
    experts = FFNExperts(
        num_local_experts=EXPERTS,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        gated=False,
        init_method=lambda w: torch.nn.init.normal_(w, std=0.02),
        output_init_method=lambda w: torch.nn.init.normal_(w, std=0.02),
    ).cuda()
    x = torch.randn(ROWS, HIDDEN, device="cuda", requires_grad=True)
    counts = [ROWS // EXPERTS] * EXPERTS
    timeline: dict = {}
    queue = None
    if deferred:
        queue = WgradQueue("all-under-next-a2a", max_mb=None, num_layers=1)
        experts.store_key, experts.weight_grad_store = "L1.experts", queue.store_for(experts)
        run_item = queue._run

        def timed(item, profile_key=None):  # CUDA events around the closure on the compute stream
            begin, finish = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            run_item(item, profile_key)
            finish.record()
            timeline["wgrad"] = (begin, finish)

        queue._run = timed
    for _ in range(2):  # the first warms up kernels and the allocator
        for p in (x, experts.weight1, experts.weight2):
            p.grad = None
        y = experts(EmulatedAllToAll.apply(x, queue, timeline), counts)
        torch.cuda.synchronize()
        step_start, step_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        step_start.record()
        y.square().sum().backward()
        step_end.record()
        torch.cuda.synchronize()
    timeline["backward"] = (step_start, step_end)
    grads = [t.grad.clone() for t in (x, experts.weight1, experts.weight2)]
    return grads, timeline, None if queue is None else queue.stats()


def test_deferred_weight_gradients_run_during_the_emulated_transfer_and_change_nothing():
    plain_grads, plain, _ = run(deferred=False)
    grads, timeline, stats = run(deferred=True)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
    # The queue counts over its life: one closure under the transfer in each of the two backwards (warm-up, timed).
    assert stats["under_a2a"] == 2 and stats["natural"] == 0, stats
    (t_start, t_end), (w_start, w_end) = timeline["transfer"], timeline["wgrad"]
    transfer_ms, wgrad_ms = t_start.elapsed_time(t_end), w_start.elapsed_time(w_end)
    began, ended = t_start.elapsed_time(w_start), t_start.elapsed_time(w_end)
    figures = {
        "transfer_ms": transfer_ms,
        "wgrad_ms": wgrad_ms,
        "wgrad_began_ms_after_transfer_start": began,
        "wgrad_ended_ms_after_transfer_start": ended,
        "backward_ms_deferred": timeline["backward"][0].elapsed_time(timeline["backward"][1]),
        "backward_ms_plain": plain["backward"][0].elapsed_time(plain["backward"][1]),
    }
    print(json.dumps(figures))
    # The dW GEMMs started while the bytes were in flight (not after the wait), and ran on during the copy.
    assert began < transfer_ms and ended > 0, figures
    assert figures["backward_ms_deferred"] < figures["backward_ms_plain"], figures
