"""Single process: the loss-spike detector, the non-finite checks, the error report,
the test-only fault injection and the spike flags.
The 2-rank runs are in tests/faults/test_ranks.py and tests/distributed/test_fail_fast.py.
"""

import importlib.util
import logging
import math
import os
import tempfile
from types import SimpleNamespace

import pytest
import torch

from megatron_moe import comm
from megatron_moe.config import ConfigError, parse_args
from megatron_moe.training.divergence import (
    LossSpikeDetector,
    NonFiniteError,
    check_grads_then,
    check_loss,
    first_nonfinite_grad,
)
from megatron_moe.training.loop import RAISE_AT_ENV, injected_failure_step
from tests.conftest import ROOT


def load_entry_point():
    spec = importlib.util.spec_from_file_location("pretrain_gpt_moe", os.path.join(ROOT, "pretrain_gpt_moe.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_spike_warns_above_factor_times_the_rolling_median():
    spikes = LossSpikeDetector(factor=3.0, window=4)
    assert [spikes.observe(i, loss) for i, loss in enumerate([10.0, 9.0, 8.0, 7.0], 1)] == [None] * 4
    assert spikes.observe(5, 25.0) is None  # 25 < 3 x 8.5
    warning = spikes.observe(6, 100.0)  # window now 9, 8, 7, 25: median 8.5 (the 25 does not raise the bar)
    assert warning is not None
    assert "iteration 6" in warning and "1.0000E+02" in warning and "median 8.5000E+00" in warning
    assert "--loss-spike-factor=3" in warning


def test_spike_warns_at_the_first_jump_skips_non_finite_and_can_be_off():
    """The first jump is named once 3 losses are known (5 before)."""
    early = LossSpikeDetector(factor=2.0, window=20)
    assert [early.observe(i, v) for i, v in enumerate([1.0, 1.0, 1.0], 4)] == [None] * 3
    assert "loss spike at iteration 7: " in early.observe(7, 50.0)
    assert early.observe(8, math.nan) is None and early.observe(9, math.inf) is None  # the NaN check's job
    assert early.observe(10, 1.5) is None  # median of 1, 1, 1, 50 is 1: NaN/inf did not enter it
    assert early.observe(11, 3.0) is not None
    off = LossSpikeDetector(factor=0.0, window=2, initial=1.0)
    assert [off.observe(i, v) for i, v in enumerate([1.0, 1e9, 1.0, 1.0, 1.0, 1e9], 1)] == [None] * 6


def test_a_loss_far_above_ln_vocab_in_the_first_steps_is_named_at_its_step():
    """With --lr 1e3 the loss reached 4e7 at iteration 2 with no warning until the step before
    the stop: the window (5 losses) knew nothing yet."""
    initial = math.log(50304)
    spikes = LossSpikeDetector(factor=3.0, window=20, initial=initial)
    assert spikes.observe(1, 10.9) is None  # about ln(vocab): an untrained model
    warning = spikes.observe(2, 4.2e7)
    assert warning.startswith("loss spike at iteration 2: lm loss 4.2000E+07 is "), warning
    assert f"ln(padded vocab) = {initial:.4f}" in warning, warning
    late = LossSpikeDetector(factor=3.0, window=20, initial=initial)
    assert [late.observe(i, 2.0) for i in (11, 12)] + [late.observe(13, 25.0)] == [None] * 3  # past step 3


def fake_chunk(grads: dict[str, torch.Tensor]):
    """A DDP chunk as the check sees it: grad buffers, and parameters carrying `main_grad` views."""
    module = torch.nn.Module()
    flat = torch.cat([g.reshape(-1) for g in grads.values()])
    at = 0
    for name, grad in grads.items():
        param = torch.nn.Parameter(torch.zeros_like(grad))
        param.main_grad = flat[at : at + grad.numel()].view_as(grad)
        at += grad.numel()
        module.register_parameter(name, param)
    return SimpleNamespace(module=module, buffers=[SimpleNamespace(grad_data=flat)], expert_parallel_buffers=[])


def test_first_nonfinite_grad_names_the_first_parameter_in_model_order():
    finite = {"a": torch.ones(3), "b": torch.ones(2, 2), "c": torch.ones(1)}
    assert first_nonfinite_grad([fake_chunk(finite)]) is None
    bad = {"a": torch.ones(3), "b": torch.tensor([[1.0, math.inf], [0, 0]]), "c": torch.tensor([math.nan])}
    assert first_nonfinite_grad([fake_chunk(bad)]) == "b (2 of 3 parameters have non-finite gradients)"
    # Several chunks (the interleaved pipeline): a name's layer index is its chunk's own, so the chunk is named.
    found = first_nonfinite_grad([fake_chunk(finite), fake_chunk(bad)])
    assert found == "model chunk 1: b (2 of 6 parameters have non-finite gradients)"


def test_grad_check_runs_before_finalize_and_names_iteration_rank_parameter():
    calls = []
    finalize = check_grads_then(
        lambda model, *a, **k: calls.append((model, a, k)), iteration=lambda: 7, rank=1, world_size=2
    )
    good = [fake_chunk({"w": torch.ones(2)})]
    finalize(good, "tokens", pg_collection=None)
    assert calls == [(good, ("tokens",), {"pg_collection": None})]
    expected = (
        r"non-finite values at iteration 7 first on rank 1: in their own forward outputs or gradients, before the "
        r"data-parallel reduction; here \(rank 1\): first in parameter w \(1 of 2 parameters"
    )
    with pytest.raises(NonFiniteError, match=expected):
        finalize([fake_chunk({"v": torch.ones(1), "w": torch.tensor([math.nan])})])
    assert len(calls) == 1  # the reduction never ran on bad grads


def test_with_a_reduction_in_flight_the_grad_check_follows_it():
    # a bucket's reduction started in backward: the buffer is being written by the collective, not checked
    finished = []
    chunk = fake_chunk({"w": torch.tensor([math.nan])})
    chunk.bucket_groups = [SimpleNamespace(grad_reduce_handle=object())]
    chunk.expert_parallel_bucket_groups = []

    def finalize(model, *args, **kwargs):
        finished.append(model)  # megatron-core's finish_grad_sync: the reduced (here still NaN) gradients
        model[0].bucket_groups[0].grad_reduce_handle = None

    with pytest.raises(
        NonFiniteError, match=r"at iteration 7 on rank 1 \(after the data-parallel reduction overlapped"
    ):
        check_grads_then(finalize, iteration=lambda: 7, rank=1, world_size=2)([chunk])
    assert finished == [[chunk]]
    chunk.bucket_groups[0].grad_reduce_handle = object()
    with pytest.raises(NonFiniteError, match=r"at iteration 7 first on rank 1: in their own forward outputs"):
        check_grads_then(finalize, iteration=lambda: 7, rank=1, world_size=2, forward_nonfinite=lambda: True)([chunk])


def test_every_rank_names_the_rank_whose_own_values_went_non_finite(monkeypatch):
    """A NaN on rank 1 was reported first by rank 0, and no rank was singled out. Here rank 0's
    gradients are finite; the agreement (faked: rank 1 set its slot) makes rank 0 stop naming rank 1."""
    peer = {}

    def agree(flags):
        flags[1] = peer.get("code", 0)
        return flags

    monkeypatch.setattr(comm, "agree_nonfinite", agree)
    calls = []
    finalize = check_grads_then(lambda model: calls.append(model), iteration=lambda: 3, rank=0, world_size=2)
    finalize([fake_chunk({"w": torch.ones(2)})])  # every rank finite: the step goes on
    peer["code"] = 2
    with pytest.raises(NonFiniteError) as error:
        finalize([fake_chunk({"w": torch.ones(2)})])
    assert str(error.value) == (
        "non-finite values at iteration 3 first on rank 1: in their own forward outputs or gradients, before the "
        "data-parallel reduction (a lower --lr usually helps)"
    )
    assert len(calls) == 1  # no rank reduces after the agreement found one


def test_loss_check():
    check_loss(2.5, iteration=3, rank=0)
    check_loss(None, iteration=3, rank=0)  # not the last pipeline stage
    with pytest.raises(NonFiniteError, match=r"non-finite lm loss \(nan\) at iteration 4 on rank 1"):
        check_loss(math.nan, iteration=4, rank=1)


def test_injected_failure_step(monkeypatch):
    monkeypatch.delenv(RAISE_AT_ENV, raising=False)
    assert injected_failure_step(1) is None
    monkeypatch.setenv(RAISE_AT_ENV, "1:3")
    assert (injected_failure_step(1), injected_failure_step(0)) == (3, None)


def test_spike_flags():
    base = ["--data-path", "d", "--tokenizer-model", "t.model"]
    cfg = parse_args([*base, "--loss-spike-factor", "5", "--loss-spike-window", "10"])
    cfg.validate(1)
    assert (cfg.logging.loss_spike_factor, cfg.logging.loss_spike_window) == (5.0, 10)
    parse_args([*base, "--loss-spike-factor", "0"]).validate(1)
    with pytest.raises(ConfigError, match=r"--loss-spike-factor=0.5: must be 0 \(off\) or above 1"):
        parse_args([*base, "--loss-spike-factor", "0.5"]).validate(1)
    with pytest.raises(ConfigError, match=r"--loss-spike-window=0: must be at least 1"):
        parse_args([*base, "--loss-spike-window", "0"]).validate(1)


def test_pretrain_skips_shutdown_when_training_fails(monkeypatch):
    """shutdown()'s barrier would wait for ranks inside a training collective: the error path has none."""
    import megatron_moe.training as training

    calls = []
    monkeypatch.setattr(training, "initialize", lambda cfg: calls.append("initialize"))
    monkeypatch.setattr(training, "shutdown", lambda **kwargs: calls.append("shutdown"))
    monkeypatch.setattr(training, "start_watchdog", lambda cfg, end_job: None)  # a world of one: none

    def failing_tokenizer(data):
        raise RuntimeError(f"cannot read {data.tokenizer_model}")

    monkeypatch.setattr(training, "build_tokenizer", failing_tokenizer)
    cfg = parse_args(["--data-path", "d", "--tokenizer-model", "t.model"])
    with pytest.raises(RuntimeError, match="cannot read t.model"):
        training.pretrain(cfg)
    assert calls == ["initialize"]


def raised() -> BaseException:
    try:
        raise RuntimeError("boom")
    except RuntimeError as error:
        return error


def test_report_names_the_rank_first_then_where(monkeypatch, caplog):
    entry = load_entry_point()
    monkeypatch.setenv("RANK", "3")
    monkeypatch.delenv("MEGATRON_MOE_VERBOSE", raising=False)
    with caplog.at_level(logging.ERROR, logger="megatron_moe"):
        entry.report_failure(raised(), expected=False)
    first, where = (r.getMessage() for r in caplog.records)
    assert first == "rank 3: RuntimeError: boom"
    assert where.startswith("rank 3: raised at ") and "in raised (MEGATRON_MOE_VERBOSE=1" in where
    caplog.clear()
    monkeypatch.setenv("MEGATRON_MOE_VERBOSE", "1")
    with caplog.at_level(logging.ERROR, logger="megatron_moe"):
        entry.report_failure(raised(), expected=False)
    first, traceback = (r.getMessage() for r in caplog.records)
    assert first == "rank 3: RuntimeError: boom"
    assert "Traceback (most recent call last)" in traceback and 'raise RuntimeError("boom")' in traceback


def test_report_of_an_expected_error_and_of_a_broken_collective(monkeypatch, caplog):
    entry = load_entry_point()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MEGATRON_MOE_VERBOSE", raising=False)
    with caplog.at_level(logging.ERROR, logger="megatron_moe"):
        entry.report_failure(ConfigError("--lr=-1.0: must be positive"), expected=True)
        entry.report_failure(RuntimeError("[pair.cc:537] Read error: Connection reset by peer."), expected=False)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "rank 0: error: --lr=-1.0: must be positive"  # no traceback for a flag error
    assert lines[1].startswith("rank 0: a collective failed, likely because another rank ended first")


def test_forward_flags_name_the_layer_where_non_finite_values_first_appeared(megatron_world1):
    """An inf in the second layer's expert weights: the NaN stop names that layer, not the embedding."""
    from megatron_moe.model import transformer_config
    from megatron_moe.training.divergence import ForwardFiniteFlags
    from megatron_moe.training.setup import build_ddp_model

    small = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-experts 4 --seq-length 16".split()
    cfg = parse_args(["--data-path", "d", "--tokenizer-model", "t", *small, "--micro-batch-size", "2"])
    cfg.validate(1)
    model = build_ddp_model(cfg, transformer_config(cfg), 128)
    flags = ForwardFiniteFlags(model)
    tokens = torch.randint(0, 128, (2, 16))
    positions = torch.arange(16).expand(2, 16)

    def forward():
        flags.reset()
        with torch.no_grad():
            model[0](tokens, positions, None)

    forward()
    assert flags.first() is None and flags.describe() == "; every forward output was finite"
    experts = {n: p for n, p in model[0].module.named_parameters() if "layers.1." in n and "experts" in n}
    assert experts, [n for n, _ in model[0].module.named_parameters()]
    saved = {n: p.detach().clone() for n, p in experts.items()}
    with torch.no_grad():
        for param in experts.values():
            param.fill_(math.inf)
    forward()
    assert flags.first() == "layer 2 (decoder.layers.1)"
    assert flags.describe() == "; first non-finite forward output in layer 2 (decoder.layers.1)"
    finalize = check_grads_then(lambda model: None, iteration=lambda: 9, rank=0, origin=flags.describe)
    bad = {"word_embeddings": torch.tensor([math.nan])}
    with pytest.raises(NonFiniteError, match=r"first in parameter word_embeddings .* in layer 2 \(decoder.layers.1\)"):
        finalize([fake_chunk(bad)])
    with pytest.raises(NonFiniteError, match=r"at iteration 9 on rank 0; first non-finite forward output in layer 2"):
        check_loss(math.nan, iteration=9, rank=0, origin=flags.describe)
    with torch.no_grad():
        for name, param in experts.items():
            param.copy_(saved[name])
    forward()  # reset() forgets the earlier step
    assert flags.first() is None
    flags.remove()


def test_an_error_every_worker_on_a_host_raises_alike_is_reported_once(monkeypatch, caplog, tmp_path):
    """Under torchrun each worker reports; a message another worker of the job on this host already reported is
    not repeated (a marker file per message), one that differs is."""
    entry = load_entry_point()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    monkeypatch.delenv("MEGATRON_MOE_VERBOSE", raising=False)
    with caplog.at_level(logging.ERROR, logger="megatron_moe"):
        for rank in (2, 0, 1):
            monkeypatch.setenv("RANK", str(rank))
            entry.report_failure(ConfigError("--data-path=x: no x.bin"), expected=True)
        entry.report_failure(ConfigError("--data-path=y: no y.bin"), expected=True)
    assert [r.getMessage() for r in caplog.records] == [
        "rank 2: error: --data-path=x: no x.bin",
        "rank 1: error: --data-path=y: no y.bin",
    ]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job8")  # another job reports its own
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="megatron_moe"):
        entry.report_failure(ConfigError("--data-path=x: no x.bin"), expected=True)
    assert len(caplog.records) == 1


def test_a_line_every_rank_logs_alike_is_printed_by_rank_0_only(monkeypatch):
    from megatron_moe.failure import ONCE, ONCE_FILTER

    def passes(rank, **extra):
        monkeypatch.setenv("RANK", str(rank))
        record = logging.LogRecord("megatron_moe.checkpointing", logging.INFO, __file__, 1, "loaded x", (), None)
        record.__dict__.update(extra)
        return ONCE_FILTER.filter(record)

    assert passes(0, **ONCE) and not passes(3, **ONCE)
    assert passes(0) and passes(3)  # anything else: as the rank's level says
