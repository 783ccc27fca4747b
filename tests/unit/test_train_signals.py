"""SIGTERM / Ctrl-C handling of the training loop: a stop request, deferred while a checkpoint is written."""
import os
import signal
import time

import pytest

from deepspec.train.stopping import SignalGuard


def _deliver(sig):
    os.kill(os.getpid(), sig)
    time.sleep(0.05)   # the handler runs in the main thread at the next bytecode boundary


def test_stop_is_requested_and_writes_are_never_interrupted():
    g = SignalGuard()
    g.install()
    try:
        _deliver(signal.SIGTERM)
        assert g.requested == signal.SIGTERM          # the loop stops after the current step
        with g.deferred():                              # writing a checkpoint: Ctrl-C twice is recorded only
            _deliver(signal.SIGINT)
            _deliver(signal.SIGINT)
        assert g.requested == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):          # outside a write, another Ctrl-C aborts at once
            _deliver(signal.SIGINT)
    finally:
        g.uninstall()
    assert signal.getsignal(signal.SIGTERM) is not g._handle
