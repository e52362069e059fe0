"""How a training process reports its end: logging set-up, one error report per rank, exit without teardown.

Outside megatron_moe.training on purpose: the entry point sets logging up before it parses the flags, and
importing the training package would import torch and megatron-core first (seconds before `--help` or a
flag error could be printed). This module imports only the standard library at load time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable

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
    "indexes because path_to_cache is None",  # --mock-data's indices, rebuilt in milliseconds, are not cached
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

ONCE = {"same_on_every_rank": True}
"""`log.info(..., extra=ONCE)`: a line every rank would print alike (a checkpoint loaded, a layout note); rank 0
prints it, the other ranks that log (the last one, which holds the loss) do not."""


class SameOnEveryRank(logging.Filter):
    """Drops `ONCE` records on every rank but 0."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "same_on_every_rank", False) or int(os.environ.get("RANK", 0)) == 0


ONCE_FILTER = SameOnEveryRank()


def setup_logging(verbose: bool = False) -> None:
    """Our INFO lines on rank 0 and the last rank (which holds the loss); megatron-core's at WARNING, less its
    `MEGATRON_NOISE` (shown once each with `verbose`, --verbose). Called again once the flags are parsed."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    level = logging.INFO if rank in (0, world - 1) else logging.WARNING
    logging.basicConfig(level=level, format="[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
    NOISE.verbose = verbose
    for handler in logging.getLogger().handlers:
        for kept_out in (NOISE, ONCE_FILTER):
            if kept_out not in handler.filters:
                handler.addFilter(kept_out)
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
    """Log `error` for this rank: "rank R: message" first, then where it was raised (all of the traceback with
    MEGATRON_MOE_VERBOSE=1); `expected` errors (flags, data, tokenizer) need no traceback. A message another worker
    of this job on this host has already reported (every rank failing alike) is not repeated."""
    log = logging.getLogger("megatron_moe")
    rank = int(os.environ.get("RANK", 0))
    message = f"error: {error}" if expected else f"{type(error).__name__}: {error}"
    if is_peer_failure(error):
        message = f"a collective failed, likely because another rank ended first (see its error): {message}"
    if not first_report_on_this_host(message):
        return
    log.error("rank %d: %s", rank, message)
    if os.environ.get(VERBOSE_ENV, "0") not in ("", "0"):
        log.error("rank %d: traceback:\n%s", rank, "".join(traceback.format_exception(error)).rstrip())
    elif not expected and error.__traceback__ is not None:
        frame = traceback.extract_tb(error.__traceback__)[-1]
        hint = "MEGATRON_MOE_VERBOSE=1 shows the traceback"
        log.error("rank %d: raised at %s:%d in %s (%s)", rank, frame.filename, frame.lineno, frame.name, hint)


def first_report_on_this_host(message: str) -> bool:
    """Whether no other worker of this torchrun job on this host has reported `message` yet: a marker file per
    message, created exclusively (no collective on the way out, so nothing can hang). Outside torchrun: always."""
    job = os.environ.get("TORCHELASTIC_RUN_ID")
    if job is None:
        return True
    folder = os.path.join(tempfile.gettempdir(), f"megatron_moe-reports-{job}-{os.getppid()}")  # the local agent
    marker = os.path.join(folder, hashlib.sha1(message.encode()).hexdigest())
    try:
        os.makedirs(folder, exist_ok=True)
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:  # no writable temp dir: report it, duplicates and all
        pass
    return True


def tell_torchrun(message: str) -> None:
    """Give torchrun `message` as this worker's failure (its error file, TORCHELASTIC_ERROR_FILE): its
    ChildFailedError summary then prints it for this rank instead of "To enable traceback see: <url>". torchrun
    still prints its own traceback and that summary when a worker exits non-zero; no worker can prevent it.
    Outside torchrun: nothing."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    when = str(int(time.time()))
    record = {"message": {"message": message, "extraInfo": {"py_callstack": message, "timestamp": when}}}
    try:
        with open(path, "w", encoding="utf-8") as stream:
            json.dump(record, stream)
    except OSError:  # the summary falls back to torchrun's own words
        pass


_UNDO_ON_EXIT: list[Callable[[], None]] = []  # what `exit_now` removes first (the save lock, a partial save)
os.register_at_fork(after_in_child=_UNDO_ON_EXIT.clear)  # a forked writer's exit must not remove its rank's lock


def undo_on_exit(cleanup: Callable[[], None]) -> None:
    """Have `exit_now` call `cleanup` (quick, filesystem only) until `forget_on_exit(cleanup)`: the ways out that
    skip `finally` blocks (the watchdog's end of the job, a second stop signal) then leave no lock or `.tmp`."""
    _UNDO_ON_EXIT.append(cleanup)


def forget_on_exit(cleanup: Callable[[], None]) -> None:
    if cleanup in _UNDO_ON_EXIT:
        _UNDO_ON_EXIT.remove(cleanup)


def exit_now(code: int) -> None:
    """End the process without interpreter teardown: no process-group destructor, checkpoint-writer join
    or atexit hook can then wait on a rank that is inside a collective. What `undo_on_exit` registered is
    undone first, the newest first."""
    for cleanup in reversed(list(_UNDO_ON_EXIT)):
        try:
            cleanup()
        except Exception as error:  # the exit must happen whatever is left behind
            logging.getLogger("megatron_moe").warning("on exit: %s", error)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    _end_process(code)


def _end_process(code: int) -> None:  # tests replace it (not os._exit itself: forked writers call that)
    os._exit(code)
