"""Equivalence of every parallel layout with the single-process run, and exact resume.

All layouts start from one saved initial checkpoint (the single-process run's
weights) and train 4 steps on the same global batches (gloo, fp32, no dropout).
Tolerances: lm loss and params norm (--log-params-norm) within 1e-5 relative
and grad norm within 1e-4 relative of the single-process run (reduction order
differs between layouts; seen: ~1e-7). megatron-core's own MoE layer
(--moe-layer-impl mcore) is held to the same at EP=2.
Resume in the same layout (with dropout, per-rank RNG) must be bit-identical.
"""

import os

import pytest

from tests.distributed.launcher import assert_matches, computed
from tests.distributed.shared_jobs import train_part

JOB_PARTS = {  # the 4-rank parts load the reference's initial weights from its directory
    "reference": train_part("reference", 1, workdir="training"),
    "layouts": train_part("layouts", workdir="training", after=("reference",), timeout=900),
    "training_esp": train_part("esp", workdir="training", after=("reference",), timeout=900),
}


@pytest.fixture(scope="module")
def reference_runs(shared_jobs):
    return shared_jobs.result("reference"), shared_jobs.workdir("reference")


@pytest.fixture(scope="module")
def runs(shared_jobs, reference_runs):
    reference, workdir = reference_runs
    layouts = dict(shared_jobs.result("layouts"))
    layouts.update({k: v for k, v in reference.items() if k != "reference"})
    return reference["reference"], layouts, workdir


@pytest.fixture(scope="module")
def esp_runs(shared_jobs, reference_runs):
    reference, _ = reference_runs
    return reference, shared_jobs.result("training_esp")


@pytest.mark.parametrize(
    "layout",
    [
        "tp2", "ep2", "pp2", "pp2_dp_last", "tp2_ep2", "ep4_distopt", "ep2_distopt_2instances", "tp2_ep2_recompute",
        "pp2_ep2_recompute", "pp2_uneven_ep2",
    ],
)  # fmt: skip
def test_layout_matches_single_process(runs, layout):
    reference, layouts, _ = runs
    assert len(layouts[layout]) == len(reference) == 4
    assert_matches(layouts[layout], reference)


@pytest.mark.parametrize(
    "case", ["resume_ref_as_tp2_ep2", "resume_ep4_distopt_as_pp2", "resume_ep4_distopt_as_2instances"]
)
def test_checkpoint_resumes_in_another_layout(runs, case):
    reference, layouts, _ = runs
    assert [s["iteration"] for s in layouts[case]] == [3, 4]
    assert_matches(layouts[case], reference)


def test_mla_under_tp2_sp_ep2_matches_single_process_and_resumes_there(runs):
    """DeepSeek-V3's attention shrunk (MLA, q/kv latent norms, YaRN; issue 40) at TP=2 + SP x EP=2 with Lancet's
    greedy dW deferral, from the single-process run's initial weights; its step-2 checkpoint resumed in that layout
    recomputing the attention's modules (qkv, core_attention, attn_proj)."""
    _, layouts, _ = runs
    reference = layouts["mla"]
    assert len(reference) == 4 and reference[-1]["lm loss"] < reference[0]["lm loss"]
    assert_matches(layouts["mla_tp2_ep2"], reference)
    assert sum(step["wgrad"]["under_a2a"] for step in layouts["mla_tp2_ep2"]) > 0  # the greedy plan deferred dW
    resumed = layouts["mla_resume_as_tp2_ep2_recompute"]
    assert [s["iteration"] for s in resumed] == [3, 4]
    assert_matches(resumed, reference)


def test_only_tensor_parallel_layouts_show_tp_traffic(runs):
    """At TP=1 megatron-core's collectives over the TP group (one rank) are done locally: the timers see no `tp`
    kind; at TP=2 they do."""
    _, layouts, _ = runs
    for layout in ("ep2", "pp2", "ep4_distopt"):
        assert all(step["comm"]["calls"]["tp"] == 0 for step in layouts[layout]), (layout, layouts[layout][0]["comm"])
    assert all(step["comm"]["calls"]["tp"] > 0 for step in layouts["tp2"])


def test_arctic_activation_policy_under_tp_pp(runs):
    """int8 activations touch only the backward: step 1's loss is exact, later steps within 1%."""
    reference, layouts, _ = runs
    arctic = layouts["tp2_pp2_arctic"]
    assert arctic[0]["lm loss"] == pytest.approx(reference[0]["lm loss"], rel=1e-5)
    assert arctic[0]["grad norm"] == pytest.approx(reference[0]["grad norm"], rel=0.05)
    for step, ref in zip(arctic[1:], reference[1:]):
        assert step["lm loss"] == pytest.approx(ref["lm loss"], rel=0.01), (step, ref)


def test_fp16_stays_close_to_fp32(runs):
    """fp16 weights and compute with fp32 main weights: within 1% of the fp32 loss, no step skipped."""
    reference, layouts, _ = runs
    fp16 = layouts["fp16"]
    assert [s["skipped"] for s in fp16] == [False] * 4
    for step, ref in zip(fp16, reference):
        assert step["lm loss"] == pytest.approx(ref["lm loss"], rel=0.01), (step, ref)


def test_fp16_overflow_skips_the_step(runs):
    """A loss scale of 2^100 overflows fp16's gradients: each step is skipped (not a NaN error) and run on."""
    reference, layouts, _ = runs
    steps = layouts["fp16_overflow"]
    assert [(s["iteration"], s["skipped"]) for s in steps] == [(1, True), (2, True), (3, True), (4, True)]
    assert steps[0]["lm loss"] == pytest.approx(reference[0]["lm loss"], rel=0.01)  # the forward is fine


def test_resume_is_exact(runs):
    _, layouts, _ = runs
    straight, resumed = layouts["straight"], layouts["resumed"]
    assert [s["iteration"] for s in resumed] == [4, 5, 6]
    assert computed(resumed) == computed(straight[3:])


def test_loss_falls(runs):
    reference, _, _ = runs
    assert reference[-1]["lm loss"] < reference[0]["lm loss"]


def test_params_norm_is_the_norm_of_the_weights(runs):
    """--log-params-norm: each step's norm after the update; the last equals the saved weights' own norm."""
    reference, layouts, _ = runs
    norms = [step["params norm"] for step in reference]
    assert len(set(norms)) == len(norms)  # the weights move every step
    assert norms[-1] == pytest.approx(layouts["ref_params_norm_from_checkpoint"], rel=1e-6)


def test_megatron_core_moe_layer_trains_and_matches_itself_at_ep2(runs):
    """--moe-layer-impl mcore (the layer benchmark's reference) stays trainable from the CLI, at EP=2 and at TP=2
    with ESP unset (megatron-core's expert tensor parallelism over the TP ranks, Megatron-LM's default), and logs
    the single process's balancing loss in both."""
    _, layouts, _ = runs
    single, ep2, tp2 = layouts["mcore"], layouts["mcore_ep2"], layouts["mcore_tp2"]
    assert len(single) == len(ep2) == len(tp2) == 4
    assert single[-1]["lm loss"] < single[0]["lm loss"]
    assert all(step["moe aux loss"] > 0 for step in single)  # megatron-core's tracker, logged
    assert_matches(ep2, single)
    assert_matches(tp2, single)
    # Its logged balancing loss too: at TP=2 each rank tracks its share of the TP group's (was half the figure).
    for layout in (ep2, tp2):
        for step, ref in zip(layout, single):
            assert step["moe aux loss"] == pytest.approx(ref["moe aux loss"], rel=1e-5), (step, ref)


def test_a_balancing_loss_not_computed_is_not_logged(runs):
    """Balancing off, or a gate balanced by construction: no `moe aux loss` in the log (was logged as 0)."""
    reference, layouts, _ = runs
    assert all(step["moe aux loss"] > 0 for step in reference)
    for case in ("no_balancing", "expert_choice"):
        (step,) = layouts[case]
        assert "moe aux loss" not in step and "moe tokens cv" in step, (case, step)


def test_saves_leave_no_partial_checkpoint(runs):
    _, _, workdir = runs
    for root, dirs, files in os.walk(workdir):
        assert not [d for d in dirs if d.endswith(".tmp")], root
        assert not [f for f in files if f.endswith(".tmp")], root
    with open(os.path.join(workdir, "ref", "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == "4"


def test_every_process_group_has_the_flags_timeout(runs):
    """--distributed-timeout-minutes (10 by default) plus the watchdog's minute reaches every process group,
    megatron-core's expert and data-parallel groups included (which kept its 30 minutes before)."""
    _, layouts, _ = runs
    assert layouts["timeouts_default"] == [660.0]
    # The run's own groups have its timeout; the default group keeps the one the job's first run gave it.
    assert layouts["timeouts_3_minutes"] == [240.0, 660.0]


@pytest.mark.parametrize("layout", ["esp2_ep2", "tp2_esp2_ep2", "pp2_esp2", "esp2_ep2_distopt"])
def test_expert_sharded_layout_matches_single_process(esp_runs, layout):
    """Experts' FFN width split over ESP=2 ranks (with EP=2, TP=2+SP, PP=2, the distributed optimizer)
    trains as the single process does, from the same initial weights (resharded along F on load)."""
    reference, esp = esp_runs
    assert len(esp[layout]) == len(reference["reference"]) == 4
    assert_matches(esp[layout], reference["reference"])
    for step in esp[layout]:  # the experts really were sharded: the timers saw the ESP collectives both ways
        calls = step["comm"]["calls"]
        assert min(calls[k] for k in ("esp_ag", "esp_rs", "esp_ag_bwd", "esp_rs_bwd")) > 0, calls


def test_expert_sharded_swiglu_with_the_padded_all_to_all_matches_single_process(esp_runs):
    reference, esp = esp_runs
    assert len(esp["esp2_ep2_swiglu_padded"]) == 4
    assert_matches(esp["esp2_ep2_swiglu_padded"], reference["swiglu_padded"])


@pytest.mark.parametrize(
    "case, iterations",
    [("resume_ref_as_esp2_ep2", [3, 4]), ("resume_esp2_ep2_as_ep4", [3, 4]), ("resume_esp2_ep2_as_ep1", [3, 4])],
)
def test_checkpoints_resume_across_esp_sizes(esp_runs, case, iterations):
    """Model and optimizer state saved at one ESP x EP layout resume in another (load-time resharding)."""
    reference, esp = esp_runs
    assert [s["iteration"] for s in esp[case]] == iterations
    assert_matches(esp[case], reference["reference"])


# Figures of the MoE metrics (summed over every chunk's layers and reduced over the world) that must match too.
MOE_FIGURES = ("moe aux loss", "moe tokens cv", "moe dead experts", "moe router entropy")


@pytest.mark.parametrize("layout", ["pp2_vpp2", "pp2_vpp2_ep2", "pp2_vpp2_ep2_overlap_distopt"])
def test_interleaved_pipeline_matches_single_process(runs, layout):
    """PP=2 x VPP=2 (each rank two model chunks, megatron-core's interleaved 1F1B), also with EP=2 and with
    the distributed optimizer's overlapped reduction and gather, trains as the single process does; the MoE metrics
    cover both chunks of every rank."""
    reference, layouts, _ = runs
    assert len(layouts[layout]) == len(reference) == 4
    assert_matches(layouts[layout], reference)
    for step, ref in zip(layouts[layout], reference):
        for figure in MOE_FIGURES:
            assert step[figure] == pytest.approx(ref[figure], rel=1e-5), (figure, step, ref)


def test_an_interleaved_pipeline_checkpoint_holds_every_layer_once(runs):
    """Read by one plain model (no pipeline): the norm of its weights is the run's params norm at iteration 2."""
    reference, layouts, _ = runs
    assert layouts["vpp_params_norm_from_checkpoint"] == pytest.approx(reference[1]["params norm"], rel=1e-5)


@pytest.mark.parametrize("case", ["resume_vpp2_as_pp1", "resume_vpp2_as_pp2", "resume_ref_as_pp2_vpp2_ep2"])
def test_interleaved_pipeline_checkpoints_resume_in_other_pipeline_layouts(runs, case):
    """Saved at PP=2 x VPP=2 x EP=2 (a model state per chunk, layers numbered globally), resumed at PP=1 and at PP=2
    without virtual stages; and the single-process checkpoint resumed at PP=2 x VPP=2: the same losses."""
    reference, layouts, _ = runs
    assert [s["iteration"] for s in layouts[case]] == [3, 4]
    assert_matches(layouts[case], reference)


def test_multi_token_prediction_at_pp2_ep2_matches_one_process_and_resumes_exactly(runs):
    """--mtp-num-layers 1: the MTP layer (our MoE) on the last of 2 stages at EP=2 trains as on one process (lm
    loss, MTP loss, norms), and its checkpoint (the MTP stage's embedding copy tied to the first stage's) resumes
    bit-identically."""
    _, layouts, _ = runs
    one, split, resumed = layouts["mtp"], layouts["mtp_pp2_ep2"], layouts["mtp_pp2_ep2_resumed"]
    assert_matches(split, one)
    for step, ref in zip(split, one, strict=True):
        assert step["mtp_1 loss"] == pytest.approx(ref["mtp_1 loss"], rel=1e-5)
    assert one[-1]["mtp_1 loss"] < one[0]["mtp_1 loss"] and one[-1]["lm loss"] < one[0]["lm loss"]
    assert [s["iteration"] for s in resumed] == [3, 4]
    assert computed(resumed) == computed(split[2:])


@pytest.mark.parametrize("layout", ["mtp_tp2_ep2_overlaps", "mtp_pp2_vpp2_ep2_chunked", "mtp_pp2_vpp2_layout"])
def test_multi_token_prediction_composes_with_the_overlaps(runs, layout):
    """The MTP layer's norms under --sequence-parallel, its MoE in 2 pieces, its dW deferred; on the last virtual
    stage, its MoE chunked (FSMoE's pipeline at 2 x 2) with shadowing auto: as on one process."""
    _, layouts, _ = runs
    one, overlapped = layouts["mtp"], layouts[layout]
    assert_matches(overlapped, one)
    for step, ref in zip(overlapped, one, strict=True):
        assert step["mtp_1 loss"] == pytest.approx(ref["mtp_1 loss"], rel=1e-5)


@pytest.mark.parametrize("name", ["muon", "muon_layer_wise"])
def test_muon_at_ep2_trains_and_resumes_exactly(runs, name):
    """--optimizer muon (and its layer-wise distributed optimizer, bf16) at EP=2 with our MoE layer: 4 steps from
    the reference's initial weights, saved at 2; resumed from there, steps 3 and 4 are bit-identical."""
    reference, layouts, _ = runs
    straight, resumed = layouts[f"{name}_ep2"], layouts[f"{name}_ep2_resumed"]
    assert [s["iteration"] for s in straight] == [1, 2, 3, 4] and [s["iteration"] for s in resumed] == [3, 4]
    assert computed(resumed) == computed(straight[2:])
    assert straight[-1]["lm loss"] < straight[0]["lm loss"]
    assert [s["lm loss"] for s in straight[1:]] != [s["lm loss"] for s in reference[1:]]  # not Adam's steps


def test_tensor_parallel_newton_schulz_equals_the_unsharded(runs):
    """emerging_optimizers' newton_schulz_tp (the stand-in) over 4 ranks: duplicated gathers and computes the whole
    matrix (bit-identical), distributed all-reduces the Gram matrices (float32 rounding)."""
    errors = runs[1]["muon_tp_modes"]
    assert errors["duplicated_0"] == errors["duplicated_1"] == 0.0
    assert errors["distributed_0"] < 1e-5 and errors["distributed_1"] < 1e-5
