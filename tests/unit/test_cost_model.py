"""FSMoE's cost model and Algorithm 1 (megatron_moe/overlap/cost_model.py): fits, the four cases, the solver
against brute force, degenerate groups, the JSON file."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from megatron_moe.config.fields import ConfigError
from megatron_moe.overlap.cost_model import (
    BACKWARD_KINDS,
    DIRECTIONS,
    FIT_KINDS,
    MIN_GAIN,
    OVERHEAD_KINDS,
    ClusterFits,
    LayerSizes,
    LinearFit,
    brute_force,
    capacity_rows,
    case_at,
    chunk_times,
    fit_linear,
    layer_time_ms,
    overhead_ms,
    predict,
    required_gain,
    solve_degrees,
)
from megatron_moe.overlap.profiler import model_error


def _fits(alpha: dict[str, float], beta: dict[str, float]) -> ClusterFits:
    base_alpha = {"a2a": 0.1, "ag": 0.05, "rs": 0.05, "ar": 0.1, "gemm": 0.01}
    base_beta = {"a2a": 1e-7, "ag": 1e-8, "rs": 1e-8, "ar": 1e-7, "gemm": 1e-10}
    return ClusterFits.from_coefficients(base_alpha | alpha, base_beta | beta, {"world": 4})


SIZES = LayerSizes(n_a2a=8e6, n_ag=16e6, n_rs=16e6, n_exp=4e9, ep=2, esp=2)


def _t(fit: LinearFit, n: float, r: int) -> float:
    return fit.alpha + n / r * fit.beta


def test_fit_recovers_exact_line():
    points = [(n * 262144, 0.287 + n * 262144 * 2.21e-7) for n in range(1, 25)]
    fit = fit_linear(points)
    assert fit.alpha == pytest.approx(0.287, rel=1e-9)
    assert fit.beta == pytest.approx(2.21e-7, rel=1e-9)
    assert fit.r2 == pytest.approx(1.0, abs=1e-12)
    assert fit.points == tuple((float(n), float(ms)) for n, ms in points)
    assert fit.time_ms(1e6) == pytest.approx(0.287 + 0.221, rel=1e-9)


def test_fit_holds_a_negative_coefficient_at_zero():
    fit = fit_linear([(1e6, 0.5), (2e6, 1.6), (3e6, 2.4)])  # unconstrained: alpha -0.4, beta 9.5e-7
    assert fit.alpha == 0.0
    assert fit.beta == pytest.approx((0.5e6 + 3.2e6 + 7.2e6) / (1e12 + 4e12 + 9e12), rel=1e-9)  # through 0
    assert fit.r2 < 1
    flat = fit_linear([(1, 2.0), (2, 1.9), (3, 1.8)])  # a falling time: beta held at 0, alpha the mean
    assert flat.beta == 0.0 and flat.alpha == pytest.approx(1.9)


def test_fit_r2_below_one_on_noise_and_refuses_one_size():
    noisy = fit_linear([(1, 1.0), (2, 3.0), (3, 2.0), (4, 5.0)])
    assert 0 < noisy.r2 < 1
    with pytest.raises(ValueError, match="2 or more distinct sizes"):
        fit_linear([(5, 1.0), (5, 2.0)])


def test_each_case_dominates_and_uses_its_formula():
    r = 4
    # (fits, t_gar, case expected): chosen so one resource dominates at r = 4
    scenarios = [
        (_fits({}, {"a2a": 1e-6}), 1000.0, 1),  # a huge gradient all-reduce: inter-node communication dominates
        (_fits({}, {"gemm": 1e-8}), 0.0, 2),  # the experts dominate
        (_fits({}, {"a2a": 1e-5}), 0.0, 3),  # the all-to-all dominates
        (_fits({}, {"ag": 1e-5, "rs": 1e-5}), 0.0, 4),  # the intra-node all-gather / reduce-scatter dominates
    ]
    for fits, t_gar, expected in scenarios:
        a2a, ag, rs = (_t(fits[k], n, r) for k, n in (("a2a", 8e6), ("ag", 16e6), ("rs", 16e6)))
        exp = fits["gemm"].alpha + 4e9 / r * fits["gemm"].beta  # alpha: one chunk's fixed cost
        formula = {
            1: 2 * r * a2a + t_gar,
            2: 2 * a2a + ag + rs + r * exp,
            3: 2 * r * a2a + ag + rs,
            4: 2 * a2a + r * ag + r * rs,
        }
        ms, case = layer_time_ms(fits, SIZES, r, "backward", t_gar_ms=t_gar, dw_in_backward=False)
        assert case == expected, (expected, case)
        assert ms == pytest.approx(formula[expected], rel=1e-12)
        # the case that holds is the slowest of the candidates its conditions compare
        assert ms == pytest.approx(max(formula.values()) if expected != 1 else formula[1], rel=1e-12)


def test_case_conditions_as_written():
    t = chunk_times(_fits({}, {}), SIZES, 2)
    assert case_at(t, 1, 0.0) == 2  # r = 1: Q2 reads exp > 0, so without t_gar the unpipelined time is case 2
    assert case_at(t, 1, 1e9) == 1


def _random_fits(rng: random.Random) -> ClusterFits:
    kinds = (*FIT_KINDS, *BACKWARD_KINDS)
    alpha = {k: 10 ** rng.uniform(-2, 0.5) for k in kinds}
    beta = {k: 10 ** rng.uniform(-10.5, -8) if k.startswith("gemm") else 10 ** rng.uniform(-7.5, -5) for k in kinds}
    fits = {k: LinearFit(alpha=alpha[k], beta=beta[k]) for k in kinds}
    fits = fits if rng.random() < 0.75 else {k: fits[k] for k in FIT_KINDS}
    if rng.random() < 0.5:
        fits |= {k: LinearFit(alpha=rng.uniform(0, 2), beta=rng.uniform(0, 3)) for k in OVERHEAD_KINDS}
    return ClusterFits(fits=fits)


def test_solver_equals_brute_force_on_random_fits():
    rng = random.Random(15)
    chosen = set()
    for _ in range(150):
        fits = _random_fits(rng)
        sizes = LayerSizes.from_layer(
            tokens=rng.choice([512, 4096, 16384]),
            topk=rng.choice([1, 2]),
            hidden_size=rng.choice([256, 1024, 4096]),
            ffn_hidden_size=rng.choice([1024, 4096]),
            num_experts=8,
            ep=rng.choice([2, 4]),
            esp=rng.choice([1, 2, 4]),
            gated=rng.random() < 0.5,
        )
        kw = {"t_gar_ms": rng.choice([0.0, rng.uniform(0, 50)]), "dw_in_backward": rng.random() < 0.5}
        top = rng.choice([4, 8, 16])
        solved = solve_degrees(fits, sizes, max_degree=top, min_gain=0.0, **kw)
        best = brute_force(fits, sizes, range(1, top + 1), **kw)
        for direction in DIRECTIONS:
            assert solved.predicted_ms[direction] <= best.predicted_ms[direction] * (1 + 1e-9), (direction, top)
            assert 1 <= getattr(solved, direction) <= top
            chosen.add(getattr(solved, direction))
        again = predict(fits, sizes, solved.forward, solved.backward, **kw)
        assert again == solved
    assert len(chosen) >= 4, chosen  # the grid exercises the solver, not one corner of it


def test_backward_degree_differs_under_a_gradient_all_reduce():
    fits = _fits({"a2a": 0.01}, {"gemm": 2e-9})
    free = solve_degrees(fits, SIZES, dw_in_backward=False)
    assert free.forward == free.backward > 1  # no gemm_bwd line: the backward chunks cost the forward's
    assert free.predicted_ms["forward"] == free.predicted_ms["backward"]
    loaded = solve_degrees(fits, SIZES, t_gar_ms=500.0, dw_in_backward=False)
    assert loaded.forward == free.forward
    assert (loaded.backward, loaded.case["backward"]) == (1, 1)  # f1 = 2 r t_a2a + t_gar grows with r
    assert loaded.predicted_ms["backward"] == pytest.approx(2 * _t(fits["a2a"], 8e6, 1) + 500.0)


def test_weight_gradients_hide_the_last_all_to_all():
    """Backward with dW in the layer: f_case(r) + max(0, t_dw - t_a2a,r); a large dW favours fewer chunks (each
    chunk's all-to-all is longer, so more of dW hides under the last one)."""
    fits = ClusterFits(
        fits=dict(_fits({"a2a": 0.01}, {"gemm": 2e-9}).fits)
        | {"gemm_bwd": LinearFit(alpha=0.02, beta=3e-9), "gemm_dw": LinearFit(alpha=0.5, beta=1e-9)}
    )
    t_dw = 0.5 + 4e9 * 1e-9
    for r in (1, 2, 3, 8):
        without, case = layer_time_ms(fits, SIZES, r, "backward", dw_in_backward=False)
        with_dw, same_case = layer_time_ms(fits, SIZES, r, "backward")
        assert same_case == case
        t = chunk_times(fits, SIZES, r, "backward")
        assert t.exp == pytest.approx(0.02 + 4e9 / r * 3e-9)
        assert with_dw == pytest.approx(without + max(0.0, t_dw - t.a2a))
    forward = layer_time_ms(fits, SIZES, 2)[0]
    assert forward == pytest.approx(layer_time_ms(_fits({"a2a": 0.01}, {"gemm": 2e-9}), SIZES, 2)[0])
    solved = solve_degrees(fits, SIZES, min_gain=0.0)
    assert solved.predicted_ms["backward"] == pytest.approx(
        brute_force(fits, SIZES, range(1, 9)).predicted_ms["backward"]
    )
    assert solved.backward <= solve_degrees(fits, SIZES, dw_in_backward=False, min_gain=0.0).backward


def test_overhead_line_adds_alpha_and_beta_per_extra_chunk():
    plain = _fits({"a2a": 0.01}, {"gemm": 2e-9})
    loaded = ClusterFits(
        fits=dict(plain.fits) | {"chunk": LinearFit(alpha=0.3, beta=0.7), "chunk_bwd": LinearFit(alpha=0.1, beta=2.0)}
    )
    for direction in ("forward", "backward"):  # r = 1 runs no chunks: not the chunk line
        assert overhead_ms(loaded, SIZES, 1, direction) == 0.0
        assert layer_time_ms(loaded, SIZES, 1, direction) == layer_time_ms(plain, SIZES, 1, direction)
    at_1 = {"unchunked": LinearFit(alpha=-0.2, beta=0.0), "unchunked_bwd": LinearFit(alpha=0.4, beta=0.0)}
    measured_1 = ClusterFits(fits=dict(loaded.fits) | at_1)  # r = 1's own time beyond the model, signed
    assert overhead_ms(measured_1, SIZES, 1, "forward") == -0.2 and overhead_ms(measured_1, SIZES, 1, "backward") == 0.4
    assert overhead_ms(measured_1, SIZES, 3, "forward") == overhead_ms(loaded, SIZES, 3, "forward")
    for r in (2, 5):
        for direction, (alpha, beta) in (("forward", (0.3, 0.7)), ("backward", (0.1, 2.0))):
            assert overhead_ms(loaded, SIZES, r, direction) == pytest.approx(alpha + (r - 1) * beta)
            assert overhead_ms(plain, SIZES, r, direction) == 0.0  # no line: the paper's model
            base, case = layer_time_ms(plain, SIZES, r, direction)
            assert layer_time_ms(loaded, SIZES, r, direction) == (pytest.approx(base + alpha + (r - 1) * beta), case)
    single = LayerSizes(n_a2a=0.0, n_ag=0.0, n_rs=0.0, n_exp=4e9, ep=1, esp=1)
    assert overhead_ms(loaded, single, 4, "forward") == 0.0  # nothing pipelined, nothing overlapped
    # a steep enough per-chunk cost moves the optimum down, never up
    free, costly = solve_degrees(plain, SIZES, min_gain=0.0), solve_degrees(loaded, SIZES, min_gain=0.0)
    assert costly.forward <= free.forward and costly.backward <= free.backward
    assert (costly.forward, costly.backward) != (free.forward, free.backward)


def test_min_gain_keeps_r1_unless_the_predicted_saving_clears_it():
    """A degree > 1 runs only when the model says it saves at least `min_gain` of r = 1's time."""
    fits = _fits({"a2a": 0.01}, {"gemm": 2e-9})
    best = solve_degrees(fits, SIZES, min_gain=0.0, dw_in_backward=False)
    r1 = predict(fits, SIZES, 1, 1, dw_in_backward=False)
    assert best.forward > 1
    gain = 1 - best.predicted_ms["forward"] / r1.predicted_ms["forward"]
    assert 0 < gain < 0.9
    below = solve_degrees(fits, SIZES, min_gain=gain * 1.01, dw_in_backward=False)
    above = solve_degrees(fits, SIZES, min_gain=gain * 0.99, dw_in_backward=False)
    assert (below.forward, below.predicted_ms["forward"]) == (1, r1.predicted_ms["forward"])
    assert (above.forward, above.predicted_ms["forward"]) == (best.forward, best.predicted_ms["forward"])
    assert solve_degrees(fits, SIZES, dw_in_backward=False) == (best if gain >= MIN_GAIN else r1)
    with pytest.raises(ConfigError, match="min_gain"):
        solve_degrees(fits, SIZES, min_gain=1.0)


def test_the_profiles_model_error_raises_the_gain_a_degree_must_clear():
    """`ClusterFits.model_error` (the model's largest miss on the profiled pipeline) replaces `min_gain` in its
    direction where larger; the other direction keeps `min_gain`; the plan's JSON keeps it."""
    fits = _fits({"a2a": 0.01}, {"gemm": 2e-9})
    best = solve_degrees(fits, SIZES, min_gain=0.0, dw_in_backward=False)
    r1 = predict(fits, SIZES, 1, 1, dw_in_backward=False)
    gain = {d: 1 - best.predicted_ms[d] / r1.predicted_ms[d] for d in DIRECTIONS}
    assert best.forward > 1 and best.backward > 1 and min(gain.values()) > 0.01
    assert required_gain(fits, "forward") == MIN_GAIN  # coefficients by hand: no error measured
    noisy = dataclasses.replace(fits, model_error={"forward": gain["forward"] * 1.01, "backward": 0.001})
    assert required_gain(noisy, "forward") == gain["forward"] * 1.01
    assert required_gain(noisy, "backward", min_gain=0.01) == 0.01
    solved = solve_degrees(noisy, SIZES, min_gain=0.01, dw_in_backward=False)
    assert (solved.forward, solved.backward) == (1, best.backward)  # the forward's gain is inside the error
    quiet = dataclasses.replace(fits, model_error={"forward": gain["forward"] * 0.99, "backward": 0.0})
    assert solve_degrees(quiet, SIZES, min_gain=0.01, dw_in_backward=False).forward == best.forward
    assert ClusterFits.from_json(json.loads(json.dumps(noisy.to_json()))).model_error == noisy.model_error
    older = {k: v for k, v in noisy.to_json().items() if k != "model_error"}  # a profile saved before the field
    assert ClusterFits.from_json(older).model_error == {}


def test_model_error_is_the_largest_miss_on_the_profiled_pipeline():
    fits = _fits({"a2a": 0.01}, {"gemm": 2e-9})
    exact = {
        raw: [(r, layer_time_ms(fits, SIZES, r, direction, dw_in_backward=False)[0]) for r in (1, 2, 4, 8)]
        for raw, direction in (("pipeline", "forward"), ("pipeline_bwd", "backward"))
    }
    assert model_error(fits, SIZES, exact) == {"forward": 0.0, "backward": 0.0}
    off = dict(exact, pipeline=[(r, ms * (1.25 if r == 4 else 1.0)) for r, ms in exact["pipeline"]])
    errors = model_error(fits, SIZES, off)  # measured 1.25x the model at r = 4: it misses 0.25 / 1.25 = 20%
    assert errors["forward"] == pytest.approx(0.2) and errors["backward"] == 0.0


def test_no_esp_drops_all_gather_and_reduce_scatter():
    sizes = LayerSizes.from_layer(tokens=1024, topk=2, hidden_size=512, ffn_hidden_size=2048, num_experts=8, ep=2)
    assert (sizes.n_ag, sizes.n_rs, sizes.esp) == (0.0, 0.0, 1)
    fits = _fits({"ag": 50.0, "rs": 50.0}, {})  # would dominate if an absent collective paid its alpha
    t = chunk_times(fits, sizes, 4)
    assert (t.ag, t.rs) == (0.0, 0.0)
    schedule = solve_degrees(fits, sizes)
    assert schedule.case["forward"] in (2, 3)  # Q1 holds (t_ag = 0): Tutel's two cases
    assert schedule.predicted_ms["forward"] < 50.0


def test_single_ep_rank_has_nothing_to_pipeline():
    sizes = LayerSizes.from_layer(
        tokens=4096, topk=2, hidden_size=1024, ffn_hidden_size=4096, num_experts=8, ep=1, esp=2
    )
    assert sizes.n_a2a == 0.0 and sizes.n_ag > 0
    schedule = solve_degrees(_fits({}, {"ag": 1e-5, "rs": 1e-5}), sizes)
    assert (schedule.forward, schedule.backward) == (1, 1)


def test_layer_sizes_from_layer():
    sizes = LayerSizes.from_layer(
        tokens=1024, topk=2, hidden_size=512, ffn_hidden_size=2048, num_experts=8, ep=2, esp=2
    )
    rows = 1024 * 2
    assert sizes.n_a2a == rows * 512 * 4
    assert sizes.n_ag == sizes.n_rs == 2 * rows * 512 * 4
    assert sizes.n_exp == rows * 512 * 2048 * 2
    gated = LayerSizes.from_layer(
        tokens=1024, topk=2, hidden_size=512, ffn_hidden_size=2048, num_experts=8, ep=2, gated=True, dtype_bytes=2
    )
    assert gated.n_exp == rows * 512 * 2048 * 3 and gated.n_a2a == rows * 512 * 2
    kw = {"tokens": 1000, "topk": 2, "hidden_size": 8, "ffn_hidden_size": 8, "num_experts": 8, "ep": 2}
    assert LayerSizes.from_layer(**kw, capacity_factor=0.5).n_a2a == 8 * 125 * 32  # C = 125 < 250 per expert
    assert LayerSizes.from_layer(**kw, capacity_factor=1.5, padded=True).n_a2a == 8 * 375 * 32  # E * C
    assert LayerSizes.from_layer(**kw, capacity_factor=-0.5).n_a2a == 8 * 125 * 32  # adaptive: capped
    assert LayerSizes.from_layer(**kw, capacity_factor=-1.5, padded=True).n_a2a == 8 * 250 * 32  # balanced < cap


def test_capacity_matches_the_layer():
    from megatron_moe.moe.capacity import capacity_limit

    for f, tokens, k, e in [(1.0, 1024, 2, 8), (1.25, 1000, 1, 6), (-0.3, 77, 2, 16), (4.0, 3, 1, 64)]:
        assert capacity_rows(f, tokens, k, e) == capacity_limit(f, tokens, k, e)


def test_bad_sizes_name_the_flag():
    kw = {"tokens": 1024, "topk": 2, "hidden_size": 8, "ffn_hidden_size": 6, "num_experts": 8}
    with pytest.raises(ConfigError, match="--moe-ffn-hidden-size=6"):
        LayerSizes.from_layer(**kw, esp=4)
    with pytest.raises(ConfigError, match="--num-experts=8"):
        LayerSizes.from_layer(**kw, ep=3)
    with pytest.raises(ConfigError, match="--expert-model-parallel-size=0"):
        LayerSizes.from_layer(**kw, ep=0)
    with pytest.raises(ConfigError, match="max_degree=0"):
        solve_degrees(_fits({}, {}), SIZES, max_degree=0)


def test_json_round_trip(tmp_path):
    fits = ClusterFits(
        fits={
            k: fit_linear([(1, 1.0 + i), (2, 2.5 + i), (4, 4.0 + i)])
            for i, k in enumerate((*FIT_KINDS, *BACKWARD_KINDS))
        },
        cluster={"world": 4, "ep": 2, "esp": 2, "hosts": ["a", "b"]},
    )
    path = tmp_path / "fits.json"
    fits.save(str(path))
    assert ClusterFits.load(str(path)) == fits
    assert ClusterFits.load(str(path))["gemm_dw"] == fits["gemm_dw"]
    hand = ClusterFits.from_coefficients({k: 1.0 for k in FIT_KINDS}, {k: 2.0 for k in FIT_KINDS})
    assert hand["gemm_bwd"] == hand["gemm_dw"] == hand["gemm"]  # no backward lines: the forward's
    with pytest.raises(ValueError, match="no fit for"):
        ClusterFits(fits={"a2a": fits["a2a"]})
