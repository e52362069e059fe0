"""Reshard a megatron_moe checkpoint offline to another TP/PP/EP/ESP layout.

Two halves:

- the job maker (`make_reshard_job`, one process, no torch.distributed): reads the
  source's saved RunConfig, derives the target config, picks the smallest
  world size that fits the target layout and refuses what cannot work
  (impossible layout, optimizer formats that cannot move, an existing
  destination) before any process is started;
- the converter (`reshard_on_this_rank`, every rank of a torchrun job):
  builds the model and optimizer in the target layout with megatron_moe's own
  training code, loads the source (dist_checkpointing reshards on load) and
  saves it again, so a converted checkpoint is exactly what training in that
  layout would have saved.

`run_reshard_job` ties them together for `convert.py reshard`: it saves into a
staging directory beside the destination and renames it into place only
when every rank succeeded, so a failure leaves no half-written destination.

Run as a script this module is the torchrun worker: `python -m tools.checkpoint.reshard --job JOB.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import warnings

# Only light imports at module level: torchrun runs this file, and the checkpoint writer's
# spawned helper re-imports it; megatron-core is imported where it is used.
from megatron_moe.config import ConfigError, ParallelDims, RunConfig
from megatron_moe.failure import setup_logging
from megatron_moe.files import umask
from tools.cli import HelpFormatter

log = logging.getLogger("megatron_moe")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Target flag of this tool -> the training flag whose value it sets (for error messages).
TARGET_FLAGS = {
    "--tensor-model-parallel-size": "--target-tensor-parallel-size",
    "--pipeline-model-parallel-size": "--target-pipeline-parallel-size",
    "--expert-model-parallel-size": "--target-expert-parallel-size",
    "--expert-tensor-parallel-size": "--target-expert-tensor-parallel-size",
    "--sequence-parallel": "--target-sequence-parallel",
    "--num-virtual-stages-per-pipeline-rank": "--target-num-virtual-stages-per-pipeline-rank",
}
EMBEDDING_KEY = "embedding.word_embeddings.weight"


class ReshardError(RuntimeError):
    """A conversion that cannot be done as asked; the message says why and what to do instead."""


@dataclasses.dataclass
class Target:
    """What the user asked for; None keeps the source's value."""

    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    expert_parallel_size: int | None = None
    expert_tensor_parallel_size: int | None = None
    """ESP: ranks that split each expert's FFN width."""
    sequence_parallel: bool | None = None
    virtual_stages: int | None = None
    """Model chunks per pipeline rank (the interleaved pipeline; 1: none). Unset: the source's, none at PP 1."""
    use_distributed_optimizer: bool | None = None
    drop_optimizer: bool = False


@dataclasses.dataclass
class ReshardJob:
    """Everything a rank needs to convert; JSON-serialisable so torchrun workers can read it."""

    source: str  # the iteration directory that is read
    destination: str  # the --save root the user named
    iteration: int
    source_layout: dict
    target_config: dict  # RunConfig.to_dict() in the target layout
    world_size: int
    vocab_size: int  # padded rows of the embedding, read from the checkpoint
    with_optimizer: bool
    scheduler: dict  # the source's LR scheduler state, kept even when the optimizer is dropped
    data: dict | None = None  # the source's record of its data (data/fingerprint.py), kept for a resume to check

    def config(self) -> RunConfig:
        return RunConfig.from_dict(self.target_config)

    def describe_target(self) -> str:
        cfg = self.config()
        dims = cfg.dims(self.world_size)
        return (
            f"TP={dims.tp} PP={dims.pp} VPP={dims.vpp or 1} EP={dims.ep} ESP={dims.esp} "
            f"SP={dims.sequence_parallel} distributed-optimizer={cfg.parallel.use_distributed_optimizer}"
        )

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(dataclasses.asdict(self), f, indent=1)

    @classmethod
    def load(cls, path: str) -> ReshardJob:
        with open(path) as f:
            return cls(**json.load(f))


# ---------------------------------------------------------------- the job


def smallest_world_size(cfg: RunConfig) -> int:
    """Fewest ranks that hold the layout: world % (TP*PP*CP) == 0 and (world/PP) % (EP*expert-TP) == 0.

    Fewer ranks means fewer processes (and copies of the non-expert weights)
    on the converting machine; data parallelism does not change what is saved.
    """
    return ParallelDims.from_config(cfg.parallel).smallest_world


def _read_source(load: str) -> tuple[str, dict]:
    """(iteration directory, common state) of `load`: a --save root or one iter_N directory."""
    from megatron.core import dist_checkpointing

    from megatron_moe.checkpointing import resolve_load_dir

    probe = RunConfig()
    probe.checkpoint.load = load
    path = resolve_load_dir(probe)  # raises ConfigError naming --load for anything unusable
    common = dist_checkpointing.load_common_state_dict(path)
    missing = [
        k for k in ("config", "layout", "train_state", "has_optimizer", "distributed_optimizer") if k not in common
    ]
    if missing:
        raise ReshardError(f"--load={load}: {path} is not a megatron_moe checkpoint (no {', '.join(missing)})")
    return path, common


def _saved_config(common: dict, path: str) -> RunConfig:
    try:
        return RunConfig.from_dict(common["config"])
    except TypeError as error:  # a flag this version does not know (or no longer has)
        raise ReshardError(f"{path}: its saved run config does not fit this version of megatron_moe: {error}") from None


def _vocab_rows(path: str) -> int:
    """Padded vocabulary size from the saved embedding, so the tokenizer file is not needed."""
    from megatron.core import dist_checkpointing

    metadata = dist_checkpointing.load_tensors_metadata(path)
    if EMBEDDING_KEY not in metadata:
        raise ReshardError(f"{path}: no {EMBEDDING_KEY} in the checkpoint; cannot size the model")
    return metadata[EMBEDDING_KEY].global_shape[0]


def _target_config(source: RunConfig, target: Target) -> RunConfig:
    cfg = RunConfig.from_dict(source.to_dict())
    p = cfg.parallel
    if target.tensor_parallel_size is not None:
        p.tensor_model_parallel_size = target.tensor_parallel_size
    if target.pipeline_parallel_size is not None:
        p.pipeline_model_parallel_size = target.pipeline_parallel_size
    if target.expert_parallel_size is not None:
        p.expert_model_parallel_size = target.expert_parallel_size
    if target.expert_tensor_parallel_size is not None:
        p.expert_tensor_parallel_size = target.expert_tensor_parallel_size
    # The interleaved pipeline changes no saved tensor (layers are numbered globally): it follows its flag, else
    # the source's, and goes where the target has no pipeline to interleave (PP 1).
    if target.virtual_stages is not None or p.pipeline_model_parallel_size == 1:
        p.num_layers_per_virtual_pipeline_stage = None
        p.num_virtual_stages_per_pipeline_rank = None if target.virtual_stages == 1 else target.virtual_stages
    # Sequence parallelism changes no saved tensor; MoE needs it with TP>1, so it follows TP unless told.
    p.sequence_parallel = (
        target.sequence_parallel if target.sequence_parallel is not None else p.tensor_model_parallel_size > 1
    )
    if target.use_distributed_optimizer is not None:
        p.use_distributed_optimizer = target.use_distributed_optimizer
    return cfg


def _validate_layout(cfg: RunConfig) -> int:
    """The world size for `cfg`, or a ConfigError that names this tool's flags."""
    dims = ParallelDims.from_config(cfg.parallel)
    sizes = (dims.tp, dims.pp, dims.ep, dims.esp)
    for flag, value in zip(list(TARGET_FLAGS.values())[:4], sizes):
        if value < 1:
            raise ConfigError(f"{flag}={value}: must be >= 1")
    world = smallest_world_size(cfg)
    try:
        cfg.validate(world)
    except ConfigError as error:
        message = str(error)
        for training_flag, tool_flag in TARGET_FLAGS.items():
            message = message.replace(training_flag, tool_flag)
        raise ConfigError(
            f"target layout TP={sizes[0]} PP={sizes[1]} EP={sizes[2]} ESP={sizes[3]} cannot hold this checkpoint's "
            f"model: {message}"
        ) from None
    return world


def _check_optimizer(common: dict, cfg: RunConfig, target: Target) -> bool:
    """Whether optimizer state moves; refuses a move between the two optimizer formats."""
    if not common["has_optimizer"] or target.drop_optimizer:
        return False
    if common.get("optimizer_kind") in ("muon", "layer_wise_muon"):
        raise ReshardError(
            "the source's optimizer state is Muon's (--optimizer muon), which this tool does not move (megatron-core "
            "0.16.1's layer-wise Muon saves for a fixed data-parallel layout); add --no-optimizer to convert the "
            "weights only (a run resumed from it starts the optimizer afresh, as --no-load-optim does)"
        )
    saved, wanted = common["distributed_optimizer"], cfg.parallel.use_distributed_optimizer
    if saved != wanted:
        flag = "--target-use-distributed-optimizer" if wanted else "--no-target-use-distributed-optimizer"
        raise ReshardError(
            f"{flag}: the source's optimizer state was saved {'with' if saved else 'without'} "
            f"--use-distributed-optimizer, and optimizer state cannot move between the distributed "
            f"optimizer's format (fp32 main weights and Adam moments gathered per parameter) and the "
            f"plain optimizer's. Keep the source's setting (leave the flag out), or add --no-optimizer "
            f"to convert the weights only (a run resumed from it starts Adam and the LR schedule afresh, "
            f"as --no-load-optim does)."
        )
    return True


def _check_destination(destination: str, source_root: str, overwrite: bool) -> None:
    dst, src = os.path.realpath(destination), os.path.realpath(source_root)
    if dst == src or dst.startswith(src + os.sep) or src.startswith(dst + os.sep):
        raise ReshardError(f"--save={destination}: must not be, contain or lie inside --load={source_root}")
    if os.path.exists(dst) and not (os.path.isdir(dst) and not os.listdir(dst)) and not overwrite:
        raise ReshardError(f"--save={destination}: already exists; choose a new directory or add --overwrite")
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise ReshardError(f"--save={destination}: is a file, not a directory")


def make_reshard_job(load: str, save: str, target: Target, *, overwrite: bool = False) -> ReshardJob:
    """Read the source and decide everything; no side effects. Raises ConfigError/ReshardError."""
    load, save = os.path.abspath(load), os.path.abspath(save)
    path, common = _read_source(load)
    source_root = os.path.dirname(load) if os.path.isfile(os.path.join(load, "metadata.json")) else load
    _check_destination(save, source_root, overwrite)
    source = _saved_config(common, path)
    # The ESP the source ran with (an unset flag means TP now, 1 before): kept where the target leaves it unset.
    source.parallel.expert_tensor_parallel_size = common["layout"].get("esp", 1)
    cfg = _target_config(source, target)
    world = _validate_layout(cfg)
    with_optimizer = _check_optimizer(common, cfg, target)
    cfg.checkpoint.load, cfg.checkpoint.save = load, save
    cfg.checkpoint.no_load_optim = cfg.checkpoint.no_save_optim = not with_optimizer
    return ReshardJob(
        source=os.path.abspath(path),
        destination=save,
        iteration=common["train_state"]["iteration"],
        source_layout=common["layout"],
        target_config=cfg.to_dict(),
        world_size=world,
        vocab_size=_vocab_rows(path),
        with_optimizer=with_optimizer,
        scheduler=common.get("scheduler") or {},
        data=common.get("data"),
    )


# ---------------------------------------------------------------- converting (every rank)


def reshard_on_this_rank(job: ReshardJob, save_root: str, *, keep_process_group: bool = False) -> str:
    """Collective: load `job.source` into the target layout and save it under `save_root`.

    Uses the same start-up, model, optimizer, scheduler, load and save code as
    training, so the result is what a run in the target layout would save.
    RNG states move only when the layouts are equal (load_checkpoint decides);
    otherwise the saved ones are the target layout's fresh seeds, the state a
    run resuming the source directly in that layout would start from.
    """
    from megatron_moe.checkpointing import load_checkpoint, save_checkpoint
    from megatron_moe.model import transformer_config
    from megatron_moe.training.initialize import initialize, shutdown
    from megatron_moe.training.setup import build_ddp_model, build_optimizer, build_scheduler

    cfg = job.config()
    initialize(cfg)
    try:
        log.info("reshard: building the model and optimizer in the target layout (%s)", job.describe_target())
        model = build_ddp_model(cfg, transformer_config(cfg), job.vocab_size)
        optimizer = build_optimizer(cfg, model)
        scheduler = build_scheduler(cfg, optimizer)
        log.info("reshard: loading %s (layout %s)", job.source, job.source_layout)
        state = load_checkpoint(job.source, cfg, model, optimizer, scheduler)
        if not job.with_optimizer and job.scheduler:
            scheduler.load_state_dict(job.scheduler)  # load_checkpoint restores it with the optimizer only
        log.info("reshard: saving iteration %d", state.iteration)
        return save_checkpoint(save_root, cfg, model, optimizer, scheduler, state, data=job.data)
    finally:
        shutdown(destroy_process_group=not keep_process_group)


# ---------------------------------------------------------------- the command


def _missing_ancestors(path: str) -> list[str]:
    """Directories above `path` that do not exist yet, deepest first."""
    missing, parent = [], os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    return missing


def _launch(job_path: str, world: int, save_root: str) -> int:
    """torchrun this module on `world` CPU processes; their output streams through."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # world processes share the cores
    env.setdefault("MEGATRON_MOE_FORCE_CPU", "1")  # offline: the CPU, even where GPUs exist
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))  # `-m tools...` from any cwd
    cmd = [
        sys.executable, "-m", "megatron_moe.launch",  # torchrun; a failure in one line per rank, its exit code
        "--standalone", f"--nproc-per-node={world}", "-m", "tools.checkpoint.reshard", "--job", job_path,
        "--save-root", save_root,
    ]  # fmt: skip
    print(f"reshard: launching {world} CPU process{'es' if world > 1 else ''}: {' '.join(cmd)}", flush=True)
    return subprocess.run(cmd, env=env).returncode


def _publish(staging: str, destination: str) -> None:
    """Move the finished staging directory to `destination`, replacing what --overwrite allowed."""
    from megatron_moe.checkpointing import TRACKER

    if not os.path.isfile(os.path.join(staging, TRACKER)):
        raise ReshardError(f"the conversion wrote no {TRACKER} into {staging}")
    old = None
    if os.path.isdir(destination) and os.listdir(destination):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(destination)}.replaced-", dir=os.path.dirname(destination))
        os.replace(destination, os.path.join(old, "previous"))
    elif os.path.isdir(destination):
        os.rmdir(destination)
    os.replace(staging, destination)
    if old:
        shutil.rmtree(old)


def run_reshard_job(job: ReshardJob) -> str:
    """Convert into a staging directory beside the destination, then rename it into place."""
    created = _missing_ancestors(job.destination)
    os.makedirs(os.path.dirname(job.destination), exist_ok=True)
    name = os.path.basename(job.destination)
    staging = tempfile.mkdtemp(prefix=f".{name}.reshard-", dir=os.path.dirname(job.destination))
    os.chmod(staging, 0o777 & ~umask())  # mkdtemp's 0700 would become the destination's mode
    published = False
    try:
        with tempfile.TemporaryDirectory() as tmp:
            job_path = os.path.join(tmp, "job.json")
            job.save(job_path)
            code = _launch(job_path, job.world_size, staging)
        if code == 2:  # the worker named why in its one line
            raise ReshardError(f"{job.destination} was not written (the conversion failed: the line above)")
        if code != 0:
            raise ReshardError(f"the conversion job failed (exit code {code}); {job.destination} was not written")
        _publish(staging, job.destination)
        published = True
    finally:
        if not published:
            shutil.rmtree(staging, ignore_errors=True)
            for directory in created:  # parents this run created, if still empty
                if os.path.isdir(directory) and not os.listdir(directory):
                    os.rmdir(directory)
    return job.destination


def _setup_worker_logging() -> None:
    """Progress on rank 0 only; megatron-core's notices filtered as in training (`setup_logging`: its loggers at
    WARNING less `MEGATRON_NOISE`, its warnings off), so a conversion prints what it did, not "Unknown MLP type"
    once per rank."""
    setup_logging()
    if int(os.environ.get("RANK", 0)) != 0:  # training's last rank logs too (it holds the loss): not here
        logging.getLogger().setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed.checkpoint")


def worker_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="torchrun worker of `convert.py reshard` (not for direct use)", formatter_class=HelpFormatter
    )
    parser.add_argument("--job", required=True, help="the JSON ReshardJob written by run_reshard_job")
    parser.add_argument("--save-root", required=True, help="where to save (run_reshard_job's staging directory)")
    args = parser.parse_args(argv)
    _setup_worker_logging()
    try:
        reshard_on_this_rank(ReshardJob.load(args.job), args.save_root)
    except ConfigError as error:  # a full disk (CheckpointError) included: one line, as the command's own
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":  # the guard matters: the checkpoint writer spawns processes
    sys.exit(worker_main())
