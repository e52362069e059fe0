"""A shared job's part (job_runner.py, 2 gloo ranks) of test_overlap_plan.py: `agree` of the dW-overlap profile.

Cases, each rank with its own profile (`PROFILES`):
- same_layers: both ranks hold layers 1-2 (data/expert-parallel peers of one stage) with different times;
- two_stages: rank 0 holds layers 1-2, rank 1 layers 3-4 (two pipeline stages), the same names in both;
- solo_group: same_layers' profiles agreed over a group of one rank;
- moved: both ranks hold layer 1, but rank 1 profiled the router's dW after the combine's all-to-all (a pass of
  another structure): `agree` refuses it on both ranks (their plans would differ).
Each rank's results (raw and agreed events, the greedy plans from both, the collectives `agree` issued) are
gathered to rank 0, which writes `{case: [rank 0's, rank 1's]}` to $RESULTS.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch.distributed as dist

warnings.filterwarnings("ignore")

from megatron_moe import comm  # noqa: E402
from megatron_moe.overlap.wgrad_schedule import Event, agree, make_wgrad_schedule  # noqa: E402

# case -> (num_layers, {rank: [(kind, key, ms, held_mb)]})
PROFILES = {
    "same_layers": (
        2,
        {
            0: [
                ("wgrad", "L2.shared_expert", 1.0, 4.0),
                ("wgrad", "L2.router", 2.0, 1.0),
                ("a2a", "L2.combine", 2.0, 0.0),
                ("wgrad", "L2.experts", 2.0, 8.0),
                ("a2a", "L2.dispatch", 2.0, 0.0),
                ("wgrad", "L1.attn_proj", 1.0, 2.0),
            ],
            1: [
                ("wgrad", "L2.shared_expert", 1.8, 5.0),
                ("wgrad", "L2.router", 2.6, 1.0),
                ("a2a", "L2.combine", 1.9, 0.0),
                ("wgrad", "L2.experts", 1.0, 9.0),
                ("a2a", "L2.dispatch", 3.0, 0.0),
                ("wgrad", "L1.attn_proj", 0.5, 2.0),
            ],
        },
    ),
    "two_stages": (
        4,
        {
            0: [
                ("a2a", "L2.combine", 1.0, 0.0),
                ("wgrad", "L2.experts", 0.5, 3.0),
                ("a2a", "L2.dispatch", 1.0, 0.0),
                ("wgrad", "L1.mlp_fc2", 2.0, 1.0),
            ],
            1: [
                ("a2a", "L4.combine", 3.0, 0.0),
                ("wgrad", "L4.experts", 4.0, 6.0),
                ("a2a", "L4.dispatch", 0.5, 0.0),
                ("wgrad", "L3.mlp_fc2", 1.0, 2.0),
            ],
        },
    ),
    "moved": (
        1,
        {
            0: [("wgrad", "L1.router", 1.0, 1.0), ("a2a", "L1.combine", 2.0, 0.0), ("wgrad", "L1.experts", 2.0, 4.0)],
            1: [("a2a", "L1.combine", 2.0, 0.0), ("wgrad", "L1.router", 1.0, 1.0), ("wgrad", "L1.experts", 2.0, 4.0)],
        },
    ),
}


class Recorder:
    """A `comm.Monitor` that keeps the (kind, purpose) of every collective issued."""

    def __init__(self):
        self.seen = []

    def issued(self, collective):
        self.seen.append([collective.kind, collective.purpose])

    def handle(self, token, work):
        pass

    def blocked(self, token):
        pass

    def unblocked(self, token, *, completed):
        pass

    def read_started(self, read):
        pass

    def read_ended(self, token):
        pass


def run_case(case: str, rank: int, group=None) -> dict:
    num_layers, profiles = PROFILES[case]
    events = [Event(*e) for e in profiles[rank]]
    with comm.monitoring(Recorder()) as recorder:
        try:
            agreed = agree(events, num_layers, group)
        except ValueError as error:
            return {"error": str(error), "collectives": recorder.seen}
    return {
        "raw": [dataclasses.astuple(e) for e in events],
        "agreed": [dataclasses.astuple(e) for e in agreed],
        "raw_plan": make_wgrad_schedule("greedy", events).to_json(),
        "agreed_plan": make_wgrad_schedule("greedy", agreed).to_json(),
        "collectives": recorder.seen,
    }


def cases() -> dict:
    rank = dist.get_rank()
    solo = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]  # every rank joins every new_group
    mine = {
        "same_layers": run_case("same_layers", rank),
        "two_stages": run_case("two_stages", rank),
        "solo_group": run_case("same_layers", rank, solo),
        "moved": run_case("moved", rank),
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {case: [ranks[case] for ranks in everyone] for case in mine}
