"""Atomic, pickle-free training checkpoints.

    {run_dir}/checkpoints/
      latest                       "step_N" (the newest complete checkpoint; informational)
      step_N/                      written as step_N.tmp/, then renamed (atomic)
        config.json                the draft, loadable with `load_drafter(dir, target)`
        model.safetensors          (written by the drafter's `save_pretrained`)
        run.yaml                   resolved config of the run
        training_state/
          meta.json                step, sequences consumed, world size, strategy, optimizer groups…
          master_weights.safetensors   fp32 trainable weights, keyed by parameter name
          optimizer.safetensors        "<param name>::<state key>" → tensor (exp_avg, exp_avg_sq, step)
          rng.safetensors / rng.json   per-rank torch (+cuda) / python + numpy RNG states

Only tensors (safetensors) and JSON are written; nothing is unpickled on load.  A directory
without ``training_state/meta.json`` or with a ``.tmp`` suffix is not a checkpoint: stale
``.tmp`` directories (a run killed while saving) are removed at start-up.
"""
from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from ..errors import DeepSpecError
from ..utils.fs import atomic_write, fsync_dir

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d+)$")
_SEP = "::"


class CheckpointError(DeepSpecError, ValueError):
    """A checkpoint that cannot be written, or read back as safetensors + JSON (never unpickled)."""


# ---------------------------------------------------------------------------------------------
# finding checkpoints
# ---------------------------------------------------------------------------------------------
def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step}"


def is_complete(path: Path) -> bool:
    return _STEP_RE.match(path.name) is not None and (path / "training_state" / "meta.json").is_file()


def list_checkpoints(root: Path) -> List[Tuple[int, Path]]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = [(int(_STEP_RE.match(p.name).group(1)), p) for p in root.iterdir()
           if p.is_dir() and is_complete(p)]
    return sorted(out)


def latest_checkpoint(root: Path) -> Optional[Path]:
    """The newest complete checkpoint (by step; the ``latest`` file is a convenience for people)."""
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def run_config_path(run_dir: Path, checkpoint: Path) -> Path:
    """The resolved config of a training run: ``run_dir/run.yaml``, else the copy saved in ``checkpoint``."""
    for p in (Path(run_dir) / "run.yaml", Path(checkpoint) / "run.yaml"):
        if p.is_file():
            return p
    raise CheckpointError(f"{run_dir}: no run.yaml (the trainer writes one into the run directory and each "
                          "checkpoint)")


def remove_partial(root: Path) -> List[Path]:
    """Delete half-written ``step_N.tmp`` / ``step_N.old`` directories left by a killed run."""
    root = Path(root)
    removed = []
    if root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and (p.name.endswith(".tmp") or p.name.endswith(".old")):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


# ---------------------------------------------------------------------------------------------
# optimizer state <-> flat tensors
# ---------------------------------------------------------------------------------------------
def flatten_optimizer_state(state: Dict[str, Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    flat = {}
    for name, st in state.items():
        for key, t in st.items():
            flat[f"{name}{_SEP}{key}"] = t
    return flat


def unflatten_optimizer_state(flat: Dict[str, torch.Tensor]) -> Dict[str, Dict[str, torch.Tensor]]:
    out: Dict[str, Dict[str, torch.Tensor]] = {}
    for k, t in flat.items():
        name, _, key = k.rpartition(_SEP)
        out.setdefault(name, {})[key] = t
    return out


# ---------------------------------------------------------------------------------------------
# RNG states (python, numpy, torch, cuda) as tensors + JSON
# ---------------------------------------------------------------------------------------------
def capture_rng(device: Optional[torch.device] = None) -> Dict[str, Any]:
    np_state = np.random.get_state()
    py = random.getstate()
    out = {"torch": torch.get_rng_state().clone(),
           "numpy_keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
           "json": {"python": [py[0], list(py[1]), py[2]],
                    "numpy": [np_state[0], int(np_state[2]), int(np_state[3]), float(np_state[4])]}}
    if device is not None and device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device).clone()
    return out


def restore_rng(state: Dict[str, Any], device: Optional[torch.device] = None) -> None:
    torch.set_rng_state(state["torch"])
    j = state["json"]
    random.setstate((j["python"][0], tuple(j["python"][1]), j["python"][2]))
    name, pos, has_gauss, cached = j["numpy"]
    np.random.set_state((name, state["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached))
    if device is not None and device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _rng_files(states: List[Dict[str, Any]]) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    tensors, meta = {}, {}
    for r, st in enumerate(states):
        for k in ("torch", "numpy_keys", "cuda"):
            if k in st:
                tensors[f"rank{r}/{k}"] = st[k]
        meta[f"rank{r}"] = st["json"]
    return tensors, meta


def _rng_from_files(tensors: Dict[str, torch.Tensor], meta: Dict[str, Any]) -> List[Dict[str, Any]]:
    out = []
    r = 0
    while f"rank{r}" in meta:
        st = {"json": meta[f"rank{r}"]}
        for k in ("torch", "numpy_keys", "cuda"):
            if f"rank{r}/{k}" in tensors:
                st[k] = tensors[f"rank{r}/{k}"]
        out.append(st)
        r += 1
    return out


# ---------------------------------------------------------------------------------------------
# save / load
# ---------------------------------------------------------------------------------------------
@dataclass
class TrainingState:
    path: Path
    meta: Dict[str, Any]
    weights: Dict[str, torch.Tensor]
    optimizer: Dict[str, Dict[str, torch.Tensor]]
    rng: List[Dict[str, Any]] = field(default_factory=list)

    @property
    def step(self) -> int:
        return int(self.meta["step"])


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True))


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*"), reverse=True):
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
        except OSError:
            if not p.is_dir():   # a file that cannot be made durable (ENOSPC, EIO): not a checkpoint
                raise
        finally:
            os.close(fd)
    fsync_dir(path)


def _tensors(d: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous().clone() for k, v in d.items()}


def save_checkpoint(root: Path, step: int, *, save_draft: Callable[[Path], None],
                    weights: Dict[str, torch.Tensor], optimizer: Dict[str, Dict[str, torch.Tensor]],
                    meta: Dict[str, Any], rng: List[Dict[str, Any]], config_yaml: str,
                    keep_last: int = 0) -> Path:
    """Write ``root/step_{step}`` atomically (rank 0 only) and prune old checkpoints."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        save_draft(tmp)
        (tmp / "run.yaml").write_text(config_yaml)
        ts = tmp / "training_state"
        ts.mkdir()
        save_file(_tensors(weights), str(ts / "master_weights.safetensors"), metadata={"format": "deepspec-train"})
        save_file(_tensors(flatten_optimizer_state(optimizer)), str(ts / "optimizer.safetensors"),
                  metadata={"format": "deepspec-train"})
        rng_t, rng_meta = _rng_files(rng)
        save_file(_tensors(rng_t), str(ts / "rng.safetensors"))
        _write_json(ts / "rng.json", rng_meta)
        _write_json(ts / "meta.json", {"format_version": FORMAT_VERSION, **meta, "step": step})  # last: complete
        _fsync_tree(tmp)
    except Exception as e:   # disk full, permission denied…: drop the partial copy (frees its space)
        shutil.rmtree(tmp, ignore_errors=True)
        kept = latest_checkpoint(root)
        raise CheckpointError(f"cannot write checkpoint {final} ({type(e).__name__}: {e}); the checkpoints "
                              f"already saved are intact (latest: {kept or 'none'})") from e
    if final.exists():   # re-saving a step (e.g. after a rollback): swap, never a half state
        old = final.with_name(final.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    try:   # atomic, not fsynced (the directory fsync below covers the rename)
        atomic_write(root / "latest", final.name + "\n", tmp=root / "latest.tmp", fsync=False)
    except OSError as e:   # informational only: resume scans for complete step_N directories
        log.warning("could not update %s (%s); checkpoint %s itself is complete", root / "latest", e, final)
    fsync_dir(root)
    if keep_last and keep_last > 0:
        for s, p in list_checkpoints(root)[:-keep_last]:
            if p != final:
                shutil.rmtree(p, ignore_errors=True)
    return final


def load_training_state(path: Path) -> TrainingState:
    path = Path(path)
    ts = path / "training_state"

    def js(name):
        try:
            obj = json.loads((ts / name).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:   # ValueError includes bad UTF-8 (e.g. a pickle in its place)
            raise CheckpointError(f"{ts / name}: not a readable JSON file ({type(e).__name__}: {e})") from None
        if not isinstance(obj, dict):
            raise CheckpointError(f"{ts / name}: expected a JSON object")
        return obj

    def st(name):
        try:
            return load_file(str(ts / name))
        except Exception as e:   # SafetensorError, missing file…  (only safetensors are ever read)
            raise CheckpointError(f"{ts / name}: not a readable safetensors file ({type(e).__name__}: {e}); "
                                  "deepspec never unpickles checkpoint files") from None

    meta = js("meta.json")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {meta.get('format_version')} != {FORMAT_VERSION}")
    weights = st("master_weights.safetensors")
    optimizer = unflatten_optimizer_state(st("optimizer.safetensors"))
    rng = []
    if (ts / "rng.json").is_file():
        rng = _rng_from_files(st("rng.safetensors"), js("rng.json"))
    return TrainingState(path=path, meta=meta, weights=weights, optimizer=optimizer, rng=rng)
