"""One declaration per setting (issue 39): a new MoE flag is its field and its use; a new gate is its class and its
row in the traits table; a feature's blocker is one function that both the flag checks and the layer read."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from megatron_moe.config import parse_args
from megatron_moe.config.features import BLOCKERS, shadow_blocker
from megatron_moe.config.fields import ConfigError, add_arguments, arg, flag_fields, parse_flag_values
from megatron_moe.config.gate_traits import GATE_TRAITS, GateTraits
from megatron_moe.config.groups import MoEConfig
from megatron_moe.config.moe_layer import MoELayerConfig, parse_degree
from megatron_moe.moe import gates
from megatron_moe.moe.gates import GATE_BUILDERS, SoftmaxTopKGate, build_gate


def test_every_layer_flag_is_generated_from_the_layer_config_with_its_declaration():
    layer_fields = {f.name: f for f in dataclasses.fields(MoELayerConfig) if "help" in f.metadata}
    run_fields = {f.name: f for f in dataclasses.fields(MoEConfig)}
    assert len(layer_fields) >= 20
    for field in layer_fields.values():
        attribute = field.metadata["flag"][2:].replace("-", "_")
        assert dict(run_fields[attribute].metadata) == dict(field.metadata)  # the declaration itself, not a mirror


def test_flags_are_typed_once_parsed_whoever_builds_the_group():
    moe = parse_args(
        ["--mock-data", "--num-experts", "8", "--moe-shadow-experts", "0", "--moe-pipeline-degree", "3"]
    ).moe
    assert (moe.moe_shadow_experts, moe.moe_pipeline_degree, moe.moe_bp_pipeline_degree) == ("off", 3, "auto")
    built = MoEConfig(num_experts=8, moe_shadow_experts="2", moe_bp_pipeline_degree="4")
    assert (built.moe_shadow_experts, built.moe_bp_pipeline_degree) == (2, 4)


def test_a_new_flag_is_its_field_and_its_use():
    # 1. the field: one declaration (type, default, help, parse) on the layer's config
    @dataclasses.dataclass(kw_only=True)
    class WithChunks(MoELayerConfig):
        combine_chunks: int | str = arg(1, "chunks of the combine", flag="--moe-combine-chunks", parse=parse_degree)

    # the run's flag group and its CLI follow from it, typed
    group = dataclasses.make_dataclass("Group", flag_fields(WithChunks), kw_only=True)
    parser = argparse.ArgumentParser()
    add_arguments(parser, group, "moe")
    assert "--moe-combine-chunks" in parser.format_help()
    values = vars(parser.parse_args(["--moe-combine-chunks", "3"]))
    parsed = group(**values)
    parse_flag_values(parsed)
    assert parsed.moe_combine_chunks == 3 and parsed.moe_router_topk == 2
    # 2. its use: reading the typed value from the layer config
    layer = WithChunks(num_experts=4, hidden_size=8, ffn_hidden_size=16, combine_chunks=parsed.moe_combine_chunks)
    assert layer.validate().combine_chunks == 3


class FirstTwoGate(SoftmaxTopKGate):
    """A throw-away gate (its class: file 1 of 2)."""


def test_a_new_gate_is_its_class_and_its_table_row(monkeypatch):
    monkeypatch.setitem(GATE_BUILDERS, "first_two", FirstTwoGate)  # registered beside its class (gates.py)
    monkeypatch.setitem(GATE_TRAITS, "first_two", GateTraits(own_order=True))  # its row (config/gate_traits.py)
    cfg = MoELayerConfig(num_experts=4, hidden_size=8, ffn_hidden_size=16, gate="first_two").validate()
    gate = build_gate(cfg)
    assert isinstance(gate, FirstTwoGate) and gates.GATE_BUILDERS is GATE_BUILDERS
    routing = gate(torch.randn(6, 8))
    assert routing.expert_N.numel() == 12
    with pytest.raises(ConfigError, match="orders its claims itself"):  # the table row is what the checks read
        dataclasses.replace(cfg, drop_policy="probs").validate()


def test_every_gate_has_a_builder_and_a_row():
    assert set(GATE_BUILDERS) == set(GATE_TRAITS)


@pytest.mark.parametrize(
    "sizes, fields, blocked",
    [
        ({"ep_size": 1, "esp_size": 1}, {}, "(one EP rank has every expert)"),
        ({"ep_size": 2, "esp_size": 2}, {}, "sliced over their ESP group"),
        ({"ep_size": 2, "esp_size": 1}, {"capacity_factor": 1.0}, "dropless only"),
        ({"ep_size": 2, "esp_size": 1}, {"gate": "expert_choice"}, "fixes every load"),
        ({"ep_size": 2, "esp_size": 1}, {}, None),
        ({"ep_size": None, "esp_size": None}, {}, None),  # the layout not known yet: only the flags' own reasons
    ],
)
def test_one_blocker_per_feature_answers_the_flags_and_the_layer(sizes, fields, blocked):
    cfg = MoELayerConfig(num_experts=8, hidden_size=8, ffn_hidden_size=16, **fields)
    reason = shadow_blocker(cfg, **sizes)
    assert BLOCKERS["shadow_experts"] is shadow_blocker
    assert (reason is None) == (blocked is None) and (blocked is None or blocked in reason.why)
    explicit = dataclasses.replace(cfg, shadow_experts=2)
    if blocked is None:
        explicit.validate(**sizes)
    else:  # asked for by value: an error naming the flag; auto: no error (the layer logs the reason)
        with pytest.raises(ConfigError, match=r"--moe-shadow-experts=2: off"):
            explicit.validate(**sizes)
        dataclasses.replace(cfg, shadow_experts="auto").validate(**sizes)
