"""megatron_moe/overlap/op_partition.py: Lancet's pipeline simulation, its DP against brute force, the flags."""

import itertools
import json
import math
import random

import pytest

from megatron_moe.config.fields import ConfigError
from megatron_moe.config.rules import parse_pieces, parse_ranges
from megatron_moe.overlap import op_partition as op
from megatron_moe.overlap.cost_model import (
    DENSE_KINDS,
    FIT_KINDS,
    MIN_GAIN,
    ClusterFits,
    LayerSizes,
    LinearFit,
    fit_linear,
)

ZERO = {k: 0.0 for k in FIT_KINDS}


def _fits(alpha=None, beta=None) -> ClusterFits:
    """No start-up times by default; dense lines per token."""
    a = ZERO | {k: 0.0 for k in DENSE_KINDS} | (alpha or {})
    b = ZERO | {"a2a": 1e-3, "gemm": 1e-3, "attn": 1.0, "mlp": 1.0, "route": 0.5, "unroute": 0.5} | (beta or {})
    return ClusterFits.from_coefficients(a, b)


def _one_moe_layer(**kw) -> op.StageModel:
    """B = 2, 4 tokens: a piece of 2 tokens runs attn 2 ms, route 1, dispatch 3, experts 1, combine 3, unroute 1
    (EP = 1 in the sizes: no count exchange, so the hand timeline stays whole numbers)."""
    sizes = LayerSizes(n_a2a=6000.0, n_ag=0.0, n_rs=0.0, n_exp=2000.0, ep=1)
    return op.StageModel(layers=(1,), moe=(True,), micro_batch=2, tokens=4, sizes=sizes, **kw)


def _timeline(direction, pieces=2):
    schedule, pool = op.range_schedule(_fits(), _one_moe_layer(), 1, 1, pieces, direction)
    return {i.name: span for i, span in zip(schedule, op.simulate(schedule))}, pool


def test_forward_of_two_pieces_by_hand():
    """Piece 1's attention and router run under piece 0's dispatch; each combine waits for the link."""
    spans, _ = _timeline("forward")
    assert spans == {
        "L1.attn@0": (0, 2),
        "L1.route@0": (2, 3),
        "L1.dispatch.0@0": (3, 6),
        "L1.attn@1": (3, 5),
        "L1.route@1": (5, 6),
        "L1.dispatch.0@1": (6, 9),
        "L1.experts.0@0": (6, 7),
        "L1.combine.0@0": (9, 12),
        "L1.experts.0@1": (9, 10),
        "L1.combine.0@1": (12, 15),
        "L1.unroute@0": (12, 13),
        "L1.unroute@1": (15, 16),
    }


def test_backward_mirrors_the_forward_by_hand():
    """Pieces in reverse (autograd's order); dense backward = 2 x forward (no _bwd lines), experts' dX and dW on
    the "gemm" line; the last piece's combine' runs under the first's unroute'."""
    spans, pool = _timeline("backward")
    assert pool == 0.0
    assert spans == {
        "L1.unroute'@1": (0, 2),
        "L1.combine'.0@1": (2, 5),
        "L1.unroute'@0": (2, 4),
        "L1.combine'.0@0": (5, 8),
        "L1.experts'.0@1": (5, 6),
        "L1.dispatch'.0@1": (8, 11),
        "L1.experts_dw@1": (6, 7),
        "L1.experts'.0@0": (8, 9),
        "L1.dispatch'.0@0": (11, 14),
        "L1.experts_dw@0": (9, 10),
        "L1.route'@1": (11, 13),
        "L1.attn'@1": (13, 17),
        "L1.route'@0": (17, 19),
        "L1.attn'@0": (19, 23),
    }


def test_range_times_by_hand():
    fits, stage = _fits(), _one_moe_layer()
    two = op.range_times(fits, stage, 1, 1, 2)
    assert (two.forward, two.backward, two.a2a, two.hidden) == (16, 23, 24, 6 + 9)
    whole = op.range_times(fits, stage, 1, 1, 1)  # one chain: 4 + 2 + 6 + 2 + 6 + 2, then 4 + 6 + 2 + 6 + 4 + 8
    assert (whole.forward, whole.backward, whole.hidden) == (22, 30, 2)  # the dW (2) under the dispatch'


def test_deferred_weight_gradients_fill_idle_compute():
    """--overlap-wgrad: half of each dense backward and all the experts' dW leave the timeline; the compute's idle
    time absorbs them before they add."""
    fits = _fits()
    deferred = op.range_times(fits, _one_moe_layer(defer_wgrad=True, experts_defer_wgrad=True), 1, 1, 1)
    # whole, dX only: unroute' 4 (no weights), combine' 6, experts' 2, dispatch' 6, route' 2, attn' 4 = 24 with the
    # compute idle 12 ms (the all-to-alls); the pool, route 2 + attn 4 + experts 2 = 8, fits in it
    assert deferred.backward == 24
    fast_link = _fits(beta={"a2a": 1e-4})  # all-to-alls of 0.6 ms: 1.2 ms idle, 6.8 ms of the pool add
    deferred = op.range_times(fast_link, _one_moe_layer(defer_wgrad=True, experts_defer_wgrad=True), 1, 1, 1)
    assert deferred.backward == pytest.approx(4 + 0.6 + 2 + 0.6 + 2 + 4 + 6.8)


def test_host_read_holds_the_next_compute():
    schedule = [
        op.Instr("a", op.COMPUTE, 1.0),
        op.Instr("counts", op.LINK, 5.0, (0,), holds_host=True),
        op.Instr("b", op.COMPUTE, 1.0),
        op.Instr("c", op.COMPUTE, 1.0),
    ]
    assert op.simulate(schedule) == [(0, 1), (1, 6), (6, 7), (7, 8)]


def test_overlap_counts_link_time_under_compute():
    schedule = [op.Instr("c", op.COMPUTE, 4.0), op.Instr("l", op.LINK, 6.0), op.Instr("c2", op.COMPUTE, 1.0, (1,))]
    assert op.overlap_ms(schedule, op.simulate(schedule)) == 4.0


def test_pieces_split_like_tensor_split():
    assert op.piece_batches(8, 3) == [3, 3, 2]
    assert op.piece_batches(4, 4) == [1, 1, 1, 1]
    with pytest.raises(ConfigError, match="--moe-partition-pieces=5"):
        op.piece_batches(4, 5)


def _stage(moe, micro_batch=4, degrees=None, **kw) -> op.StageModel:
    sizes = LayerSizes.from_layer(tokens=512, topk=2, hidden_size=64, ffn_hidden_size=128, num_experts=4, ep=2)
    layers = tuple(range(1, len(moe) + 1))
    return op.StageModel(
        layers=layers,
        moe=tuple(moe),
        micro_batch=micro_batch,
        tokens=512,
        sizes=sizes,
        num_experts=4,
        degrees=degrees or {},
        **kw,
    )


def _random_fits(rng: random.Random) -> ClusterFits:
    alpha = ZERO | {k: rng.uniform(0, 0.3) for k in ("a2a", "gemm", *DENSE_KINDS)}
    beta = ZERO | {
        "a2a": rng.uniform(1e-7, 2e-5),
        "gemm": rng.uniform(1e-10, 1e-9),
        **{k: rng.uniform(1e-4, 4e-3) for k in DENSE_KINDS},
    }
    return ClusterFits.from_coefficients(alpha, beta)


def _brute_force(fits, stage, max_pieces, max_range) -> float:
    """Every way of cutting the layers into contiguous spans, each whole or in k pieces at the solved degrees or
    r = 1 (k >= 2 only where it saves MIN_GAIN of the span whole): the least total."""
    n = len(stage.layers)
    whole = [op.range_times(fits, stage, layer, layer, 1).total for layer in stage.layers]
    best = math.inf
    for cuts in itertools.product((False, True), repeat=n - 1):
        bounds = [0] + [i + 1 for i, cut in enumerate(cuts) if cut] + [n]
        total = 0.0
        for lo, hi in zip(bounds, bounds[1:]):
            base = math.fsum(whole[lo:hi])
            options = [base]
            if hi - lo <= max_range:
                for k in range(2, min(max_pieces, stage.micro_batch) + 1):
                    first, last = stage.layers[lo], stage.layers[hi - 1]
                    ms = min(op.range_times(fits, stage, first, last, k, unchunked=u).total for u in (False, True))
                    if ms <= (1 - MIN_GAIN) * base:
                        options.append(ms)
            total += min(options)
        best = min(best, total)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_dp_equals_brute_force(seed):
    rng = random.Random(seed)
    fits = _random_fits(rng)
    moe = [rng.random() < 0.6 for _ in range(5)]
    moe[rng.randrange(5)] = True
    degrees = {i + 1: (rng.choice((1, 2)), rng.choice((1, 2))) for i, m in enumerate(moe) if m}
    stage = _stage(moe, micro_batch=4, degrees=degrees)
    plan = op.plan_partition(fits, stage, max_pieces=3, max_range=3)
    assert plan.predicted_ms["partitioned"] == pytest.approx(_brute_force(fits, stage, 3, 3), rel=1e-12)
    assert plan.predicted_ms["partitioned"] <= plan.predicted_ms["unpartitioned"]
    for span in plan.ranges:
        assert span.pieces >= 2 and span.predicted_ms <= (1 - MIN_GAIN) * span.whole_ms
        assert span.last - span.first < 3
    covered = sum(r.predicted_ms for r in plan.ranges) + sum(
        op.range_times(fits, stage, layer, layer, 1).total
        for layer in stage.layers
        if not any(r.first <= layer <= r.last for r in plan.ranges)
    )
    assert covered == pytest.approx(plan.predicted_ms["partitioned"], rel=1e-12)


def test_large_start_up_times_keep_every_layer_whole():
    """A piece's fixed costs (alpha) larger than the all-to-all it could hide: k = 1 everywhere."""
    fits = _fits(alpha={k: 50.0 for k in DENSE_KINDS}, beta={"a2a": 1e-7})
    plan = op.plan_partition(fits, _stage([False, True, False, True]))
    assert plan.ranges == () and plan.as_tuples() == []
    assert plan.predicted_ms["partitioned"] == plan.predicted_ms["unpartitioned"]
    assert "none (no range predicted to gain)" in plan.report()


def test_long_all_to_alls_are_partitioned():
    """All-to-alls as long as the attention: the dispatch hides under the next piece's attention."""
    fits = _fits(
        alpha={k: 0.01 for k in DENSE_KINDS}, beta={"a2a": 1e-5, "gemm": 1e-9, **dict.fromkeys(DENSE_KINDS, 2e-3)}
    )
    stage = _stage([False, True, False, True], micro_batch=8)
    plan = op.plan_partition(fits, stage)
    assert plan.ranges and all(2 <= r.pieces <= 8 for r in plan.ranges)
    assert plan.predicted_ms["partitioned"] <= (1 - MIN_GAIN) * plan.predicted_ms["unpartitioned"]
    assert plan.hidden_ms["partitioned"] > plan.hidden_ms["unpartitioned"]
    assert plan.a2a_ms["partitioned"] >= plan.a2a_ms["unpartitioned"]  # each piece pays the count exchange
    text = plan.report()
    assert text.startswith("operator partition (Lancet), ranges: L") and len(text.splitlines()) == 3
    # the flags: a fixed k, fixed ranges, both (as asked, even where predicted slower), off
    assert all(r.pieces == 2 for r in op.plan_partition(fits, stage, pieces=2).ranges)
    given = op.plan_partition(fits, stage, ranges=[(2, 2)])
    assert [(r.first, r.last) for r in given.ranges] in ([], [(2, 2)])
    forced = op.plan_partition(_fits(alpha={k: 50.0 for k in DENSE_KINDS}), stage, pieces=4, ranges=[(1, 4)])
    assert forced.as_tuples() == [(1, 4, 4)]
    assert forced.predicted_ms["partitioned"] > forced.predicted_ms["unpartitioned"]
    assert op.plan_partition(fits, stage, pieces=1).ranges == ()


def test_nothing_to_plan_says_why():
    fits = _fits()
    assert "micro-batch size 1" in op.plan_partition(fits, _stage([True], micro_batch=1)).why
    assert "no all-to-all" in op.plan_partition(fits, _stage([False, False])).why


def test_old_profiles_load_and_the_planner_declines():
    old = ClusterFits.from_coefficients(ZERO | {"a2a": 0.1}, ZERO | {"a2a": 1e-7, "gemm": 1e-9}).to_json()
    for kind in [k for k in old["fits"] if k not in FIT_KINDS]:
        del old["fits"][kind]
    fits = ClusterFits.from_json(json.loads(json.dumps(old)))
    assert fits.missing_dense() == list(DENSE_KINDS)
    with pytest.raises(KeyError, match="attn"):
        fits["attn_bwd"]
    plan = op.plan_partition(fits, _stage([True, True]))
    assert plan.ranges == () and "re-profile" in plan.why and "re-profile" in plan.report()


def test_dense_lines_fit_and_round_trip():
    line = fit_linear([(256, 0.3 + 256 * 0.002), (512, 0.3 + 512 * 0.002), (1024, 0.3 + 1024 * 0.002)])
    assert line.alpha == pytest.approx(0.3) and line.beta == pytest.approx(0.002) and line.r2 == pytest.approx(1.0)
    fits = ClusterFits(fits={**_fits().fits, "attn": line, "mlp_bwd": LinearFit(alpha=1.0, beta=0.5)})
    back = ClusterFits.from_json(json.loads(json.dumps(fits.to_json())))
    assert back == fits and back.missing_dense() == []
    assert back["attn_bwd"] == LinearFit(alpha=2 * line.alpha, beta=2 * line.beta)  # no line: 2 x forward
    assert back["mlp_bwd"] == LinearFit(alpha=1.0, beta=0.5)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("auto", None), ("all", [(1, 6)]), ("2-3", [(2, 3)]), ("1-1, 3-6", [(1, 1), (3, 6)])],
)
def test_parse_ranges(text, expected):
    assert parse_ranges(text, 6) == expected


@pytest.mark.parametrize("text", ["3-2", "0-1", "1-7", "a-b", "2", "1-3,3-4", "4-5,1-2", ""])
def test_parse_ranges_names_the_flag_value_and_a_choice(text):
    with pytest.raises(ConfigError, match=rf"--moe-partition-range={text}: .*(auto|ascending)"):
        parse_ranges(text, 6)


def test_parse_pieces():
    assert parse_pieces("auto", 4) is None and parse_pieces("1", 4) == 1 and parse_pieces(4, 4) == 4
    for bad in ("0", "x", "-2", "5"):
        with pytest.raises(ConfigError, match=rf"--moe-partition-pieces={bad}: "):
            parse_pieces(bad, 4)


def test_run_flags_to_the_stage_model():
    from megatron_moe.config import parse_args
    from megatron_moe.overlap.degrees import layer_sizes

    argv = [
        "--num-layers",
        "4",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "128",
        "--max-position-embeddings",
        "128",
        "--micro-batch-size",
        "4",
        "--num-experts",
        "4",
        "--expert-model-parallel-size",
        "2",
        "--moe-layer-freq",
        "2",
    ]
    cfg = parse_args(argv)
    stage = op.stage_model(cfg, [3, 4])
    assert stage.layers == (3, 4) and stage.micro_batch == 4 and stage.tokens == 4 * 128
    assert stage.moe == tuple(bool(cfg.moe.layer_pattern(4)[n - 1]) for n in (3, 4))
    assert stage.sizes == layer_sizes(cfg) and stage.num_experts == 4
