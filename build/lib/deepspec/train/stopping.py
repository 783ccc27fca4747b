"""How a training run stops early: a signal (SIGTERM / Ctrl-C) or a non-finite loss.

`SignalGuard` turns SIGTERM / SIGINT into a stop request the loop honours after the current
step (after saving a checkpoint), deferring signals while a checkpoint is written;
`TrainingInterrupted` is what the loop then raises.  A NaN/inf loss raises
`NonFiniteLossError` with `nonfinite_loss_message` (which loss terms, the last complete checkpoint).
"""
from __future__ import annotations

import contextlib
import logging
import math
import signal
import threading
from pathlib import Path
from typing import Dict, Optional

from deepspec.errors import DeepSpecError
from deepspec.utils.signals import GracefulStop

log = logging.getLogger("deepspec.train")


class NonFiniteLossError(DeepSpecError, RuntimeError):
    """The loss (or one of its terms) became NaN/inf; the run stopped without saving that step."""


class TrainingInterrupted(GracefulStop):
    """SIGTERM / Ctrl-C: the run stopped after saving a complete checkpoint.

    A `KeyboardInterrupt` (like the other stages' `GracefulStop`): the CLI prints one line and
    exits with 143 (SIGTERM) / 130 (Ctrl-C)."""

    def __init__(self, step: int, checkpoint: Optional[Path], signum: int):
        super().__init__(signum)
        self.step, self.checkpoint = step, checkpoint
        self.args = (f"training stopped by {signal.Signals(self.signum).name} after step {step}; "
                     f"checkpoint {checkpoint} is complete",)


def nonfinite_loss_message(step: int, stats: Dict, last_saved: Optional[Path]) -> str:
    """Which loss term(s) went NaN/inf at ``step`` (``stats``: the loop's reduced step statistics)."""
    loss = stats["loss"]
    diagnostics = {"loss", "expected_tau", "blocks", "positions"}   # contract-level metrics, not terms
    terms = [k for k in sorted(stats["metrics"]) if "/" not in k and k not in diagnostics
             and not math.isfinite(stats["metrics"][k])]
    terms = terms or sorted(stats["nonfinite"]) or ["loss"]
    values = ", ".join(f"{t}={stats['metrics'].get(t, loss)}" for t in terms)
    return (f"non-finite loss at step {step} in loss term(s) {', '.join(repr(t) for t in terms)} "
            f"({values}; loss={loss}). "
            f"Stopping without saving this step; last complete checkpoint: {last_saved or 'none'}. "
            "Try a lower train.lr, train.grad_clip, or train.bf16=false.")


def ignore_sigint(_worker_id: int) -> None:
    """Data workers leave Ctrl-C to the main process, which stops cleanly after the step."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class SignalGuard:
    """SIGTERM / SIGINT request a clean stop at the end of the current step.  While a checkpoint
    is being written, signals are only recorded (the write finishes); a second Ctrl-C outside a
    write aborts at once (an interrupted write leaves only a `.tmp` dir, removed on restart)."""

    def __init__(self):
        self.requested: Optional[int] = None
        self._saving = False
        self._previous = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, h in self._previous.items():
            signal.signal(sig, h)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.requested is not None and not self._saving and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.requested is None:
            log.warning("signal %d: stopping after this step (a checkpoint will be saved)", signum)
        self.requested = signum

    @contextlib.contextmanager
    def deferred(self):
        self._saving = True
        try:
            yield
        finally:
            self._saving = False
