"""TensorBoard that a person reads (training/tensorboard_tags.py): only tags that can be non-zero in the run's
layout, none zero for the whole run, one group per concern, the samples axis under one prefix; and a one-rank
training run's event file read back, which holds no tag that breaks these rules."""

from __future__ import annotations

import types

import pytest

from megatron_moe.comm.timers import SUMMARY_KINDS
from megatron_moe.config.parallel_dims import ParallelDims
from megatron_moe.training.comm_report import HEADLINE_FIGURES, SCALAR_FIGURES
from megatron_moe.training.tensorboard_tags import (
    GROUPS,
    TAGS,
    Dashboard,
    TagLayout,
    ZeroHold,
    expert_load_tag,
    tag_of,
)
from tests.unit.one_rank_run import one_rank_trainer


def layout(world=1, *, moe=True, **degrees) -> TagLayout:
    flags = {k: v for k, v in degrees.items() if k in ("tp", "pp", "cp", "ep", "esp")}
    features = {k: v for k, v in degrees.items() if k not in flags}
    return TagLayout(dims=ParallelDims(world=world, **flags), moe=moe, **features)


def comm_tags() -> set[str]:
    """Every per-kind tag `comm_report.tensorboard_scalars` can write, and its totals."""
    per_kind = {
        f"{'comm' if figure in HEADLINE_FIGURES else 'comm_detail'}/{figure}/{kind}"
        for figure in SCALAR_FIGURES
        for kind in SUMMARY_KINDS
    }
    totals = {f"comm/total_{f}" for f in ("exposed_ms", "wire_ms", "skew_ms", "transfer_ms")} | {"comm/hidden_frac"}
    return per_kind | totals


def test_every_name_the_logger_writes_gets_a_group():
    names = [*TAGS, "moe aux loss", "moe dropped fraction", "moe/layer_003/tokens_cv", "lm loss validation"]
    for name in names:
        assert tag_of(name).split("/", 1)[0] in GROUPS, name
    assert tag_of("lm loss") == "loss/lm loss" and tag_of("grad-norm") == "optim/grad-norm"  # Megatron-LM's leaf
    assert tag_of("moe aux loss") == "moe/aux loss"
    assert tag_of("moe/layer_003/tokens_cv") == "moe_layers/layer_003/tokens_cv"
    assert tag_of("comm_detail/bytes/tp") == "comm_detail/bytes/tp"  # already grouped
    assert tag_of("something new") == "other/something new"  # kept, not lost


@pytest.mark.parametrize(
    "where, expected",
    [
        (layout(1), set()),  # one rank: no communication at all
        (layout(1, moe=False), set()),
        (layout(2, ep=2), {"a2a_dispatch", "a2a_dispatch_bwd", "a2a_combine", "a2a_combine_bwd", "dp_grad_reduce",
                           "other"}),  # the demo's layout: EP=2 over DP=2
        (layout(2, ep=2, moe=False), {"dp_grad_reduce", "other"}),
        (layout(2, tp=2, moe=False), {"tp", "other"}),
        (layout(2, tp=2), {"tp", "dp_grad_reduce", "other"}),  # experts not split by TP: expert-DP 2 reduces
        (layout(2, pp=2), {"pp_p2p", "other"}),
        (layout(4, ep=2, esp=2), {"a2a_dispatch", "a2a_dispatch_bwd", "a2a_combine", "a2a_combine_bwd",
                                  "esp_ag", "esp_ag_bwd", "esp_rs", "esp_rs_bwd", "tp", "dp_grad_reduce", "other"}),
        (layout(2, ep=2, shadow=True), {"a2a_dispatch", "a2a_dispatch_bwd", "a2a_combine", "a2a_combine_bwd",
                                        "shadow", "shadow_bwd", "dp_grad_reduce", "other"}),
        (layout(2, shadow=True), {"dp_grad_reduce", "other"}),  # EP=1: nothing to shadow
    ],
)  # fmt: skip
def test_comm_kinds_are_those_of_the_layout(where, expected):
    assert where.comm_kinds() == expected
    written = {tag for tag in comm_tags() if where.can_occur(tag)}
    assert {tag.rsplit("/", 1)[1] for tag in written} - {"hidden_frac", *(f"total_{f}" for f in SCALAR_FIGURES)} == (
        expected
    )
    assert ("comm/total_exposed_ms" in written) == bool(expected)


def test_skew_only_for_the_kinds_whose_skew_is_measured():
    demo = layout(2, ep=2)
    assert demo.can_occur("comm_detail/skew_ms/a2a_combine_bwd") and demo.can_occur("comm/total_skew_ms")
    assert not demo.can_occur("comm_detail/skew_ms/dp_grad_reduce")  # megatron-core's: not split, all transfer
    assert demo.can_occur("comm_detail/transfer_ms/dp_grad_reduce")
    assert not layout(2, tp=2).can_occur("comm/total_skew_ms")  # no kind whose skew is measured
    assert demo.can_occur("comm_layers/layer_001/skew_ms/a2a_dispatch")
    assert not demo.can_occur("comm_layers/layer_001/exposed_ms/esp_ag")


def test_features_that_make_a_figure_exist():
    assert not layout().can_occur("moe/dropped fraction") and layout(drops=True).can_occur("moe/dropped fraction")
    assert not layout().can_occur("moe_layers/layer_001/dropped_fraction")
    assert not layout(moe=False).can_occur("moe/tokens cv") and layout().can_occur("moe/tokens cv")
    assert not layout().can_occur("optim/loss-scale") and layout(fp16=True).can_occur("optim/loss-scale")
    assert not layout().can_occur("vs_samples/optim/loss-scale")  # the samples axis follows its tag
    assert layout().can_occur("loss/lm loss") and layout().can_occur("throughput/tokens-per-sec")


def test_a_tag_zero_so_far_is_held_then_written_with_its_history():
    hold = ZeroHold()
    assert hold.admit("comm/exposed_ms/other", 0.0, 1) == [] and hold.admit("comm/exposed_ms/other", 0.0, 2) == []
    assert hold.held_tags() == {"comm/exposed_ms/other"}
    points = hold.admit("comm/exposed_ms/other", 3.0, 3)
    assert [(step, value) for _, value, step, _ in points] == [(1, 0.0), (2, 0.0), (3, 3.0)]
    assert [p[1:3] for p in hold.admit("comm/exposed_ms/other", 0.0, 4)] == [(0.0, 4)]  # live: zeros written now
    assert hold.held_tags() == set()


def test_a_dead_expert_is_shown_beside_the_experts_that_get_tokens():
    hold = ZeroHold()
    assert hold.admit(expert_load_tag(1, 0), 0.0, 1) == []  # expert 0 first: nothing of the layer yet
    released = hold.admit(expert_load_tag(1, 1), 5.0, 1)
    assert [p[0] for p in released] == [expert_load_tag(1, 0), expert_load_tag(1, 1)]
    assert hold.admit(expert_load_tag(2, 0), 0.0, 1) == []  # another layer: its own family


def test_the_held_points_are_bounded():
    hold = ZeroHold(limit=3)
    for step in range(10):
        hold.admit("t/x", 0.0, step)
    assert [p[2] for p in hold.admit("t/x", 1.0, 10)] == [7, 8, 9, 10]


class FakeWriter:
    def __init__(self):
        self.scalars: dict[str, list[tuple[int, float]]] = {}
        self.histograms: list[str] = []

    def add_scalar(self, tag, value, step, walltime=None):
        self.scalars.setdefault(tag, []).append((step, value))

    def add_histogram(self, tag, values, step):
        self.histograms.append(tag)


def test_the_samples_axis_for_the_loss_and_optimizer_tags_only_under_one_prefix():
    writer, logged = FakeWriter(), []
    wandb = types.SimpleNamespace(log=lambda values, step: logged.append((step, values)))
    board = Dashboard(writer, layout=layout(1), wandb_run=wandb)
    board.scalars({"lm loss": 3.0, "learning-rate": 1e-3, "tokens-per-sec": 5.0, "comm/exposed_ms/tp": 1.0}, 2, 16)
    assert writer.scalars == {
        "loss/lm loss": [(2, 3.0)],
        "vs_samples/loss/lm loss": [(16, 3.0)],
        "optim/learning-rate": [(2, 1e-3)],
        "vs_samples/optim/learning-rate": [(16, 1e-3)],
        "throughput/tokens-per-sec": [(2, 5.0)],
    }  # no tp traffic on one rank, even if a timer said so
    assert logged == [(2, {"loss/lm loss": 3.0, "optim/learning-rate": 1e-3, "throughput/tokens-per-sec": 5.0})]
    board.expert_loads({1: [4.0, 0.0], 3: [2.0, 2.0]}, 2, scalar_layers=1)
    assert writer.histograms == ["moe_layers/layer_001/tokens_per_expert", "moe_layers/layer_003/tokens_per_expert"]
    assert writer.scalars[expert_load_tag(1, 1)] == [(2, 0.0)] and expert_load_tag(3, 0) not in writer.scalars


def test_a_one_rank_run_writes_no_tag_that_is_zero_throughout_or_cannot_occur(megatron_world1, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    flags = "--train-iters 3 --eval-interval 3 --eval-iters 1 --log-throughput --tensorboard-dir".split()
    cfg, trainer = one_rank_trainer(*flags, str(tmp_path))
    assert len(trainer.train()) == 3
    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    where = TagLayout.of(cfg, 1)
    assert not [tag for tag in tags if not where.can_occur(tag)]
    assert not [tag for tag in tags if all(e.value == 0 for e in events.Scalars(tag))]
    assert {tag.removeprefix("vs_samples/").split("/", 1)[0] for tag in tags} <= set(GROUPS)
    assert not [tag for tag in tags if tag.startswith(("comm", "optim/loss-scale")) or "dropped" in tag]
    expected = {"loss/lm loss", "loss/lm loss validation", "vs_samples/loss/lm loss", "optim/learning-rate",
                "optim/grad-norm", "throughput/tokens-per-sec", "moe/tokens cv", "moe/aux loss",
                "moe_layers/layer_001/expert_000_tokens"}  # fmt: skip
    assert expected <= tags, expected - tags
    assert [e.step for e in events.Scalars("loss/lm loss")] == [1, 2, 3]
