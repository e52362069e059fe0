"""A Megatron-LM user's flags parse as Megatron-LM means them, or say in one line why not."""

import dataclasses
import json
import logging
import math
import re
import sys
import types

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping, topk_routing_with_score_function

from megatron_moe.config import ConfigError, ConfigErrors, build_parser, parse_and_validate, parse_args
from megatron_moe.config.fields import as_typed, flag_name
from megatron_moe.config.groups import GROUPS
from megatron_moe.config.megatron_lm import (
    NOT_NEEDED,
    NOT_NEEDED_WITH,
    REFUSED,
    RENAMED,
    TOKENIZER_TYPES_READ_AS,
    TOKENIZER_TYPES_REFUSED,
)
from megatron_moe.data.files import check_data_files
from megatron_moe.model.builder import transformer_config
from megatron_moe.moe import MoELayerConfig, build_gate, capacity_limit
from megatron_moe.moe.ordering import sort_pairs
from megatron_moe.platform import PeakRate
from megatron_moe.training.flops import flops_per_token, matmul_params_per_token
from megatron_moe.training.logger import TrainingLogger, wandb_run_for

BASE = ["--data-path", "d", "--tokenizer-model", "t.model"]
MOE = [*BASE, "--num-experts", "8"]


def cfg(*flags, world=1):
    c = parse_args([*BASE, *flags])
    c.validate(world_size=world)
    return c


def error(*flags) -> str:
    with pytest.raises(ConfigError) as caught:
        cfg(*flags)
    message = str(caught.value)
    assert "\n" not in message and "usage:" not in message, message
    return message


def note(*flags) -> str:
    """The one start-up line a flag that changes nothing in this run gets (it is accepted, not refused)."""
    notes = cfg(*flags).notes
    assert len(notes) == 1, notes
    assert notes[0].endswith("; accepted and ignored"), notes
    return notes[0]


# ---------------------------------------------------------------------------------------- unknown and foreign flags


def test_a_misspelt_flag_is_one_line_with_the_closest_flag_and_its_group():
    message = error("--moe-expert-capcity-factor", "1.0")
    assert message.startswith("unknown flag --moe-expert-capcity-factor; did you mean --moe-expert-capacity-factor?")
    assert "group moe" in message
    assert error("--lr-warmup-iter", "3").startswith("unknown flag --lr-warmup-iter; did you mean --lr-warmup-iters?")
    assert error("--zzzz-qqqq") == "unknown flag --zzzz-qqqq (--help lists every flag by group)"
    assert "invalid int value: 'x'" in error("--num-layers", "x")


@pytest.mark.parametrize("flag", sorted(NOT_NEEDED))
def test_a_megatron_lm_flag_not_needed_here_is_accepted_with_its_reason(flag):
    takes_value, why = NOT_NEEDED[flag]
    c = parse_args([*BASE, flag, *(["nccl"] if takes_value else []), "--num-layers", "2"])
    assert c.model.num_layers == 2  # what follows it is read as before
    assert c.notes == [f"{flag}: not needed here ({why}); accepted and ignored"]
    assert "notes" not in c.to_dict()


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_a_megatron_lm_flag_that_would_mislead_is_refused_with_its_reason(flag):
    message = error(flag, *(["2"] if REFUSED[flag][0] else []))
    assert message == f"{flag}: {REFUSED[flag][1]}"


def test_a_renamed_megatron_lm_flag_is_read_as_ours_with_a_line_saying_so():
    assert set(RENAMED).isdisjoint(NOT_NEEDED) and set(RENAMED).isdisjoint(REFUSED)
    c = cfg("--moe-shared-expert-intermediate-size", "96", *MOE[len(BASE) :], "--num-layers", "2")
    assert c.moe.moe_shared_expert_ffn_hidden_size == 96 and c.model.num_layers == 2
    assert c.notes == [
        "--moe-shared-expert-intermediate-size: read as --moe-shared-expert-ffn-hidden-size 96 (same meaning here)"
    ]
    assert (
        cfg("--moe-shared-expert-intermediate-size=64", *MOE[len(BASE) :]).moe.moe_shared_expert_ffn_hidden_size == 64
    )
    c = cfg("--position-embedding-type", "learned_absolute", "--use-rotary-position-embeddings")
    assert c.model.position_embedding_type == "rope"  # Megatron-LM's old switch wins when it comes last, as there
    c = cfg("--recompute-activations")  # Megatron-LM: selective recompute of core attention
    assert c.activations.selective and c.activations.recompute_modules == ["core_attention"]
    assert c.activation_policy().mode("core_attention") == "recompute"


@pytest.mark.parametrize("flag", sorted(NOT_NEEDED_WITH))
def test_a_megatron_lm_flag_is_accepted_with_a_value_that_changes_nothing_and_refused_with_another(flag):
    values, why, otherwise = NOT_NEEDED_WITH[flag]
    c = parse_args([*BASE, flag, values[0], "--num-layers", "2"])
    assert c.model.num_layers == 2
    assert c.notes == [f"{flag} {values[0]}: not needed here ({why}); accepted and ignored"]
    message = error(f"{flag}=7")
    assert message == f"{flag}=7: {otherwise} (accepted: {', '.join(values)})"


def test_megatron_lms_whole_moe_group_is_answered():
    """Every flag of Megatron-LM's `_add_moe_args` (as of megatron-core 0.16) is ours, renamed, not needed or
    refused with a reason: none is an unknown flag."""
    megatron_lm_moe = (
        "--expert-model-parallel-size --expert-tensor-parallel-size --num-experts --moe-layer-freq "
        "--moe-ffn-hidden-size --moe-shared-expert-intermediate-size --moe-shared-expert-overlap --moe-grouped-gemm "
        "--moe-use-legacy-grouped-gemm --moe-layer-recompute --moe-extended-tp --moe-use-upcycling "
        "--moe-router-load-balancing-type --moe-router-dtype --moe-router-fusion --moe-router-score-function "
        "--moe-router-topk --moe-router-pre-softmax --moe-router-num-groups --moe-router-group-topk "
        "--moe-router-topk-scaling-factor --moe-router-enable-expert-bias --moe-router-bias-update-rate "
        "--moe-router-force-load-balancing --moe-router-padding-for-fp8 --moe-aux-loss-coeff --moe-z-loss-coeff "
        "--moe-input-jitter-eps --moe-per-layer-logging --moe-token-dispatcher-type --moe-enable-deepep "
        "--moe-deepep-num-sms --moe-permute-fusion --moe-expert-capacity-factor --moe-pad-expert-input-to-capacity "
        "--moe-token-drop-policy --moe-apply-probs-on-input --overlap-moe-expert-parallel-comm "
        "--delay-wgrad-compute --moe-upcycling-granularity --moe-pad-experts-for-cuda-graph-inference"
    ).split()
    ours = {option for action in build_parser()._actions for option in action.option_strings}
    answered = ours | set(RENAMED) | set(NOT_NEEDED) | set(NOT_NEEDED_WITH) | set(REFUSED)
    assert [flag for flag in megatron_lm_moe if flag not in answered] == []


def test_attention_softmax_in_fp32_reaches_megatron_core_under_half_precision():
    assert transformer_config(cfg("--bf16", "--attention-softmax-in-fp32")).attention_softmax_in_fp32
    assert not transformer_config(cfg("--bf16")).attention_softmax_in_fp32
    assert note("--attention-softmax-in-fp32") == (
        "--attention-softmax-in-fp32: changes nothing in this run (it applies only with --fp16 or --bf16); "
        "accepted and ignored"
    )


def test_help_says_each_default_once_and_offers_no_none_or_double_negation():
    parser = build_parser()
    text = parser.format_help().replace("\n" + " " * 24, " ")
    assert parser.format_usage().count("\n") == 1  # no usage dump of every flag
    for action in parser._actions:
        assert not any(option.startswith("--no-no-") for option in action.option_strings), action.option_strings
        assert None not in (action.choices or ()), action.option_strings
        assert (action.help or "").count("default") <= 1, action.help
        assert "(default: None" not in (action.help or ""), action.help
    assert "--train-samples" in text and "--moe-router-score-function {softmax,sigmoid}" in text


# ---------------------------------------------------------------------------------------------- samples and schedules


def test_samples_set_the_iterations_and_the_schedule_in_samples():
    c = cfg("--train-samples", "330", "--global-batch-size", "32", "--lr-warmup-samples", "64")
    assert c.training.train_iters == 10  # whole global batches, as Megatron-LM
    assert c.training.lr_schedule_samples() == {"warmup": 64, "decay": 330, "wsd_decay": None}
    c = cfg("--train-iters", "10", "--global-batch-size", "32", "--lr-warmup-fraction", "0.1")
    assert c.training.lr_schedule_samples() == {"warmup": 32, "decay": 320, "wsd_decay": None}
    c = cfg("--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "3", "--global-batch-size", "4")
    assert c.training.train_iters == 100 and c.training.lr_schedule_samples()["wsd_decay"] == 12


@pytest.mark.parametrize(
    ("flags", "start"),
    [
        (["--train-iters", "5", "--train-samples", "100"], "--train-iters=5: and --train-samples both"),
        (["--train-samples", "100", "--lr-warmup-iters", "2"], "--lr-warmup-iters=2: counts iters"),
        (["--train-iters", "5", "--lr-decay-samples", "20"], "--lr-decay-samples=20: counts samples"),
        (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"], "--lr-warmup-fraction=0.1: and --lr-warmup-iters"),
        (["--lr-warmup-fraction", "1.5"], "--lr-warmup-fraction=1.5: must be in [0, 1)"),
        (["--lr-decay-style", "WSD"], "--lr-decay-style=WSD: needs the length of its final decay"),
        (["--train-samples", "3", "--global-batch-size", "4"], "--train-samples=3: must be at least one global"),
        (["--ckpt-format", "torch"], "--ckpt-format=torch: this stack writes and reads"),
        (["--tensorboard-log-interval", "0"], "--tensorboard-log-interval=0: must be > 0"),
    ],
)
def test_a_schedule_or_logging_flag_that_cannot_work_is_named(flags, start):
    assert error(*flags).startswith(start)


@pytest.mark.parametrize(
    ("flags", "start"),
    [
        (["--lr-wsd-decay-iters", "3"], "--lr-wsd-decay-iters 3: changes nothing in this run (it applies only with"),
        (["--overlap-param-gather"], "--overlap-param-gather: changes nothing in this run (it applies only with --use"),
        (["--wandb-exp-name", "x"], "--wandb-exp-name x: changes nothing in this run (it applies only with --wandb"),
        (["--log-validation-ppl-to-tensorboard"], "--log-validation-ppl-to-tensorboard: changes nothing in this run"),
    ],
)
def test_a_schedule_or_logging_flag_that_changes_nothing_is_accepted_with_one_line(flags, start):
    assert note(*flags).startswith(start)


# ---------------------------------------------------------------------------------------------------- router flags


def test_router_flags_become_our_gates_settings():
    c = cfg("--num-experts", "8", "--moe-router-score-function", "sigmoid")
    assert c.moe.layer_config(c.model).gate == "sigmoid"
    c = cfg("--num-experts", "8", "--moe-router-pre-softmax", "--moe-router-topk-scaling-factor", "2.5")
    settings = c.moe.layer_config(c.model)
    assert not settings.normalize_topk and settings.topk_scaling_factor == 2.5
    c = cfg("--num-experts", "8", "--moe-expert-capacity-factor", "1", "--moe-token-drop-policy", "position")
    assert c.moe.layer_config(c.model).drop_policy == "position"
    assert "selects --moe-gate topk, not --moe-gate sigmoid; drop one" in error(
        "--num-experts", "8", "--moe-gate", "sigmoid", "--moe-router-score-function", "softmax"
    )
    assert "only with --num-experts and --moe-gate topk or sigmoid" in note(
        "--num-experts", "8", "--moe-gate", "xmoe", "--moe-router-score-function", "sigmoid"
    )
    assert note(
        "--num-experts", "8", "--moe-gate", "switch", "--moe-router-topk", "1", "--moe-router-pre-softmax"
    ).startswith("--moe-router-pre-softmax: changes nothing in this run")
    assert note("--num-experts", "8", "--moe-token-drop-policy", "probs").startswith(
        "--moe-token-drop-policy probs: changes nothing in this run (it applies only with a positive"
    )


H, E, T = 16, 8, 64


def route(*, score="softmax", pre_softmax=False, scaling=None, policy=None, topk=2):
    settings = MoELayerConfig(
        num_experts=E,
        hidden_size=H,
        ffn_hidden_size=8,
        topk=topk,
        gate="sigmoid" if score == "sigmoid" else "topk",
        normalize_topk=not pre_softmax,
        topk_scaling_factor=scaling,
        drop_policy=policy,
        capacity_factor=1.0,
    ).validate()
    torch.manual_seed(0)
    gate = build_gate(settings)
    x = torch.randn(T, H)
    routing = gate(x)
    logits = (x @ gate.weight.t()).float()
    return routing, logits


def dense(routing):
    """[T, E] combine weights of the routing's pairs."""
    weights = torch.zeros(T, E)
    tokens = torch.arange(T).repeat(routing.expert_N.numel() // T)
    return weights.index_put_((tokens, routing.expert_N), routing.weight_N.detach())


@pytest.mark.parametrize(
    ("score", "pre_softmax", "scaling"),
    [("softmax", False, None), ("softmax", True, None), ("softmax", True, 2.5), ("sigmoid", False, None),
     ("sigmoid", False, 2.5)],
)  # fmt: skip
def test_our_gates_weigh_as_megatron_cores_router(score, pre_softmax, scaling):
    routing, logits = route(score=score, pre_softmax=pre_softmax, scaling=scaling)
    probs, routing_map = topk_routing_with_score_function(
        logits, 2, use_pre_softmax=pre_softmax, scaling_factor=scaling, score_function=score
    )
    assert torch.equal(dense(routing) > 0, routing_map)
    torch.testing.assert_close(dense(routing), probs, rtol=1e-6, atol=1e-7)


def kept(routing) -> torch.Tensor:
    """[T, E] True where the pair got one of the capacity's slots."""
    pair, expert, slot, _ = sort_pairs(routing)
    capacity = capacity_limit(1.0, num_tokens=T, topk=2, num_experts=E)
    mask = torch.zeros(T, E, dtype=torch.bool)
    keep = slot < capacity
    return mask.index_put_((pair[keep] % T, expert[keep]), torch.tensor(True))


def test_the_probs_drop_policy_keeps_what_megatron_core_keeps():
    routing, logits = route(policy="probs")
    probs, routing_map = topk_routing_with_score_function(logits, 2)
    _, final_map = apply_router_token_dropping(probs, routing_map, 2, 1.0, drop_policy="probs")
    assert torch.equal(kept(routing), final_map)
    assert int(final_map.sum()) < 2 * T  # some pairs were dropped: the policy chose


def test_the_position_drop_policy_keeps_each_experts_earliest_tokens():
    routing, _ = route(policy="position")
    mask, capacity = kept(routing), capacity_limit(1.0, num_tokens=T, topk=2, num_experts=E)
    chosen = dense(routing) > 0
    for e in range(E):
        tokens = chosen[:, e].nonzero().flatten()
        assert torch.equal(mask[:, e].nonzero().flatten(), tokens[:capacity])
    default, _ = route()
    assert not torch.equal(kept(default), mask)  # k-major (GShard) keeps others: the flag changed something


# ----------------------------------------------------------------------------------------------- throughput, wandb


def test_model_flops_count_every_weight_a_token_meets():
    c = cfg(
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--ffn-hidden-size", "128", "--num-experts", "8", "--moe-router-topk", "2", "--moe-layer-freq", "2",
    )  # fmt: skip
    attention = 4 * 64 * 64
    dense_layer, moe_layer = attention + 2 * 64 * 128, attention + 64 * 8 + 2 * (2 * 64 * 128)
    assert matmul_params_per_token(c, 1000) == moe_layer + dense_layer + 64 * 1000
    assert flops_per_token(c, 1000) == 6 * (moe_layer + dense_layer + 64 * 1000) + 12 * 2 * 32 * 64


def test_wandb_missing_is_named_with_the_flag(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ConfigError, match=r"--wandb-project=p: needs the wandb package"):
        wandb_run_for("p", "x", "/tmp/unused", {})
    assert wandb_run_for(None, None, None, {}) is None


def test_wandb_gets_what_tensorboard_gets(monkeypatch, tmp_path):
    logged, inits = [], []
    run = types.SimpleNamespace(log=lambda values, step: logged.append((step, values)), finish=lambda: None)
    fake = types.SimpleNamespace(init=lambda **kw: inits.append(kw) or run)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    wandb = wandb_run_for("proj", "exp", str(tmp_path / "w"), {"model": {}})
    assert inits == [{"project": "proj", "name": "exp", "dir": str(tmp_path / "w"), "config": {"model": {}}}]
    logger = TrainingLogger(
        train_iters=2, log_interval=2, tokens_per_step=64, tensorboard_dir=None, wandb_run=wandb,
        flops_per_step=1e12, devices=2, validation_ppl=True,
    )  # fmt: skip
    for it in (1, 2):
        logger.step(it, {"lm loss": 3.0}, lr=1e-3, grad_norm=1.0, skipped=False, num_zeros=5)
    logger.validation(2, {"lm loss": 2.0})
    steps = {}
    for step, values in logged:
        steps.setdefault(step, {}).update(values)
    assert steps[1]["loss/lm loss"] == 3.0 and steps[1]["optim/num-zeros"] == 5
    assert steps[1]["optim/learning-rate"] == 1e-3 and steps[2]["throughput/tflops-per-device"] > 0
    validation = {"loss/lm loss validation": 2.0, "loss/lm loss validation ppl": pytest.approx(math.exp(2.0))}
    assert logged[-1] == (2, validation)


def test_the_log_record_holds_megatron_lms_figures(caplog, tmp_path):
    """The full record (--log-format json; log.jsonl either way) holds what Megatron-LM's line shows; the short
    line keeps its `iteration N/ M` and `lm loss:` / `grad norm:` labels."""
    path = tmp_path / "tb" / "log.jsonl"
    logger = TrainingLogger(
        train_iters=10, log_interval=2, tokens_per_step=8 * 32, tensorboard_dir=None, flops_per_step=4e9,
        peak_flops=PeakRate(1e18, "measured GEMM rate"), devices=2, global_batch_size=8, jsonl_path=str(path),
    )  # fmt: skip
    with caplog.at_level("INFO", logger="megatron_moe"):
        for it in (1, 2):
            figures = {"lm loss": 3.5, "moe dropped fraction": 0.125, "moe tokens cv": 0.5}
            logger.step(it, figures, lr=1e-3, grad_norm=1.0, skipped=False, consumed_samples=8 * it, loss_scale=4096.0)
    line = caplog.records[-1].getMessage()
    assert re.match(r"iteration +2/10 \| lm loss: 3\.5000 \| grad norm: 1 \|", line), line
    (record,) = [json.loads(text) for text in path.read_text().splitlines()]
    assert record["consumed_samples"] == 16 and record["consumed_tokens"] == 512
    assert record["global_batch_size"] == 8 and record["loss_scale"] == 4096.0 and record["learning_rate"] == 1e-3
    assert record["lm loss"] == 3.5 and record["moe dropped fraction"] == 0.125 and record["moe tokens cv"] == 0.5
    tflops, mfu = record["tflops_per_device"], record["mfu_percent"]
    assert tflops > 0 and mfu == pytest.approx(100 * tflops / 1e6)  # of 1 EFLOP/s
    assert record["mfu_of"] == "measured GEMM rate"


def test_megatron_cores_noise_is_filtered_in_one_place_and_shown_once_with_verbose():
    from megatron_moe.failure import MegatronNoise

    noise = MegatronNoise()

    def record(name, message):
        return logging.LogRecord(name, logging.WARNING, __file__, 1, message, None, None)

    unknown = record("megatron.core.transformer.transformer_layer", "Unknown MLP type: <ModuleSpec>. Using default")
    assert not noise.filter(unknown)
    assert noise.filter(record("megatron.core.optimizer", "a real warning"))  # anything else passes
    assert noise.filter(record("megatron_moe", "Unknown MLP type in our own words"))  # ours are never noise
    noise.verbose = True
    assert noise.filter(unknown) and not noise.filter(unknown)  # --verbose: once


# ------------------------------------------------------------------------------------- tokenizer types, mock data


@pytest.mark.parametrize("kind", sorted(TOKENIZER_TYPES_READ_AS))
def test_megatron_lms_sentencepiece_tokenizer_types_are_read_as_ours_with_one_line(kind):
    ours, differs = TOKENIZER_TYPES_READ_AS[kind]
    for flags in (["--tokenizer-type", kind], [f"--tokenizer-type={kind}"]):
        c = cfg(*flags, "--num-layers", "2")
        assert (c.data.tokenizer_type, c.model.num_layers) == (ours, 2)
        assert c.notes == [f"--tokenizer-type {kind}: read as --tokenizer-type {ours} ({differs})"]
    assert "prepends BOS" in TOKENIZER_TYPES_READ_AS["Llama2Tokenizer"][1]  # the one difference, said


@pytest.mark.parametrize("kind", sorted(TOKENIZER_TYPES_REFUSED))
def test_megatron_lms_other_tokenizer_types_are_refused_with_the_reason(kind):
    assert error("--tokenizer-type", kind) == f"--tokenizer-type={kind}: {TOKENIZER_TYPES_REFUSED[kind]}"


def test_mock_data_needs_no_data_path_and_refuses_one():
    c = parse_args(["--tokenizer-model", "t.model", "--mock-data"])
    c.validate(1)
    assert c.data.mock_data and c.data.data_path == [] and c.notes == []
    with pytest.raises(ConfigError) as caught:
        parse_args(["--tokenizer-model", "t.model"]).validate(1)
    assert str(caught.value).startswith("--data-path=[]: give a .bin/.idx prefix")
    with pytest.raises(ConfigError, match=r"^--data-path=d: and --mock-data both name the training data: give one"):
        cfg("--mock-data")
    (line,) = parse_args(["--tokenizer-model", "t.model", "--mock-data", "--split", "9,1,0"]).notes
    assert line.startswith("--split 9,1,0: changes nothing in this run (it applies only with --data-path: ")


# ----------------------------------------------------------------------------------- every error in one pass


def test_every_configuration_error_is_reported_in_one_pass():
    """Refused Megatron-LM flags, bad values, unknown flags and the run's rules: all of them, each once."""
    with pytest.raises(ConfigErrors) as caught:
        parse_and_validate(
            [
                *BASE, "--moe-extended-tp", "--tokenizer-type", "Llama3Tokenizer", "--num-layers", "x",
                "--mokc-data", "--recompute-modules", "qkv", "bogus", "--num-attention-heads", "3", "--lr", "-1",
                "--tensorboard-log-interval", "0",
            ],
            world_size=1,
        )  # fmt: skip
    assert caught.value.errors == [
        "--moe-extended-tp: deprecated in Megatron-LM too: use --expert-tensor-parallel-size",
        "argument --tokenizer-type: invalid choice: 'Llama3Tokenizer' (choose from 'SentencePieceTokenizer', "
        "'GPT2BPETokenizer', 'HuggingFaceTokenizer', 'NullTokenizer')",
        "argument --num-layers: invalid int value: 'x'",
        "unknown flag --mokc-data; did you mean --mock-data? (similar flags in group data: --mock-data)",
        "--hidden-size=256: must be a multiple of --num-attention-heads=3",
        "--lr=-1.0: must be >= 0, e.g. --lr 0.0003",
        "--recompute-modules=bogus: a module name, one of: input_norm, qkv, core_attention, attn_proj, "
        "pre_mlp_norm, router, ordering, dispatch, expert_fc1, expert_act, expert_fc2, combine, unorder, "
        "shared_expert, mlp_fc1, mlp_act, mlp_fc2, or megatron-core's core_attn, moe_act, layernorm, mlp, "
        "shared_experts, moe, mla_up_proj",
        "--tensorboard-log-interval=0: must be > 0, e.g. --tensorboard-log-interval 1",
    ]
    message = str(caught.value)
    assert message.startswith("8 configuration errors:\n  --moe-extended-tp: ") and "usage:" not in message
    assert message.count("\n") == 8


def test_one_error_stays_one_line_and_a_flag_set_aside_is_not_blamed_twice():
    with pytest.raises(ConfigError) as caught:
        parse_and_validate([*BASE, "--num-attention-heads", "3"], world_size=1)
    assert not isinstance(caught.value, ConfigErrors) and "\n" not in str(caught.value)
    # --tokenizer-type is set aside; the checks then see the default type, whose complaint about it is left out
    with pytest.raises(ConfigError) as caught:
        parse_and_validate(["--data-path", "d", "--tokenizer-type", "Tik", "--vocab-file", "v"], world_size=1)
    assert str(caught.value).startswith("argument --tokenizer-type: invalid choice: 'Tik'")


def test_the_files_are_looked_for_when_asked(tmp_path):
    (tmp_path / "d.bin").write_bytes(b"")
    (tmp_path / "t.model").write_bytes(b"")
    prefix, model = str(tmp_path / "d"), str(tmp_path / "t.model")
    parse_and_validate(["--data-path", prefix, "--tokenizer-model", model], 1)  # not looked for
    with pytest.raises(ConfigError) as caught:
        parse_and_validate(
            ["--data-path", "0.5", prefix, "0.5", prefix, "--tokenizer-model", model], 1, files=check_data_files
        )
    assert str(caught.value) == (
        f"--data-path {prefix}: missing {prefix}.idx; give the prefix tools/preprocess_data.py wrote "
        "(PREFIX_text_document for --output-prefix PREFIX)"
    )
    (tmp_path / "d.idx").write_bytes(b"")  # its header is read: how many documents
    with pytest.raises(ConfigError) as caught:
        parse_and_validate(["--data-path", prefix, "--tokenizer-model", model], 1, files=check_data_files)
    assert str(caught.value) == (
        f"--data-path: index file {prefix}.idx is truncated or corrupt; re-run tools/preprocess_data.py to rebuild it"
    )


def test_a_split_left_without_documents_is_named_with_the_flag_errors(train_data):
    """Megatron-LM's --split 99990,8,2 is meant for millions of documents; on the test corpus's 27 its
    validation split gets none (megatron-core would loop forever on it): named before start-up, with the other
    errors, and only where the run validates."""
    prefix, model = train_data
    flags = ["--data-path", prefix, "--tokenizer-model", model, "--split", "99990,8,2"]
    with pytest.raises(ConfigErrors) as caught:
        parse_and_validate([*flags, "--eval-iters", "1", "--num-attention-heads", "3"], 1, files=check_data_files)
    assert str(caught.value).splitlines()[1:] == [
        "  --hidden-size=256: must be a multiple of --num-attention-heads=3",
        f"  --split 99990,8,2: the valid split of {prefix} gets none of its 27 documents; give it a larger share "
        "(e.g. --split 90,10,0), set its share to 0, or add documents",
    ]
    parse_and_validate([*flags, "--eval-iters", "0"], 1, files=check_data_files)  # no validation: the split is not read
    parse_and_validate([*flags[:-1], "98,2,0", "--eval-iters", "1"], 1, files=check_data_files)


@pytest.mark.parametrize("split", ["99990,8,2", "98,2,0", "1", "969,30,1", "0,1", "1,1,1", "0.7,0.2,0.1", "3,0,7"])
def test_the_light_split_arithmetic_is_megatron_cores(split):
    """data/files.py writes megatron-core's split arithmetic out (no megatron-core import before start-up): the
    same bookends, to the last bit, so that the check before start-up refuses exactly the splits that would hang."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    from megatron_moe.data.files import split_matrix

    assert split_matrix(split) == convert_split_vector_to_split_matrix(parse_and_normalize_split(split))


# --------------------------------------------------------------------------------- flags that change nothing here


def given_alone():
    """(group, field, flag, typed) for each flag with an `applies=` condition the plain run (BASE) does not meet:
    given alone (`typed`), it changes nothing."""
    plain = parse_args(BASE)
    for name, group in GROUPS:
        for field in dataclasses.fields(group):
            applies = field.metadata.get("applies")
            if applies is None or applies.test(plain):
                continue
            default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
            flag, choices = flag_name(field), field.metadata.get("choices")
            if isinstance(default, bool):  # the switch, or its --no- form where it is on by default
                typed = [as_typed(flag, True if flag.startswith("--no-") else not default)]
            else:
                typed = [flag, str(choices[-1] if choices else 2 if default in (None, []) else default)]
            yield name, field.name, flag, typed


@pytest.mark.parametrize("name, field, flag, typed", list(given_alone()), ids=lambda x: x if isinstance(x, str) else "")
def test_each_flag_that_changes_nothing_in_a_run_gets_exactly_one_line(name, field, flag, typed):
    c = parse_args([*BASE, *typed])
    (line,) = c.notes
    assert line.startswith(f"{typed[0]}{':' if len(typed) == 1 else ' '}"), line
    assert line.endswith(
        f": changes nothing in this run (it applies only {_applies(name, field)}); accepted and ignored"
    )
    assert c.to_dict() == parse_args(BASE).to_dict()  # the run is the one without the flag


def _applies(name: str, field: str) -> str:
    group = dict(GROUPS)[name]
    return next(f for f in dataclasses.fields(group) if f.name == field).metadata["applies"].text


def test_at_least_the_megatron_lm_flags_that_change_nothing_here_are_among_them():
    flags = {flag for _, _, flag, _ in given_alone()}
    assert {"--sequence-parallel", "--moe-grouped-gemm", "--no-load-optim", "--no-load-rng"} <= flags
    assert {"--no-masked-softmax-fusion", "--overlap-param-gather", "--lr-wsd-decay-iters"} <= flags
