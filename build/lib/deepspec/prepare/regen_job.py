"""The regeneration job's state on disk: its paths, its identity, its record, and the final assembly.

``regen.jsonl.job.json`` records which job (`job_fingerprint`) wrote the part files in
``regen.jsonl.parts/`` and whether it finished; `RegenJob` reads it to refuse mixing two jobs,
to skip a finished one and to start a new one, and `RegenJob.finish` assembles the output and
error files in input order (`assemble`) and records the outcome.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

from ..data import Conversation, write_jsonl_atomic
from ..engines.base import SamplingParams
from ..paths import heldout_path, regen_path
from ..errors import DeepSpecError
from .parts import PartStore, read_json, write_json_atomic

FORMAT_VERSION = 1
# Failures that a re-run with the same config would repeat (the prompt itself is the cause): a
# re-run keeps them instead of loading the engine again to retry them.
FINAL_CODES = frozenset({"prompt_too_long", "bad_request"})


class RegenError(DeepSpecError, RuntimeError):
    """The regeneration job cannot continue (config changed under a resume, missing results)."""


@dataclass
class RegenPaths:
    output: Path
    heldout: Path
    ingest_errors: Path
    errors: Path
    parts: Path
    job: Path

    @classmethod
    def from_config(cls, cfg) -> "RegenPaths":
        out = regen_path(cfg)
        ing = Path(cfg.data.errors_path) if cfg.data.errors_path else out.parent / "errors.jsonl"
        return cls(output=out, heldout=heldout_path(cfg), ingest_errors=ing,
                   errors=out.with_name(out.stem + ".errors.jsonl"),
                   parts=out.with_name(out.name + ".parts"), job=out.with_name(out.name + ".job.json"))


def job_fingerprint(cfg, train: Sequence[Conversation], params: SamplingParams) -> str:
    """What makes two runs the same job (servers and concurrency may change; the work may not)."""
    e = cfg.engine
    h = hashlib.sha256()
    ident = {
        "format": FORMAT_VERSION, "kind": e.kind, "sampling": params.to_dict(), "max_turns": e.max_turns,
        "max_prompt_tokens": e.max_prompt_tokens or cfg.data.max_length,
        "model": (cfg.target.path, cfg.target.dtype) if e.kind == "hf" else e.model,
        "chat_template_kwargs": dict(cfg.target.chat_template_kwargs or {}),
        "enable_thinking": cfg.target.enable_thinking, "num_samples": len(train),
    }
    h.update(json.dumps(ident, sort_keys=True, default=str).encode())
    for c in train:
        h.update(c.id.encode() + b"\x00" + c.content_hash().encode() + b"\n")
    return h.hexdigest()


def retryable(entry: Dict[str, Any]) -> bool:
    """A failed part entry that a re-run retries (the failure was not the prompt's fault)."""
    return not entry.get("ok") and entry.get("code") not in FINAL_CODES


def assemble(paths: RegenPaths, train: Sequence[Conversation], store: PartStore,
             fsync: bool = True) -> Tuple[int, int, int]:
    """Write output and error files in input order from the part files: (ok, failed, tokens)."""
    entries = store.load()
    missing = [i for i in range(len(train)) if i not in entries]
    if missing:
        raise RegenError(f"{len(missing)} sample(s) have no result (first: index {missing[0]}, "
                         f"id {train[missing[0]].id}); re-run the same command to resume")
    for i, c in enumerate(train):
        if entries[i].get("id") != c.id:
            raise RegenError(f"{paths.parts}: entry {i} is for id {entries[i].get('id')!r}, expected {c.id!r}; "
                             "the part files belong to another job: rerun with engine.resume=false")
    ok = [entries[i]["sample"] for i in range(len(train)) if entries[i].get("ok")]
    bad = [{k: v for k, v in entries[i].items() if k not in ("ok", "sample")} for i in range(len(train))
           if not entries[i].get("ok")]
    for b in bad:
        b["index"] = b.pop("i")
    write_jsonl_atomic(paths.errors, bad, fsync=fsync)
    write_jsonl_atomic(paths.output, ok, fsync=fsync)
    tokens = sum(int(s["meta"].get("num_tokens", 0)) for s in ok)
    return len(ok), len(bad), tokens


class RegenJob:
    """This job (paths, fingerprint, settings) against the record an earlier run left in ``job.json``."""

    def __init__(self, cfg, paths: RegenPaths, train: Sequence[Conversation], params: SamplingParams):
        self.paths, self.train = paths, train
        self.ecfg = cfg.engine
        self.fingerprint = job_fingerprint(cfg, train, params)
        self.sampling = params.to_dict()
        self.previous: Optional[Dict[str, Any]] = read_json(paths.job)

    @property
    def same_as_previous(self) -> bool:
        return self.previous is not None and self.previous.get("fingerprint") == self.fingerprint

    def check_resumable(self) -> None:
        """A resume never mixes in the progress of a job with another config or other data."""
        if self.previous is not None and not self.same_as_previous and self.ecfg.resume:
            raise RegenError(
                f"{self.paths.job}: an earlier regeneration job with a different config or data wrote "
                f"{self.paths.output.parent}; to start over run with engine.resume=false (discards its progress), "
                "or use another run_dir / data.regen_path")

    def already_complete(self) -> bool:
        """The same job finished and its output is there (with nothing to retry, or retries off)."""
        job = self.previous
        return (self.same_as_previous and bool(job.get("complete")) and self.ecfg.resume
                and self.paths.output.is_file()
                and (not job.get("retryable", job.get("failed")) or not self.ecfg.retry_failed))

    def finished(self, entry: Optional[Dict[str, Any]]) -> bool:
        """A part entry this run keeps (a success, a final failure, or any failure with retries off)."""
        return entry is not None and (not retryable(entry) or not self.ecfg.retry_failed)

    def _record(self, **fields) -> None:
        write_json_atomic(self.paths.job, {"fingerprint": self.fingerprint, "num_samples": len(self.train),
                                           "sampling": self.sampling, "engine": self.ecfg.kind, **fields})

    def start(self, store: PartStore) -> None:
        """Rank 0, before any rank runs: drop another (or an unknown) job's progress, record this job."""
        if not self.same_as_previous or not self.ecfg.resume:
            store.clear()
        self._record(complete=False, started=time.strftime("%Y-%m-%dT%H:%M:%S"))

    def finish(self, store: PartStore, speed: Optional[Dict[str, Any]] = None) -> Tuple[int, int, int, int]:
        """Rank 0, after every rank ran: assemble the output, record the outcome (and ``speed``, this run's
        generation rate); the part files stay only while some failure can be retried.
        Returns (ok, failed, retryable, tokens)."""
        n_ok, n_bad, n_tok = assemble(self.paths, self.train, store, fsync=self.ecfg.fsync)
        n_retry = sum(1 for e in store.load().values() if retryable(e))
        self._record(complete=True, ok=n_ok, failed=n_bad, retryable=n_retry, num_tokens=n_tok,
                     finished=time.strftime("%Y-%m-%dT%H:%M:%S"), **({"speed": speed} if speed else {}))
        if n_retry == 0:
            store.clear()
        return n_ok, n_bad, n_retry, n_tok
