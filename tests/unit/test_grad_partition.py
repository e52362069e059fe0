"""FSMoE's adaptive gradient partition (megatron_moe/overlap/grad_partition.py): step 1 fills each MoE layer's
overlappable time with the oldest gradients, step 2 never does worse than either extreme, the model's bookkeeping
adds up."""

from __future__ import annotations

import pytest

from megatron_moe.config.fields import ConfigError
from megatron_moe.overlap.cost_model import ClusterFits, LayerSizes, chunk_times, solve_degrees
from megatron_moe.overlap.grad_partition import (
    GeneralizedLayer,
    f_moe_ms,
    g_inv_bytes,
    overlappable_ms,
    partition,
    t_ar_ms,
)

# experts dominate (case 2): 4 ms of expert work per layer, all-to-alls of 0.5 ms
FITS = ClusterFits.from_coefficients(
    {"a2a": 0.1, "ag": 0.0, "rs": 0.0, "ar": 0.2, "gemm": 0.05},
    {"a2a": 1e-7, "ag": 0.0, "rs": 0.0, "ar": 1e-6, "gemm": 1e-9},
)
SIZES = LayerSizes(n_a2a=4e6, n_ag=0.0, n_rs=0.0, n_exp=4e9, ep=2, esp=1)
MIB = float(1 << 20)


def _layers(*grad_bytes: float) -> list[GeneralizedLayer]:
    top = len(grad_bytes) * 2
    return [GeneralizedLayer(layer=top - 2 * i, sizes=SIZES, grad_bytes=n) for i, n in enumerate(grad_bytes)]


def test_the_all_reduce_line_and_its_inverse():
    assert t_ar_ms(FITS, 0) == 0.0 and t_ar_ms(FITS, 1e6) == pytest.approx(0.2 + 1.0)
    assert g_inv_bytes(FITS, 1.2) == pytest.approx(1e6) and g_inv_bytes(FITS, 0.1) == 0.0


def test_overlappable_time_is_the_case_2_formula_at_t_gar_zero():
    schedule = solve_degrees(FITS, SIZES, dw_in_backward=False)
    assert schedule.case["backward"] == 2
    r, t = schedule.backward, chunk_times(FITS, SIZES, schedule.backward, "backward")
    expected = r * t.exp - 2 * (r - 1) * t.a2a
    assert overlappable_ms(FITS, SIZES, dw_in_backward=False, max_degree=8) == pytest.approx(expected)
    assert expected > 1.0


def test_step_1_fills_each_layer_with_the_oldest_gradients_and_carries_the_rest():
    olp = overlappable_ms(FITS, SIZES, dw_in_backward=False, max_degree=8)
    room = g_inv_bytes(FITS, olp)
    layers = _layers(1.5 * room, 0.2 * room, 0.0)
    plan = partition(FITS, layers, tail_bytes=1e5, dw_in_backward=False)
    # eqs. 3-4: layer 1 (backward order) takes a full room; its 0.5 room left over goes to the next, with 0.2 more
    assert plan.first[6] == pytest.approx(room)
    assert plan.first[4] == pytest.approx(0.7 * room)
    assert plan.first[2] == pytest.approx(0.0)
    total = sum(g.grad_bytes for g in layers) + 1e5
    assert sum(plan.assigned.values()) + plan.tail_bytes == pytest.approx(total)
    # everything fitted: nothing for step 2, the tail alone reduced after backward
    assert plan.assigned == plan.first and plan.tail_bytes == pytest.approx(1e5)
    assert plan.predicted_ms["total"] < plan.predicted_ms["megatron"]
    for ms in plan.predicted_ms["layers"].values():  # hidden: the layer takes as long as without it
        assert ms == pytest.approx(f_moe_ms(FITS, SIZES, 0.0, dw_in_backward=False, max_degree=8))


def test_step_2_spreads_what_does_not_fit_and_beats_both_extremes():
    olp = overlappable_ms(FITS, SIZES, dw_in_backward=False, max_degree=8)
    room = g_inv_bytes(FITS, olp)
    layers = _layers(6 * room, 0.0, 0.0)  # far more than the three layers hide
    plan = partition(FITS, layers, tail_bytes=0.0, dw_in_backward=False)
    assert plan.first == {6: pytest.approx(room), 4: pytest.approx(room), 2: pytest.approx(room)}  # carried down
    assert sum(plan.assigned.values()) + plan.tail_bytes == pytest.approx(6 * room)
    kw = {"dw_in_backward": False, "max_degree": 8}

    def total(assigned: dict[int, float], tail: float) -> float:
        return sum(f_moe_ms(FITS, SIZES, t_ar_ms(FITS, n), **kw) for n in assigned.values()) + t_ar_ms(FITS, tail)

    assert plan.predicted_ms["total"] == pytest.approx(total(plan.assigned, plan.tail_bytes))
    rest_at_end = total(plan.first, 3 * room)
    rest_in_first = total({6: 4 * room, 4: room, 2: room}, 0.0)
    assert plan.predicted_ms["total"] <= min(rest_at_end, rest_in_first) + 1e-9
    assert plan.predicted_ms["total"] < plan.predicted_ms["megatron"]
    assert plan.predicted_ms["floor"] == 0.0  # nothing made after the first MoE layer's backward began
    with_tail = partition(FITS, layers, tail_bytes=2 * MIB, dw_in_backward=False)
    assert with_tail.predicted_ms["floor"] == pytest.approx(t_ar_ms(FITS, 2 * MIB))  # the tail's all-reduce alone
    assert with_tail.predicted_ms["tail"] >= with_tail.predicted_ms["floor"]


def test_a_layer_never_takes_gradients_made_after_it():
    layers = _layers(0.0, 0.0, 5 * MIB)  # every byte made just before the lowest MoE layer
    plan = partition(FITS, layers, tail_bytes=0.0, dw_in_backward=False)
    assert plan.assigned[6] == 0.0 and plan.assigned[4] == 0.0


def test_the_plan_is_the_same_on_every_call():
    layers = _layers(8 * MIB, 3 * MIB, 1 * MIB)
    assert partition(FITS, layers, 2 * MIB) == partition(FITS, layers, 2 * MIB)


def test_bad_sizes_name_the_field():
    with pytest.raises(ConfigError, match="tail_bytes"):
        partition(FITS, _layers(1.0), tail_bytes=-1.0)


def test_planned_and_when_ready_groups_are_ordered_as_backward_reaches_them():
    """`grad_reduce._backward_order`: MoE layer L's planned groups launch at its backward's first all-to-all,
    before transformer layer L's attention completes (point L); the output layer (point num_layers + 1) first,
    the embedding (point 0) last."""
    from megatron_moe.overlap.grad_reduce import _backward_order

    keys = [(None, 0), (1, None), (None, 1), (None, 5), (3, None), (None, 3), (None, 4), (2, None)]
    order = _backward_order(dict.fromkeys(keys))
    assert order == [(None, 5), (None, 4), (3, None), (None, 3), (2, None), (1, None), (None, 1), (None, 0)]


def test_the_plan_pays_only_where_it_saves_the_share_asked():
    """--moe-overlap-choice auto keeps the adaptive partition only where its backward beats megatron-core's by 5%."""
    from megatron_moe.overlap.grad_partition import GradPartition

    def plan(total: float) -> GradPartition:
        return GradPartition(first={}, assigned={}, tail_bytes=0.0, olp_ms={},
                             predicted_ms={"total": total, "megatron": 100.0})  # fmt: skip

    assert plan(95.0).pays(0.05) and plan(60.0).pays(0.05)
    assert not plan(95.1).pays(0.05) and not plan(101.0).pays(0.05)
