"""FasterMoE's shadow experts, the parts without a process group: the split of the send buffer and its inverse,
the agreed order of experts by load, the latency model on fitted lines and the greedy policy, and the flag's
refusals (moe/shadow.py; the collectives and the gradients: tests/distributed/test_shadow.py)."""

import pytest
import torch

from megatron_moe.config import ConfigError, parse_args
from megatron_moe.moe.shadow import (
    ShadowCosts,
    ShadowGrads,
    ShadowPolicy,
    ShadowSplit,
    a2a_rows,
    by_load,
    greedy_shadows,
    predicted_ms,
    rank_rows,
)
from megatron_moe.overlap.cost_model import ClusterFits

# 2 EP ranks x 2 local experts; expert 1 (rank 0's) is hot: both ranks send it most of their rows.
COUNTS_GE = [[10, 80, 5, 5], [10, 90, 0, 0]]


def test_split_and_merge_are_inverse_and_keep_expert_order():
    split = ShadowSplit(experts=(1, 3), counts=[2, 3, 1, 2], local=2)
    rows = torch.arange(8.0).view(8, 1)
    sent, shadow = split.split(rows)
    assert split.sent_counts == [2, 0, 1, 0] and split.shadow_counts == [3, 2]
    assert sent.view(-1).tolist() == [0, 1, 5] and shadow.view(-1).tolist() == [2, 3, 4, 6, 7]
    assert torch.equal(split.merge(sent, shadow), rows)


def test_split_with_every_expert_shadowed_sends_nothing():
    split = ShadowSplit(experts=(0, 1), counts=[2, 1], local=1)
    rows = torch.arange(3.0).view(3, 1)
    sent, shadow = split.split(rows)
    assert sent.shape == (0, 1) and torch.equal(split.merge(sent, shadow), rows)


def test_experts_by_load_break_ties_by_index():
    assert by_load([[1, 5, 5, 0], [1, 0, 0, 2]]) == [1, 2, 0, 3]


def test_rows_computed_and_moved_per_rank():
    assert rank_rows(COUNTS_GE, set(), 2) == [190, 10]
    # expert 1 shadowed: rank 0 keeps its 80 rows of it and rank 1 its 90; rank 0 computes expert 0 for both
    assert rank_rows(COUNTS_GE, {1}, 2) == [20 + 80, 10 + 90]
    # sent (own block included) vs received from every rank: rank 0 receives experts 0 and 1 from both
    assert a2a_rows(COUNTS_GE, set(), 2) == [max(100, 190), max(100, 10)]
    assert a2a_rows(COUNTS_GE, {1}, 2) == [max(20, 20), max(10, 10)]


def fits(a2a_beta: float) -> ClusterFits:
    kinds = ("a2a", "ag", "rs", "ar", "gemm")
    return ClusterFits.from_coefficients(
        alpha=dict.fromkeys(kinds, 0.1), beta={**dict.fromkeys(kinds, 1e-6), "a2a": a2a_beta, "gemm": 1e-6}
    )


COSTS = dict(macs_per_row=1_000_000, row_bytes=1024, weight_bytes=64 * 1024)


def test_predicted_time_is_the_papers_sum_on_the_fitted_lines():
    costs = ShadowCosts(fits=fits(1e-5), **COSTS)
    compute = 3 * (0.1 + 190 * 1_000_000 * 1e-6)  # the busiest rank's forward, input and weight gradients
    moved = 4 * (0.1 + 190 * 1024 * 1e-5)
    assert predicted_ms(COUNTS_GE, set(), 2, costs) == pytest.approx(compute + moved)
    shadow = 2 * (0.1 + 64 * 1024 * 2 * 1e-5)  # broadcast and reduce of one expert's weights (W G / (G - 1))
    compute = 3 * (0.1 + 100 * 1_000_000 * 1e-6)
    moved = 4 * (0.1 + 20 * 1024 * 1e-5)
    assert predicted_ms(COUNTS_GE, {1}, 2, costs) == pytest.approx(compute + moved + shadow)


def test_the_greedy_policy_shadows_the_hot_expert_when_its_weights_are_cheaper_than_its_rows():
    assert greedy_shadows(COUNTS_GE, 2, ShadowCosts(fits=fits(1e-5), **COSTS)) == (1,)
    heavy = ShadowCosts(fits=fits(1e-5), **{**COSTS, "weight_bytes": 64 << 20})  # weights far dearer than rows
    assert greedy_shadows(COUNTS_GE, 2, heavy) == ()
    balanced = [[25, 25, 25, 25], [25, 25, 25, 25]]  # no rank waits for another: nothing to gain
    assert greedy_shadows(balanced, 2, ShadowCosts(fits=fits(1e-5), **COSTS)) == ()


def test_the_policy_modes():
    costs = ShadowCosts(fits=fits(1e-5), **COSTS)
    assert ShadowPolicy("off", 2, costs).choose(COUNTS_GE) == ()
    assert ShadowPolicy("auto", 2).choose(COUNTS_GE) == ()  # no costs given yet: nothing
    assert ShadowPolicy("auto", 2, costs).choose(COUNTS_GE) == (1,)
    assert ShadowPolicy(2, 2).choose(COUNTS_GE) == (0, 1)  # the 2 most loaded, ascending


def test_a_deferred_owner_closure_adds_the_shadows_gradients_once_and_never_before_they_arrive():
    slot = ShadowGrads()
    with pytest.raises(RuntimeError, match="before the shadows' gradients were reduced"):
        slot.added((torch.ones(1), torch.ones(1)))
    slot.put((torch.full((1,), 2.0), torch.full((1,), 3.0)))
    assert [g.item() for g in slot.added((torch.ones(1), torch.ones(1)))] == [3.0, 4.0]
    assert [g.item() for g in slot.added((torch.ones(1), torch.ones(1)))] == [1.0, 1.0]  # added once


BASE = ["--data-path", "d", "--tokenizer-model", "t.model", "--num-experts", "8"]


def error(*flags, world_size=2):
    with pytest.raises(ConfigError) as caught:
        parse_args([*BASE, *flags]).validate(world_size=world_size)
    return str(caught.value)


@pytest.mark.parametrize(
    "flags, message",
    [
        ("--moe-shadow-experts 2", "--moe-shadow-experts=2: off or auto: shadowing needs --expert-model-parallel-size "
         "> 1 (one EP rank has every expert)"),
        ("--moe-shadow-experts 9 --expert-model-parallel-size 2", "--moe-shadow-experts=9: at most --num-experts=8"),
        ("--moe-shadow-experts 1 --expert-model-parallel-size 2 --moe-expert-capacity-factor 1.0",
         "--moe-shadow-experts=1: off: shadowing is dropless only"),
        ("--moe-shadow-experts some --expert-model-parallel-size 2", "--moe-shadow-experts=some: off, auto or N >= 1"),
    ],
)  # fmt: skip
def test_the_flag_is_refused_before_start_up_naming_it(flags, message):
    assert message in error(*flags.split())


def test_auto_and_off_are_accepted_anywhere():
    for value in ("auto", "off", "0"):
        parse_args([*BASE, "--moe-shadow-experts", value]).validate(world_size=1)
