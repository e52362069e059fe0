"""What a logged iteration says: a short line that fits a terminal, the full record as JSON (console with
--log-format json, and log.jsonl either way), MFU never above 100%, and the run's exposed-comm breakdown."""

import json
import logging

import pytest

from megatron_moe.comm.timers import SUMMARY_KINDS
from megatron_moe.config import ConfigError, parse_args
from megatron_moe.platform import PeakRate
from megatron_moe.training.flops import Mfu
from megatron_moe.training.log_line import exposed_by_group, jsonl_path, short_line
from megatron_moe.training.logger import TrainingLogger

BASE = ["--data-path", "d", "--tokenizer-model", "t.model"]
TIMESTAMP = len("[2026-11-26 20:07:56] ")  # the log format's prefix (failure.py)


def run_steps(logger: TrainingLogger, iterations, *, step_ms: float = 700.0, exposed: dict | None = None):
    """Log `iterations` with the figures a MoE run gives, every summary kind exposed (`exposed`: per kind, ms)."""
    exposed = exposed if exposed is not None else {kind: 1.0 for kind in SUMMARY_KINDS}
    for it in iterations:
        logger.step(
            it,
            {"lm loss": 4.588393, "moe aux loss": 1.051097, "moe dropped fraction": 0.0, "moe tokens cv": 0.2028},
            lr=2e-4,
            grad_norm=0.8318,
            skipped=False,
            params_norm=123.4,
            comm=(step_ms, sum(exposed.values()), 30.0, 2.0, sum(exposed.values()) - 2.0),
            comm_layers={1: (10.0, 14.0), 3: (8.0, 12.0)},
            comm_kinds=exposed_by_group(exposed),
            consumed_samples=8 * it,
        )


def logger_for(**kwargs) -> TrainingLogger:
    args = {
        "train_iters": 200_000,
        "log_interval": 10,
        "tokens_per_step": 2048,
        "tensorboard_dir": None,
        "flops_per_step": 1e9,
        "peak_flops": PeakRate(1e15, "H100 SXM peak"),
        "devices": 2,
        "global_batch_size": 8,
    }
    return TrainingLogger(**(args | kwargs))


def test_the_iteration_line_fits_a_terminal(caplog):
    """The demo's line was 700 characters. The short one, with every part at its widest (6-digit iterations, a
    4-digit step time, millions of tokens/s, 2-digit comm share, a 2-digit ETA), takes at most 115;
    the demo's fits about 120 with the log's timestamp."""
    logger = logger_for()
    with caplog.at_level("INFO", logger="megatron_moe"):
        run_steps(logger, range(123_451, 123_461))
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("iteration")]
    assert line.startswith("iteration 123460/200000 | lm loss: 4.5884 | grad norm: 0.8318 | "), line
    for part in (" ms | ", " tok/s | ", "comm ", "ETA "):
        assert part in line, (part, line)
    widest = {
        "iteration": 123_460,
        "train_iters": 200_000,
        "lm loss": 10.123456,
        "grad_norm": 1234.5678,
        "ms_per_iteration": 9876.5,
        "tokens_per_s": 9_876_543.0,
        "eta_s": 99 * 3600.0 + 3599,
        "comm": {"exposed_percent": 43.21},
    }
    assert len(short_line(widest)) <= 115, short_line(widest)
    demo = {
        "iteration": 200,
        "train_iters": 200,
        "lm loss": 4.588393,
        "grad_norm": 0.8318,
        "ms_per_iteration": 729.1,
        "tokens_per_s": 2809.0,
        "eta_s": 0.0,
        "comm": {"exposed_percent": 6.2},
    }
    assert short_line(demo) == (
        "iteration 200/200 | lm loss: 4.5884 | grad norm: 0.8318 | 729 ms | 2809 tok/s | comm 6.2% | ETA 0:00:00"
    )
    assert TIMESTAMP + len(short_line(demo)) <= 125
    assert "| 47.5k tok/s |" in short_line(demo | {"tokens_per_s": 47_512.0})
    record = {
        "iteration": 7,
        "train_iters": 10,
        "ms_per_iteration": 5.25,
        "tokens_per_s": 10.0,
        "eta_s": 3.0,
        "skipped_iterations": 2,
        "lm loss": float("nan"),
    }
    assert short_line(record) == "iteration  7/10 | lm loss: nan | 5.2 ms | 10 tok/s | ETA 0:00:03 | skipped 2"


def test_json_format_prints_the_full_record_and_both_write_log_jsonl(caplog, tmp_path):
    for log_format in ("text", "json"):
        path = tmp_path / log_format / "log.jsonl"
        logger = logger_for(log_format=log_format, jsonl_path=str(path), train_iters=20)
        with caplog.at_level("INFO", logger="megatron_moe"):
            caplog.clear()
            run_steps(logger, range(1, 21))
            logger.validation(20, {"lm loss": 5.151045})
            logger.close()
        records = [json.loads(line) for line in path.read_text().splitlines()]
        assert [r["iteration"] for r in records] == [10, 20, 20] and records[-1]["validation"] == {"lm loss": 5.151045}
        last = records[1]
        assert last["lm loss"] == pytest.approx(4.588393) and last["moe aux loss"] == pytest.approx(1.051097)
        assert last["grad_norm"] == 0.8318 and last["params_norm"] == 123.4 and last["consumed_samples"] == 160
        assert last["comm"]["hidden_percent_by_moe_layer"] == {"1": pytest.approx(100 * 4 / 14), "3": 100 * 4 / 12}
        assert set(last["comm"]["exposed_ms_by_kind"]) == {
            "a2a",
            "esp",
            "shadow",
            "dp_grad_reduce",
            "tp",
            "pp_p2p",
            "other",
        }
        messages = [r.getMessage() for r in caplog.records]
        if log_format == "json":  # the console's lines are the records
            assert [json.loads(m) for m in messages if m.startswith("{")] == records
        else:
            assert sum(m.startswith("iteration ") for m in messages) == 2
            assert not any(m.startswith("{") for m in messages)
        closing = messages[-1]
        assert closing.startswith("over the run's 20 timed steps, exposed comm: 14.0 ms per step (2.0% of step) = ")
    more = logger_for(jsonl_path=str(tmp_path / "text" / "log.jsonl"), train_iters=30)
    run_steps(more, range(21, 31))  # a resumed run appends
    more.close()
    assert len((tmp_path / "text" / "log.jsonl").read_text().splitlines()) == 4


def test_the_records_go_beside_the_tensorboard_files():
    assert jsonl_path("runs/x/tb") == "runs/x/tb/log.jsonl"
    assert jsonl_path(None) is None  # not into --save: a checkpoint directory holds checkpoints only
    assert parse_args(BASE).logging.log_format == "text"
    assert parse_args([*BASE, "--log-format", "json"]).logging.log_format == "json"
    with pytest.raises((ConfigError, SystemExit)):
        parse_args([*BASE, "--log-format", "yaml"])


class SlowProbe:
    """A GEMM-rate probe that read slow at start-up (shared cores) and reads `rates` when measured again."""

    def __init__(self, *rates: float):
        self.rates, self.calls = list(rates), 0

    def __call__(self) -> float:
        self.calls += 1
        return self.rates.pop(0)


def test_mfu_never_exceeds_100_percent_of_a_slow_probe(caplog):
    """The demo showed MFU 118%: its start-up probe read slow. A run faster than the measured rate measures it
    again and keeps the better; faster still, the run's own rate is the best seen: 100%, with one warning."""
    probe = SlowProbe(3e12, 3.5e12)
    mfu = Mfu(PeakRate(1e12, "measured GEMM rate", remeasure=probe))
    assert mfu.percent(0.5e12) == pytest.approx(50.0) and probe.calls == 0  # below the rate: not measured again
    assert mfu.percent(1.5e12) == pytest.approx(50.0) and probe.calls == 1  # of the re-measured 3 TFLOP/s
    with caplog.at_level(logging.WARNING, logger="megatron_moe"):
        assert mfu.percent(4e12) == 100.0 and probe.calls == 2  # 3.5 re-measured: still slower than the run
        assert mfu.percent(2e12) == pytest.approx(50.0)  # of the best rate seen, 4 TFLOP/s
        assert mfu.percent(5e12) == 100.0 and probe.calls == 2  # measured again at most twice
    assert mfu.what == "best rate seen"
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "4.000 TFLOP/s per device exceed the measured GEMM rate (3.500 TFLOP/s, measured again now)" in warning


def test_mfu_of_a_data_sheet_peak_is_capped_with_a_warning(caplog):
    mfu = Mfu(PeakRate(1e15, "NVIDIA H200 peak"))
    with caplog.at_level(logging.WARNING, logger="megatron_moe"):
        assert mfu.percent(0.4e15) == pytest.approx(40.0)
        assert mfu.percent(1.2e15) == 100.0 and mfu.percent(1.3e15) == 100.0
        assert mfu.percent(0.5e15) == pytest.approx(50.0)  # the data sheet stays the denominator
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "exceed the NVIDIA H200 peak (1000.000 TFLOP/s): its model FLOPs are overcounted" in warning


def test_the_logged_mfu_of_a_slow_probe_stays_at_most_100(caplog):
    """Through the logger: the probe measured 1 GFLOP/s, the run does far more per device."""
    probe = SlowProbe(2e9, 2e9)
    peak = PeakRate(1e9, "measured GEMM rate", remeasure=probe)
    logger = logger_for(peak_flops=peak, flops_per_step=2e11, log_format="json")
    with caplog.at_level("INFO", logger="megatron_moe"):
        run_steps(logger, range(1, 21))
    records = [json.loads(r.getMessage()) for r in caplog.records if r.getMessage().startswith("{")]
    assert len(records) == 2 and all(0 < r["mfu_percent"] <= 100.0 for r in records), records
    assert probe.calls >= 1 and records[0]["mfu_of"] == "best rate seen"
