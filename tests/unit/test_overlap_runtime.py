"""The overlap runtime (megatron_moe/overlap/runtime.py): one object handed to the model once, its pieces pulled
when a backward all-to-all starts, so the order of the set-up's steps does not matter."""

from types import SimpleNamespace

import pytest
import torch

from megatron_moe.moe.dispatch import build_dispatcher
from megatron_moe.overlap.grad_reduce import GradReduceLauncher
from megatron_moe.overlap.runtime import OverlapRuntime


class _Layer(torch.nn.Module):
    """A module holding a real dispatcher (single process: no group), as an MoE layer does."""

    def __init__(self, number: int):
        super().__init__()
        self.dispatcher = build_dispatcher("alltoallv", None, 4, layer=number)


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer(1), _Layer(2)])


class _Queue:
    """Lancet's queue's `run_under`: logs, then waits."""

    def __init__(self, log: list):
        self.log = log

    def run_under(self, record, handle):
        self.log.append(("queue", record.layer))
        return handle.wait()


class _Group:
    """A planned bucket group as the launcher sees it."""

    def __init__(self, layer: int, log: list):
        self.layer, self.log, self.released, self.is_last_microbatch = layer, log, False, True

    def release(self):
        self.released = True
        self.log.append(("release", self.layer))


class _Handle:
    def __init__(self, log: list):
        self.log = log

    def wait(self):
        self.log.append(("wait",))
        return torch.zeros(1)


def _launcher(log: list) -> GradReduceLauncher:
    launcher = GradReduceLauncher()
    launcher.groups = {1: [_Group(1, log)], 2: [_Group(2, log)]}
    return launcher


def _backward_all_to_alls(model: _Model, log: list) -> list:
    for layer in reversed(model.layers):  # backward order
        overlap = layer.dispatcher.backward_overlap
        overlap.run_under(SimpleNamespace(layer=layer.dispatcher.layer, kind="a2a_combine"), _Handle(log))
    return log


def _set_up(order: str) -> list:
    """The set-up's steps in `order`: "attach-first" (as training/__init__.py runs them) or "plan-first"."""
    log = []
    runtime, model = OverlapRuntime(wgrad_queue=_Queue(log)), _Model()
    if order == "attach-first":
        runtime.attach([model])
        runtime.grad_reduce = _launcher(log)
    else:
        runtime.grad_reduce = _launcher(log)
        runtime.attach([model])
    return _backward_all_to_alls(model, log)


def test_the_dispatchers_overlap_does_not_depend_on_the_order_of_attaching_and_planning():
    expected = [("release", 2), ("queue", 2), ("wait",), ("release", 1), ("queue", 1), ("wait",)]
    assert _set_up("attach-first") == expected
    assert _set_up("plan-first") == expected


@pytest.mark.parametrize("queue", [False, True])
def test_every_dispatcher_holds_the_one_runtime_and_with_nothing_planned_it_only_waits(queue):
    log = []
    runtime, model = OverlapRuntime(wgrad_queue=_Queue(log) if queue else None), _Model()
    runtime.attach([model])
    assert all(layer.dispatcher.backward_overlap is runtime for layer in model.layers)
    _backward_all_to_alls(model, log)
    assert log == ([("queue", 2), ("wait",), ("queue", 1), ("wait",)] if queue else [("wait",), ("wait",)])


def test_the_launcher_releases_a_layers_groups_once_per_iteration():
    log = []
    runtime, model = OverlapRuntime(), _Model()
    runtime.attach([model])
    runtime.grad_reduce = _launcher(log)
    _backward_all_to_alls(model, log)
    _backward_all_to_alls(model, log)  # a second micro-batch's backward: already released
    assert [entry for entry in log if entry[0] == "release"] == [("release", 2), ("release", 1)]
    assert runtime.stats() == {"wgrad": None, "grad_reduce": {"released": 2, "planned": 2}}
