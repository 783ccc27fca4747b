"""`deepspec train`: the training loop.

    run(cfg) -> Path of the final checkpoint

One process or many (`torchrun`), any drafter of the registry, data from the hidden-state
cache or computed online by the frozen target.  Reading order:

    Trainer.__init__   target, drafter (same init on every rank), data, resume, strategy
    Trainer.fit        for each step: accumulate micro-batches -> reduce metrics across ranks
                       -> stop on a non-finite loss -> clip + AdamW step -> log / eval / save
    Trainer.save       atomic checkpoint (`checkpoint.py`), signals deferred while writing

The trainer never looks at the algorithm: it calls `build_drafter`, `drafter(batch)` and
`save_pretrained`, and logs whatever metrics the drafter returns.

Around the loop: `stopping` (signals, non-finite loss), `accumulate` (per-step statistics
reduced across ranks), `logging` (where the metrics go).
"""
from __future__ import annotations

import contextlib
import logging
import math
import signal
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from deepspec import paths
from deepspec.cache.union import open_caches
from deepspec.config import to_object, to_yaml
from deepspec.config.schema import DeepSpecConfig
from deepspec.drafts import build_drafter
from deepspec.targets import load_target

from . import checkpoint as ckpt
from .resume import find_resume_state, load_weights, restore_rng
from .accumulate import Accumulator, metric_keys, reduce_stats
from .data import (CachedSequences, GlobalBatchPlan, MicroBatches, OnlineFeatures, OnlineSequences,
                   build_micro_batch, check_batch_sizes, heldout_micro_batches, loader_workers, split_heldout)
from .logging import MetricsLogger, config_as_dict, progress_postfix
from .decode_eval import DecodeEval
from .vocab_setup import install_draft_vocab
from .optim import lr_at
from .precision import use_bf16
from .stopping import (NonFiniteLossError, SignalGuard, TrainingInterrupted, ignore_sigint,
                       nonfinite_loss_message)
from .distributed import (DistEnv, all_gather_object, all_reduce_, barrier, broadcast_object, init_distributed,
                          shutdown)
from .strategies import FSDPStrategy, build_strategy

log = logging.getLogger("deepspec.train")


def run(cfg: DeepSpecConfig) -> Path:
    """Train the configured drafter; returns the final checkpoint directory."""
    cfg = to_object(cfg)
    env = init_distributed(cfg.train, cfg.target.device)
    try:
        trainer = Trainer(cfg, env)
        try:
            return trainer.fit()
        finally:
            trainer.close()
    finally:
        shutdown(env)


# ---------------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, cfg: DeepSpecConfig, env: DistEnv):
        self.cfg, self.env, tc = cfg, env, cfg.train
        self.run_dir, self.ckpt_root = paths.run_dir(cfg), paths.checkpoints_dir(cfg)
        self.signals = SignalGuard()
        self._resume_notes: List[str] = []

        # -- model: frozen target, drafter initialised identically on every rank ----------------
        self.target = load_target(cfg.target, device=str(env.device))
        torch.manual_seed(cfg.seed)
        self.drafter = build_drafter(self.target, cfg.draft)

        # -- data ---------------------------------------------------------------------------------
        self.online = bool(cfg.data.online)
        self.source, self.features = self._build_source()
        self.train_idx, self.heldout_idx = split_heldout(self.source.sample_ids(), cfg.data.heldout_fraction,
                                                         cfg.data.split_seed)
        if self.drafter.draft_vocab is not None:
            install_draft_vocab(self.drafter, self.source, self.train_idx, self.target, self.cfg.draft.init_from,
                                self.run_dir if env.is_main else None)
        self.accum = check_batch_sizes(tc.global_batch_sequences, tc.micro_batch_sequences, env.world_size)
        lengths = self.source.lengths() if tc.group_by_length else None
        self.plan = GlobalBatchPlan(self.train_idx, tc.global_batch_sequences, tc.micro_batch_sequences,
                                    env.world_size, cfg.seed, lengths)
        self.total_steps = tc.max_steps or (tc.epochs * len(self.train_idx)) // tc.global_batch_sequences
        if self.total_steps <= 0:
            raise ValueError(f"nothing to train: {len(self.train_idx)} training sequences × {tc.epochs} epoch(s) "
                             f"is less than one global batch of {tc.global_batch_sequences} (lower "
                             "train.global_batch_sequences or set train.max_steps)")

        # -- resume -------------------------------------------------------------------------------
        self.step, self.consumed = 0, 0
        state = self._find_resume_state()
        if state is not None:
            load_weights(self.drafter, state)
            self.step, self.consumed = state.step, int(state.meta["sequences_consumed"])

        # -- strategy (wraps the drafter, builds AdamW) ----------------------------------------
        self.strategy = build_strategy(env, tc)
        self.drafter.train()
        self.strategy.setup(self.drafter)
        if state is not None:
            self.strategy.load_optimizer_state(state.optimizer)
            restore_rng(state, self.env, self.cfg.seed)
        else:
            torch.manual_seed(cfg.seed + 1 + env.rank)
        self._shadow = None        # rank 0's full copy for saving sharded (FSDP) drafters
        self.decode_eval = DecodeEval(cfg, self.target) if tc.decode_eval_every > 0 and env.is_main else None
        self._last_decode: Dict[str, float] = {}
        self._metric_keys: Optional[List[str]] = None
        self.use_bf16 = use_bf16(tc.bf16, env.device)
        self.logger = MetricsLogger(self.run_dir, tc, enabled=env.is_main, total_steps=self.total_steps,
                                    start_step=self.step, config_dict=config_as_dict(cfg))
        if env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "run.yaml").write_text(to_yaml(cfg))
            for note in self._resume_notes:
                log.warning(note)
            self.logger.write(self._banner())

    # -- building blocks ---------------------------------------------------------------------------
    def _build_source(self):
        cfg = self.cfg
        if self.online:
            # the same samples and lengths as a cache built from this JSONL, then cut like it
            source = OnlineSequences.from_jsonl(paths.regen_path(cfg), self.target, cfg.data.max_length)
            dtype = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "native": None,
                     "float32": torch.float32}.get(cfg.train.online_feature_dtype, "bad")
            if dtype == "bad":
                raise ValueError(f"train.online_feature_dtype={cfg.train.online_feature_dtype!r}: "
                                 "use bfloat16 | float32 | native")
            # target_lse only serves a draft-vocabulary loss (it then scores N, not V, target logits)
            return source, OnlineFeatures(self.target, dtype, with_lse=cfg.draft.vocab_size is not None)
        cache_dir = paths.cache_dir(cfg)
        if not Path(cache_dir).is_dir():
            raise FileNotFoundError(f"no hidden-state cache at {cache_dir}: run `deepspec prepare` first, "
                                    "set cache.dir, or train online with data.online=true")
        for k, d in enumerate(cfg.cache.extra_dirs):
            if not Path(d).is_dir():
                raise FileNotFoundError(f"cache.extra_dirs[{k}]={d}: no such cache directory")
        reader = open_caches([cache_dir, *cfg.cache.extra_dirs])
        reader.validate(self.target, layer_subset=True)   # e.g. a 3-layer Eagle3 from a 5-layer cache
        return CachedSequences(reader, cfg.data.max_length, self.target.layer_ids), None


    def _banner(self) -> str:
        tc, env = self.cfg.train, self.env
        n_params = sum(p.numel() for p in self.drafter.parameters() if p.requires_grad)
        return (f"training {self.cfg.draft.algorithm} ({n_params / 1e6:.2f}M trainable params) on "
                f"{'online target features' if self.online else 'the cache'}: {len(self.train_idx)} train / "
                f"{len(self.heldout_idx)} held-out sequences; strategy {self.strategy.name} × {env.world_size} "
                f"on {env.device.type}; global batch {tc.global_batch_sequences} = {tc.micro_batch_sequences} × "
                f"{env.world_size} × {self.accum} accumulation; steps {self.step} → {self.total_steps}")

    def _find_resume_state(self) -> Optional[ckpt.TrainingState]:
        if self.env.is_main:
            for p in ckpt.remove_partial(self.ckpt_root):
                log.warning("removed an incomplete checkpoint %s (the run was killed while saving)", p)
        barrier(self.env)
        state, self._resume_notes = find_resume_state(self.ckpt_root, self.cfg, self.env, self.accum,
                                                      len(self.train_idx), self.drafter.algorithm)
        return state

    def _loader(self):
        tc = self.cfg.train
        ds = MicroBatches(self.source, self.plan, self.env.rank, self.step, self.consumed,
                          self.total_steps - self.step, tc.anchors_per_sequence, self.cfg.seed,
                          tc.pad_to_multiple_of)
        workers = loader_workers(tc.num_workers, self.env.device, self.env.world_size, self.online)
        extra = {"persistent_workers": True} if workers else {}
        return torch.utils.data.DataLoader(ds, batch_size=None, shuffle=False, num_workers=workers,
                                           pin_memory=self.env.device.type == "cuda",
                                           worker_init_fn=ignore_sigint if workers else None, **extra)

    def _to_device(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        batch = {k: v.to(self.env.device, non_blocking=True) for k, v in batch.items()}
        if self.features is not None:
            batch = self.features(batch)
        return batch

    def _autocast(self):
        if not self.use_bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.env.device.type, dtype=torch.bfloat16)

    # -- the loop ----------------------------------------------------------------------------------
    def fit(self) -> Path:
        tc = self.cfg.train
        G = tc.global_batch_sequences
        batches = iter(self._loader())
        last_saved: Optional[Path] = ckpt.latest_checkpoint(self.ckpt_root) if self.step else None
        self.signals.install()
        while self.step < self.total_steps:
            t0, c0 = time.perf_counter(), time.process_time()
            lr = lr_at(self.step, self.total_steps, tc.lr, tc.warmup_ratio, tc.min_lr_ratio)
            acc = Accumulator()
            t_data = 0.0
            for a in range(self.accum):
                td = time.perf_counter()
                batch = self._to_device(next(batches))
                t_data += time.perf_counter() - td
                last = a == self.accum - 1
                with self.strategy.sync(last):
                    with self._autocast():
                        out = self.strategy.forward(batch)
                    self.strategy.backward(out["loss"], self.accum, last)
                acc.add(out, tokens=batch["attention_mask"].sum())
            stats = self._reduce(acc, stop=self.signals.requested)
            step = self.step + 1
            self._check_finite(step, stats, last_saved)
            grad_norm = self.strategy.step(lr)
            self.step, self.consumed = step, self.consumed + G
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            record = {**{f"train/{k}": v for k, v in stats["metrics"].items()},
                      "train/loss": stats["loss"], "lr": lr, "grad_norm": grad_norm,
                      "tokens_per_s": stats["tokens"] / max(dt, 1e-9), "tokens": stats["tokens"],
                      "step_time_s": dt, "step_cpu_s": cpu, "data_time_s": t_data, "epoch": self.consumed / len(self.train_idx),
                      "sequences": self.consumed}
            if tc.verify_sync:
                record["param_sync_diff"] = self._sync_diff()
            if step % max(tc.log_every, 1) == 0 or step == self.total_steps:
                self.logger.log(step, record)
            self.logger.progress(step, {**progress_postfix(record), **self._last_decode_postfix()})
            if self.heldout_idx and tc.eval_every and (step % tc.eval_every == 0 or step == self.total_steps):
                ev = self.evaluate()
                self.logger.log(step, ev)
                self.logger.write(f"step {step}: eval loss {ev['eval/loss']:.4f}, "
                                  f"τ {ev.get('eval/expected_tau', float('nan')):.3f}")
            if tc.decode_eval_every > 0 and (step % tc.decode_eval_every == 0 or step == self.total_steps):
                self._decode_eval(step)
            if (tc.save_every and step % tc.save_every == 0) or step == self.total_steps or stats["stop"]:
                last_saved = self.save()
            if stats["stop"]:
                signum = self.signals.requested or signal.SIGTERM
                self.logger.write(f"stopping after step {step} on signal {signum}; saved {last_saved}")
                raise TrainingInterrupted(step, last_saved, signum)
        if last_saved is None or ckpt.step_dir(self.ckpt_root, self.step) != last_saved:
            last_saved = self.save()   # e.g. resumed at the very end
        self.logger.write(f"done: {self.step} steps; final checkpoint {last_saved}")
        return last_saved

    def _reduce(self, acc: Accumulator, stop: Optional[int]) -> Dict:
        """Means over every micro-batch of every rank (one all-reduce)."""
        if self._metric_keys is None:   # the same key order on every rank
            self._metric_keys = metric_keys(acc, self.env)
        return reduce_stats(acc, self._metric_keys, self.env, stop)

    def _check_finite(self, step: int, stats: Dict, last_saved: Optional[Path]) -> None:
        if math.isfinite(stats["loss"]):
            return
        msg = nonfinite_loss_message(step, stats, last_saved)
        self.logger.write(msg)
        raise NonFiniteLossError(msg)

    def _sync_diff(self) -> float:
        c = self.strategy.sync_checksum()
        if c is None:
            return 0.0
        t = torch.tensor([c, -c], dtype=torch.float64)
        dev = self.env.device if self.env.backend == "nccl" else torch.device("cpu")
        t = all_reduce_(t.to(dev), self.env, op=torch.distributed.ReduceOp.MAX).cpu()
        return float(t[0] + t[1])

    # -- eval ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> Dict[str, float]:
        tc, env = self.cfg.train, self.env
        chunks = heldout_micro_batches(self.heldout_idx, tc.micro_batch_sequences, env.rank, env.world_size,
                                       tc.eval_max_sequences)
        self.strategy.train(False)
        acc = Accumulator()
        try:
            for items, weight in chunks:
                batch = build_micro_batch(self.source, items, tc.anchors_per_sequence, self.cfg.seed,
                                          tc.pad_to_multiple_of)
                with self._autocast():
                    out = self.strategy.forward(self._to_device(batch))
                if weight > 0:
                    acc.add(out, tokens=batch["attention_mask"].sum())
        finally:
            self.strategy.train(True)
        stats = self._reduce(acc, stop=None)
        return {"eval/loss": stats["loss"], **{f"eval/{k}": v for k, v in stats["metrics"].items()}}

    def _decode_eval(self, step: int) -> None:
        """Real-loop τ on rank 0 (`decode_eval.py`); sharded drafters are gathered into a full copy first."""
        drafter = self._full_drafter() if isinstance(self.strategy, FSDPStrategy) else self.drafter
        if self.env.is_main:
            out = self.decode_eval(drafter)
            self._last_decode = out
            self.logger.log(step, out)
            taus = ", ".join(f"{k.split('_', 1)[1]} {v:.3f}" for k, v in out.items() if k.startswith("decode/tau_"))
            self.logger.write(f"step {step}: decode τ {taus} ({out['decode/seconds']:.0f} s)")
        barrier(self.env)

    def _last_decode_postfix(self) -> Dict[str, str]:
        return {f"τ {k.split('_', 1)[1]}": f"{v:.2f}" for k, v in self._last_decode.items()
                if k.startswith("decode/tau_")}

    # -- checkpoints -------------------------------------------------------------------------------
    def save(self) -> Path:
        env, tc = self.env, self.cfg.train
        with self.signals.deferred():
            weights, optim = self.strategy.full_state()           # collective
            rng = all_gather_object(ckpt.capture_rng(env.device), env)
            path = ckpt.step_dir(self.ckpt_root, self.step)
            error = None
            if env.is_main:
                try:
                    meta = {"sequences_consumed": self.consumed, "epoch": self.consumed / len(self.train_idx),
                            "world_size": env.world_size, "strategy": tc.strategy, "accumulation": self.accum,
                            "global_batch_sequences": tc.global_batch_sequences,
                            "micro_batch_sequences": tc.micro_batch_sequences, "total_steps": self.total_steps,
                            "num_train_sequences": len(self.train_idx), "seed": self.cfg.seed,
                            "algorithm": self.drafter.algorithm, "data": "online" if self.online else "cache",
                            "time": time.time()}
                    path = ckpt.save_checkpoint(self.ckpt_root, self.step, save_draft=self._draft_saver(weights),
                                                weights=weights, optimizer=optim, meta=meta, rng=rng,
                                                config_yaml=to_yaml(self.cfg), keep_last=tc.keep_last)
                except Exception as e:   # keep ranks in step; re-raised below on every rank
                    error = f"{type(e).__name__}: {e}"
            error = broadcast_object(error, env)
            if error:
                raise RuntimeError(f"saving checkpoint step_{self.step} failed: {error}")
        return path

    def _draft_saver(self, weights: Dict[str, torch.Tensor]):
        if not isinstance(self.strategy, FSDPStrategy):
            return self.drafter.save_pretrained

        def save(out: Path) -> None:   # sharded parameters: save through a full copy on rank 0
            self._fill_shadow(weights).save_pretrained(out)
        return save

    def _fill_shadow(self, weights: Dict[str, torch.Tensor]):
        """Rank 0's full drafter holding ``weights`` (built once, outside the training RNG stream)."""
        if self._shadow is None:
            with torch.random.fork_rng(devices=[self.env.device] if self.env.device.type == "cuda" else []):
                self._shadow = build_drafter(self.target, self.cfg.draft)
        with torch.no_grad():
            for n, p in self._shadow.named_parameters():
                if n in weights:
                    p.copy_(weights[n].to(p.device, p.dtype))
        return self._shadow

    def _full_drafter(self):
        weights, _ = self.strategy.full_state()       # collective: every rank calls it
        return self._fill_shadow(weights) if self.env.is_main else None

    def close(self) -> None:
        self.signals.uninstall()
        self.logger.close()
