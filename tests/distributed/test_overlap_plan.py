"""`agree` of megatron_moe/overlap/wgrad_schedule.py on 2 gloo ranks (one torchrun job): every rank schedules from
the same figures.

Each rank holds its own profile (tests/distributed/overlap_plan_worker.py `PROFILES`); the agreed figure of a key
is the max over the ranks that hold it, indexed by global layer, so pipeline stages holding different layers (with
the same module names) do not mix. Expected values are worked by hand below.
"""

import pytest

from tests.distributed.shared_jobs import Part

JOB_PARTS = {"overlap_plan": Part("overlap_plan_worker", "cases", 2, timeout=300)}


@pytest.fixture(scope="module")
def results(shared_jobs):
    return shared_jobs.result("overlap_plan")


def test_ranks_of_one_stage_agree_on_the_max_of_each_key(results):
    # Rank 0 / rank 1 (ms, MiB): shared_expert 1.0 4 / 1.8 5, router 2.0 1 / 2.6 1, combine 2.0 / 1.9,
    # experts 2.0 8 / 1.0 9, dispatch 2.0 / 3.0, attn_proj 1.0 2 / 0.5 2.
    expected = [
        ["wgrad", "L2.shared_expert", 1.8, 5.0],
        ["wgrad", "L2.router", 2.6, 1.0],
        ["a2a", "L2.combine", 2.0, 0.0],
        ["wgrad", "L2.experts", 2.0, 9.0],
        ["a2a", "L2.dispatch", 3.0, 0.0],
        ["wgrad", "L1.attn_proj", 1.0, 2.0],
    ]
    for rank in results["same_layers"]:
        assert rank["agreed"] == expected
        assert rank["collectives"] == [["other", "agree_wgrad_profile"]]


def test_the_agreed_profile_gives_every_rank_the_same_plan(results):
    rank0, rank1 = results["same_layers"]
    # Raw, rank 0: combine 2.0 takes router (|0|); dispatch 2.0 takes experts (|0|).
    assert rank0["raw_plan"]["under"] == {"L2.router": "L2.combine", "L2.experts": "L2.dispatch"}
    # Raw, rank 1: combine 1.9 takes shared 1.8 (|0.1|), then router 2.6; dispatch 3.0 takes experts 1.0.
    # Agreed: combine 2.0 takes shared 1.8 (|0.2| < |0.6|), then router; dispatch 3.0 takes experts 2.0.
    agreed = {"L2.shared_expert": "L2.combine", "L2.router": "L2.combine", "L2.experts": "L2.dispatch"}
    assert rank1["raw_plan"]["under"] == agreed
    assert rank0["agreed_plan"] == rank1["agreed_plan"]
    assert rank0["agreed_plan"]["under"] == agreed


def test_pipeline_stages_keep_their_own_layers(results):
    # Rank 0 holds L1-L2, rank 1 L3-L4 with the same names: indexed by global layer, no figure mixes.
    rank0, rank1 = results["two_stages"]
    assert rank0["agreed"] == rank0["raw"] and [e[1] for e in rank0["agreed"]][0] == "L2.combine"
    assert rank1["agreed"] == rank1["raw"] and rank1["agreed"][1] == ["wgrad", "L4.experts", 4.0, 6.0]
    assert rank0["agreed_plan"]["under"] == {"L2.experts": "L2.dispatch"}
    assert rank1["agreed_plan"]["under"] == {"L4.experts": "L4.dispatch"}


def test_a_group_of_one_rank_keeps_its_own_figures(results):
    for rank in results["solo_group"]:
        assert rank["agreed"] == rank["raw"]
        assert rank["collectives"] == [["other", "agree_wgrad_profile"]]
    assert results["solo_group"][0]["agreed"] != results["solo_group"][1]["agreed"]


def test_ranks_that_profiled_another_structure_are_refused_on_every_rank(results):
    """Rank 1 profiled the router's dW after the combine: the ranks' plans (and the order their reductions start in)
    would differ. The same reduction that agrees the figures finds it, and every rank that holds the key says so."""
    for rank in results["moved"]:
        assert "error" in rank, rank
        assert "not on every rank that holds it" in rank["error"], rank["error"]
        assert rank["collectives"] == [["other", "agree_wgrad_profile"]]
