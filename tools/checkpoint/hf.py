"""`export-hf`, `import-hf` and `verify`: HuggingFace Mixtral, Qwen2/3-MoE and DeepSeek-V2/V3 both ways, by logits.

Each ends by running our model and transformers' own class of the family
(AutoModelForCausalLM) on the same tokens (CPU, fp32) and printing the
largest absolute logit difference; it fails (exit 2) above --tolerance.
"""

from __future__ import annotations

import argparse
import os

from megatron_moe.config import ConfigError


def _verify(ckpt: str, hf_dir: str, tolerance: float) -> float:
    from megatron_moe.checkpointing.hf_convert import load_single, max_logit_difference, probe_tokens

    # The HF directory's tokenizer: the one the model was made with, wherever the checkpoint came from.
    _, model, tokenizer = load_single(ckpt, tokenizer_model=hf_dir)
    diff = max_logit_difference(model, hf_dir, probe_tokens(tokenizer.vocab_size))
    print(
        f"verify: max |logits(megatron_moe) - logits(transformers)| = {diff:.3e} (tolerance {tolerance:g})", flush=True
    )
    if diff > tolerance:
        raise ConfigError(f"--tolerance={tolerance}: logits differ by {diff:.3e}; the conversion is wrong")
    return diff


def _common(parser: argparse.ArgumentParser, load_help: str, save_help: str) -> None:
    parser.add_argument("--load", required=True, help=load_help)
    parser.add_argument("--save", required=True, help=save_help)
    parser.add_argument("--overwrite", action="store_true", help="replace --save if it exists")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="largest accepted logit difference")


class ExportHFCommand:
    help = (
        "write a checkpoint (any layout) as a HuggingFace model directory of its family (Mixtral, Qwen2-MoE, "
        "Qwen3-MoE, DeepSeek-V2/V3)"
    )

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        _common(parser, "a --save directory or one iter_N directory", "the new HF model directory")
        parser.add_argument(
            "--tokenizer-model",
            help="export this tokenizer instead of the run's: a sentencepiece .model, a tokenizer.json or a "
            "directory holding one (default: the run's --tokenizer-type and files)",
        )

    @staticmethod
    def run(args: argparse.Namespace) -> None:
        from megatron_moe.checkpointing.hf_convert import export_hf

        export_hf(
            args.load,
            args.save,
            tokenizer_model=args.tokenizer_model,
            overwrite=args.overwrite,
            progress=lambda line: print(line, flush=True),
        )
        print(f"export-hf: wrote {args.save}", flush=True)
        _verify(args.load, args.save, args.tolerance)


class ImportHFCommand:
    help = "write a HuggingFace Mixtral, Qwen2-MoE, Qwen3-MoE or DeepSeek-V2/V3 directory as a megatron_moe checkpoint"

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        _common(
            parser,
            "HF model directory (config.json, *.safetensors, tokenizer.model or tokenizer.json)",
            "the new --save directory (loads into any TP/PP/EP layout)",
        )
        for name, what in [("tensor", "TP"), ("pipeline", "PP"), ("expert", "EP")]:
            parser.add_argument(
                f"--target-{name}-parallel-size",
                type=int,
                metavar=what,
                help=f"record the checkpoint in this {what} (default 1; any layout loads it)",
            )

    @staticmethod
    def run(args: argparse.Namespace) -> None:
        import shutil
        import tempfile

        from megatron_moe.checkpointing.hf_families import read_hf_config

        read_hf_config(args.load)  # a bad config.json refused before torch and megatron-core load (seconds)
        from megatron_moe.checkpointing.hf_convert import import_hf

        layout = [
            args.target_tensor_parallel_size,
            args.target_pipeline_parallel_size,
            args.target_expert_parallel_size,
        ]
        progress = lambda line: print(line, flush=True)  # noqa: E731
        if not any(layout):
            import_hf(args.load, args.save, overwrite=args.overwrite, progress=progress)
        else:  # import in one process, then move to the asked layout with `reshard`
            from tools.checkpoint.reshard import Target, make_reshard_job, run_reshard_job

            staging = tempfile.mkdtemp(prefix="import-hf-")
            try:
                imported = import_hf(args.load, f"{staging}/ckpt", progress=progress, tokenizer_home=args.save)
                target = Target(
                    tensor_parallel_size=layout[0],
                    pipeline_parallel_size=layout[1],
                    expert_parallel_size=layout[2],
                    sequence_parallel=None,
                    use_distributed_optimizer=None,
                    drop_optimizer=False,
                )
                job = make_reshard_job(imported, args.save, target, overwrite=args.overwrite)
                progress(f"import-hf: resharding to {job.describe_target()}")
                run_reshard_job(job)
                for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                    if os.path.isfile(f"{imported}/{name}"):  # the HF directory's tokenizer, as import_hf copied it
                        shutil.copyfile(f"{imported}/{name}", f"{args.save}/{name}")
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        print(f"import-hf: wrote {args.save}", flush=True)
        _verify(args.save, args.load, args.tolerance)


class VerifyCommand:
    help = "compare a checkpoint's logits with a HuggingFace model directory's"

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--load", required=True, help="megatron_moe checkpoint")
        parser.add_argument("--hf", required=True, help="HF model directory")
        parser.add_argument("--tolerance", type=float, default=1e-4, help="largest accepted logit difference")

    @staticmethod
    def run(args: argparse.Namespace) -> None:
        _verify(args.load, args.hf, args.tolerance)
