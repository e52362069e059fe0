"""A shared job's part (job_runner.py, 4 gloo ranks) of tests/distributed/test_lancet.py's memory-cap cases.

    argv: cap DATA_PREFIX TOKENIZER WORKDIR; entry: `cap`

TP=2+SP+EP=2 (DP=2 for the dense and the expert parameters: a sum of two is exact in any order, so every run below
is bit-identical to --overlap-wgrad off when the reductions pair up right). Dropless routing made uneven on
purpose: each rank's router adds `BIAS` to the logits of the experts of one EP rank, EP rank 0's in the first EP
group and EP rank 1's in the second, so that each expert-data-parallel pair (the ranks that reduce the same experts'
gradients) holds one rank that receives most rows and one that receives few.

Greedy's schedule is pinned (`pinned_schedule`): the last MoE layer's experts dW under the first MoE layer's dispatch
all-to-all, past the first MoE layer's own experts dW (a schedule from agreed figures may do that; Algorithm 1's
choice depends on timings). A first run without a cap measures what each rank's pinned closure holds; the capped
runs then take a cap between the busy and the idle ranks' figures. Before the fix the busy rank ran its closure at
its natural place and readied its bucket group there, its peer under the all-to-all: the two issued the reductions
of the two layers' experts (same shapes) in opposite orders.

Per run, besides the logging rank's history: per rank, the order its bucket groups started their reduction in
(each group named by its parameters), the queue's figures per iteration and the bytes the pinned key's closures
held per iteration.
"""

import contextlib
import dataclasses
import os
from unittest import mock

import torch
import torch.distributed as dist

from tests.distributed.train_worker import LAYOUTS, TRUSTED_PROFILE, WORKDIR, slow_link_profile, train

BIAS = 0.3
"""Added to the router logits of the favoured EP rank's experts (the logits' spread at init is about 0.16)."""
ITERS = 4
STEPS = ["--train-iters", str(ITERS)]
NAMES: dict = {}
"""Parameter -> its name in the model, for naming bucket groups (set when the model is built)."""
RECORD: dict = {"starts": [], "counts": [], "held": [], "ep": None, "edp": None}
"""This rank's figures of the current run, and its EP and expert-data-parallel ranks."""


def install(stack: contextlib.ExitStack) -> None:
    """The biased router, the pinned schedule and the recorders, until `stack` closes."""
    from megatron.core import parallel_state
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    import megatron_moe.training as training
    from megatron_moe.moe import routing
    from megatron_moe.overlap.wgrad_queue import WgradQueue
    from megatron_moe.overlap.wgrad_schedule import parse_key

    def biased_logits(self, x_TH):
        logits_TE = logits(self, x_TH)
        ep_size = parallel_state.get_expert_model_parallel_world_size()
        favoured = parallel_state.get_expert_data_parallel_rank() % ep_size
        local = logits_TE.shape[-1] // ep_size
        bias_E = torch.zeros(logits_TE.shape[-1], dtype=logits_TE.dtype, device=logits_TE.device)
        bias_E[favoured * local : (favoured + 1) * local] = BIAS
        return logits_TE + bias_E

    logits = routing.DeferrableRouter.router_logits
    stack.enter_context(mock.patch.object(routing.DeferrableRouter, "router_logits", biased_logits))

    def named_model(*args, **kwargs):
        model = build(*args, **kwargs)
        NAMES.clear()
        NAMES.update({param: name for chunk in model for name, param in chunk.module.named_parameters()})
        RECORD["ep"] = parallel_state.get_expert_model_parallel_rank()
        RECORD["edp"] = parallel_state.get_expert_data_parallel_rank()
        return model

    build = training.build_ddp_model
    stack.enter_context(mock.patch.object(training, "build_ddp_model", named_model))

    def noted_start(self, *args, **kwargs):
        RECORD["starts"].append(sorted(NAMES[p] for bucket in self.buckets for p in bucket.params_list))
        return start(self, *args, **kwargs)

    start = _ParamAndGradBucketGroup.start_grad_sync
    stack.enter_context(mock.patch.object(_ParamAndGradBucketGroup, "start_grad_sync", noted_start))

    def pinned_schedule(self):
        schedule = make_schedule(self)
        layers = sorted(parse_key(e.key)[0] for e in schedule.events if parse_key(e.key)[1] == "experts")
        return dataclasses.replace(schedule, under={f"L{layers[-1]}.experts": f"L{layers[0]}.dispatch"})

    make_schedule = WgradQueue._schedule_from_profile
    stack.enter_context(mock.patch.object(WgradQueue, "_schedule_from_profile", pinned_schedule))

    def noted_put(self, item):
        if self.schedule is not None and item.module.store_key in self.schedule.under:
            RECORD["held"][-1] = max(RECORD["held"][-1], item.nbytes)
        return put(self, item)

    put = WgradQueue.put
    stack.enter_context(mock.patch.object(WgradQueue, "put", noted_put))

    def noted_iteration(self, iteration):
        RECORD["held"].append(0)
        return start_iteration(self, iteration)

    start_iteration = WgradQueue.start_iteration
    stack.enter_context(mock.patch.object(WgradQueue, "start_iteration", noted_iteration))

    def noted_end(self):
        RECORD["counts"].append(dict(self.counts))
        return end_iteration(self)

    end_iteration = WgradQueue.end_iteration
    stack.enter_context(mock.patch.object(WgradQueue, "end_iteration", noted_end))


def run(*flags: str) -> dict:
    """One run; the logging rank's history and every rank's `RECORD`."""
    RECORD.update(starts=[], counts=[], held=[], ep=None, edp=None)
    history = train(*STEPS, *flags)
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, RECORD)
    return {"history": history, "ranks": ranks}


def cases() -> dict:
    layout = LAYOUTS["tp2_ep2"]
    path = os.path.join(WORKDIR, "lancet_cap_profile.json")
    profile = ["--moe-cost-profile", path, *TRUSTED_PROFILE]
    adaptive = [*layout, *profile, "--grad-reduce-schedule", "adaptive"]
    train("--train-iters", "0", *adaptive)
    slow_link_profile(path)
    greedy, next_a2a = ["--overlap-wgrad", "greedy"], ["--overlap-wgrad", "all-under-next-a2a"]
    results = {
        "off": run(*adaptive, "--overlap-wgrad", "off"),
        "greedy_uncapped": run(*adaptive, *greedy, "--overlap-wgrad-max-mb", "0"),
    }
    # The cap: between what the busy and the idle ranks' pinned closures held in the planned iterations.
    held = sorted((rank["held"][2:] for rank in results["greedy_uncapped"]["ranks"]), key=sum)
    idle, busy = held[: len(held) // 2], held[len(held) // 2 :]
    cap_mb = (min(map(min, busy)) + max(map(max, idle))) / 2 / 2**20
    results["cap_mb"] = cap_mb
    capped = ["--overlap-wgrad-max-mb", repr(cap_mb)]
    results["greedy_capped"] = run(*adaptive, *greedy, *capped)
    results["next_capped"] = run(*adaptive, *next_a2a, *capped)
    # megatron-core's own buckets, started when ready (--overlap-grad-reduce)
    overlapped = [*layout, "--overlap-grad-reduce"]
    results["overlapped_greedy_capped"] = run(*overlapped, *greedy, *capped)
    return results


def cap() -> dict:
    """The part's entry: `cases` with the router, the schedule and the recorders patched."""
    with contextlib.ExitStack() as stack:
        install(stack)
        return cases()
