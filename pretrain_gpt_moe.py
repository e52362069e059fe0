"""Pretrain a GPT mixture-of-experts model with megatron-core (launch with torchrun).

    torchrun --nproc-per-node 2 pretrain_gpt_moe.py --num-experts 8 \
        --expert-model-parallel-size 2 --data-path PREFIX --tokenizer-model TOK.model ...

`examples/` has complete launch scripts; `--help` lists every flag by group.

Fail fast: an exception on any rank ends that rank at once with "rank R: <message>" and the place it was
raised (the full traceback with MEGATRON_MOE_VERBOSE=1), exit code 1 (2 for a flag, data or tokenizer
error); no collective runs on the way out, and torchrun then stops the other ranks.
"""

import logging
import os
import sys
import traceback
import warnings

from megatron_moe.config import ConfigError, parse_args


def setup_logging() -> None:
    """Our INFO lines on rank 0 and the last rank (which holds the loss); megatron-core's at WARNING."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    level = logging.INFO if rank in (0, world - 1) else logging.WARNING
    logging.basicConfig(level=level, format="[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
    logging.getLogger("megatron").setLevel(logging.WARNING)
    # We subclass its legacy tokenizer on purpose (the GPTDataset interface); no need to say so per run.
    logging.getLogger("megatron.core.datasets.megatron_tokenizer").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="megatron")  # apex/TE-absent notices, deprecations
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


def is_peer_failure(error: BaseException) -> bool:
    """A collective broken by another rank's exit (a consequence, not the culprit)."""
    import torch.distributed as dist

    text = str(error)
    return isinstance(error, dist.DistError) or any(f"Connection {w} by peer" in text for w in ("reset", "closed"))


def report_failure(error: BaseException, *, expected: bool) -> None:
    """Log `error` once for this rank: "rank R: message" first, then where it was raised (all of the
    traceback with MEGATRON_MOE_VERBOSE=1); `expected` errors (flags, data, tokenizer) need no traceback."""
    log = logging.getLogger("megatron_moe")
    rank = int(os.environ.get("RANK", 0))
    message = f"error: {error}" if expected else f"{type(error).__name__}: {error}"
    if is_peer_failure(error):
        message = f"a collective failed, likely because another rank ended first (see its error): {message}"
    log.error("rank %d: %s", rank, message)
    if os.environ.get("MEGATRON_MOE_VERBOSE", "0") not in ("", "0"):
        log.error("rank %d: traceback:\n%s", rank, "".join(traceback.format_exception(error)).rstrip())
    elif not expected and error.__traceback__ is not None:
        frame = traceback.extract_tb(error.__traceback__)[-1]
        hint = "MEGATRON_MOE_VERBOSE=1 shows the traceback"
        log.error("rank %d: raised at %s:%d in %s (%s)", rank, frame.filename, frame.lineno, frame.name, hint)


def exit_now(code: int) -> None:
    """End the process without interpreter teardown: no process-group destructor, checkpoint-writer join
    or atexit hook can then wait on a rank that is inside a collective."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv=None) -> int:
    setup_logging()
    log = logging.getLogger("megatron_moe")
    try:
        cfg = parse_args(argv)  # before the heavy imports: --help and flag errors come at once
        # Before any process group: torchrun's WORLD_SIZE is the world size initialize() will see.
        cfg.validate(int(os.environ.get("WORLD_SIZE", 1)))
    except ConfigError as error:
        if int(os.environ.get("RANK", 0)) == 0:  # every rank fails alike; one line says why
            log.error("error: %s", error)
        return 2
    from megatron_moe.data import DataError
    from megatron_moe.data.tokenizer import TokenizerError
    from megatron_moe.training import pretrain

    try:
        pretrain(cfg)
    except Exception as error:  # any rank, any error: end the job now (the other ranks may be mid-collective)
        expected = isinstance(error, (ConfigError, DataError, TokenizerError))
        report_failure(error, expected=expected)
        exit_now(2 if expected else 1)
    return 0


if __name__ == "__main__":  # the guard matters: the checkpoint writer spawns processes
    sys.exit(main())
