"""How a training process reports its end: logging set-up, one error report per rank, exit without teardown.

Outside megatron_moe.training on purpose: the entry point sets logging up before it parses the flags, and
importing the training package would import torch and megatron-core first (seconds before `--help` or a
flag error could be printed). This module imports only the standard library at load time.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
import warnings

VERBOSE_ENV = "MEGATRON_MOE_VERBOSE"  # "1": every error report carries its whole traceback


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
    import torch.distributed as dist  # only once an error happened: torch is loaded by then

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
    if os.environ.get(VERBOSE_ENV, "0") not in ("", "0"):
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
