"""Batch-level overlap (--overlap-moe-expert-parallel-comm, overlap/batch.py) changes no number.

Every layout of `train_worker.BATCH` (EP=2 with 4 micro-batches a step; EP=4; TP=2+SP+EP=2; PP=2+EP=2, run in
megatron-core's interleaved schedule with one chunk; PP=2 x VPP=2 + EP=2; EP=2 with MLA and qk-norm, a dense first
layer, a gated shared expert and an MTP layer), and TP=2+SP+EP=2 with the adaptive gradient partition, FSMoE's
pipeline at 2 x 2 and Lancet's greedy queue, trains 3 steps from the same seed without and with it: every computed
figure of the step log (lm loss, the router's losses and loads, grad norm, params norm) is bit-identical step by
step (each micro-batch's arithmetic is the same, and the gradients accumulate in the same order). The pairing
happened: forward-backward pairs ran, and forward stages ran under backward all-to-alls (none without the flag).
--moe-overlap-choice auto chooses by the profile's link (a slow one: batch-level overlap and Lancet's queue; a free
one: neither), and its run is the run of the chosen flags typed.
"""

import pytest

from tests.distributed.launcher import computed
from tests.distributed.shared_jobs import train_part

JOB_PARTS = {"batch_overlap": train_part("batch_overlap", timeout=1500)}
LAYOUTS = ["ep2", "ep4", "tp2_ep2", "pp2_ep2", "pp2_vpp2_ep2", "ep2_deepseek", "tp2_ep2_all_on"]


@pytest.fixture(scope="module")
def runs(shared_jobs):
    return shared_jobs.result("batch_overlap")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_batch_level_overlap_is_bit_identical_to_none(runs, layout):
    off, on = runs[f"{layout}/off"], runs[f"{layout}/on"]
    figures = computed(on["history"])
    assert len(figures) == 3 and {"lm loss", "moe aux loss", "grad norm", "params norm"} <= set(figures[-1])
    assert figures == computed(off["history"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_forward_ran_under_the_other_micro_batchs_backward_all_to_alls(runs, layout):
    off, on = runs[f"{layout}/off"]["counts"], runs[f"{layout}/on"]["counts"]
    assert off == {"paired": 0, "under": 0, "chunked": 0, "unchunked": 0}
    assert on["paired"] > 0 and on["under"] >= 2 * on["paired"], on
    if layout != "tp2_ep2_all_on":  # degrees 1 / 1: nothing to chunk
        assert on["chunked"] == on["unchunked"] == 0, on


def test_under_batch_level_overlap_only_the_lone_passes_run_the_pipelines_chunks(runs):
    """FSMoE's pipeline at 2 x 2 beside batch-level overlap, 4 micro-batches a step: per MoE layer and step, forward
    0 runs alone (chunked) and backward 3 alone (chunked); the other six passes run paired, whole. They ran chunked
    before, each chunk another all-to-all on a link the pair keeps busy (docs/overlap.md: 2x1, 0.2 Gbit/s, 4
    micro-batches, 6.69 s a step so, 7.24 s with every pass whole, 8.05 s with every pass chunked)."""
    on = runs["tp2_ep2_all_on/on"]["counts"]
    assert on["unchunked"] == 3 * on["chunked"] and on["chunked"] > 0 and on["chunked"] % (2 * 3) == 0, on


def test_a_checkpoint_saved_under_the_one_chunk_schedule_resumes_to_the_same_step(runs):
    """PP=2 without virtual stages says one virtual stage only while the schedule runs: a save reads the model's own
    layout (it asked for a vp_stage before), and the resumed step 3 is the uninterrupted run's."""
    resumed = computed(runs["pp2_ep2/resumed"]["history"])
    assert [step["iteration"] for step in resumed] == [3]
    (uninterrupted,) = computed(runs["pp2_ep2/on"]["history"])[2:]
    differ = {key: (resumed[0].get(key), uninterrupted.get(key)) for key in {*resumed[0], *uninterrupted}
              if resumed[0].get(key) != uninterrupted.get(key)}  # fmt: skip
    assert not differ


@pytest.mark.parametrize("link", ["slow", "free"])
def test_the_cost_model_chooses_and_the_run_is_the_chosen_flags_typed(runs, link):
    """--moe-overlap-choice auto at EP=2, 2 micro-batches: on a slow link batch-level overlap is predicted to save
    more than 5% and runs; on a free one nothing is predicted to gain, so nothing runs (the demo's case). Either way
    the run is the run of the chosen flags typed, figure for figure, and the chosen overlap ran (pairs)."""
    auto, typed = runs[f"choice/{link}/auto"]["history"], runs[f"choice/{link}/typed"]["history"]
    choice = auto[0]["startup"]["overlap_choice"]
    steps = choice["steps_ms"]
    assert {"none", "batch", "wgrad", "pipeline", "batch+wgrad+pipeline"} <= set(steps) and len(steps) == 8
    counts = runs[f"choice/{link}/auto"]["counts"]
    if link == "slow":
        assert "batch" in choice["on"] and steps["batch"] < 0.95 * steps["none"], choice
        assert counts["paired"] > 0 and counts["under"] >= 2 * counts["paired"], counts  # the chosen overlap ran
    else:
        assert choice["on"] == [] and max(steps.values()) == pytest.approx(min(steps.values())), choice
        assert counts["paired"] == counts["under"] == 0, counts
    assert computed(auto) == computed(typed) and len(computed(auto)) == 3
