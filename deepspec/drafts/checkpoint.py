"""Draft checkpoint files: names, errors, reading config and weights, the target check.

Checkpoint format (`Drafter.save_pretrained(dir)`)
--------------------------------------------------
* ``config.json``: ``architecture`` (the registered algorithm name),
  ``format_version``, ``draft`` (every `DraftConfig` field, loss weights included),
  ``mask_token_id`` (resolved), ``target`` (fingerprint, ``layer_ids``,
  ``feature_dim``, hidden/vocab size, model type), and ``shared_modules``
  naming what is referenced from the target instead of stored.
* ``model.safetensors``: the trainable weights only, plus ``draft_vocab`` (int64 ``[N]``, the
  sorted target ids the draft head scores) when ``draft.vocab_size = N``.  The embedding and LM head
  come from the target at load time, so a checkpoint is only meaningful with the
  same target: loading checks the fingerprint and refuses a different target
  unless ``allow_target_mismatch=True``; different layer ids or sizes are always
  refused (the weights would not fit).

Only ``config.json`` and ``model.safetensors`` are ever read: no pickle, no ``.bin``/``.pt``.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Dict

import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from ..config.draft import DraftConfig, LossConfig
from ..data.vocab import ids_problem
from ..errors import DeepSpecError

log = logging.getLogger(__name__)
FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


class DraftTargetMismatchError(DeepSpecError, ValueError):
    """A draft checkpoint was saved against a different target."""


class DraftCheckpointError(DeepSpecError, ValueError):
    """A draft checkpoint whose config.json is not JSON or whose weights are not safetensors.

    Only ``config.json`` and ``model.safetensors`` are ever read: no pickle, no ``.bin``/``.pt``."""


# Options that older drafts may carry in their saved config, at the value that made them a no-op.
# They were removed after measuring level or worse; a draft trained with another value cannot be rebuilt.
REMOVED_OPTIONS = {"feature_norm": "none", "context_mlp": False, "init_from_target_layer": None,
                   "soft_ce_weight": 0.0}


def _check_removed(d: Dict[str, Any], where: str) -> None:
    for k, off in REMOVED_OPTIONS.items():
        if k in d and d[k] != off:
            raise DraftCheckpointError(f"{where}.{k}={d[k]!r}: this option was removed (it measured level or "
                                       "worse); the draft cannot be rebuilt by this version")
        d.pop(k, None)


def coerce_draft_config(cfg) -> DraftConfig:
    """A `DraftConfig` from a dataclass, an OmegaConf node or a plain dict (unknown keys dropped with a
    warning; removed options accepted only at their no-op value)."""
    if isinstance(cfg, DraftConfig):
        return dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss))
    if not isinstance(cfg, dict):
        cfg = OmegaConf.to_container(cfg, resolve=True)
    d = dict(cfg)
    _check_removed(d, "draft")
    if isinstance(d.get("loss"), dict):
        d["loss"] = dict(d["loss"])
        _check_removed(d["loss"], "draft.loss")
    known = {f.name for f in dataclasses.fields(DraftConfig)}
    extra = sorted(set(d) - known)
    if extra:
        log.warning("ignoring unknown draft config keys %s", extra)
    loss = d.get("loss") or {}
    if not isinstance(loss, LossConfig):
        lknown = {f.name for f in dataclasses.fields(LossConfig)}
        loss = LossConfig(**{k: v for k, v in dict(loss).items() if k in lknown})
    d = {k: v for k, v in d.items() if k in known and k != "loss"}
    return DraftConfig(**d, loss=loss)


def read_checkpoint_config(in_dir) -> Dict[str, Any]:
    """``config.json`` of a draft checkpoint, as a dict."""
    path = Path(in_dir) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no draft checkpoint at {in_dir} (missing {CONFIG_NAME})")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:   # includes bad UTF-8
        raise DraftCheckpointError(f"{path}: not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict):
        raise DraftCheckpointError(f"{path}: expected a JSON object")
    return meta


def load_weights(in_dir, device) -> Dict[str, torch.Tensor]:
    """``model.safetensors`` of a draft checkpoint (safetensors only: nothing is ever unpickled)."""
    path = Path(in_dir) / WEIGHTS_NAME
    if not path.is_file():
        raise DraftCheckpointError(f"draft checkpoint {in_dir}: {WEIGHTS_NAME} is missing")
    try:
        return load_file(str(path), device=device)
    except Exception as e:   # SafetensorError on anything else (a pickle, a torch.save zip, garbage)
        raise DraftCheckpointError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e}); "
                                   "deepspec loads draft weights from safetensors only") from None


def check_target(saved: Dict[str, Any], target, allow_target_mismatch: bool = False, where: str = "") -> None:
    """Refuse a target that differs from the one the draft was trained against."""
    shape_keys = {"layer_ids": list(target.layer_ids), "feature_dim": int(target.feature_dim),
                  "hidden_size": int(target.hidden_size), "vocab_size": int(target.vocab_size)}
    for k, have in shape_keys.items():
        want = saved.get(k)
        if want is not None and want != have:
            hint = " (set target.layer_ids to the saved ids)" if k == "layer_ids" else ""
            raise DraftTargetMismatchError(f"draft {where}: target {k} is {have} but the draft was saved with "
                                           f"{want}{hint}")
    want_fp = saved.get("fingerprint") or {}
    have_fp = target.fingerprint()
    diff = sorted(k for k in want_fp if want_fp.get(k) != have_fp.get(k))
    if diff:
        msg = (f"draft {where} was trained against a different target ({', '.join(diff)} differ: saved "
               f"{saved.get('name')!r}, loading with {getattr(target, 'name', None)!r})")
        if not allow_target_mismatch:
            raise DraftTargetMismatchError(msg + "; pass allow_target_mismatch=True to load it anyway")
        log.warning("%s; loading anyway (allow_target_mismatch=True)", msg)


def saved_draft_vocab_size(meta: Dict[str, Any], state: Dict[str, torch.Tensor], full: int) -> int:
    """How many target tokens a saved draft scores: its ``draft_vocab`` length, else the full vocabulary."""
    if "draft_vocab" in state:
        return int(state["draft_vocab"].numel())
    return int((meta.get("target") or {}).get("vocab_size") or full)


def check_draft_vocab(state: Dict[str, torch.Tensor], vocab_size: Any, target_vocab: int, where: str) -> None:
    """Refuse (`DraftCheckpointError`, naming ``where``) saved weights whose ``draft_vocab`` does not fit
    ``draft.vocab_size = vocab_size`` of the config next to them or the target's ``target_vocab`` tokens."""
    ids = state.get("draft_vocab")
    if vocab_size is None:
        if ids is not None:
            raise DraftCheckpointError(f"{where}: holds a draft_vocab of {ids.numel()} tokens but its config says "
                                       "draft.vocab_size=null (the full vocabulary)")
        return
    if ids is None:
        raise DraftCheckpointError(f"{where}: config says draft.vocab_size={vocab_size} but the weights hold no "
                                   "draft_vocab (the target ids the draft head scores)")
    if ids.dim() != 1 or ids.numel() != int(vocab_size):
        raise DraftCheckpointError(f"{where}: draft_vocab has shape {list(ids.shape)}, config says "
                                   f"draft.vocab_size={vocab_size}")
    problem = ids_problem(ids.cpu().numpy(), int(target_vocab))
    if problem:
        raise DraftCheckpointError(f"{where}: draft_vocab: {problem}")
