"""The first pass a launch runs (`parse_and_validate`, DRY_RUN=1) as a Megatron-LM user meets it: what it passes
starts, a derived value is not taken for a given one, and an unknown flag's suggestion is a close one."""

import argparse
import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from unittest import mock

import pytest

from megatron_moe.config import ConfigError, ConfigErrors, build_parser, parse_and_validate, parse_args
from megatron_moe.config.kernels import Kernels, uses_transformer_engine
from megatron_moe.config.megatron_lm import unknown_flag
from tests.conftest import ROOT, shell_env

MOCK = ["--mock-data", "--tokenizer-model", "t.model"]
SMALL = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-experts 4 --seq-length 32".split()


# ------------------------------------------------------------------------------------ --train-samples at start-up


def test_a_validated_config_validates_again_unchanged():
    """Start-up validates the config the first pass validated (`training.initialize`, on the real world size):
    the --train-iters the first validation derived from --train-samples is not a second given length."""
    cfg = parse_and_validate([*MOCK, *SMALL, "--train-samples", "32", "--global-batch-size", "8"], 1)
    assert cfg.training.train_iters == 4
    before = cfg.to_dict()
    cfg.validate(1)
    assert cfg.to_dict() == before


def test_train_iters_and_train_samples_typed_together_are_refused_even_when_they_agree():
    with pytest.raises(ConfigError, match=r"^--train-iters=4: and --train-samples both set the run's length"):
        parse_and_validate([*MOCK, "--train-iters", "4", "--train-samples", "32", "--global-batch-size", "8"], 1)


def test_a_mock_data_run_by_train_samples_starts():
    """The entry point's path: the first pass, then start-up (`initialize`), which validates again."""
    from megatron_moe.training.initialize import initialize, shutdown

    cfg = parse_and_validate([*MOCK, *SMALL, "--train-samples", "16", "--global-batch-size", "4"], 1)
    # as from a shell; what start-up sets in the environment (its rendezvous) is taken away again after
    with mock.patch.dict(os.environ, shell_env(), clear=True):
        try:
            initialize(cfg)
        finally:
            shutdown()
    assert cfg.training.train_iters == 4 and cfg.training.lr_schedule_samples()["decay"] == 16


# ------------------------------------------------------------------------------------------- did you mean


def parser_without(*flags: str) -> argparse.ArgumentParser:
    """Our parser without `flags` (other changes may define them: the suggestions are tested where they are
    unknown)."""
    parser = argparse.ArgumentParser(add_help=False)
    for group in build_parser()._action_groups:
        mine = parser.add_argument_group(group.title)
        for action in group._group_actions:
            names = [o for o in action.option_strings if o not in flags]
            if names and action.option_strings[0].startswith("--"):
                mine.add_argument(*names, dest=action.dest, action="store_true" if action.nargs == 0 else "store")
    return parser


MLA_AND_MTP_FLAGS = ("--q-lora-rank", "--kv-lora-rank", "--mscale-all-dim", "--mtp-num-layers")


def test_a_sibling_flag_is_a_fair_suggestion():
    line = unknown_flag(parser_without("--kv-lora-rank"), "--kv-lora-rank")
    assert line.startswith("unknown flag --kv-lora-rank; did you mean --q-lora-rank?"), line


@pytest.mark.parametrize(
    ("flag", "not_suggested"),
    [("--kv-lora-rank", "--no-load-rng"), ("--mscale", "--save"), ("--mtp-loss-scaling-factor", "--loss-spike-factor")],
)
def test_an_unknown_flag_far_from_every_flag_gets_no_suggestion(flag, not_suggested):
    parser = parser_without(flag, *MLA_AND_MTP_FLAGS)  # as before they were defined: their siblings are close
    line = unknown_flag(parser, flag)
    assert not_suggested not in line and "did you mean" not in line, line
    assert line.startswith(f"unknown flag {flag}"), line


def test_a_typo_still_gets_its_suggestion():
    line = unknown_flag(build_parser(), "--moe-router-topp")
    assert line.startswith("unknown flag --moe-router-topp; did you mean --moe-router-topk?"), line
    line = unknown_flag(build_parser(), "--num-layer")
    assert line.startswith("unknown flag --num-layer; did you mean --num-layers?"), line


def test_unknown_flag_names_the_nearest_group_by_prefix():
    line = unknown_flag(parser_without("--moe-foo-bar"), "--moe-foo-bar")
    assert "did you mean" not in line and "flags starting --moe-" in line, line


def test_parse_args_keeps_the_suggestion_in_its_error():
    with pytest.raises(ConfigError, match="did you mean --num-layers"):
        parse_args([*MOCK, "--num-layer", "2"])


# -------------------------------------------------------------------------------------------- Megatron-LM's habits


def scheduler_lrs(*flags: str, steps: int = 3) -> list[float]:
    import torch

    from megatron_moe.training.setup import build_scheduler

    cfg = parse_and_validate([*MOCK, "--lr", "1e-3", "--global-batch-size", "1", "--micro-batch-size", "1", *flags], 1)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_scheduler(cfg, optimizer)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step(increment=1)
    return lrs


def test_lr_warmup_init_is_where_the_warm_up_starts_as_megatron_lm():
    assert scheduler_lrs("--lr-warmup-iters", "4") == pytest.approx([0.0, 2.5e-4, 5e-4])
    assert scheduler_lrs("--lr-warmup-iters", "4", "--lr-warmup-init", "2e-4") == pytest.approx([2e-4, 4e-4, 6e-4])
    with pytest.raises(ConfigError, match=r"--lr-warmup-init=0.01: must be in \[0, --lr=0.001\]"):
        parse_and_validate([*MOCK, "--lr", "1e-3", "--lr-warmup-iters", "4", "--lr-warmup-init", "1e-2"], 1)
    notes = parse_and_validate([*MOCK, "--lr-warmup-init", "1e-5"], 1).notes
    assert any(line.startswith("--lr-warmup-init") and "warm-up" in line for line in notes), notes


@pytest.mark.parametrize(
    ("flags", "start"),
    [
        (["--optimizer", "lion"], "--optimizer=lion: optimizers other than Adam and Muon"),
        (["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn", "mlp"], "--cuda-graph-impl: CUDA graphs"),
        (["--fp8-format", "hybrid"], "--fp8-format: FP8 and FP4 training is not supported here"),
        (["--use-megatron-fsdp"], "--use-megatron-fsdp: Megatron-FSDP and torch FSDP2 is not supported"),
        (["--fine-grained-activation-offloading"], "--fine-grained-activation-offloading: activation offloading"),
        (["--moe-token-dispatcher-type", "flex"], "--moe-token-dispatcher-type=flex: the flex dispatcher"),
        (["--grpo-group-size", "2"], "--grpo-group-size: reinforcement learning and inference"),
    ],
)
def test_a_feature_not_built_here_is_refused_by_its_flag_with_the_reason(flags, start):
    with pytest.raises(ConfigError) as caught:
        parse_and_validate([*MOCK, *flags], 1)
    lines = [str(caught.value)] if "\n" not in str(caught.value) else str(caught.value).splitlines()[1:]
    assert lines[0].strip().startswith(start), lines
    assert not any("unexpected argument" in line or "unknown flag" in line for line in lines), lines


def test_the_habit_flags_of_megatron_lm_scripts_are_accepted_with_a_line_each():
    habits = [
        "--async-save",
        "--use-persistent-ckpt-worker",
        "--ckpt-fully-parallel-load",
        "--no-ckpt-fully-parallel-save",
        "--ckpt-assume-constant-structure",
        "--dist-ckpt-strictness",
        "log_all",
        "--dist-ckpt-optim-fully-reshardable",
        "--auto-detect-ckpt-format",
        "--deterministic-mode",
        "--manual-gc",
        "--manual-gc-interval",
        "100",
        "--no-check-for-nan-in-loss-and-grad",
        "--logging-level",
        "40",
        "--enable-experimental",
        "--no-mmap-bin-files",
        "--attention-backend",
        "flash",
    ]
    cfg = parse_and_validate([*MOCK, *habits], 1)
    answered = [line.split(":")[0].split()[0] for line in cfg.notes]
    assert answered == [flag for flag in habits if flag.startswith("--")], cfg.notes


def test_what_pretrain_gpt_means_by_a_flag_left_out_or_a_transport():
    """--vocab-file and --merge-file without --tokenizer-type: GPT2BPETokenizer (pretrain_gpt.py's default);
    allgather in our layer: its all-to-all (the same rows to the same experts); megatron-core's layer keeps it."""
    cfg = parse_args(["--mock-data", "--vocab-file", "v.json", "--merge-file", "m.txt", "--num-experts", "4",
                      "--moe-token-dispatcher-type", "allgather"])  # fmt: skip
    assert cfg.data.tokenizer_type == "GPT2BPETokenizer" and cfg.moe.moe_token_dispatcher_type == "alltoall"
    assert [line.split(":")[0] for line in cfg.notes] == [
        "--vocab-file, --merge-file without --tokenizer-type",
        "--moe-token-dispatcher-type allgather",
    ]
    mcore = parse_args(
        [*MOCK, "--num-experts", "4", "--moe-layer-impl", "mcore", "--moe-token-dispatcher-type=allgather"]
    )
    assert mcore.moe.moe_token_dispatcher_type == "allgather" and mcore.notes == []


# ------------------------------------------------------------------------------- kernels in the first pass (DRY_RUN)

CPU = Kernels(gpu=False, transformer_engine=False, grouped_gemm=False)
GPU_TE = Kernels(gpu=True, transformer_engine=True, grouped_gemm=False)
NEEDS_KERNELS = [
    "--transformer-impl", "transformer_engine", "--use-flash-attn", "--context-parallel-size", "2",
    "--num-experts", "4", "--moe-layer-impl", "mcore", "--moe-grouped-gemm",
]  # fmt: skip


def test_the_first_pass_refuses_every_flag_whose_kernel_the_machine_lacks_at_once():
    gpu_without_te = dataclasses.replace(CPU, gpu=True)
    with pytest.raises(ConfigErrors) as caught:
        parse_and_validate([*MOCK, *NEEDS_KERNELS], 2, kernels=gpu_without_te)
    assert [line.split(":")[0].split("=")[0].split()[0] for line in caught.value.errors] == [
        "--transformer-impl", "--use-flash-attn", "--context-parallel-size", "--moe-grouped-gemm",
    ]  # fmt: skip
    assert "this machine has no transformer_engine" in caught.value.errors[0]
    parse_and_validate([*MOCK, *NEEDS_KERNELS], 2, kernels=GPU_TE)  # transformer-engine runs the grouped GEMMs
    no_te = dataclasses.replace(CPU, gpu=True, grouped_gemm=True)
    parse_and_validate(
        [*MOCK, "--num-experts", "4", "--moe-layer-impl", "mcore", "--moe-grouped-gemm"], 1, kernels=no_te
    )


def test_without_a_gpu_a_gpu_script_runs_on_local_modules_and_says_so():
    """A GPU launch script's CPU run (the tests', a laptop's): transformer-engine's modules and flash attention are
    stood in for by megatron-core's local ones, with the same arithmetic and checkpoint keys, one line each; what
    has no CPU stand-in (context parallelism, megatron-core's grouped GEMM) is still refused."""
    with pytest.raises(ConfigErrors) as caught:
        parse_and_validate([*MOCK, *NEEDS_KERNELS], 2, kernels=CPU)
    assert [line.split(":")[0].split("=")[0] for line in caught.value.errors] == [
        "--context-parallel-size",
        "--moe-grouped-gemm",
    ]
    notes = parse_and_validate([*MOCK, "--transformer-impl", "transformer_engine", "--use-flash-attn"], 1, kernels=CPU)
    stand_ins = [line for line in notes.notes if "no GPU here" in line]
    assert [line.split(":")[0] for line in stand_ins] == ["--transformer-impl transformer_engine", "--use-flash-attn"]
    assert not uses_transformer_engine(notes, CPU)


def test_the_probe_imports_no_torch_and_answers_in_milliseconds():
    code = (
        "import sys, time; t = time.perf_counter(); from megatron_moe.config.kernels import probe_kernels; "
        "probe_kernels(); print(time.perf_counter() - t, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    seconds, torch_imported = out.split()
    assert torch_imported == "False" and float(seconds) < 1.0, out


def test_dry_run_says_no_where_the_build_would_fail(tokenizer, monkeypatch, caplog):
    """DRY_RUN=1 ran the flag pass without the kernel checks: --moe-grouped-gemm in megatron-core's layer then
    crashed at build on a machine without transformer-engine or grouped_gemm."""
    spec = importlib.util.spec_from_file_location("pretrain_gpt_moe", os.path.join(ROOT, "pretrain_gpt_moe.py"))
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    monkeypatch.setattr(entry, "probe_kernels", lambda: CPU)
    monkeypatch.setenv("DRY_RUN", "1")
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    flags = ["--mock-data", "--tokenizer-model", tokenizer.model_path, *SMALL, "--moe-layer-impl", "mcore"]
    assert entry.main(flags) == 0
    assert entry.main([*flags, "--moe-grouped-gemm"]) == 2
    assert "--moe-grouped-gemm: megatron-core's layer (--moe-layer-impl mcore) runs grouped GEMMs" in caplog.text


# ----------------------------------------------------------------------------------------------- NullTokenizer


def test_null_tokenizer_is_megatron_lms():
    """Megatron-LM HEAD's NullTokenizer: ids typed as numbers, vocab_size as given, eod the last id, pad -1."""
    from megatron_moe.data.tokenizer import build_tokenizer

    cfg = parse_and_validate(["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"], 1)
    tokenizer = build_tokenizer(cfg.data)
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.pad) == (1000, 999, -1)
    assert tokenizer.tokenize("5 17 998") == [5, 17, 998] and tokenizer.detokenize([5, 17]) == "5 17"
    eod = parse_and_validate(["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "10",
                              "--null-tokenizer-eod-id", "0"], 1)  # fmt: skip
    assert build_tokenizer(eod.data).eod == 0
    import pickle

    assert pickle.loads(pickle.dumps(tokenizer)).vocab_size == 1000  # data loader workers re-build it


@pytest.mark.parametrize(
    ("flags", "start"),
    [
        ([], "--vocab-size=None: --tokenizer-type NullTokenizer needs its vocabulary size"),
        (["--vocab-size", "8", "--null-tokenizer-eod-id", "8"], "--null-tokenizer-eod-id=8: must be an id"),
    ],
)
def test_null_tokenizer_flags_are_checked(flags, start):
    with pytest.raises(ConfigError, match="^" + re.escape(start)):
        parse_and_validate(["--mock-data", "--tokenizer-type", "NullTokenizer", *flags], 1)
    with pytest.raises(ConfigError, match=r"--tokenizer-type=NullTokenizer: with --mock-data only here"):
        parse_and_validate(["--data-path", "d", "--tokenizer-type", "NullTokenizer", "--vocab-size", "8"], 1)


def test_a_mock_data_run_with_null_tokenizer_gets_its_batches(megatron_world1):
    """Megatron-LM's tests' habit: --mock-data --tokenizer-type NullTokenizer --vocab-size V."""
    from megatron_moe.data.tokenizer import build_tokenizer
    from megatron_moe.training.data import build_run_data

    flags = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200", *SMALL, "--train-iters", "1"]
    cfg = parse_and_validate([*flags, "--micro-batch-size", "2", "--global-batch-size", "2"], 1)
    data = build_run_data(cfg, build_tokenizer(cfg.data), 0)
    batch = next(data.train_iterator)
    assert batch["tokens"].shape == (2, 32) and int(batch["tokens"].max()) < 200


def test_the_flex_dispatcher_is_read_as_our_all_to_all_with_its_kernel_flags_dropped():
    """DeepSeek-V3's script: flex + HybridEP are megatron-core's kernels for the same dispatch; our layer runs its
    all-to-all and says so; megatron-core's layer keeps the flag (and refuses it: no DeepEP/HybridEP here)."""
    flags = ["--num-experts", "4", "--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "hybridep"]
    cfg = parse_args([*MOCK, *flags])
    assert cfg.moe.moe_token_dispatcher_type == "alltoall"
    assert [line.split(":")[0] for line in cfg.notes[:2]] == [
        "--moe-token-dispatcher-type flex",
        "--moe-flex-dispatcher-backend",
    ], cfg.notes
    with pytest.raises(ConfigError, match="--moe-token-dispatcher-type=flex: the flex dispatcher"):
        parse_and_validate([*MOCK, *flags, "--moe-layer-impl", "mcore"], 1)
