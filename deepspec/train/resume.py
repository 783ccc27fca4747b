"""Picking a run up again: the newest complete checkpoint, what changed since it was written, and
its weights and random state put back (`deepspec.train.loop.Trainer` calls these once at start)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from . import checkpoint as ckpt

log = logging.getLogger("deepspec.train")


def find_resume_state(ckpt_root: Path, cfg, env, accumulation: int, n_train: int,
                      algorithm: str) -> Tuple[Optional[ckpt.TrainingState], List[str]]:
    """(the training state to resume from or None, notes to log about what differs since it was saved)."""
    latest = ckpt.latest_checkpoint(ckpt_root)
    if latest is None:
        return None, []
    tc = cfg.train
    if not tc.resume:
        log.warning("train.resume=false: ignoring the checkpoints in %s (they may be overwritten)", ckpt_root)
        return None, []
    state = ckpt.load_training_state(latest)
    meta = state.meta
    notes = [f"resuming from {latest} (step {state.step}, {meta['sequences_consumed']} sequences consumed)"]
    if meta.get("world_size") != env.world_size or meta.get("strategy") != tc.strategy:
        notes.append(f"world size {meta.get('world_size')} → {env.world_size}, strategy "
                     f"{meta.get('strategy')} → {tc.strategy}: data position re-derived from the "
                     f"{meta['sequences_consumed']} sequences consumed; accumulation "
                     f"{meta.get('accumulation')} → {accumulation}")
    if meta.get("global_batch_sequences") != tc.global_batch_sequences:
        notes.append(f"global batch {meta.get('global_batch_sequences')} → {tc.global_batch_sequences}")
    if meta.get("num_train_sequences") != n_train:
        notes.append(f"WARNING: the training split has {n_train} sequences but the checkpoint "
                     f"was written with {meta.get('num_train_sequences')}: the sample order differs")
    if meta.get("algorithm") not in (None, algorithm):
        raise ValueError(f"{latest} holds a {meta.get('algorithm')} drafter but draft.algorithm="
                         f"{cfg.draft.algorithm}; use another run_dir or train.resume=false")
    return state, notes


def load_weights(drafter: torch.nn.Module, state: ckpt.TrainingState) -> None:
    """The checkpoint's trainable weights into ``drafter`` (exactly its trainable parameters, by name)."""
    own = {n for n, p in drafter.named_parameters() if p.requires_grad}
    if set(state.weights) != own:
        raise ValueError(f"{state.path}: checkpoint weights do not fit this drafter (missing "
                         f"{sorted(own - set(state.weights))[:5]}, unexpected "
                         f"{sorted(set(state.weights) - own)[:5]})")
    with torch.no_grad():
        for n, p in drafter.named_parameters():
            if n in state.weights:
                p.copy_(state.weights[n].to(p.device, p.dtype))


def restore_rng(state: ckpt.TrainingState, env, seed: int) -> None:
    """This rank's saved RNG state; with another world size a fresh seed derived from the step."""
    if state.meta.get("world_size") == env.world_size and env.rank < len(state.rng):
        ckpt.restore_rng(state.rng[env.rank], env.device)
    else:
        torch.manual_seed(seed + 1 + env.rank + 7919 * state.step)
