"""Batch-level overlap (overlap/batch.py) in one process: the coroutine that runs one micro-batch's forward in turns
with another's backward, the order in which their stages run, and the flag pass's rules. The equivalence of whole
runs (EP=2, EP=4, TP=2+SP+EP=2, PP=2+EP=2, PP=2 x VPP=2 + EP=2): tests/distributed/test_batch_overlap.py."""

import gc
import threading
import weakref

import pytest
import torch

from megatron_moe.config import ConfigError, parse_and_validate
from megatron_moe.moe import handover
from megatron_moe.moe.handover import Coroutine, at_yield, run_paired, under_backward_comm
from megatron_moe.overlap import batch

FLAG = "--overlap-moe-expert-parallel-comm"
MOCK = ["--mock-data", "--tokenizer-model", "t.model", "--num-layers", "4", "--hidden-size", "64"]
MOE = [*MOCK, "--num-attention-heads", "4", "--num-experts", "4", "--seq-length", "32", "--micro-batch-size", "2"]


# ------------------------------------------------------------------------------------------------ the coroutine


def test_a_coroutine_runs_only_between_resume_and_pause_and_returns_its_result():
    trace = []

    def fn():
        trace.append("a")
        coroutine.pause()
        trace.append("b")
        coroutine.pause()
        trace.append("c")
        return 42

    coroutine = Coroutine(fn)
    assert coroutine.resume() and trace == ["a"]
    trace.append("caller")
    assert coroutine.resume() and trace == ["a", "caller", "b"]
    assert not coroutine.resume() and trace == ["a", "caller", "b", "c"]
    assert coroutine.done and coroutine.result == 42
    assert not coroutine.resume()  # a finished coroutine runs nothing more


def test_a_coroutines_error_is_raised_by_the_resume_that_ran_into_it():
    def fn():
        coroutine.pause()
        raise ValueError("forward failed")

    coroutine = Coroutine(fn)
    coroutine.resume()
    with pytest.raises(ValueError, match="forward failed"):
        coroutine.resume()
    assert coroutine.done


def test_closing_a_paused_coroutine_unwinds_its_frames():
    unwound = threading.Event()

    def fn():
        try:
            coroutine.pause()
            raise AssertionError("ran on after close")
        finally:
            unwound.set()

    coroutine = Coroutine(fn)
    coroutine.resume()
    coroutine.close()
    assert unwound.is_set() and coroutine.done and coroutine.result is None


def test_the_coroutine_takes_the_callers_grad_mode():
    def fn():
        return torch.is_grad_enabled()

    with torch.no_grad():
        off = Coroutine(fn)
        off.resume()
    on = Coroutine(fn)
    on.resume()
    assert off.result is False and on.result is True


# ------------------------------------------------------------------------------------------------ the pairing


def test_each_backward_all_to_all_runs_the_forwards_next_stage_under_it():
    """The forward runs to its first all-to-all (`at_yield`), then the backward; each backward all-to-all started
    (`under_backward_comm`) runs the forward up to its next all-to-all; the forward's rest runs after the backward."""
    trace = []

    def forward():
        for stage in ("attention+dispatch", "experts+combine", "next layer", "loss"):
            trace.append(f"F {stage}")
            if stage != "loss":
                at_yield()
        return "output"

    def backward():
        for stage in ("loss", "combine bwd", "dispatch bwd"):
            trace.append(f"B {stage}")
            if stage != "loss":
                under_backward_comm()
        return "grads"

    assert run_paired(forward, backward) == ("output", "grads")
    assert trace == [
        "F attention+dispatch",
        "B loss",
        "B combine bwd",
        "F experts+combine",
        "B dispatch bwd",
        "F next layer",
        "F loss",
    ]


def test_outside_a_pair_the_hand_over_points_do_nothing():
    at_yield()
    under_backward_comm()
    paired = handover.COUNTS["paired"]

    def forward():  # a forward that itself reaches a backward all-to-all (a recompute inside it) does not resume itself
        under_backward_comm()
        return 1

    assert run_paired(forward, lambda: 2) == (1, 2)
    assert handover.COUNTS["paired"] == paired + 1


def test_a_paired_pass_runs_unchunked_a_lone_one_at_its_degrees_and_only_there():
    """`chunked` narrows the pipeline degrees (forward, backward) only inside `alone`, on its own thread: a pass
    known to run paired gets 1, a lone one (or one not known: backward None) keeps its degree; each pass of degree
    above 1 is counted as run chunked or whole."""
    assert handover.chunked((2, 3)) == (2, 3)
    before = dict(handover.COUNTS)
    with handover.alone(True, False):
        assert handover.chunked((2, 3)) == (2, 1)
        seen = []
        other = threading.Thread(target=lambda: seen.append(handover.chunked((2, 3))))
        other.start()
        other.join()
        assert seen == [(2, 3)]  # thread-local: the other micro-batch's backward thread is not narrowed
        with handover.alone(False, True):
            assert handover.chunked((2, 3)) == (1, 3)
        assert handover.chunked((4, 1)) == (4, 1)
    with handover.alone(False, None):
        assert handover.chunked((2, 3)) == (1, 3)
    with handover.alone(False, False):
        assert handover.chunked((1, 1)) == (1, 1)
    assert handover.chunked((2, 3)) == (2, 3)
    counted = {key: handover.COUNTS[key] - before[key] for key in before}
    assert counted == {"paired": 0, "under": 0, "chunked": 4, "unchunked": 3}


@pytest.mark.parametrize(
    ("pipeline", "expected"),
    [(1, [(2, 1), (1, 1), (1, 1), (1, 3)]), (2, [(2, 3), (1, 3), (1, 3), (1, 3)])],
    ids=["no_pipeline", "pp2"],
)
def test_the_combined_step_runs_the_lone_passes_chunked(monkeypatch, pipeline, expected):
    """megatron-core's no-pipeline combined 1F1B with 4 micro-batches: forward 0 alone (its backward paired with
    forward 1), forwards 1-3 paired, backward 3 alone. Each forward's MoE degrees (2, 3) as `combined_step` leaves
    them: the lone passes chunked, the paired whole. Under PP the backward's pairing is not known at its forward:
    the backward degree stands."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import schedules

    seen = []

    def forward_step(*args, current_microbatch=None, **kwargs):
        seen.append(handover.chunked((2, 3)))
        return torch.zeros(()), 1

    monkeypatch.setattr(schedules, "forward_step", forward_step)
    monkeypatch.setattr(schedules, "backward_step", lambda *args: None)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda: pipeline)
    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 1)
    config = type("Config", (), {"virtual_pipeline_model_parallel_size": None})()
    model = torch.nn.Linear(1, 1)
    model.model_type = None  # what megatron-core's get_model_type reads for the backward step
    for microbatch in range(4):
        b_model = None if microbatch == 0 else model
        batch.combined_step(
            None, None, model, 4, None, [], b_model, None, None, None, config, current_microbatch=microbatch
        )
    assert seen == expected


def test_a_failed_backward_ends_the_paired_forward():
    ended = threading.Event()

    def forward():
        try:
            at_yield()
            at_yield()
        finally:
            ended.set()

    def backward():
        raise RuntimeError("backward failed")

    with pytest.raises(RuntimeError, match="backward failed"):
        run_paired(forward, backward)
    assert ended.is_set() and handover._PAIRED is None


def test_a_finished_pair_keeps_nothing_of_its_forward_alive():
    """The coroutine thread outlives its coroutines: what a forward's closure and result hold (the step's model, with
    its process groups and their transport threads) must be freed when the caller lets go of them. It was not: the
    thread held its last coroutine, and a 4-rank job kept 179 destroyed gloo groups (537 threads) per rank alive,
    their TCP loops polling, which made each later part up to 3x slower."""

    class Model:
        pass

    held = {"model": Model()}
    alive = weakref.ref(held["model"])

    def forward():
        at_yield()
        return [held["model"]]

    result, _ = run_paired(forward, lambda: under_backward_comm())
    assert result == [alive()]
    held.clear()
    del forward, result
    gc.collect()
    assert alive() is None


# ------------------------------------------------------------------------------------------------ the flag pass


@pytest.mark.parametrize(
    "flags, world",
    [
        (["--expert-model-parallel-size", "2", "--global-batch-size", "8"], 2),
        (["--expert-model-parallel-size", "2", "--global-batch-size", "8", "--delay-wgrad-compute"], 2),
        (["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--global-batch-size", "8"], 4),
        (["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"], 4),
    ],
)
def test_batch_level_overlap_is_accepted_with_expert_parallelism(flags, world):
    cfg = parse_and_validate([*MOE, FLAG, *flags], world)
    assert cfg.moe.overlap_moe_expert_parallel_comm


@pytest.mark.parametrize(
    "flags, world, message",
    [
        (["--expert-model-parallel-size", "2", "--recompute-granularity", "full"], 2,
         rf"^{FLAG}=True: off with full activation recompute"),
        (["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--global-batch-size", "4"], 4,
         rf"^--global-batch-size=4: at least --pipeline-model-parallel-size=2 micro-batches a step with {FLAG}"),
    ],
)  # fmt: skip
def test_batch_level_overlap_is_refused_by_name_where_it_cannot_run(flags, world, message):
    with pytest.raises(ConfigError, match=message):
        parse_and_validate([*MOE, FLAG, *flags], world)


def test_without_expert_parallelism_the_flag_changes_nothing_and_is_set_back():
    """As the house's other EP-only flags: accepted with a start-up line (nothing to hide at EP=1), not run."""
    assert not parse_and_validate([*MOE, FLAG], 1).moe.overlap_moe_expert_parallel_comm


def test_delay_wgrad_compute_needs_the_overlap_and_lancets_queue():
    ep2 = [*MOE, "--expert-model-parallel-size", "2", "--delay-wgrad-compute"]
    with pytest.raises(ConfigError, match=rf"^--delay-wgrad-compute=True: only with {FLAG}"):
        parse_and_validate(ep2, 2)
    with pytest.raises(ConfigError, match=r"^--overlap-wgrad=off: greedy or all-under-next-a2a with --delay-wgrad"):
        parse_and_validate([*ep2, FLAG, "--overlap-wgrad", "off"], 2)


def test_pp_without_virtual_stages_runs_the_interleaved_schedule_with_one_chunk():
    pp2 = [*MOE, "--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]
    assert batch.one_chunk_pipeline(parse_and_validate([*pp2, FLAG], 4))
    assert not batch.one_chunk_pipeline(parse_and_validate(pp2, 4))
    vpp = [*pp2, FLAG, "--num-layers-per-virtual-pipeline-stage", "1"]
    assert not batch.one_chunk_pipeline(parse_and_validate(vpp, 4))
