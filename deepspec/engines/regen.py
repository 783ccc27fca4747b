"""`prepare` stage 1a: prompts in, regenerated conversations out.

    regenerate(cfg) -> regen_path(cfg)

1. ingest ``data.source`` (bad records per ``data.on_error``; skips → errors.jsonl);
2. split by a seeded hash of the sample id; write the held-out prompts
   (``heldout_path(cfg)``, ``{"id", "turns"}`` JSONL) — only the train side is regenerated;
3. regenerate every assistant turn in order, each one conditioned on the regenerated
   history, with the configured engine (``engine.kind=hf|openai``);
4. write ``{"id", "conversations", "meta"}`` JSONL in input order, plus
   ``regen.errors.jsonl`` for samples that failed after retries.

Resumable: completed samples are appended (fsync'd) to ``regen.jsonl.parts/``; a
re-run with the same config skips them (and retries failures unless
``engine.retry_failed=false``).  The output is assembled atomically at the end.
Under torchrun each rank takes the samples with ``index % world == rank``.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..data import Conversation, load_conversations, split_conversations, write_heldout, write_jsonl_atomic
from ..errors import DeepSpecError
from ..paths import heldout_path, regen_path
from .base import Completion, Engine, EngineError, GenerationError, Messages, SamplingParams
from ..utils.signals import GracefulStop, sigterm_as_interrupt
from .parts import PartStore, read_json, write_json_atomic

log = logging.getLogger(__name__)
FORMAT_VERSION = 1


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


# -- multi-turn plan ----------------------------------------------------------------------
def plan_turns(messages: Sequence[Dict[str, str]], max_turns: Optional[int] = None) -> List[List[Dict[str, str]]]:
    """Split a conversation into prompt segments, one per assistant turn to regenerate.

    Source assistant messages are dropped; each segment is the system/user messages
    since the previous generation point and ends with a user message.
    """
    steps, cur = [], []
    for m in messages:
        if m["role"] == "assistant":
            if any(x["role"] == "user" for x in cur):
                steps.append(cur)
                cur = []
            continue
        cur.append({"role": m["role"], "content": m["content"]})
    if any(x["role"] == "user" for x in cur):
        steps.append(cur)
    return steps[:max_turns] if max_turns else steps


class _SampleRun:
    def __init__(self, index: int, conv: Conversation, max_turns: Optional[int]):
        self.index, self.conv = index, conv
        self.steps = plan_turns(conv.messages, max_turns)
        self.history: List[Dict[str, str]] = []
        self.k = 0
        self.turn_tokens: List[int] = []
        self.finish: List[str] = []
        self.prompt_tokens = 0
        self.error: Optional[GenerationError] = None
        self.truncated = 0

    @property
    def active(self) -> bool:
        return self.error is None and self.k < len(self.steps)

    def prompt(self) -> Messages:
        return self.history + self.steps[self.k]

    def key(self) -> str:
        return f"{self.conv.id}\x00turn{self.k}"

    def accept(self, r) -> None:
        if isinstance(r, GenerationError):
            if r.code == "prompt_too_long" and self.k > 0:
                self.truncated = len(self.steps) - self.k   # keep the turns that fit
                self.k = len(self.steps)
            else:
                self.error = r
            return
        self.history = self.history + self.steps[self.k] + [{"role": "assistant", "content": str.__str__(r)}]
        self.turn_tokens.append(int(getattr(r, "num_tokens", 0)))
        self.finish.append(getattr(r, "finish_reason", "stop"))
        self.prompt_tokens += int(getattr(r, "prompt_tokens", 0))
        self.k += 1

    def entry(self, meta_base: Dict[str, Any]) -> Dict[str, Any]:
        if self.error is not None:
            return {"i": self.index, "id": self.conv.id, "ok": False, **self.error.to_dict(),
                    "turn": self.k, "origin": self.conv.origin}
        meta = dict(meta_base)
        meta.update(num_tokens=sum(self.turn_tokens), turn_tokens=self.turn_tokens,
                    finish_reason=self.finish[-1] if self.finish else None, finish_reasons=self.finish,
                    prompt_tokens=self.prompt_tokens, turns=len(self.turn_tokens),
                    truncated_turns=self.truncated, origin=self.conv.origin)
        return {"i": self.index, "id": self.conv.id, "ok": True,
                "sample": {"id": self.conv.id, "conversations": self.history, "meta": meta}}


def run_samples(engine: Engine, samples: Sequence[Tuple[int, Conversation]], params: SamplingParams,
                max_turns: Optional[int] = None, meta: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    """Regenerate a group of samples turn by turn; one part entry per sample (input order)."""
    runs = [_SampleRun(i, c, max_turns) for i, c in samples]
    for r in runs:
        if not r.steps:
            r.error = GenerationError("nothing to regenerate: no user turn", code="bad_request")
    while True:
        active = [r for r in runs if r.active]
        if not active:
            break
        results = engine.generate([r.prompt() for r in active], params, keys=[r.key() for r in active])
        for r, res in zip(active, results):
            r.accept(res)
    return [r.entry(meta or {}) for r in runs]


# -- distributed ---------------------------------------------------------------------------
class _Dist:
    def __init__(self):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.created = False
        if self.world > 1:
            import torch.distributed as dist
            if not dist.is_initialized():
                dist.init_process_group("gloo", timeout=timedelta(days=3))
                self.created = True

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist
            dist.barrier()

    def close(self) -> None:
        if self.created:
            import torch.distributed as dist
            dist.destroy_process_group()


# -- the job -------------------------------------------------------------------------------
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


def build_engine(cfg, device: Optional[str] = None) -> Engine:
    kind = cfg.engine.kind
    if kind == "hf":
        from .hf import HFEngine
        return HFEngine.from_config(cfg, device=device)
    if kind == "openai":
        from .openai_client import OpenAIEngine
        return OpenAIEngine.from_config(cfg)
    raise EngineError(f"unknown engine.kind={kind!r}; choose hf or openai")


def _chunk_size(cfg, engine: Engine) -> int:
    if cfg.engine.chunk_size:
        return max(1, int(cfg.engine.chunk_size))
    return max(1, 4 * engine.parallelism)


def _progress(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm
    return tqdm(total=total, initial=initial, disable=not enabled, unit="sample", dynamic_ncols=True,
                desc="regenerate", mininterval=1.0, smoothing=0.1)


# Failures that a re-run with the same config would repeat (the prompt itself is the cause): a
# re-run keeps them instead of loading the engine again to retry them.
FINAL_CODES = frozenset({"prompt_too_long", "bad_request"})


def _retryable(entry: Dict[str, Any]) -> bool:
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


def regenerate(cfg, engine: Optional[Engine] = None) -> Path:
    """Regenerate the train split of ``data`` with ``engine`` (built from ``cfg.engine`` if None).

    SIGTERM / Ctrl-C stop it with `GracefulStop` after the samples already appended (whole
    lines, fsync'd) — the chunk in flight is dropped and redone by a re-run."""
    with sigterm_as_interrupt():
        try:
            return _regenerate(cfg, engine)
        except GracefulStop as e:
            print(f"regenerate: {e}; finished samples are kept in {RegenPaths.from_config(cfg).parts}; "
                  "run the same command again to resume", file=sys.stderr, flush=True)
            raise


def _regenerate(cfg, engine: Optional[Engine]) -> Path:
    paths = RegenPaths.from_config(cfg)
    ecfg = cfg.engine
    d = _Dist()
    is0 = d.rank == 0
    t0 = time.time()
    try:
        convs, stats = load_conversations(cfg.data, paths.ingest_errors if is0 else None)
        train, held = split_conversations(convs, cfg.data.heldout_fraction, cfg.data.split_seed)
        params = SamplingParams.from_config(ecfg, default_seed=cfg.seed)
        if is0:
            write_heldout(held, paths.heldout)
            print(stats.summary(), flush=True)
            print(f"split: {len(train)} train (regenerated), {len(held)} held-out → {paths.heldout}", flush=True)
        fp = job_fingerprint(cfg, train, params)
        store = PartStore(paths.parts, rank=d.rank, fsync=ecfg.fsync)
        job = read_json(paths.job)
        if job is not None and job.get("fingerprint") != fp and ecfg.resume:
            raise RegenError(
                f"{paths.job}: an earlier regeneration job with a different config or data wrote "
                f"{paths.output.parent}; to start over run with engine.resume=false (discards its progress), "
                "or use another run_dir / data.regen_path")
        if job is not None and job.get("fingerprint") == fp and job.get("complete") and ecfg.resume \
                and paths.output.is_file() and (not job.get("retryable", job.get("failed")) or not ecfg.retry_failed):
            if is0:
                if not job.get("failed"):
                    store.clear()
                print(f"regenerate: already complete ({job.get('ok')} samples, {job.get('failed')} failed) "
                      f"→ {paths.output}", flush=True)
            d.barrier()
            return paths.output
        d.barrier()
        if is0:
            if job is None or job.get("fingerprint") != fp or not ecfg.resume:
                store.clear()  # progress of another (or an unknown) job is never mixed in
            write_json_atomic(paths.job, {"fingerprint": fp, "complete": False, "num_samples": len(train),
                                          "sampling": params.to_dict(), "engine": ecfg.kind,
                                          "started": time.strftime("%Y-%m-%dT%H:%M:%S")})
        d.barrier()

        done = store.load()

        def finished(i: int) -> bool:
            e = done.get(i)
            return e is not None and (not _retryable(e) or not ecfg.retry_failed)

        mine = [i for i in range(len(train)) if i % d.world == d.rank]
        todo = [i for i in mine if not finished(i)]
        resumed = len(mine) - len(todo)
        if resumed and is0:
            print(f"regenerate: resuming, {resumed} sample(s) already done on this rank", flush=True)
        gen_ok = gen_fail = tokens = 0
        if todo:
            own = engine is None
            if own:
                device = None
                if d.world > 1:
                    import torch
                    if torch.cuda.is_available():
                        torch.cuda.set_device(d.local_rank)
                        device = f"cuda:{d.local_rank}"
                engine = build_engine(cfg, device=device)
            try:
                meta = {"engine": engine.name, "sampling": params.to_dict()}
                desc = engine.describe()
                meta["model"] = desc.get("model")
                if desc.get("chat_template_kwargs"):
                    meta["chat_template_kwargs"] = desc["chat_template_kwargs"]
                chunk = _chunk_size(cfg, engine)
                bar = _progress(len(mine), resumed, ecfg.progress and is0)
                store.open()
                start = time.time()
                try:
                    for s in range(0, len(todo), chunk):
                        idx = todo[s:s + chunk]
                        entries = run_samples(engine, [(i, train[i]) for i in idx], params, ecfg.max_turns, meta)
                        if not engine.healthy():
                            # keep what finished; the rest stays pending for a re-run
                            store.append([e for e in entries if e["ok"]])
                            raise EngineError("the engine lost every server; re-run the same command to resume")
                        store.append(entries)
                        for e in entries:
                            if e["ok"]:
                                gen_ok += 1
                                tokens += int(e["sample"]["meta"]["num_tokens"])
                            else:
                                gen_fail += 1
                        bar.update(len(idx))
                        el = max(time.time() - start, 1e-9)
                        bar.set_postfix(tok_s=f"{tokens / el:.0f}", failed=gen_fail, refresh=False)
                finally:
                    bar.close()
                    store.close()
            finally:
                if own:
                    engine.close()
        d.barrier()
        if is0:
            n_ok, n_bad, n_tok = assemble(paths, train, store, fsync=ecfg.fsync)
            n_retry = sum(1 for e in store.load().values() if _retryable(e))
            write_json_atomic(paths.job, {"fingerprint": fp, "complete": True, "num_samples": len(train),
                                          "ok": n_ok, "failed": n_bad, "retryable": n_retry, "num_tokens": n_tok,
                                          "sampling": params.to_dict(), "engine": ecfg.kind,
                                          "finished": time.strftime("%Y-%m-%dT%H:%M:%S")})
            if n_retry == 0:
                store.clear()
            el = time.time() - t0
            print(f"regenerate: {len(train)} train samples: {n_ok} ok, {n_bad} failed "
                  f"({resumed} resumed, {gen_ok + gen_fail} run now on rank 0); {n_tok} tokens; "
                  f"{el:.1f}s → {paths.output}"
                  + (f"; failures in {paths.errors}" if n_bad else "")
                  + (f" ({n_retry} transient: re-run to retry; {n_bad - n_retry} final: the prompt is the cause)"
                     if n_retry else (" (final: the prompt is the cause, e.g. too long; not retried)" if n_bad else "")),
                  flush=True)
        d.barrier()
        return paths.output
    finally:
        d.close()


def main(argv=None) -> int:
    """``python -m deepspec.engines.regen [overrides]``: stage 1a alone (e.g. under torchrun)."""
    from ..config import ConfigError, load_config
    from ..data import DataError
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(args)
    except ConfigError as e:
        print(f"regenerate: config error: {e}", file=sys.stderr)
        return 2
    try:
        regenerate(cfg)
    except (DataError, RegenError, EngineError, OSError) as e:
        print(f"regenerate: {e}", file=sys.stderr)
        return 1
    except GracefulStop as e:
        return e.exit_code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
