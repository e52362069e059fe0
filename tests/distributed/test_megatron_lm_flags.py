"""The flags a Megatron-LM user types, each group parsed and run (`train_worker.py megatron_lm`, 4 gloo
ranks at EP=2, one torchrun job, 4 steps per run from the same seed), and the same corpus through each
--tokenizer-type, trained and resumed."""

import math
import os

import pytest

from tests.distributed.launcher import computed
from tests.distributed.shared_jobs import Part

TRAIN_ARGS = ("megatron_lm", "{data}", "{tokenizer}", "{workdir}", "{tokenizer_runs}")
JOB_PARTS = {"megatron_lm": Part("train_worker", "megatron_lm", 4, TRAIN_ARGS, timeout=900)}
LR, MIN_LR = 1e-3, 1e-4


@pytest.fixture(scope="module")
def workdir(shared_jobs):
    return shared_jobs.workdir("megatron_lm")


@pytest.fixture(scope="module")
def runs(shared_jobs):
    return shared_jobs.result("megatron_lm")


def lrs(history):
    return [step["learning rate"] for step in history]


def cosine(samples, warmup, decay):
    ratio = min(1.0, (samples - warmup) / (decay - warmup))
    return MIN_LR + 0.5 * (math.cos(math.pi * ratio) + 1) * (LR - MIN_LR)


def test_a_run_counted_in_samples_is_the_run_counted_in_iterations(runs):
    # 32 samples at global batch 8 = 4 iterations; warm-up 8 samples = 1 iteration, decay 24 = 3
    assert len(runs["samples"]) == len(runs["iters"]) == 4
    assert computed(runs["samples"]) == computed(runs["iters"])


def test_the_schedules_follow_megatron_lms_formulas(runs):
    # the learning rate logged after each step: the scheduler has counted 8, 16, 24, 32 samples
    assert lrs(runs["iters"]) == pytest.approx([LR, cosine(16, 8, 24), MIN_LR, MIN_LR], rel=1e-9)
    # WSD: constant until the last 2 iterations (16 samples), then linear down to --min-lr
    assert lrs(runs["wsd"]) == pytest.approx([LR, LR, MIN_LR + 0.5 * (LR - MIN_LR), MIN_LR], rel=1e-9)
    # --lr-warmup-fraction 0.25 of the 32-sample decay: warm-up over 8 samples
    assert lrs(runs["fraction"]) == pytest.approx([LR, cosine(16, 8, 32), cosine(24, 8, 32), MIN_LR], rel=1e-9)


def test_the_router_flags_are_the_gates_they_name(runs):
    # --moe-router-score-function sigmoid is --moe-gate sigmoid; --moe-router-pre-softmax is no renormalisation
    assert computed(runs["score_sigmoid"]) == computed(runs["gate_sigmoid"])
    assert computed(runs["pre_softmax"]) == computed(runs["no_normalize"])
    assert computed(runs["pre_softmax"]) != computed(runs["iters"])


def test_megatron_lms_spellings_train_as_ours(runs):
    # --moe-shared-expert-intermediate-size, --recompute-activations, --use-rotary-position-embeddings read as
    # ours; --moe-router-dtype fp32, --rotary-percent 1.0 and the rest change nothing
    assert len(runs["megatron_lm_spelling"]) == 4
    assert computed(runs["megatron_lm_spelling"]) == computed(runs["our_spelling"])


@pytest.mark.parametrize("case", ["scaled_probs", "position", "mcore"])
def test_the_drop_policies_and_the_scaling_factor_train(runs, case):
    history = runs[case]
    assert len(history) == 4
    assert all(math.isfinite(step["lm loss"]) and math.isfinite(step["grad norm"]) for step in history), history


def test_overlapped_parameter_gather_changes_nothing_but_when(runs):
    # the same step, evaluation and checkpoint: the pre-hooks gather before each (Megatron-LM's disable/enable)
    assert computed(runs["param_gather"]) == computed(runs["distopt"])
    assert runs["param_gather_params_norm"] == runs["distopt_params_norm"]


def test_the_logging_flags_reach_the_log_and_tensorboard(runs, workdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    history = runs["logging"]
    assert all(isinstance(step["num zeros"], int) and step["num zeros"] >= 0 for step in history)
    events = EventAccumulator(os.path.join(workdir, "tb"), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    # Megatron-LM's names where the quantity is the same, grouped (training/tensorboard_tags.py); the loss and
    # optimizer ones also against the consumed samples, under vs_samples/, the timers not
    grouped = {"loss/lm loss", "optim/learning-rate", "optim/grad-norm", "optim/batch-size"}
    # a tag zero at every step so far is held back: num-zeros appears only once a step had a zero gradient entry
    assert ("optim/num-zeros" in tags) == any(step["num zeros"] for step in history), tags
    timers = {"throughput/tflops-per-device", "throughput/iteration-time", "throughput/tokens-per-sec"}
    assert grouped | timers | {f"vs_samples/{tag}" for tag in grouped} <= tags, (grouped | timers) - tags
    assert not {f"vs_samples/{tag}" for tag in timers} & tags and not any(" vs samples" in tag for tag in tags)
    assert {"loss/lm loss validation", "loss/lm loss validation ppl"} <= tags, tags
    # EP=2 on 4 ranks (DP=4): the all-to-alls and the gradient reduction; no TP, PP or ESP traffic, no drops
    assert {"comm/exposed_ms/a2a_dispatch", "comm/exposed_ms/dp_grad_reduce"} <= tags, tags
    assert not [tag for tag in tags if tag.endswith(("/tp", "/pp_p2p", "/esp_ag", "/shadow")) or "dropped" in tag]
    # --tensorboard-log-interval 2: the step scalars at steps 2 and 4 only, i.e. after 16 and 32 samples
    assert [e.step for e in events.Scalars("loss/lm loss")] == [2, 4]
    assert [e.step for e in events.Scalars("vs_samples/loss/lm loss")] == [16, 32]
    assert all(e.value > 0 for e in events.Scalars("throughput/tflops-per-device"))
    validation = zip(events.Scalars("loss/lm loss validation"), events.Scalars("loss/lm loss validation ppl"))
    for loss, ppl in validation:
        assert ppl.value == pytest.approx(math.exp(loss.value), rel=1e-5)
    # tokens per expert: a histogram per MoE layer (1 and 3), a scalar per expert; every routed pair counted
    histograms = {"moe_layers/layer_001/tokens_per_expert", "moe_layers/layer_003/tokens_per_expert"}
    assert histograms <= set(events.Tags()["histograms"])
    per_expert = [events.Scalars(f"moe_layers/layer_001/expert_{e:03d}_tokens")[-1].value for e in range(4)]
    assert sum(per_expert) == 8 * 32 * 2  # global batch 8 x 32 tokens x top-2


def test_the_start_up_summary_counts_every_parameter_once_in_any_layout(runs):
    ep2, tp2 = runs["iters"][0]["startup"], runs["tp2_ep2"][0]["startup"]
    assert ep2["parameters"]["total"] == tp2["parameters"]["total"]
    assert tp2["parameters"]["this_rank"] < ep2["parameters"]["this_rank"] < ep2["parameters"]["total"]
    # 2 MoE layers (--moe-layer-freq 2 of 4) x (4 experts - top 2) x fc1 + fc2 (64 x 256 each) not met per token
    assert ep2["parameters"]["total"] - ep2["parameters"]["active_per_token"] == 2 * 2 * 2 * 64 * 256
    documents, sequences = ep2["datasets"]["train"]
    assert 0 < documents and 4 * 8 <= sequences  # at least the 4 steps' samples


@pytest.mark.parametrize("kind", ["SentencePieceTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer"])
def test_each_tokenizer_type_trains_and_resumes_exactly(runs, tokenizer_train_data, kind):
    straight, resumed = runs[f"{kind}/straight"], runs[f"{kind}/resumed"]
    files = " + ".join(tokenizer_train_data[kind][5::2])  # the values of the tokenizer's file flags
    files = os.path.join(files, "tokenizer.json") if kind == "HuggingFaceTokenizer" else files  # a directory
    assert straight[0]["startup"]["tokenizer"] == f"{kind} {files}"
    assert [s["iteration"] for s in straight] == [1, 2, 3, 4] and [s["iteration"] for s in resumed] == [3, 4]
    assert computed(resumed) == computed(straight[2:])
    assert straight[-1]["lm loss"] < straight[0]["lm loss"]


def test_the_tokenizer_types_saw_their_own_tokens(runs):
    """GPT-2's files and the same BPE as a tokenizer.json make the same data; the sentencepiece model other data."""
    first = {kind: runs[f"{kind}/straight"][0]["lm loss"] for kind in ("SentencePieceTokenizer", "GPT2BPETokenizer")}
    assert computed(runs["GPT2BPETokenizer/straight"]) == computed(runs["HuggingFaceTokenizer/straight"])
    assert first["SentencePieceTokenizer"] != first["GPT2BPETokenizer"]


def test_megatron_lms_own_moe_test_configs_train_two_steps_on_cpu(runs):
    """Megatron-LM's functional-test configs that need no GPU-only feature, degrees as written (4 ranks), sizes
    shrunk (tests/distributed/megatron_lm_configs.py): each trains its 2 steps with finite, falling-or-flat losses."""
    from tests.distributed.megatron_lm_configs import CPU_RUNS

    for name in CPU_RUNS:
        history = runs[f"config:{name}"]
        losses = [step["lm loss"] for step in history]
        assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses), (name, history)
        assert losses[1] < losses[0] + 0.1, (name, losses)
