"""The batching worker of `deepspec serve` (`server`): one thread owns the engine.

Request threads `submit` (messages, params, seed) and wait on the returned `Future`; the
worker gathers what is queued (up to ``max_batch``, waiting at most ``wait_s`` for more),
groups it by sampling parameters and runs one `Engine.generate` call per group.  A failed
call answers its requests with a `GenerationError`, never taking the server down.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Dict, Optional, Tuple

from .base import Engine, GenerationError, SamplingParams

log = logging.getLogger(__name__)


class Batcher:
    """One thread owns the engine; requests queue up and are generated in batches."""

    def __init__(self, engine: Engine, max_batch: int = 16, wait_s: float = 0.005):
        self.engine = engine
        self.max_batch = max(1, max_batch)
        self.wait_s = wait_s
        self.q: "queue.Queue[Optional[Tuple[list, SamplingParams, int, Future]]]" = queue.Queue()
        self._stop = False
        self.thread = threading.Thread(target=self._loop, name="deepspec-serve-batcher", daemon=True)
        self.thread.start()

    def submit(self, messages, params: SamplingParams, seed: int) -> Future:
        f: Future = Future()
        self.q.put((messages, params, seed, f))
        return f

    def close(self) -> None:
        self._stop = True
        self.q.put(None)
        self.thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop:
            item = self.q.get()
            if item is None:
                break
            items = [item]
            deadline = time.monotonic() + self.wait_s
            while len(items) < self.max_batch:
                try:
                    nxt = self.q.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if nxt is None:
                    self._stop = True
                    break
                items.append(nxt)
            groups: Dict[SamplingParams, list] = {}
            for it in items:
                groups.setdefault(it[1], []).append(it)
            for params, group in groups.items():
                try:
                    res = self.engine.generate([g[0] for g in group], params, keys=[g[2] for g in group])
                except Exception as e:  # never take the server down
                    log.exception("generation failed")
                    res = [GenerationError(f"{type(e).__name__}: {e}", code="exception")] * len(group)
                for g, r in zip(group, res):
                    if not g[3].done():
                        g[3].set_result(r)
        while True:  # fail whatever is still queued
            try:
                it = self.q.get_nowait()
            except queue.Empty:
                break
            if it is not None and not it[3].done():
                it[3].set_result(GenerationError("server shutting down", code="exception", retryable=True))
