"""Lancet's deferred weight-gradient GEMMs change no number.

Every layout of `train_worker.LANCET` (EP=2; TP=2+SP+EP=2 and PP=2+EP=2 with 2
micro-batches; EP=2 with 4; EP=4 with the distributed optimizer; every module
recomputed; full recompute (nested backward passes); the arctic policy's quantized activations; bf16; fp16 with loss
scaling; a shared expert; an untied LM head, deferred too; megatron-core DDP's --overlap-grad-reduce, whose
buckets count a deferred gradient when it runs; expert-sharded parallelism ESP=2 x EP=2) trains 4 steps
from the same seed with --overlap-wgrad off and all-under-next-a2a
(greedy too in two: its plan runs from iteration 3): lm loss, grad norm and
params norm are bit-identical, step by step (the same GEMMs on the same
operands, accumulated into main_grad in the same order per parameter). The
queue's own figures show the deferral happened: closures ran under the
all-to-alls (not at their natural place), and under a tiny memory cap some
ran at their natural place instead. Under the interleaved pipeline (PP=2 x VPP=2 + EP=2) each model chunk's
backward is a pass of its own, planned on its own by greedy.

(`lancet_cap_worker.py`, a second job): the memory cap under dropless routing made uneven on purpose, one
rank of each expert-data-parallel pair receiving most rows and its peer few, with a cap between the two, the
adaptive partition and megatron-core's overlapped reduction on: every rank starts its reductions in the same order,
and the numbers are bit-identical to the uncapped run and to Lancet off.
"""

import pytest

from tests.distributed.launcher import computed
from tests.distributed.shared_jobs import Part, train_part

JOB_PARTS = {
    "lancet": train_part("lancet", timeout=1500),
    "lancet_cap": Part("lancet_cap_worker", "cap", 4, ("cap", "{data}", "{tokenizer}", "{workdir}"), timeout=1200),
}
LAYOUTS = [
    "ep2",
    "tp2_ep2",
    "pp2_ep2",
    "ep4_distopt",
    "tp2_ep2_recompute",
    "ep2_arctic",
    "ep2_bf16",
    "ep2_fp16",
    "ep2_shared",
    "ep2_accumulate",
    "ep2_full_recompute",
    "ep2_untied",
    "pp2_ep2_overlap_grad_reduce",
    "esp2_ep2",
    "pp2_vpp2_ep2",
]


@pytest.fixture(scope="module")
def runs(shared_jobs):
    return shared_jobs.result("lancet")


def numbers(history: list[dict]) -> list[tuple]:
    return [(step["lm loss"], step["grad norm"], step["params norm"]) for step in history]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_deferred_weight_gradients_are_bit_identical(runs, layout):
    off, on = runs[f"{layout}/off"], runs[f"{layout}/all-under-next-a2a"]
    assert len(off) == len(on) == 4
    assert numbers(on) == numbers(off)
    assert all(step["wgrad"] is None for step in off)
    for step in on:  # every closure of the logging rank waited for an all-to-all, none ran where it was made
        assert step["wgrad"]["under_a2a"] > 0 and step["wgrad"]["natural"] == 0, step["wgrad"]
        assert step["wgrad"]["peak_held_mb"] > 0


@pytest.mark.parametrize("layout", ["ep2", "tp2_ep2", "pp2_vpp2_ep2"])
def test_the_greedy_plan_profiles_then_defers_and_changes_no_number(runs, layout):
    off, greedy = runs[f"{layout}/off"], runs[f"{layout}/greedy"]
    assert numbers(greedy) == numbers(off)
    first, profiled, *planned = [step["wgrad"] for step in greedy]
    for step in (first, profiled):  # no plan yet: every closure runs at its natural place
        assert step["under_a2a"] == 0 and step["natural"] > 0, step
    assert profiled["planned"] > 0
    for step in planned:
        assert step["under_a2a"] > 0, step


def test_an_untied_lm_head_runs_its_weight_gradient_under_the_first_all_to_all(runs):
    tied, untied = runs["ep2/all-under-next-a2a"], runs["ep2_untied/all-under-next-a2a"]
    for a, b in zip(tied, untied):  # one micro-batch per step: the head's one closure more, under L4's combine
        assert b["wgrad"]["under_a2a"] == a["wgrad"]["under_a2a"] + 1, (a["wgrad"], b["wgrad"])


def test_a_memory_cap_runs_some_closures_gemms_at_once(runs):
    off, capped = runs["ep2/off"], runs["ep2/capped"]
    assert numbers(capped) == numbers(off)
    for step in capped:
        assert step["wgrad"]["over_cap"] > 0 and step["wgrad"]["peak_held_mb"] <= 0.2, step["wgrad"]


@pytest.fixture(scope="module")
def capped_runs(shared_jobs):
    return shared_jobs.result("lancet_cap")


def test_the_cap_is_passed_by_one_rank_of_each_expert_data_parallel_pair(capped_runs):
    """The scenario holds: what the pinned closure held in the planned iterations, uncapped, is above the cap on one
    rank of each pair of ranks that reduce the same experts' gradients and below it on the other."""
    ranks, cap = capped_runs["greedy_uncapped"]["ranks"], capped_runs["cap_mb"] * 2**20
    for ep in (0, 1):
        low, high = sorted((rank["held"][2:] for rank in ranks if rank["ep"] == ep), key=sum)
        assert max(low) < cap < min(high), (ep, low, high, cap)


@pytest.mark.parametrize("run", ["greedy_capped", "next_capped", "overlapped_greedy_capped"])
def test_ranks_the_cap_binds_differently_start_their_reductions_in_the_same_order(capped_runs, run):
    """greedy's pinned plan and all-under-next-a2a, the adaptive partition and megatron-core's --overlap-grad-reduce:
    every rank's bucket groups start in the same order (before the fix, the busy rank started its last MoE layer's
    experts group before the first's, its peer after: same shapes, so gloo summed the wrong layers silently), and
    the numbers are bit-identical to the uncapped run and to Lancet off, step by step."""
    off, history, ranks = capped_runs["off"]["history"], capped_runs[run]["history"], capped_runs[run]["ranks"]
    assert len(history) == 4
    assert numbers(history) == numbers(off) and computed(history) == computed(off)
    assert computed(capped_runs["greedy_uncapped"]["history"]) == computed(off)
    assert ranks[0]["starts"], "no reduction started"
    for rank in ranks[1:]:
        assert rank["starts"] == ranks[0]["starts"]
    # the cap bound: the busy ranks ran closures' GEMMs at once, holding less than the cap
    assert sum(counts.get("over_cap", 0) for rank in ranks for counts in rank["counts"]) > 0
    for step in history:
        assert step["wgrad"]["peak_held_mb"] <= capped_runs["cap_mb"], step["wgrad"]
