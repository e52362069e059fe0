"""`python -m megatron_moe.launch`: torchrun, taking torchrun's own arguments, whose failed job ends in one line.

    python -m megatron_moe.launch --nproc-per-node 2 pretrain_gpt_moe.py --num-experts 8 ...

torchrun itself (`torch.distributed.run.run`, in this process) with its end changed: each failing rank prints
its own one line ("rank R: ..." from `megatron_moe.failure`), then this prints torchrun's summary in one line
(which rank failed first, its exit code or signal, the other failed ranks) instead of ChildFailedError's ~35
lines and the launcher's traceback, and exits with the first failed rank's code (2 for a flag, data or tokenizer
error; 128 + N for signal N). The example scripts launch through it (examples/common.sh).
"""

from __future__ import annotations

import logging
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.run import parse_args, run

QUIETED = ("failed (exitcode:", "Sending process", "Closing process")
"""torchrun's own log lines about a failure that the one summary line says (or that name pids, not ranks)."""


class _Quiet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in str(record.msg) for text in QUIETED)


def exit_code(failure: ProcessFailure) -> int:
    """A worker's exit code as a shell gives it: 128 + N for a worker killed by signal N."""
    return 128 - failure.exitcode if failure.exitcode < 0 else failure.exitcode


def summary(error: ChildFailedError) -> str:
    """torchrun's summary of a failed job in one line: the first failure, then the others (stopped by torchrun:
    SIGTERM)."""
    rank, first = error.get_first_failure()
    how = f"killed by {first.signal_name()}" if first.exitcode < 0 else f"exited with code {first.exitcode}"
    others = [
        f"rank {other} ({failure.signal_name() if failure.exitcode < 0 else f'code {failure.exitcode}'})"
        for other, failure in sorted(error.failures.items())
        if other != rank
    ]
    then = f"; then {', '.join(others)}" if others else ""
    return f"torchrun: {error.name} failed: rank {rank} (local rank {first.local_rank}) {how} first{then}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    quiet = _Quiet()
    for name in ("", "torch", "torch.distributed"):  # where torchrun's records meet a handler
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(quiet)
    try:
        run(args)
    except ChildFailedError as error:
        print(summary(error), file=sys.stderr, flush=True)
        return exit_code(error.get_first_failure()[1])
    except SignalException as error:  # the launcher was told to stop: the workers were stopped with it
        print(f"torchrun: stopped by {signal.Signals(error.sigval).name}", file=sys.stderr, flush=True)
        return 128 + int(error.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
