"""SIGTERM as a graceful stop for the resumable stages (regeneration, cache build).

By default SIGTERM kills Python on the spot: no ``finally`` block runs, so a half-written
temp file is left behind (harmless — every stage cleans those up when it resumes — but
untidy, and the process ends without saying what it kept).  Inside
``sigterm_as_interrupt()`` SIGTERM instead raises `GracefulStop` (a `KeyboardInterrupt`)
in the main thread, exactly like Ctrl-C, so the stage's own rollback code runs: a shard
being written is deleted, open files are closed, and the error names what was kept.
``deferred()`` marks a commit (append + fsync of finished samples, rename + sidecar of a
shard): SIGTERM / Ctrl-C arriving inside it are held until it is complete, so a unit of
work is either fully committed or rolled back, never half-written.

Training has its own `deepspec.train.stopping.SignalGuard` (it stops after the current step and
saves a checkpoint instead of raising).
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator, List, Optional

EXIT_CODES = {signal.SIGTERM: 143, signal.SIGINT: 130}


class GracefulStop(KeyboardInterrupt):
    """SIGTERM (or Ctrl-C) stopped a stage; completed work is on disk and a re-run resumes."""

    def __init__(self, signum: int = signal.SIGTERM):
        self.signum = int(signum)
        super().__init__(f"stopped by {signal.Signals(self.signum).name}")

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.signum, 128 + self.signum)


_state = threading.local()


def _raise(signum, frame) -> None:
    pending: Optional[List[int]] = getattr(_state, "pending", None)
    if pending is not None:      # inside deferred(): record, deliver at its end
        pending.append(signum)
        return
    raise GracefulStop(signum)


def _main() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises `GracefulStop` in the main thread (no-op in other threads)."""
    if not _main() or signal.getsignal(signal.SIGTERM) is _raise:
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold SIGTERM and SIGINT until the block (a commit) is done, then stop.

    Outside ``sigterm_as_interrupt`` SIGTERM keeps its previous handler; SIGINT is always held."""
    if not _main() or getattr(_state, "pending", None) is not None:
        yield
        return
    _state.pending = []
    prev_int = signal.signal(signal.SIGINT, _raise)
    try:
        yield
    finally:
        pending, _state.pending = _state.pending, None
        signal.signal(signal.SIGINT, prev_int)
    if pending:   # the block completed: now stop (an exception from the block wins instead)
        raise GracefulStop(pending[0])
