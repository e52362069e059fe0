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


MEGATRON_NOISE = (
    "Unknown MLP type",  # our MLP specs are ModuleSpecs it does not list; it then uses the right kwargs
    "RNG state changed within GPU RNG context",  # the CPU platform's RNG tracker: expected on CPU
    "legacy tokenizer",  # we subclass its legacy tokenizer on purpose (the GPTDataset interface)
    "Apex is not installed",
    "Transformer Engine",
    "transformer_engine",
    "RerunStateMachine",
    "rerun state machine",
    "BlendedDataset",  # its cache notices
)
"""megatron-core's messages that say nothing about this run (its modules' expectations of a GPU set-up)."""


class MegatronNoise(logging.Filter):
    """Drops `MEGATRON_NOISE` from megatron-core's loggers; `verbose` (--verbose) shows each such message once
    instead. One place, on the root handlers, so every logger's records pass it."""

    def __init__(self):
        super().__init__()
        self.verbose = False
        self._seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("megatron.") and record.name != "megatron":
            return True
        message = record.getMessage()
        if not any(pattern in message for pattern in MEGATRON_NOISE):
            return True
        if not self.verbose or message in self._seen:
            return False
        self._seen.add(message)
        return True


NOISE = MegatronNoise()


def setup_logging(verbose: bool = False) -> None:
    """Our INFO lines on rank 0 and the last rank (which holds the loss); megatron-core's at WARNING, less its
    `MEGATRON_NOISE` (shown once each with `verbose`, --verbose). Called again once the flags are parsed."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    level = logging.INFO if rank in (0, world - 1) else logging.WARNING
    logging.basicConfig(level=level, format="[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
    NOISE.verbose = verbose
    for handler in logging.getLogger().handlers:
        if NOISE not in handler.filters:
            handler.addFilter(NOISE)
    logging.getLogger("megatron").setLevel(logging.INFO if verbose else logging.WARNING)
    if not verbose:
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
