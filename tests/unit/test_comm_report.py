"""What training reports from the communication timers: the overlap warning (once per run, naming the
option), the TensorBoard scalars and the log line's figures."""

import logging

import pytest

from megatron_moe.comm.timers import SUMMARY_KINDS, CommSummary
from megatron_moe.config import parse_args
from megatron_moe.config.fields import ConfigError
from megatron_moe.training.comm_report import OVERLAP_OPTIONS, HiddenCheck, OverlapOption, tensorboard_scalars
from megatron_moe.training.logger import _comm_parts, _kind_parts, _layer_parts, exposed_by_group

BASE = ["--data-path", "d", "--tokenizer-model", "t.model", "--num-experts", "4"]
SHARED = [*BASE, "--expert-model-parallel-size", "2", "--moe-shared-expert-ffn-hidden-size", "64"]


def summary(*, dispatch_comm: float, dispatch_exposed: float, other: float = 0.0) -> CommSummary:
    comm = {**dict.fromkeys(SUMMARY_KINDS, 0.0), "a2a_dispatch": dispatch_comm, "other": other}
    exposed = {**dict.fromkeys(SUMMARY_KINDS, 0.0), "a2a_dispatch": dispatch_exposed, "other": other}
    total = dispatch_comm + other
    hidden = 1 - (dispatch_exposed + other) / total if total else 0.0
    zeros = dict.fromkeys(SUMMARY_KINDS, 0)
    return CommSummary(comm_ms=comm, exposed_ms=exposed, bytes=zeros, calls=zeros, per_layer={}, hidden_frac=hidden)


def test_the_shared_expert_is_an_overlap_option_only_with_ep():
    (shared,) = [option for option in OVERLAP_OPTIONS if "shared-expert" in option.description]
    assert shared.enabled(parse_args(SHARED))
    assert not shared.enabled(parse_args(BASE + ["--expert-model-parallel-size", "2"]))
    assert not shared.enabled(parse_args(BASE + ["--moe-shared-expert-ffn-hidden-size", "64"]))
    assert shared.hides == ("a2a_dispatch",)


def test_lancet_is_an_overlap_option_of_the_backward_all_to_alls_with_ep():
    (wgrad,) = [option for option in OVERLAP_OPTIONS if "--overlap-wgrad" in option.description]
    assert wgrad.hides == ("a2a_dispatch_bwd", "a2a_combine_bwd")
    assert wgrad.enabled(parse_args(BASE + ["--expert-model-parallel-size", "2"]))  # greedy by default
    assert wgrad.enabled(
        parse_args(BASE + ["--expert-model-parallel-size", "2", "--overlap-wgrad", "all-under-next-a2a"])
    )
    assert not wgrad.enabled(parse_args(BASE + ["--expert-model-parallel-size", "2", "--overlap-wgrad", "off"]))
    assert not wgrad.enabled(parse_args(BASE))  # EP=1: no all-to-all to hide under
    with pytest.raises(ConfigError, match="--overlap-wgrad=greedy: does nothing.*expert-model-parallel-size > 1"):
        parse_args(BASE + ["--overlap-wgrad", "greedy"])  # given where it can hide nothing, the flag is refused


def test_an_overlap_option_that_hides_nothing_is_named_once(caplog):
    check = HiddenCheck(parse_args(SHARED), window=20)
    with caplog.at_level(logging.WARNING, logger="megatron_moe"):
        # 2% of the dispatch hidden; the `other` kind (not the option's) is all exposed and does not count.
        said = [check.observe(summary(dispatch_comm=10.0, dispatch_exposed=9.8, other=50.0)) for _ in range(40)]
    assert all(s == [] for s in said[:19]) and all(s == [] for s in said[20:])
    (warning,) = said[19]
    assert "--moe-shared-expert-ffn-hidden-size" in warning and "hides nothing" in warning
    assert "2.0% of a2a_dispatch communication hidden over 20 steps" in warning
    assert [r.getMessage() for r in caplog.records] == [warning]


def test_an_overlap_option_that_hides_enough_or_is_off_says_nothing():
    hiding = HiddenCheck(parse_args(SHARED), window=20)
    assert all(hiding.observe(summary(dispatch_comm=10.0, dispatch_exposed=9.0)) == [] for _ in range(30))
    off = HiddenCheck(parse_args(BASE), window=20)
    assert all(off.observe(summary(dispatch_comm=10.0, dispatch_exposed=10.0)) == [] for _ in range(30))
    nothing_to_hide = HiddenCheck(parse_args(SHARED), window=3)
    assert all(nothing_to_hide.observe(summary(dispatch_comm=0.0, dispatch_exposed=0.0)) == [] for _ in range(5))


def test_rows_added_to_the_table_are_checked_on_their_own_kinds():
    options = (
        OverlapOption(description="--a", enabled=lambda cfg: True, hides=("other",)),
        OverlapOption(description="--b", enabled=lambda cfg: True, hides=("a2a_dispatch",)),
    )
    check = HiddenCheck(parse_args(BASE), window=2, options=options)
    check.observe(summary(dispatch_comm=10.0, dispatch_exposed=1.0, other=5.0))
    (warning,) = check.observe(summary(dispatch_comm=10.0, dispatch_exposed=1.0, other=5.0))
    assert warning.startswith("overlap option --a hides nothing: 0.0% of other")


def test_tensorboard_gets_every_kind_and_every_moe_layer():
    s = summary(dispatch_comm=4.0, dispatch_exposed=1.0)
    s.per_layer = {2: {"comm_ms": {"a2a_combine_bwd": 3.0}, "exposed_ms": {"a2a_combine_bwd": 2.0}, "calls": {}}}
    scalars = tensorboard_scalars(s)
    assert scalars["comm/hidden_frac"] == pytest.approx(0.75)
    assert scalars["comm/comm_ms/a2a_dispatch"] == 4.0 and scalars["comm/exposed_ms/a2a_dispatch"] == 1.0
    figures = ("comm_ms", "exposed_ms", "bytes", "calls")
    assert {f"comm/{f}/{k}" for f in figures for k in SUMMARY_KINDS} < set(scalars)
    assert scalars["comm/layer_002/comm_ms/a2a_combine_bwd"] == 3.0
    assert scalars["comm/layer_002/exposed_ms/a2a_combine_bwd"] == 2.0
    assert scalars["comm/layer_002/hidden_frac"] == pytest.approx(1 / 3)
    assert len(scalars) == 1 + 4 * len(SUMMARY_KINDS) + 3


def test_the_log_line_figures():
    """Two steps of 100 ms, 30 ms exposed out of 120 ms of communication in all."""
    parts = _comm_parts(steps=2, step_ms=200.0, exposed_ms=30.0, comm_ms=120.0)
    assert parts == ["exposed comm: 15.0 ms (15.0% of step)", "hidden: 75.0%"]
    assert _comm_parts(steps=0, step_ms=0.0, exposed_ms=0.0, comm_ms=0.0) == []  # timers off: nothing shown
    assert _comm_parts(steps=1, step_ms=10.0, exposed_ms=0.0, comm_ms=0.0) == [
        "exposed comm: 0.0 ms (0.0% of step)",
        "hidden: 0.0%",
    ]


def test_the_log_line_shows_exposed_all_to_all_esp_and_gradient_reduce_apart():
    step = {"a2a_dispatch": 3.0, "a2a_combine_bwd": 1.0, "esp_ag": 0.5, "dp_grad_reduce": 2.0, "tp": 7.0, "other": 1.0}
    kinds = exposed_by_group(step)
    assert kinds == {"a2a": 4.0, "esp": 0.5, "dp_grad_reduce": 2.0}  # tp and other are in the total only
    two_steps = {k: 2 * v for k, v in kinds.items()}
    assert _kind_parts(two_steps, steps=2) == ["exposed a2a / esp / dp_grad_reduce: 4.0 / 0.5 / 2.0 ms"]
    assert _kind_parts({}, steps=2) == [] and _kind_parts(kinds, steps=0) == []


def test_the_log_line_names_each_moe_layers_hidden_share():
    assert _layer_parts({4: [3.0, 10.0], 2: [5.0, 10.0], 6: [0.0, 0.0]}) == ["hidden by MoE layer: 2: 50% 4: 70% 6: 0%"]
    assert _layer_parts({}) == []


def test_the_flag_that_turns_them_off():
    assert parse_args(BASE).logging.no_comm_timers is False
    assert parse_args([*BASE, "--no-comm-timers"]).logging.no_comm_timers is True


def test_explicit_pipeline_degrees_are_overlap_options_with_ep():
    forward, backward = (
        next(option for option in OVERLAP_OPTIONS if option.description.startswith(flag))
        for flag in ("--moe-pipeline-degree", "--moe-bp-pipeline-degree")
    )
    assert forward.hides == ("a2a_dispatch", "a2a_combine")
    assert backward.hides == ("a2a_dispatch_bwd", "a2a_combine_bwd")
    ep2 = BASE + ["--expert-model-parallel-size", "2"]
    cfg = parse_args(ep2 + ["--moe-pipeline-degree", "4", "--moe-bp-pipeline-degree", "1"])
    assert forward.enabled(cfg) and not backward.enabled(cfg)
    assert backward.enabled(parse_args(ep2 + ["--moe-bp-pipeline-degree", "2"]))
    assert not forward.enabled(parse_args(ep2))  # auto: the solver's degrees, judged after set-up
    assert not forward.enabled(parse_args(BASE + ["--moe-pipeline-degree", "4"]))  # EP=1: nothing to pipeline
