"""A shared job's part (job_runner.py, 4 gloo ranks) of test_cost_profiler.py: the cost-model profiler.

Layout of an emulated 2 nodes x 2 ranks: ESP groups {0, 1} and {2, 3} (inside a node), EP groups {0, 2} and
{1, 3} (across), data-parallel group the world. Cases:
- esp_traffic: the gloo form of the ESP all-gather / reduce-scatter gives what they give (rank-valued blocks);
- first: `load_or_measure` with no file: measures, rank 0 saves; every rank's fits and collectives;
- second: the same call again: loads the file, measures nothing;
- changed: other settings (the description differs): measures again;
- parallel_state: `ProfileGroups.from_parallel_state` after megatron-core's initialize_model_parallel (EP=2, ESP=2)
  gives the groups tools/profile_cluster.py builds by hand.
Rank 0 writes `{case: [every rank's result]}` to $RESULTS. argv[1]: a directory for the profile file.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

from megatron_moe import comm  # noqa: E402
from megatron_moe.comm.profiling import esp_traffic  # noqa: E402
from megatron_moe.overlap.profiler import ExpertWork, ProfileGroups, ProfileSettings, load_or_measure  # noqa: E402
from tests.conftest import load_tool  # noqa: E402

SETTINGS = ProfileSettings(
    comm_bytes=(16 << 10, 32 << 10, 64 << 10),
    experts=ExpertWork(
        num_local_experts=2, hidden_size=64, ffn_hidden_size=64, sources=4, rows=(256,), degrees=(1, 2, 4)
    ),
    repeats=3,
)


class Recorder:
    """A `comm.Monitor` that keeps (kind, purpose, group ranks) of every collective issued."""

    def __init__(self):
        self.seen = []

    def issued(self, collective):
        ranks = None if collective.group is None else dist.get_process_group_ranks(collective.group)
        self.seen.append([collective.kind, collective.purpose, ranks])

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


def esp_case(esp) -> dict:
    rank = dist.get_rank()
    blocks = torch.arange(4, dtype=torch.float32).repeat(2, 1) + 10 * rank  # [P=2 blocks, 4]: this rank's values
    gathered = esp_traffic("ag", blocks.clone().view(-1), torch.empty(8), esp)
    summed = esp_traffic("rs", blocks.clone().view(-1), torch.empty(8), esp)
    return {"gathered": gathered.tolist(), "summed": summed.tolist()}


def profile_case(path: str, groups: ProfileGroups, settings: ProfileSettings) -> dict:
    with comm.monitoring(Recorder()) as recorder:
        fits, measured = load_or_measure(path, groups, settings, link="loopback")
    return {"fits": fits.to_json(), "measured": measured, "collectives": recorder.seen, "saved": os.path.exists(path)}


def parallel_state_case() -> dict:
    from megatron.core import parallel_state

    tool = load_tool("profile_cluster")
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2, expert_tensor_parallel_size=2)
    try:
        groups = ProfileGroups.from_parallel_state()
        ep, esp = tool._groups(dist.get_world_size(), dist.get_rank(), 2, 2)
        ranks = dist.get_process_group_ranks
        return {
            "sizes": groups.sizes(),
            "megatron": [ranks(groups.ep), ranks(groups.esp), ranks(groups.dp)],
            "tool": [ranks(ep), ranks(esp)],
        }
    finally:
        parallel_state.destroy_model_parallel()


def cases() -> dict:
    rank = dist.get_rank()
    esp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank joins every new_group
    ep_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    groups = ProfileGroups(ep=ep_groups[rank % 2], esp=esp_groups[rank // 2], dp=dist.group.WORLD)
    path = os.path.join(sys.argv[1], "fits.json")
    mine = {
        "esp_traffic": esp_case(groups.esp),
        "first": profile_case(path, groups, SETTINGS),
        "second": profile_case(path, groups, SETTINGS),
        "changed": profile_case(path, groups, ProfileSettings(**{**SETTINGS.__dict__, "repeats": 2})),
        "parallel_state": parallel_state_case(),
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {case: [ranks[case] for ranks in everyone] for case in mine}
