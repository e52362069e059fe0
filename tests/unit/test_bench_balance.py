"""tools/bench_balance.py's pure parts: the cases' order, each method's flags and starting checkpoint, the
load imbalance, the `balance` and `quality` rows' arithmetic, the flags' check and the demo's flags."""

import json

import pytest

from tests.conftest import load_tool

bench = load_tool("bench_balance")
bench_step = load_tool("bench_step")


def test_the_plan_alternates_layouts_and_rotates_which_method_goes_first():
    methods = ["aux", "bias", "shadow", "both"]
    cases = bench.plan(["2x1", "2x2"], 1.0, methods, rounds=2)
    assert sorted(cases) == sorted([(layout, m) for layout in ("2x1", "2x2") for m in methods] * 2)
    blocks = [cases[i : i + 4] for i in range(0, len(cases), 4)]  # a layout's methods back to back
    assert all(len({layout for layout, _ in block}) == 1 for block in blocks)
    assert [block[0][0] for block in blocks] == ["2x1", "2x2", "2x2", "2x1"]  # layouts interleaved, order flipped
    assert len({block[0][1] for block in blocks}) > 1  # which method goes first rotates
    assert bench.plan(["2x1"], 0.5, ["aux"], rounds=3) == [("2x1", "aux")] * 3


def test_each_method_has_its_flags_and_starting_checkpoint():
    assert bench.METHODS["aux"] == ()  # today's default aux loss
    bias = list(bench.METHODS["bias"])
    assert "--moe-router-enable-expert-bias" in bias
    assert bench_step._flag(bias, "--moe-router-score-function") == "sigmoid"
    assert bench_step._flag(bias, "--moe-aux-loss-coeff") == "0"  # aux-loss-free, as DeepSeek-V3
    assert list(bench.METHODS["shadow"]) == ["--moe-shadow-experts", "auto"]
    assert list(bench.METHODS["both"]) == [*bias, "--moe-shadow-experts", "auto"]
    assert bench.START_OF == {"aux": "aux", "bias": "bias", "shadow": "aux", "both": "bias"}
    assert bench.starts(["both", "shadow"]) == ["aux", "bias"] and bench.starts(["shadow"]) == ["aux"]
    flags = bench.case_flags("both", "/ckpt/bias", 150, 5)
    assert flags[: len(bench.METHODS["both"])] == list(bench.METHODS["both"])
    assert bench_step._flag(flags, "--load") == "/ckpt/bias" and bench_step._flag(flags, "--train-iters") == "155"
    warm = bench.warm_flags("bias", "/ckpt/bias")
    assert bench_step._flag(warm, "--save") == "/ckpt/bias" and "--moe-router-enable-expert-bias" in warm
    # The case's flags override bench_step's (the last occurrence wins, as in the trainer's parser).
    full = bench_step.trainer_flags("2x2", 5, ("D", "T"), ["--micro-batch-size", "2", *flags], "off")
    assert bench_step._flag(full, "--train-iters") == "155" and bench_step._flag(full, "--micro-batch-size") == "2"
    assert bench_step._flag(full, "--expert-model-parallel-size") == "4"


def test_the_trainer_refuses_an_unknown_flag_before_any_job(tmp_path):
    base = bench_step.trainer_flags("2x1", 1, ("D", "T"), None)
    bench.check_flags("bias", [*base, *bench.METHODS["bias"]])  # accepted
    with pytest.raises(SystemExit, match=r"--methods both .*the trainer refuses it: unknown flag --moe-shadow"):
        bench.check_flags("both", [*base, "--moe-shadow-experts-typo", "auto"])


def test_parse_args_defaults_and_bad_flags():
    args = bench.parse_args([])
    assert args.methods == ["aux", "bias", "shadow", "both"] and args.cluster == ["2x1", "2x2"]
    assert args.link_gbit == 1.0 and args.quality_steps == 200 and len(args.quality_seeds) == 2
    assert args.overlap == "off" and args.warm_steps == bench.DEFAULT_WARM_STEPS
    assert bench.parse_args(["--overlap", "all-on"]).overlap == "adaptive"
    for bad in (["--methods", "dropless"], ["--cluster", "2x2esp"], ["--warmup", "5"], ["--warm-steps", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_imbalance_is_max_over_mean_per_expert_and_per_ep_rank():
    steps = [
        {"tokens_per_expert": {"1": [4, 4, 4, 4], "2": [8, 0, 4, 4]}},
        {"tokens_per_expert": {"1": [8, 0, 8, 0], "2": [8, 0, 4, 4]}},
    ]
    figures = bench.imbalance(steps, ep=2)
    # layer 1: experts 1.0 then 2.0, ranks (8, 8) then (8, 8); layer 2: experts 2.0, ranks (8, 8)
    assert figures["per_layer"] == {"1": {"expert": 1.5, "ep_rank": 1.0}, "2": {"expert": 2.0, "ep_rank": 1.0}}
    assert figures["expert"] == 1.75 and figures["ep_rank"] == 1.0
    skewed = bench.imbalance([{"tokens_per_expert": {"1": [6, 2, 0, 0]}}], ep=2)
    assert skewed["ep_rank"] == 2.0 and skewed["expert"] == 3.0  # ranks (8, 0): the one rank has it all
    assert bench.imbalance([{"lm loss": 1.0}], ep=2) is None  # megatron-core's layer: no counts


def row(case: str, step_ms: float, skew: dict, imbalance: float | None = None) -> dict:
    """A case row with what `balance` reads."""
    return {
        "case": case,
        "layout": "2x2 EP=4 DP=4",
        "link_gbit": 1.0,
        "overlap": {"overlap_wgrad": "off"},
        "step_ms": step_ms,
        "skew_ms": skew,
        "skew_ms_total": round(sum(skew.values()), 1),
        "transfer_ms_total": 50.0,
        "exposed_ms_total": 50.0 + sum(skew.values()),
        "load_imbalance": None if imbalance is None else {"expert": 2 * imbalance, "ep_rank": imbalance},
    }


def test_the_balance_row_compares_each_method_with_aux():
    aux_skew = {"a2a_dispatch": 300.0, "a2a_combine": 100.0, "dp_grad_reduce": 0.0}
    both_skew = {"a2a_dispatch": 100.0, "a2a_combine": 20.0, "dp_grad_reduce": 0.0}
    rows = {
        "aux": row("step_2x2_1gbit_aux", 4000.0, aux_skew, 1.5),
        "both": row("step_2x2_1gbit_both", 3200.0, both_skew, 1.1),
        "bias": row("step_2x2_1gbit_bias", 5000.0, {"a2a_dispatch": 500.0}),
    }
    summary = bench.balance(rows)
    json.dumps(summary)
    assert summary["case"] == "balance_2x2_1gbit" and summary["against"] == "aux" and summary["link_gbit"] == 1.0
    both, aux, bias = (summary["methods"][m] for m in ("both", "aux", "bias"))
    assert aux["step_ratio"] == 1.0 and aux["skew_cut"] == 0.0
    assert both["step_ratio"] == 1.25 and both["skew_cut"] == 0.7  # 1 - 120 / 400
    assert both["skew_ms"] == 120.0 and both["a2a_skew_ms"] == 120.0 and both["ep_rank_imbalance"] == 1.1
    assert bias["step_ratio"] == 0.8 and bias["skew_cut"] == -0.25 and bias["ep_rank_imbalance"] is None
    no_skew = bench.balance({"aux": row("step_2x1_1gbit_aux", 1000.0, {"a2a_dispatch": 0.0})})
    assert no_skew["methods"]["aux"]["skew_cut"] is None  # nothing to cut


def test_the_quality_row_takes_the_last_validation_and_the_spread_between_seeds():
    losses = {
        "aux": {1234: {100: 6.0, 200: 5.20}, 1235: {100: 6.1, 200: 5.10}},
        "bias": {1234: {100: 6.2, 200: 5.25}, 1235: {100: 6.0, 200: 5.15}},
    }
    summary = bench.quality(losses, ["aux", "bias", "shadow", "both"], 200)
    json.dumps(summary)
    assert summary["case"] == "quality_200steps"
    assert summary["validation_loss"] == {"aux": {"1234": 5.2, "1235": 5.1}, "bias": {"1234": 5.25, "1235": 5.15}}
    assert summary["mean"] == {"aux": 5.15, "bias": 5.2} and summary["spread"] == {"aux": 0.1, "bias": 0.1}
    assert summary["bias_minus_aux"] == 0.05
    assert summary["same_as"] == {"shadow": "aux", "both": "bias"}  # named, not trained
    assert summary["curves"]["aux"]["1234"] == {"100": 6.0, "200": 5.2}
    assert bench.validation_losses([{"iteration": 1}, {"iteration": 2, "validation lm loss": 5.0}]) == {2: 5.0}
    with pytest.raises(RuntimeError, match="no `validation lm loss`"):
        bench.validation_losses([{"iteration": 1}])


def test_the_quality_runs_take_the_demo_scripts_flags(tmp_path):
    flags = bench.demo_flags(str(tmp_path / "data"), str(tmp_path / "run"), ["--train-iters", "7", "--seed", "5"])
    assert bench_step._flag(flags, "--train-iters") == "7" and bench_step._flag(flags, "--seed") == "5"
    assert bench_step._flag(flags, "--expert-model-parallel-size") == "2"  # the demo's EP=2 on 2 ranks
    assert bench_step._flag(flags, "--data-path") == str(tmp_path / "data" / "stdlib_text_document")
    assert bench_step._flag(flags, "--save").startswith(str(tmp_path / "run"))
    assert int(bench_step._flag(flags, "--eval-iters")) > 0  # a validation loss to read
