"""Name -> drafter registry.

``@register_drafter("name", **forced)`` registers a `Drafter` subclass; ``forced``
are `DraftConfig` fields that the name implies (e.g. "dflash" is the parallel
backbone with both DSpark heads off).  `build_drafter` applies them, so the
drafter's own ``cfg`` (and what `save_pretrained` writes) is the effective one.

The registry sits below `deepspec.drafts.base` (whose ``Drafter.from_pretrained`` loads
through it): it knows a drafter class only by the constructor it calls,
``cls.from_target(target, cfg)``.  The built-in drafters register when ``deepspec/drafts/__init__.py``
imports their modules.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Dict, List, Tuple

import torch
from torch import nn

from .checkpoint import (WEIGHTS_NAME, DraftCheckpointError, check_draft_vocab, check_target, coerce_draft_config,
                         load_weights, read_checkpoint_config, saved_draft_vocab_size)

log = logging.getLogger(__name__)
_REGISTRY: Dict[str, Tuple[type, Dict[str, Any]]] = {}


def register_drafter(name: str, **forced_config):
    """Class decorator: register ``cls`` under ``name`` (config fields in ``forced_config`` are fixed)."""
    def deco(cls):
        if not (isinstance(cls, type) and issubclass(cls, nn.Module) and hasattr(cls, "from_target")):
            raise TypeError(f"@register_drafter({name!r}) needs a Drafter subclass, got {cls!r}")
        prev = _REGISTRY.get(name)
        if prev is not None and prev[0].__qualname__ != cls.__qualname__:
            raise ValueError(f"drafter {name!r} is already registered to {prev[0].__name__}")
        _REGISTRY[name] = (cls, dict(forced_config))
        return cls
    return deco


def available_drafters() -> List[str]:
    return sorted(_REGISTRY)


def drafter_class(name: str) -> type:
    """The class registered under ``name`` (e.g. to ask it ``model_free``: a drafter with nothing to train)."""
    return _lookup(name)[0]


def _lookup(name: str):
    if name not in _REGISTRY:
        raise ValueError(f"unknown draft algorithm {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def effective_config(cfg):
    """The config a registered name actually builds with (its forced fields applied)."""
    cfg = coerce_draft_config(cfg)
    _, forced = _lookup(cfg.algorithm)
    changed = {k: v for k, v in forced.items() if getattr(cfg, k) != v}
    if changed:
        log.info("draft %s: using %s", cfg.algorithm, ", ".join(f"{k}={v!r}" for k, v in changed.items()))
        cfg = dataclasses.replace(cfg, **changed)
    return cfg


def build_drafter(target, cfg) -> nn.Module:
    """A freshly initialised drafter of ``cfg.algorithm`` for ``target`` (on the target's device).

    With ``cfg.init_from`` (a `save_pretrained` directory) the weights whose names
    and shapes match are copied from there, e.g. a DSpark backbone from a trained
    DFlash checkpoint (the heads keep their fresh init)."""
    cfg = effective_config(cfg)
    cls, _ = _lookup(cfg.algorithm)
    drafter = cls.from_target(target, cfg)
    if cfg.init_from:
        init_weights_from(drafter, cfg.init_from, target)
    return drafter


def count_trainable_parameters(target, cfg) -> int:
    """Trainable parameters a drafter of ``cfg`` would have for ``target``, built on the ``meta`` device
    (shapes only: no memory, no initialisation cost; ``cfg.init_from`` is ignored)."""
    cfg = dataclasses.replace(effective_config(cfg), init_from=None)
    cls, _ = _lookup(cfg.algorithm)
    with torch.device("meta"):
        drafter = cls(target, cfg)
    return sum(p.numel() for p in drafter.parameters() if p.requires_grad)


def init_weights_from(drafter: nn.Module, in_dir, target) -> List[str]:
    """Copy matching weights of a saved drafter into ``drafter``; returns the names copied."""
    meta = read_checkpoint_config(in_dir)
    check_target(meta.get("target") or {}, target, False, where=f"init_from={in_dir}")
    saved = load_weights(in_dir, str(drafter.device))
    full = int(drafter.vocab_size)
    n_saved, n_own = saved_draft_vocab_size(meta, saved, full), int(drafter.out_vocab)
    if n_saved != n_own:
        setting = {n: "null" if n == full else str(n) for n in (n_saved, n_own)}
        raise DraftCheckpointError(
            f"draft.init_from={in_dir}: that draft scores {n_saved} of the {full} target tokens "
            f"(draft.vocab_size={setting[n_saved]}), this run {n_own} (draft.vocab_size={setting[n_own]}); "
            f"train with draft.vocab_size={setting[n_saved]} to start from it")
    check_draft_vocab(saved, (meta.get("draft") or {}).get("vocab_size"), int(drafter.vocab_size),
                      f"draft.init_from={in_dir}/{WEIGHTS_NAME}")
    own = drafter.state_dict()
    bad = sorted(k for k in saved if k in own and saved[k].shape != own[k].shape)
    if bad:
        raise ValueError(f"draft.init_from={in_dir}: shapes differ for {bad}")
    copied = sorted(k for k in saved if k in own)
    if not copied:
        raise ValueError(f"draft.init_from={in_dir}: no weight of that {meta.get('architecture')} checkpoint "
                         f"fits a {drafter.algorithm} drafter")
    drafter.load_state_dict({k: saved[k] for k in copied}, strict=False)
    fresh = sorted(set(own) - set(copied))
    log.info("draft.init_from=%s: copied %d tensors%s", in_dir, len(copied),
             f"; freshly initialised: {', '.join(fresh)}" if fresh else "")
    return copied


def load_drafter(in_dir, target, allow_target_mismatch: bool = False) -> nn.Module:
    """Rebuild a drafter saved with `save_pretrained` against ``target`` (checked by fingerprint)."""
    meta = read_checkpoint_config(in_dir)
    name = meta.get("architecture")
    cfg = coerce_draft_config(meta.get("draft") or {})
    if name and cfg.algorithm != name:
        cfg = dataclasses.replace(cfg, algorithm=name)
    if meta.get("mask_token_id") is not None:
        cfg = dataclasses.replace(cfg, mask_token_id=int(meta["mask_token_id"]))
    cfg = dataclasses.replace(cfg, init_from=None)  # saved weights replace any init
    check_target(meta.get("target") or {}, target, allow_target_mismatch, where=str(in_dir))
    if cfg.vocab_size is not None and not 1 <= int(cfg.vocab_size) <= int(target.vocab_size):
        raise DraftCheckpointError(f"draft checkpoint {in_dir}: draft.vocab_size={cfg.vocab_size} does not fit the "
                                   f"target's {target.vocab_size}-token vocabulary")
    drafter = build_drafter(target, cfg)
    state = load_weights(in_dir, str(drafter.device))
    check_draft_vocab(state, cfg.vocab_size, int(drafter.vocab_size), f"draft checkpoint {in_dir}/{WEIGHTS_NAME}")
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"draft checkpoint {in_dir} does not fit a {name} drafter: "
                         f"missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    return drafter
