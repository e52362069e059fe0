"""megatron_moe/overlap/choice.py and piece_schedule.paired_times: batch-level overlap simulated, the step's formula,
the choice's rule (a feature on only where it saves MIN_GAIN), and which features a run's flags leave open."""

import dataclasses

import pytest

from megatron_moe.config import RunConfig
from megatron_moe.overlap import choice
from megatron_moe.overlap.cost_model import DENSE_KINDS, FIT_KINDS, MIN_GAIN, ClusterFits, LayerSizes
from megatron_moe.overlap.piece_schedule import StageModel, paired_times
from megatron_moe.training.overlap_choice import open_features, with_features

ZERO = {k: 0.0 for k in FIT_KINDS} | {k: 0.0 for k in DENSE_KINDS}


def _fits(a2a_beta=1e-3, a2a_alpha=0.0) -> ClusterFits:
    beta = ZERO | {"a2a": a2a_beta, "gemm": 1e-3, "attn": 1.0, "mlp": 1.0, "route": 0.5, "unroute": 0.5}
    return ClusterFits.from_coefficients(ZERO | {"a2a": a2a_alpha}, beta)


def _stage(**kw) -> StageModel:
    """One MoE layer, 4 tokens a micro-batch: attention 4 ms, route 2, each all-to-all 6, experts 2, unroute 2
    (backward: the dense lines doubled, the experts' dX and dW 2 each); EP = 1 in the sizes (no count exchange)."""
    sizes = LayerSizes(n_a2a=6000.0, n_ag=0.0, n_rs=0.0, n_exp=2000.0, ep=1)
    return StageModel(layers=(1,), moe=(True,), micro_batch=2, tokens=4, sizes=sizes, **kw)


def test_the_pair_by_hand():
    """Forward alone 22 ms (4+2, dispatch 6, 2, combine 6, 2), backward alone 30 (4, combine' 6, 2, dispatch' 6,
    route' 4, attention' 8; the dW under dispatch'). Paired, the backward's unroute' runs under the forward's
    dispatch, the forward's experts under combine', the backward's experts under the forward's combine, and the
    link carries the four all-to-alls back to back from 6 to 30: 42 ms, not 52."""
    forward, backward, pair = paired_times(_fits(), _stage())
    assert (forward, backward, pair) == (22.0, 30.0, 42.0)


def test_a_free_link_pairs_to_the_sum():
    """Nothing on the link: the pair is the two passes' compute one after the other."""
    forward, backward, pair = paired_times(_fits(a2a_beta=0.0), _stage())
    assert pair == pytest.approx(forward + backward)


def test_the_pair_absorbs_deferred_weight_gradients_in_idle_compute():
    """Lancet's deferral: the deferred dW fills the pair's idle compute, so the pair is no longer than without it."""
    deferred = paired_times(_fits(), _stage(defer_wgrad=True, experts_defer_wgrad=True))
    plain = paired_times(_fits(), _stage())
    assert deferred[2] <= plain[2]
    assert deferred[1] <= plain[1]


def test_step_formula():
    times = choice.MicroBatchTimes(forward=22.0, backward=30.0, pair=42.0)
    assert choice.step_ms(times, micro_batches=4, pp=1) == 52 + 3 * 42  # forward 0 and backward 3 alone
    assert choice.step_ms(times, micro_batches=4, pp=2) == 52 + 2 * 52 + 2 * 42  # bubble, warm-up, 2 pairs
    assert choice.step_ms(dataclasses.replace(times, pair=None), micro_batches=4, pp=1) == 4 * 52
    assert choice.step_ms(times, micro_batches=2, pp=4) == 3 * 52 + 2 * 52  # no pair at all


def test_candidates_never_pair_batch_overlap_with_the_partition():
    labels = {c.label() for c in choice.candidates(["batch", "wgrad", "partition"])}
    assert labels == {"none", "batch", "wgrad", "partition", "batch+wgrad", "wgrad+partition"}


def test_decide_adds_only_what_saves_min_gain():
    steps = {"none": 100.0, "batch": 80.0, "wgrad": 99.0, "batch+wgrad": 79.0}
    assert choice.decide(["batch", "wgrad"], steps) == {"batch"}  # wgrad saves 1 of 80: inside the model's error
    steps["batch+wgrad"] = 80.0 * (1 - MIN_GAIN) - 0.1
    assert choice.decide(["batch", "wgrad"], steps) == {"batch", "wgrad"}
    assert (
        choice.decide(["batch", "wgrad"], {"none": 100.0, "batch": 97.0, "wgrad": 101.0, "batch+wgrad": 90.0}) == set()
    )
    # the bench's 2x1 figures: batch alone saves 5.1%, Lancet's queue after it 1%
    bench = {"none": 5610.4, "batch": 5322.7, "wgrad": 5473.8, "batch+wgrad": 5268.8}
    assert choice.decide(["batch", "wgrad"], bench) == {"batch"}


def test_decide_never_runs_batch_overlap_with_the_partition():
    steps = {"none": 100.0, "batch": 80.0, "partition": 70.0, "wgrad": 100.0, "batch+wgrad": 80.0,
             "wgrad+partition": 70.0}  # fmt: skip
    assert choice.decide(["batch", "wgrad", "partition"], steps) == {"partition"}


def _cfg(**moe) -> RunConfig:
    cfg = RunConfig()
    par = dataclasses.replace(cfg.parallel, expert_model_parallel_size=2)
    m = dataclasses.replace(cfg.moe, num_experts=4, moe_overlap_choice="auto", **moe)
    return dataclasses.replace(cfg, parallel=par, moe=m)


def test_open_features_and_what_the_flags_fix():
    cfg = _cfg()
    assert open_features(cfg, micro_batches=4) == (("batch", "wgrad", "pipeline"), {})
    features, fixed = open_features(cfg, micro_batches=1)
    assert features == ("wgrad", "pipeline") and "nothing to pair" in fixed["batch"]
    typed = _cfg(overlap_moe_expert_parallel_comm=True, overlap_wgrad="all-under-next-a2a", moe_pipeline_degree="2")
    features, fixed = open_features(typed, micro_batches=4)
    assert features == ()
    assert fixed == {"batch": "given on", "wgrad": "--overlap-wgrad all-under-next-a2a",
                     "pipeline": "--moe-pipeline-degree 2 / auto"}  # fmt: skip


def test_open_features_names_the_rule_that_refuses_batch_overlap():
    cfg = _cfg()
    cfg = dataclasses.replace(cfg, activations=dataclasses.replace(cfg.activations, recompute_granularity="full"))
    features, fixed = open_features(cfg, micro_batches=4)
    assert "batch" not in features and "full activation recompute" in fixed["batch"]


def test_with_features_sets_only_what_it_decides():
    cfg = _cfg()
    chosen = with_features(cfg, ("batch", "wgrad"), {"batch"})
    assert chosen.moe.overlap_moe_expert_parallel_comm and chosen.moe.overlap_wgrad == "off"
    kept = with_features(cfg, ("wgrad",), {"wgrad"})
    assert not kept.moe.overlap_moe_expert_parallel_comm and kept.moe.overlap_wgrad == "greedy"
    unchunked = with_features(cfg, ("pipeline",), set())
    assert (unchunked.moe.moe_pipeline_degree, unchunked.moe.moe_bp_pipeline_degree) == (1, 1)


def test_typed_degrees_stand_beside_the_solved_ones():
    from megatron_moe.overlap.cost_model import Schedule
    from megatron_moe.training.overlap_choice import given_degrees

    solved = {1: Schedule(forward=3, backward=2, predicted_ms={}, case={})}
    assert given_degrees(_cfg(moe_bp_pipeline_degree="1"), solved)[1].forward == 3
    assert given_degrees(_cfg(moe_bp_pipeline_degree="1"), solved)[1].backward == 1
    assert given_degrees(_cfg(), solved)[1].backward == 2


def test_the_pair_is_priced_at_the_degrees_a_paired_pass_runs():
    """Under batch-level overlap the lone passes keep the pipeline's chunks and the paired ones run whole
    (`handover.chunked`): the candidate's forward and backward are the chunked stage's, its pair the whole one's;
    without PP the paired backward is whole too, under PP it keeps its degree (its pairing is not known)."""
    from megatron_moe.overlap.cost_model import Schedule
    from megatron_moe.training.overlap_choice import paired_degrees

    fits, chunked, whole = _fits(a2a_alpha=1.0), _stage(degrees={1: (2, 2)}), _stage()  # each chunk 1 ms more
    both = choice.Candidate(on=frozenset({"batch", "pipeline"}))
    times = choice.stage_times(fits, [chunked], both, paired=[whole])
    assert (times.forward, times.backward) == paired_times(fits, chunked)[:2]
    assert times.pair == paired_times(fits, whole)[2] != paired_times(fits, chunked)[2]
    assert choice.stage_times(fits, [chunked], both).pair == paired_times(fits, chunked)[2]  # none given: its own
    solved = {1: Schedule(forward=3, backward=2, predicted_ms={}, case={})}
    assert (paired_degrees(solved, 1)[1].forward, paired_degrees(solved, 1)[1].backward) == (1, 1)
    assert (paired_degrees(solved, 2)[1].forward, paired_degrees(solved, 2)[1].backward) == (1, 2)
