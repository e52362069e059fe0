"""Every numeric flag's range: a bad value is one ConfigError naming the flag, the value and a valid choice."""

import dataclasses
import re
import typing

import pytest

from megatron_moe.config import GROUPS, ConfigError, parse_args
from megatron_moe.config.fields import _unwrap_optional, flag_name

BASE = ["--data-path", "d", "--tokenizer-model", "t.model", "--num-experts", "8"]

# The bad flag sets a review of the flags found (tracebacks, silently accepted, blamed on another flag), and a few more.
BAD = [
    (["--position-embedding-type", "learned_absolute", "--max-position-embeddings", "128"], "--seq-length", "256"),
    (["--num-attention-heads", "0"], "--num-attention-heads", "0"),
    (["--num-query-groups", "0"], "--num-query-groups", "0"),
    (["--global-batch-size", "0"], "--global-batch-size", "0"),
    (["--make-vocab-size-divisible-by", "0"], "--make-vocab-size-divisible-by", "0"),
    (["--init-method-std", "-1"], "--init-method-std", "-1.0"),
    (["--norm-epsilon", "-1"], "--norm-epsilon", "-1.0"),
    (["--hidden-dropout", "1.5"], "--hidden-dropout", "1.5"),
    (["--attention-dropout", "-0.1"], "--attention-dropout", "-0.1"),
    (["--adam-beta1", "1.0"], "--adam-beta1", "1.0"),
    (["--adam-beta2", "-0.5"], "--adam-beta2", "-0.5"),
    (["--adam-eps", "0"], "--adam-eps", "0.0"),
    (["--ffn-hidden-size", "0"], "--ffn-hidden-size", "0"),
    (["--save", "ck", "--save-interval", "-1"], "--save-interval", "-1"),
    (["--eval-interval", "-1"], "--eval-interval", "-1"),
    (["--clip-grad", "-1"], "--clip-grad", "-1.0"),
    (["--exit-duration-in-mins", "-1"], "--exit-duration-in-mins", "-1.0"),
    (["--exit-interval", "0"], "--exit-interval", "0"),
    (["--lr", "-1"], "--lr", "-1.0"),
    (["--log-interval", "0"], "--log-interval", "0"),
    (["--seq-length", "0"], "--seq-length", "0"),
    (["--hidden-size", "0"], "--hidden-size", "0"),
    (["--micro-batch-size", "0"], "--micro-batch-size", "0"),
    (["--train-iters", "-5"], "--train-iters", "-5"),
    (["--moe-ffn-hidden-size", "0"], "--moe-ffn-hidden-size", "0"),
    (["--moe-aux-loss-coeff", "-0.01"], "--moe-aux-loss-coeff", "-0.01"),
    (["--weight-decay", "-0.1"], "--weight-decay", "-0.1"),
    (["--lr-warmup-iters", "-1"], "--lr-warmup-iters", "-1"),
    (["--seed", "-1"], "--seed", "-1"),
    (["--seed", str(2**32)], "--seed", str(2**32)),
    (["--num-workers", "-1"], "--num-workers", "-1"),
    (["--fp16", "--min-loss-scale", "0"], "--min-loss-scale", "0.0"),
    (["--fp16", "--hysteresis", "0"], "--hysteresis", "0"),
    (["--split", "98,-2,0"], "--split", "98,-2,0"),
    (["--split", "0,0,0"], "--split", "0,0,0"),
    (["--split", "98,x"], "--split", "98,x"),
    (["--split", "1,1,1,1"], "--split", "1,1,1,1"),
]


@pytest.mark.parametrize(("flags", "flag", "value"), BAD, ids=[case[1] for case in BAD])
def test_bad_flag_is_one_line_naming_flag_value_and_choice(flags, flag, value):
    with pytest.raises(ConfigError) as error:
        parse_args([*BASE, *flags]).validate(world_size=1)
    message = str(error.value)
    assert message.startswith(f"{flag}={value}: "), message
    assert "\n" not in message
    assert re.search(r"must|e\.g\.|use|choose", message), message


SIGNED = {
    "moe_expert_capacity_factor",  # < 0 means dropless capped at |f| (Tutel semantics)
    "moe_router_force_biased",  # < 0: one bias per layer for the run (Megatron-LM's meaning)
}


def numeric_fields():
    for name, cls in GROUPS:
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            kind, _ = _unwrap_optional(hints[field.name])
            if kind in (int, float) and field.name not in SIGNED:
                yield name, field


def test_every_numeric_flag_refuses_a_negative_value_by_name():
    checked = []
    for group, field in numeric_fields():
        c = parse_args([*BASE, "--fp16"])
        setattr(getattr(c, group), field.name, -3)
        with pytest.raises(ConfigError) as error:
            c.validate(world_size=1)
        assert str(error.value).startswith(f"{flag_name(field)}=-3: "), (field.name, str(error.value))
        checked.append(field.name)
    assert len(checked) > 40, checked  # the walk found the groups' numeric fields


def test_good_values_at_the_edges_are_accepted():
    flags = ["--hidden-dropout", "0", "--attention-dropout", "1", "--adam-beta1", "0", "--clip-grad", "0"]
    flags += ["--eval-interval", "0", "--save", "ck", "--save-interval", "0", "--lr", "0", "--min-lr", "0"]
    flags += ["--position-embedding-type", "learned_absolute", "--max-position-embeddings", "256"]
    parse_args([*BASE, *flags]).validate(world_size=1)


def float_fields():
    for name, cls in GROUPS:
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            kind, _ = _unwrap_optional(hints[field.name])
            if kind is float:
                yield name, field


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_capacity_factor_nan_or_inf_is_one_line(value):
    """`--moe-expert-capacity-factor nan|inf` passed validation and failed later, raw."""
    with pytest.raises(ConfigError) as error:
        parse_args([*BASE, f"--moe-expert-capacity-factor={value}"]).validate(world_size=1)
    message = str(error.value)
    assert message.startswith(f"--moe-expert-capacity-factor={value}: must be a finite number, e.g. "), message
    assert "\n" not in message


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_every_float_flag_refuses_nan_and_inf_by_name(value):
    checked = []
    for group, field in float_fields():
        c = parse_args([*BASE, "--fp16"])
        setattr(getattr(c, group), field.name, value)
        with pytest.raises(ConfigError) as error:
            c.validate(world_size=1)
        message = str(error.value)
        assert message.startswith(f"{flag_name(field)}={value}: must be a finite number, e.g. "), message
        example = message.rsplit(" ", 1)[-1]
        setattr(getattr(c, group), field.name, float(example))  # the suggestion is itself finite
        checked.append(field.name)
    assert len(checked) > 20, checked


def test_a_short_timeout_alone_works_and_a_bad_stall_report_suggests_a_valid_value():
    """`--distributed-timeout-minutes 1` alone was refused, suggesting
    `--stall-report-seconds 120`, itself refused (above the 60 s timeout)."""
    c = parse_args([*BASE, "--distributed-timeout-minutes", "1"])
    c.validate(world_size=1)
    assert (c.parallel.stall_report_seconds, c.parallel.dead_peer_seconds) == (15, 75)
    with pytest.raises(ConfigError) as error:
        parse_args([*BASE, "--distributed-timeout-minutes", "1", "--stall-report-seconds", "90"]).validate(1)
    message = str(error.value)
    assert message.startswith("--stall-report-seconds=90.0: must be > 0 and below "), message
    suggestion = re.search(r"e\.g\. (--stall-report-seconds \S+)$", message).group(1).split()
    parse_args([*BASE, "--distributed-timeout-minutes", "1", *suggestion]).validate(world_size=1)
    with pytest.raises(ConfigError) as error:
        parse_args([*BASE, "--stall-report-seconds", "20", "--dead-peer-seconds", "10"]).validate(1)
    message = str(error.value)
    suggestion = re.search(r"e\.g\. (--dead-peer-seconds \S+)$", message).group(1).split()
    assert message.startswith("--dead-peer-seconds=10.0: must be at least --stall-report-seconds=20"), message
    parse_args([*BASE, "--stall-report-seconds", "20", *suggestion]).validate(world_size=1)
