#!/usr/bin/env python3
"""Checkpoint conversions for megatron_moe, one subcommand each.

    python -m tools.checkpoint.convert reshard --load SRC --save DST \\
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 1 \\
        --target-expert-parallel-size 2

Subcommands:
  reshard    move a checkpoint to another TP/PP/VPP/EP/ESP layout offline, on CPU,
             optimizer state included (see reshard.py)
  export-hf  write a checkpoint as a HuggingFace model of its family, then verify logits
  import-hf  write a HuggingFace Mixtral/Qwen-MoE/DeepSeek directory as a checkpoint, then verify logits
  verify     largest logit difference between a checkpoint and an HF model directory

A new subcommand is a module with `add_arguments(parser)` and `run(args)`
registered in SUBCOMMANDS. Every subcommand writes a new directory and never
overwrites an existing one unless given --overwrite. Errors exit with code 2
and one line that names the flag, its value and what would work.
"""

from __future__ import annotations

import argparse
import sys
import time

from megatron_moe.config import ConfigError  # pure Python, cheap
from megatron_moe.failure import setup_logging  # the standard library only
from tools.cli import HelpFormatter


class ReshardCommand:
    """`reshard`: another TP/PP/EP layout (and optionally the other optimizer format, weights only)."""

    help = "move a checkpoint to another tensor/pipeline/expert-parallel layout (offline, CPU)"

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--load",
            required=True,
            metavar="SRC",
            help="a --save directory (its latest checkpoint) or one iter_N directory",
        )
        parser.add_argument(
            "--save",
            required=True,
            metavar="DST",
            help="new --save directory for the converted checkpoint (must not exist)",
        )
        for name, what in [("tensor", "TP"), ("pipeline", "PP"), ("expert", "EP"), ("expert-tensor", "ESP")]:
            parser.add_argument(
                f"--target-{name}-parallel-size",
                type=int,
                metavar=what,
                help=f"{what} of the converted checkpoint (default: the source's)",
            )
        parser.add_argument(
            "--target-num-virtual-stages-per-pipeline-rank",
            type=int,
            metavar="VPP",
            help="model chunks per pipeline rank of the converted checkpoint (the interleaved pipeline; 1: none; "
            "default: the source's, none at PP 1)",
        )
        parser.add_argument(
            "--target-sequence-parallel",
            action=argparse.BooleanOptionalAction,
            help="record --sequence-parallel in the saved config (default: on when TP>1)",
        )
        parser.add_argument(
            "--target-use-distributed-optimizer",
            action=argparse.BooleanOptionalAction,
            help="optimizer format of the converted checkpoint (default: the source's); "
            "changing it needs --no-optimizer",
        )
        parser.add_argument(
            "--no-optimizer", action="store_true", help="convert the weights only and drop the optimizer state"
        )
        parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")

    @staticmethod
    def run(args: argparse.Namespace) -> None:
        from tools.checkpoint.reshard import Target, make_reshard_job, run_reshard_job

        target = Target(
            tensor_parallel_size=args.target_tensor_parallel_size,
            pipeline_parallel_size=args.target_pipeline_parallel_size,
            expert_parallel_size=args.target_expert_parallel_size,
            expert_tensor_parallel_size=args.target_expert_tensor_parallel_size,
            sequence_parallel=args.target_sequence_parallel,
            virtual_stages=args.target_num_virtual_stages_per_pipeline_rank,
            use_distributed_optimizer=args.target_use_distributed_optimizer,
            drop_optimizer=args.no_optimizer,
        )
        print(f"reshard: reading {args.load}", flush=True)
        job = make_reshard_job(args.load, args.save, target, overwrite=args.overwrite)
        print(f"reshard: iteration {job.iteration}, source layout {job.source_layout}", flush=True)
        print(
            f"reshard: target {job.describe_target()}, optimizer state "
            f"{'moves' if job.with_optimizer else 'not converted'}",
            flush=True,
        )
        run_reshard_job(job)
        print(f"reshard: wrote {job.destination} (iteration {job.iteration}, {job.describe_target()})", flush=True)


from tools.checkpoint.hf import ExportHFCommand, ImportHFCommand, VerifyCommand  # noqa: E402

SUBCOMMANDS = {
    "reshard": ReshardCommand,
    "export-hf": ExportHFCommand,
    "import-hf": ImportHFCommand,
    "verify": VerifyCommand,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Convert megatron_moe checkpoints.",
        allow_abbrev=False,
        formatter_class=HelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in SUBCOMMANDS.items():
        sub = commands.add_parser(
            name, help=command.help, description=command.__doc__, allow_abbrev=False, formatter_class=HelpFormatter
        )
        command.add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.perf_counter()
    setup_logging()  # megatron-core's TE/apex-absent and legacy-tokenizer notices filtered, as in training
    from tools.checkpoint.reshard import ReshardError

    try:
        SUBCOMMANDS[args.command].run(args)
    except (ConfigError, ReshardError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    except OSError as error:  # an output the subcommand could not write (a full disk, a read-only folder)
        save = getattr(args, "save", "")
        why = f"cannot write {error.filename or save}: {error.strerror or error}"
        print(f"error: --save={save}: {why}; free space there or give a --save in a writable folder with room")
        return 2
    print(f"{args.command}: done in {time.perf_counter() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":  # the guard matters: the checkpoint writer spawns processes
    sys.exit(main())
