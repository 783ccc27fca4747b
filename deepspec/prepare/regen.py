"""`prepare` stage 1a: prompts in, regenerated conversations out.

    regenerate(cfg) -> regen_path(cfg)

1. ingest ``data.source`` (bad records per ``data.on_error``; skips → errors.jsonl);
2. split by a seeded hash of the sample id; write the held-out prompts
   (``heldout_path(cfg)``, ``{"id", "turns"}`` JSONL) for evaluation — every sample is
   regenerated (training leaves the held-out ones out by the same hash);
3. regenerate every assistant turn in order, each one conditioned on the regenerated
   history, with the configured engine (``engine.kind=hf|openai``);
4. write ``{"id", "conversations", "meta"}`` JSONL in input order, plus
   ``regen.errors.jsonl`` for samples that failed after retries.

Resumable: completed samples are appended (fsync'd) to ``regen.jsonl.parts/``; a
re-run with the same config skips them (and retries failures unless
``engine.retry_failed=false``).  The output is assembled atomically at the end.
Under torchrun each rank takes the samples with ``index % world == rank``.

The parts: `turns` (one group of conversations through the engine), `parts` (the crash-safe
part files), `regen_job` (the job's paths, identity, record and final assembly); this module
runs the job: job state, then this rank's loop, then the assembly on rank 0.
"""
from __future__ import annotations

import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from ..config import ConfigError, load_config
from ..data import Conversation, DataError, load_conversations, split_conversations, write_heldout
from ..engines.base import Engine, EngineError, SamplingParams
from ..engines.factory import build_engine
from ..utils.dist_env import local_rank, rank_world
from ..utils.signals import GracefulStop, sigterm_as_interrupt
from .parts import PartStore
from .regen_job import RegenError, RegenJob, RegenPaths
from .turns import run_samples


class _RankGroup:
    """This process's rank; with several ranks, a gloo process group for the barriers."""

    def __init__(self):
        self.rank, self.world = rank_world()
        self.local_rank = local_rank()
        self.created = False
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("gloo", timeout=timedelta(days=3))
            self.created = True

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def close(self) -> None:
        if self.created:
            dist.destroy_process_group()


def regenerate(cfg, engine: Optional[Engine] = None) -> Path:
    """Regenerate every conversation of ``data`` with ``engine`` (built from ``cfg.engine`` if None).

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
    group = _RankGroup()
    t0 = time.time()
    try:
        convs, stats = load_conversations(cfg.data, paths.ingest_errors if group.is_main else None)
        # every conversation is regenerated: the held-out side (by id hash) is what training evaluates on,
        # teacher-forced from the cache and with the real loop from its prompts (heldout.jsonl)
        _, held = split_conversations(convs, cfg.data.heldout_fraction, cfg.data.split_seed)
        params = SamplingParams.from_config(cfg.engine, default_seed=cfg.seed)
        if group.is_main:
            write_heldout(held, paths.heldout)
            print(stats.summary(), flush=True)
            print(f"split: {len(convs) - len(held)} train, {len(held)} held-out (all regenerated; held-out prompts "
                  f"→ {paths.heldout})", flush=True)
        job = RegenJob(cfg, paths, convs, params)
        store = PartStore(paths.parts, rank=group.rank, fsync=cfg.engine.fsync)
        job.check_resumable()
        if job.already_complete():
            if group.is_main:
                if not job.previous.get("failed"):
                    store.clear()
                print(f"regenerate: already complete ({job.previous.get('ok')} samples, "
                      f"{job.previous.get('failed')} failed) → {paths.output}", flush=True)
            group.barrier()
            return paths.output
        group.barrier()
        if group.is_main:
            job.start(store)
        group.barrier()
        done = store.load()
        mine = [i for i in range(len(convs)) if i % group.world == group.rank]
        todo = [i for i in mine if not job.finished(done.get(i))]
        resumed = len(mine) - len(todo)
        if resumed and group.is_main:
            print(f"regenerate: resuming, {resumed} sample(s) already done on this rank", flush=True)
        ran = _run_rank(cfg, engine, group, convs, todo, params, store, len(mine), resumed) if todo else (0, 0, 0, 0.0)
        group.barrier()
        if group.is_main:
            speed = _speed(ran, group.world)
            _report(paths, len(convs), job.finish(store, speed), resumed, sum(ran[:2]), time.time() - t0, speed)
        group.barrier()
        return paths.output
    finally:
        group.close()


# -- this rank's loop --------------------------------------------------------------------------------
def _chunk_size(cfg, engine: Engine) -> int:
    if cfg.engine.chunk_size:
        return max(1, int(cfg.engine.chunk_size))
    return max(1, 4 * engine.parallelism)


def _rank_device(group: _RankGroup) -> Optional[str]:
    """With several ranks each one drives its own GPU (when there are GPUs)."""
    if group.world > 1 and torch.cuda.is_available():
        torch.cuda.set_device(group.local_rank)
        return f"cuda:{group.local_rank}"
    return None


def _sample_meta(engine: Engine, params: SamplingParams) -> Dict[str, Any]:
    meta = {"engine": engine.name, "sampling": params.to_dict()}
    desc = engine.describe()
    meta["model"] = desc.get("model")
    if desc.get("chat_template_kwargs"):
        meta["chat_template_kwargs"] = desc["chat_template_kwargs"]
    return meta


def _run_rank(cfg, engine: Optional[Engine], group: _RankGroup, train: Sequence[Conversation], todo: List[int],
              params: SamplingParams, store: PartStore, total: int, resumed: int) -> Tuple[int, int, int, float]:
    """Regenerate this rank's pending samples chunk by chunk, appending each chunk to the part file.

    Builds (and closes) the engine unless one is given.  Returns (ok, failed, new tokens, seconds spent
    generating — the engine's loading not included) of this run."""
    ecfg = cfg.engine
    own = engine is None
    if own:
        engine = build_engine(cfg, device=_rank_device(group))
    gen_ok = gen_fail = tokens = 0
    try:
        meta = _sample_meta(engine, params)
        chunk = _chunk_size(cfg, engine)
        bar = tqdm(total=total, initial=resumed, disable=not (ecfg.progress and group.is_main), unit="sample",
                   dynamic_ncols=True, desc="regenerate", mininterval=1.0, smoothing=0.1)
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
        seconds = time.time() - start
    finally:
        if own:
            engine.close()
    return gen_ok, gen_fail, tokens, seconds


def _speed(ran: Tuple[int, int, int, float], world: int) -> Dict[str, Any]:
    """Rank 0's generation rate in this run (new tokens ÷ seconds generating), for the job record."""
    ok, failed, tokens, seconds = ran
    return {"samples": ok + failed, "new_tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None, "ranks": world,
            "of": "rank 0" if world > 1 else "this run"}


# -- assembly ------------------------------------------------------------------------------------------
def _report(paths: RegenPaths, n_samples: int, outcome: Tuple[int, int, int, int], resumed: int, ran: int,
            seconds: float, speed: Optional[Dict[str, Any]] = None) -> None:
    n_ok, n_bad, n_retry, n_tok = outcome
    rate = ""
    if speed and speed.get("tokens_per_s"):
        rate = (f" ({speed['new_tokens']} generated now in {speed['seconds']:.1f}s: "
                f"{speed['tokens_per_s']:.0f} tok/s{' on rank 0' if speed['ranks'] > 1 else ''})")
    print(f"regenerate: {n_samples} samples: {n_ok} ok, {n_bad} failed "
          f"({resumed} resumed, {ran} run now on rank 0); {n_tok} tokens{rate}; "
          f"{seconds:.1f}s → {paths.output}"
          + (f"; failures in {paths.errors}" if n_bad else "")
          + (f" ({n_retry} transient: re-run to retry; {n_bad - n_retry} final: the prompt is the cause)"
             if n_retry else (" (final: the prompt is the cause, e.g. too long; not retried)" if n_bad else "")),
          flush=True)


def main(argv=None) -> int:
    """``python -m deepspec.prepare.regen [overrides]``: stage 1a alone (e.g. under torchrun)."""
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
