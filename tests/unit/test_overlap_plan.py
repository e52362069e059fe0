"""Lancet's Algorithm 1 (megatron_moe/overlap/wgrad_schedule.py) on hand-made backward traces with hand-worked answers.

A trace is one micro-batch's backward pass in order: W(key, ms, MiB) a module's dW became runnable (its dX
ran), A(key, ms) a backward all-to-all started. `agree` across ranks is in tests/distributed/test_overlap_plan.py.
"""

import json

import pytest

from megatron_moe.config import ConfigError
from megatron_moe.overlap.wgrad_schedule import (
    BACKWARD_NAMES,
    WGRAD_NAMES,
    Event,
    WgradSchedule,
    agree,
    all_under_next_a2a,
    best_fit_greedy,
    canonical_order,
    make_wgrad_schedule,
    merge_passes,
)


def W(key: str, ms: float, mb: float = 0.0) -> Event:
    return Event("wgrad", key, ms, mb)


def A(key: str, ms: float) -> Event:
    return Event("a2a", key, ms)


# Two layers, L2 an MoE layer with a shared expert, L1 an MoE layer; backward runs L2 then L1. Each layer's
# combine reverse runs first, then its dispatch reverse.
TRACE = [
    W("L2.shared_expert", 1.5, 4),
    A("L2.combine", 3.0),
    W("L2.experts", 2.5, 8),
    A("L2.dispatch", 3.0),
    W("L2.router", 0.1, 1),
    W("L2.attn_proj", 1.0, 2),
    W("L2.attn_qkv", 2.0, 3),
    A("L1.combine", 2.0),
    W("L1.experts", 2.0, 8),
    A("L1.dispatch", 2.0),
    W("L1.router", 0.1, 1),
    W("L1.attn_proj", 1.0, 2),
    W("L1.attn_qkv", 2.0, 3),
]


def test_best_fit_picks_the_closest_item_and_may_overshoot():
    events = [W("L2.attn_proj", 1.0), W("L2.experts", 4.0), W("L2.shared_expert", 2.5), A("L2.combine", 3.0)]
    # t_u = 3.0: |3 - 1| = 2, |3 - 4| = 1, |3 - 2.5| = 0.5 -> shared_expert, t_u = 0.5.
    # t_u = 0.5: |0.5 - 1| = 0.5, |0.5 - 4| = 3.5 -> attn_proj, t_u = -0.5: overshoot, stop.
    # experts: no a2a left -> natural place.
    assert best_fit_greedy(events) == {"L2.shared_expert": "L2.combine", "L2.attn_proj": "L2.combine"}
    schedule = make_wgrad_schedule("greedy", events)
    assert schedule.items_under("L2.combine") == ["L2.attn_proj", "L2.shared_expert"]  # event order
    assert schedule.natural() == ["L2.experts"]
    assert schedule.predicted_hidden_ms() == {"L2.combine": 3.0}  # min(3.0, 1.0 + 2.5)
    assert schedule.predicted_exposed_ms() == {"L2.combine": 0.0}


def test_items_after_an_a2a_are_not_its_candidates_and_used_items_are_not_reused():
    events = [W("L1.attn_proj", 0.5), A("L1.combine", 2.0), W("L1.experts", 2.0), A("L1.dispatch", 5.0)]
    # combine: only attn_proj is before it (experts, an exact fit, comes after) -> attn_proj, t_u = 1.5, none left.
    # dispatch: experts (attn_proj is used) -> t_u = 3.0, none left.
    assert best_fit_greedy(events) == {"L1.attn_proj": "L1.combine", "L1.experts": "L1.dispatch"}
    schedule = make_wgrad_schedule("greedy", events)
    assert schedule.predicted_hidden_ms() == {"L1.combine": 0.5, "L1.dispatch": 2.0}
    assert schedule.predicted_exposed_ms() == {"L1.combine": 1.5, "L1.dispatch": 3.0}


def test_ties_go_to_the_earlier_event():
    # t_u = 2: |2 - 1| = |2 - 3| = 1. The earlier 1.0 first: t_u = 1, then 3.0: both under it.
    assert best_fit_greedy([W("L1.mlp_fc1", 1.0), W("L1.mlp_fc2", 3.0), A("L2.dispatch", 2.0)]) == {
        "L1.mlp_fc1": "L2.dispatch",
        "L1.mlp_fc2": "L2.dispatch",
    }
    # The earlier 3.0 first: t_u = -1, stop; the 1.0 stays at its natural place.
    assert best_fit_greedy([W("L1.mlp_fc2", 3.0), W("L1.mlp_fc1", 1.0), A("L2.dispatch", 2.0)]) == {
        "L1.mlp_fc2": "L2.dispatch"
    }


def test_a_remainder_of_rounding_counts_as_covered():
    # t_u = 1.0 -> 0.7 (|0.3|), t_u = 0.30000000000000004 -> 0.3, t_u = 5.6e-17: covered; 0.1 stays natural.
    events = [W("L1.attn_qkv", 0.7), W("L1.attn_proj", 0.3), W("L1.router", 0.1), A("L1.combine", 1.0)]
    assert best_fit_greedy(events) == {"L1.attn_qkv": "L1.combine", "L1.attn_proj": "L1.combine"}


def test_an_all_to_all_of_no_time_gets_nothing():
    assert best_fit_greedy([W("L1.experts", 2.0), A("L1.dispatch", 0.0)]) == {}


def test_greedy_on_a_two_layer_trace():
    # L2.combine 3.0: [shared 1.5] -> shared, t_u 1.5, none left.
    # L2.dispatch 3.0: [experts 2.5] -> experts, t_u 0.5, none left.
    # L1.combine 2.0: [router 0.1, attn_proj 1.0, attn_qkv 2.0] (L2's) -> attn_qkv (|0|), t_u 0.
    # L1.dispatch 2.0: [L2.router 0.1, L2.attn_proj 1.0, L1.experts 2.0] -> L1.experts, t_u 0.
    schedule = make_wgrad_schedule("greedy", TRACE)
    assert schedule.under == {
        "L2.shared_expert": "L2.combine",
        "L2.experts": "L2.dispatch",
        "L2.attn_qkv": "L1.combine",
        "L1.experts": "L1.dispatch",
    }
    assert schedule.natural() == ["L2.router", "L2.attn_proj", "L1.router", "L1.attn_proj", "L1.attn_qkv"]
    assert schedule.predicted_hidden_ms() == {
        "L2.combine": 1.5,
        "L2.dispatch": 2.5,
        "L1.combine": 2.0,
        "L1.dispatch": 2.0,
    }
    assert schedule.predicted_exposed_ms() == {
        "L2.combine": 1.5,
        "L2.dispatch": 0.5,
        "L1.combine": 0.0,
        "L1.dispatch": 0.0,
    }
    # Held: shared 4 until L2.combine; experts 8 until L2.dispatch; attn_qkv 3; L1.experts 8: never two at once.
    assert schedule.held_mb_peak() == 8.0


def test_all_under_next_a2a():
    # Each dW under the first a2a after it; L1's router/attn after the last a2a: natural place.
    schedule = make_wgrad_schedule("all-under-next-a2a", TRACE)
    assert schedule.under == all_under_next_a2a(TRACE)
    assert schedule.under == {
        "L2.shared_expert": "L2.combine",
        "L2.experts": "L2.dispatch",
        "L2.router": "L1.combine",
        "L2.attn_proj": "L1.combine",
        "L2.attn_qkv": "L1.combine",
        "L1.experts": "L1.dispatch",
    }
    assert schedule.natural() == ["L1.router", "L1.attn_proj", "L1.attn_qkv"]
    # L1.combine: min(2.0, 0.1 + 1.0 + 2.0) = 2.0.
    assert schedule.predicted_hidden_ms() == {
        "L2.combine": 1.5,
        "L2.dispatch": 2.5,
        "L1.combine": 2.0,
        "L1.dispatch": 2.0,
    }
    # L2.router 1 + attn_proj 2 + attn_qkv 3 = 6 MiB queued at once, less than an experts' 8.
    assert schedule.held_mb_peak() == 8.0


def test_the_memory_cap_leaves_items_at_their_natural_place_walking_in_order():
    # all-under-next-a2a, cap 5 MiB: shared 4 (4) kept, released at L2.combine; experts 8 > 5: natural;
    # router 1 (1), attn_proj 2 (3) kept, attn_qkv 3 would make 6 > 5: natural; L1.experts 8: natural.
    schedule = make_wgrad_schedule("all-under-next-a2a", TRACE, max_mb=5)
    assert schedule.under == {"L2.shared_expert": "L2.combine", "L2.router": "L1.combine", "L2.attn_proj": "L1.combine"}
    assert schedule.held_mb_peak() == 4.0
    assert schedule.predicted_hidden_ms()["L1.combine"] == pytest.approx(1.1)
    # greedy, cap 7: shared 4 kept; experts 8: natural; attn_qkv 3 kept (shared released); L1.experts 8: natural.
    capped = make_wgrad_schedule("greedy", TRACE, max_mb=7)
    assert capped.under == {"L2.shared_expert": "L2.combine", "L2.attn_qkv": "L1.combine"}
    assert capped.held_mb_peak() == 4.0
    # A cap everything fits under changes nothing; a cap of 0 keeps only what holds nothing.
    assert make_wgrad_schedule("greedy", TRACE, max_mb=8).under == make_wgrad_schedule("greedy", TRACE).under
    assert make_wgrad_schedule(
        "greedy", [W("L1.router", 1.0, 0), W("L1.experts", 1.0, 1), A("L1.dispatch", 2.0)], 0
    ).under == {"L1.router": "L1.dispatch"}


def test_canonical_order_sorts_the_dw_between_two_all_to_alls_and_keeps_the_all_to_alls_in_place():
    """The order autograd ran a rank's dW in between two all-to-alls is not the schedule's to depend on: the cap's walk
    and best-fit's ties read it. TRACE is in the canonical order already."""
    assert sorted(BACKWARD_NAMES) == sorted(WGRAD_NAMES)
    shuffled = [TRACE[i] for i in (0, 1, 2, 3, 6, 4, 5, 7, 8, 9, 12, 10, 11)]
    assert shuffled != TRACE and canonical_order(shuffled) == canonical_order(TRACE) == TRACE
    # Two dW of one window, 1 MiB each under a 1.5 MiB cap: the walk keeps whichever comes first.
    one, other = W("L1.shared_expert", 1.0, 1), W("L1.router", 1.0, 1)

    def capped(window):
        return make_wgrad_schedule("all-under-next-a2a", [*window, A("L1.combine", 2.0)], max_mb=1.5).under

    assert capped([one, other]) != capped([other, one])
    assert (
        capped(canonical_order([other, one]))
        == capped(canonical_order([one, other]))
        == {"L1.shared_expert": "L1.combine"}
    )


def test_policy_off_plans_nothing():
    schedule = make_wgrad_schedule("off", TRACE)
    assert schedule.under == {}
    assert schedule.natural() == [e.key for e in TRACE if e.kind == "wgrad"]
    assert schedule.predicted_hidden_ms() == {
        "L2.combine": 0.0,
        "L2.dispatch": 0.0,
        "L1.combine": 0.0,
        "L1.dispatch": 0.0,
    }
    assert schedule.predicted_exposed_ms() == {
        "L2.combine": 3.0,
        "L2.dispatch": 3.0,
        "L1.combine": 2.0,
        "L1.dispatch": 2.0,
    }
    assert schedule.held_mb_peak() == 0.0


def test_report_shows_the_plan_and_its_numbers():
    text = make_wgrad_schedule("greedy", TRACE).report()
    lines = text.splitlines()
    assert "greedy" in lines[0] and "4 of 9 dW" in lines[0]
    row = next(line for line in lines if line.startswith("L2.dispatch"))
    assert row.split()[:4] == ["L2.dispatch", "3.00", "2.50", "0.50"] and "L2.experts (2.50)" in row
    row = next(line for line in lines if line.startswith("L1.combine"))
    assert row.split()[:4] == ["L1.combine", "2.00", "2.00", "0.00"] and "L2.attn_qkv (2.00)" in row
    total = next(line for line in lines if line.startswith("total"))
    assert total.split() == ["total", "10.00", "8.00", "2.00"]
    assert "L2.router (0.10)" in next(line for line in lines if line.startswith("at their natural place"))
    assert lines[-1] == "held while queued: peak 8.0 MiB"
    measured = make_wgrad_schedule("greedy", TRACE).report({"L2.combine": 1.25, "L2.dispatch": 2.0})
    row = next(line for line in measured.splitlines() if line.startswith("L2.combine"))
    assert row.split()[:5] == ["L2.combine", "3.00", "1.50", "1.50", "1.25"]
    assert next(line for line in measured.splitlines() if line.startswith("total")).split()[-1] == "3.25"


def test_json_round_trip():
    for policy, cap in (("greedy", None), ("all-under-next-a2a", 5), ("off", None)):
        schedule = make_wgrad_schedule(policy, TRACE, cap)
        back = WgradSchedule.from_json(json.loads(json.dumps(schedule.to_json())))
        assert back == schedule and back.report() == schedule.report()


def test_merge_passes_takes_the_median_time_and_the_largest_memory():
    passes = [
        [W("L1.experts", 1.0, 8), A("L1.dispatch", 4.0)],
        [W("L1.experts", 5.0, 9), A("L1.dispatch", 2.0)],
        [W("L1.experts", 2.0, 7), A("L1.dispatch", 3.0)],
    ]
    assert merge_passes(passes) == [W("L1.experts", 2.0, 9), A("L1.dispatch", 3.0)]


def test_merge_passes_names_the_first_structural_difference():
    first = [W("L1.experts", 1.0), A("L1.dispatch", 2.0), W("L1.router", 0.1)]
    swapped = [W("L1.experts", 1.0), W("L1.router", 0.1), A("L1.dispatch", 2.0)]
    with pytest.raises(ValueError, match=r"pass 1 differs from pass 0 at event 1: wgrad 'L1.router' vs a2a"):
        merge_passes([first, swapped])
    with pytest.raises(ValueError, match=r"pass 2 .* at event 2: the end of the pass vs wgrad 'L1.router'"):
        merge_passes([first, first, first[:2]])
    with pytest.raises(ValueError, match="no profiled pass"):
        merge_passes([])


def test_bad_input_is_refused_with_names():
    with pytest.raises(ConfigError, match=r"--overlap-wgrad=eager: one of off, greedy, all-under-next-a2a"):
        make_wgrad_schedule("eager", TRACE)
    with pytest.raises(ConfigError, match=r"--overlap-wgrad-max-mb=-1"):
        make_wgrad_schedule("greedy", TRACE, max_mb=-1)
    with pytest.raises(ValueError, match=r"key 'L1.experts' appears twice"):
        make_wgrad_schedule("greedy", [W("L1.experts", 1.0), A("L1.dispatch", 1.0), W("L1.experts", 1.0)])
    with pytest.raises(ValueError, match=r"'L1.mlp'.*one of \('attn_qkv'"):
        W("L1.mlp", 1.0)
    with pytest.raises(ValueError, match=r"'L1.experts'.*one of \('combine', 'dispatch'\)"):
        A("L1.experts", 1.0)
    with pytest.raises(ValueError, match=r"'L0.experts': expected L<layer >= 1>"):
        W("L0.experts", 1.0)
    with pytest.raises(ValueError, match=r"kind 'fwd'"):
        Event("fwd", "L1.experts", 1.0)
    with pytest.raises(ValueError, match=r"expected 'L\{layer\}.\{name\}'"):
        W("layer1.experts", 1.0)
    with pytest.raises(ValueError, match=r"ms=-1.0"):
        W("L1.experts", -1.0)
    # A schedule read back must keep the rule: a dW under an all-to-all that comes after it.
    data = make_wgrad_schedule("greedy", TRACE).to_json()
    data["under"]["L1.experts"] = "L2.combine"
    with pytest.raises(ValueError, match=r"'L1.experts' under 'L2.combine'"):
        WgradSchedule.from_json(data)


def test_agree_in_one_process_keeps_the_profile_and_checks_layers():
    assert agree(TRACE, num_layers=2) == TRACE
    with pytest.raises(ValueError, match=r"'L2.shared_expert': layer 2 is outside 1..1 \(num_layers\)"):
        agree(TRACE, num_layers=1)
    with pytest.raises(ValueError, match=r"appears twice"):
        agree([A("L1.combine", 1.0), A("L1.combine", 2.0)], num_layers=1)
