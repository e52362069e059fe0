"""TEMPORARY STUB (replaced by the planner branch)."""

import dataclasses

POLICIES = ("off", "greedy", "all-under-next-a2a")


@dataclasses.dataclass(frozen=True)
class Event:
    kind: str
    key: str
    ms: float
    held_mb: float = 0.0


@dataclasses.dataclass(frozen=True)
class WgradPlan:
    policy: str
    under: dict
    events: tuple = ()

    def report(self):
        return repr(self)


def merge_passes(passes):
    return passes[0]


def agree(events, num_layers, group=None):
    return events


def make_plan(policy, events, max_mb=None):
    under = {}
    for i, e in enumerate(events):
        if e.kind == "wgrad":
            nxt = next((f.key for f in events[i:] if f.kind == "a2a"), None)
            if nxt:
                under[e.key] = nxt
    return WgradPlan(policy, under, tuple(events))
