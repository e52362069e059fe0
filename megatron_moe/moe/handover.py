"""Where one micro-batch's forward hands over to another's backward (batch-level overlap, overlap/batch.py).

`run_paired(forward, backward)` runs `forward` on a `Coroutine` (the process's one coroutine thread, run only while
its caller waits) until its first MoE all-to-all is in flight (`at_yield`, called by `MoELayer.forward` at each
stage's yield), then `backward` on the caller's thread, whose MoE all-to-alls each run the forward's next stage
under them once started (`under_backward_comm`, called by `OverlapRuntime.run_under`), then the forward's rest.
Invariant: one thread runs at a time, handing over only at those points, so every rank of a stage issues its
collectives in the same order. Outside `run_paired` both points do nothing. `alone(forward, backward)` says, around
one forward, which of its passes run beside no other micro-batch's; `chunked` gives those passes the pipeline's
degrees and the paired ones 1 (their all-to-alls are under the other micro-batch's work: chunks would only add
all-to-alls to a link the pair keeps busy).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable

import torch

from megatron_moe.platform import bind_thread


class _Closed(BaseException):
    """Raised in a paused coroutine that is closed before its end (its caller failed): it unwinds its frames."""


class Coroutine:
    """`fn()` run in turns with the caller on the process's one coroutine thread: `resume()` runs it until it calls
    `pause()` or returns, while the caller waits; `result` is its return value. Its error is raised by the
    `resume()` that ran into it. It takes the caller's grad mode and device (thread-local in torch and CUDA).
    The thread lives for the process (`_worker`): a thread made per coroutine starts with cold per-thread state
    (its allocator arena's pages first-touched again): a forward on it cost 1.5x the CPU of one on a thread
    that had run many."""

    def __init__(self, fn: Callable):
        self._fn = fn
        self._turn = threading.Condition()
        self._its_turn = False
        self._closing = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.done = False
        self.result = None

    @property
    def is_current(self) -> bool:
        """Whether the calling thread is running this coroutine."""
        return self._thread is not None and not self.done and threading.current_thread() is self._thread

    def resume(self) -> bool:
        """Run the coroutine until its next `pause()` or its end; True while it has more to run."""
        if self.done:
            return False
        if self._thread is None:
            self._thread = _worker().start(self, torch.is_grad_enabled())
        self._hand_over(to_coroutine=True)
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return not self.done

    def pause(self) -> None:
        """From inside the coroutine: back to the caller until the next `resume()`."""
        self._hand_over(to_coroutine=False)
        if self._closing:
            raise _Closed

    def close(self) -> None:
        """End a coroutine that has not finished: its `pause()` raises, its frames unwind (no result)."""
        if self._thread is not None and not self.done:
            self._closing = True
            self._hand_over(to_coroutine=True)

    def _hand_over(self, *, to_coroutine: bool) -> None:
        with self._turn:
            self._its_turn = to_coroutine
            self._turn.notify_all()
            while self._its_turn == to_coroutine and not (to_coroutine and self.done):
                self._turn.wait()

    def _run(self, grad: bool) -> None:
        """On the coroutine thread: wait for the first `resume()`, run `fn` to its end, hand back."""
        with self._turn:
            while not self._its_turn:
                self._turn.wait()
        try:
            with torch.set_grad_enabled(grad):
                self.result = self._fn()
        except _Closed:
            pass
        except BaseException as error:  # raised in the caller by the resume() that ran into it
            self._error = error
        finally:
            self._fn = None  # its closure (the step's model and data) is not this coroutine's to keep
            with self._turn:
                self.done, self._its_turn = True, False
                self._turn.notify_all()


class _Worker:
    """The process's coroutine thread: runs the started coroutines one after another."""

    def __init__(self):
        self._started: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="megatron_moe-batch-forward", daemon=True)
        self.thread.start()

    def start(self, coroutine: Coroutine, grad: bool) -> threading.Thread:
        self._started.put((coroutine, grad))
        return self.thread

    def _loop(self) -> None:
        bind_thread()
        while True:
            coroutine, grad = self._started.get()
            coroutine._run(grad)
            del coroutine  # held until the next one arrives, its forward's model would outlive its run, groups too


_WORKER: _Worker | None = None


def _worker() -> _Worker:
    global _WORKER
    if _WORKER is None:
        _WORKER = _Worker()
    return _WORKER


_PAIRED: Coroutine | None = None
"""The forward running beside this rank's backward now (inside `combined_step`), or None."""

COUNTS = {"paired": 0, "under": 0, "chunked": 0, "unchunked": 0}
"""Since the process started: forward-backward pairs run (`combined_step` with both), forward stages run under a
backward all-to-all (`under_backward_comm`), and of the MoE passes (forward, backward) under `alone` whose pipeline
degree is above 1, those run chunked (alone, or not known to be paired) and those run whole (paired). What the
tests and the step log read to see the overlap happen."""


_PASSES = threading.local()
"""`.alone`: (forward, backward) of the forward this thread runs under `alone`: whether each pass runs beside no other
micro-batch's (backward None: not known, the degrees stand). Thread-local: a paired forward runs on the coroutine
thread while the caller's thread runs the other micro-batch's backward."""


@contextlib.contextmanager
def alone(forward: bool, backward: bool | None):
    """Around one micro-batch's forward under batch-level overlap: which of its passes run alone (module docstring).
    Both figures come from the schedule's position, the same on every rank of a stage."""
    before, _PASSES.alone = getattr(_PASSES, "alone", None), (forward, backward)
    try:
        yield
    finally:
        _PASSES.alone = before


def chunked(degrees: tuple[int, int]) -> tuple[int, int]:
    """The pipeline degrees (forward, backward) this forward runs: under `alone`, 1 for a pass that runs paired."""
    passes = getattr(_PASSES, "alone", None)
    if passes is None:
        return degrees
    forward_alone, backward_alone = passes
    narrowed = degrees[0] if forward_alone else 1, degrees[1] if backward_alone is not False else 1
    for degree, now in zip(degrees, narrowed):
        if degree > 1:
            COUNTS["chunked" if now > 1 else "unchunked"] += 1
    return narrowed


def at_yield() -> None:
    """An MoE layer's forward has an all-to-all in flight: inside a paired forward, the backward runs on now."""
    if _PAIRED is not None and _PAIRED.is_current:
        _PAIRED.pause()


def under_backward_comm() -> None:
    """A backward all-to-all has started: the paired forward (if any, and not this thread) runs its next stage."""
    if _PAIRED is not None and not _PAIRED.is_current and not _PAIRED.done:
        COUNTS["under"] += 1
        _PAIRED.resume()


def run_paired(forward: Callable, backward: Callable) -> tuple:
    """(forward(), backward()) as the module docstring says: `forward` on a `Coroutine` until its first `at_yield`,
    then `backward` here, the forward's next stage at each of its `under_backward_comm`s, then the forward's rest."""
    global _PAIRED
    paired = Coroutine(forward)
    COUNTS["paired"] += 1
    try:
        _PAIRED = paired
        paired.resume()
        gradients = backward()
        _PAIRED = None
        while paired.resume():
            pass
        result, paired.result = paired.result, None  # the coroutine thread may still hold `paired` a moment
        return result, gradients
    finally:
        _PAIRED = None
        paired.close()
