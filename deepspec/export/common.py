"""Shared helpers: reading a draft checkpoint, resolving the target, run metadata, the output directory."""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import yaml
from omegaconf import OmegaConf

from ..config import ConfigError, TargetConfig, as_node, load_config
from ..config.typed import build
from ..drafts import available_drafters
from ..targets import load_target
from .errors import ExportError
from .schemas import DEEPSPEC_CHECKPOINT, validate

log = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
RUN_YAML = "run.yaml"
PROVENANCE_NAME = "deepspec_export.json"


@dataclass
class Checkpoint:
    """A deepspec draft checkpoint directory (``save_pretrained`` output)."""
    path: Path
    meta: Dict[str, Any]
    run: Optional[Dict[str, Any]] = None          # run.yaml (resolved config of the run), if present

    @property
    def algorithm(self) -> str:
        return str(self.meta.get("architecture") or (self.meta.get("draft") or {}).get("algorithm"))

    @property
    def draft(self) -> Dict[str, Any]:
        return dict(self.meta.get("draft") or {})

    @property
    def target(self) -> Dict[str, Any]:
        return dict(self.meta.get("target") or {})

    @property
    def layer_ids(self) -> List[int]:
        return [int(i) for i in self.target.get("layer_ids") or []]

    def weights_path(self) -> Path:
        return self.path / WEIGHTS_NAME


def read_checkpoint(path) -> Checkpoint:
    p = Path(path)
    cfg = p / CONFIG_NAME
    if not cfg.is_file():
        raise ExportError(f"{p} is not a deepspec draft checkpoint (no {CONFIG_NAME})")
    try:
        meta = json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise ExportError(f"{cfg}: not valid JSON ({e})") from e
    problems = validate(meta, DEEPSPEC_CHECKPOINT)
    if not problems and meta["architecture"] not in available_drafters():
        problems = [f"$.architecture: must be one of {available_drafters()!r}, got {meta['architecture']!r:.60}"]
    if problems:
        raise ExportError(f"{cfg} is not a deepspec draft config: " + "; ".join(problems))
    if not (p / WEIGHTS_NAME).is_file():
        raise ExportError(f"{p}: missing {WEIGHTS_NAME}")
    run = None
    if (p / RUN_YAML).is_file():
        try:
            run = yaml.safe_load((p / RUN_YAML).read_text()) or None
        except yaml.YAMLError as e:
            log.warning("%s: unreadable (%s); ignoring it", p / RUN_YAML, e)
    return Checkpoint(p, meta, run if isinstance(run, dict) else None)


# -- target resolution --------------------------------------------------------------------------
def resolve_target_config(ckpt: Optional[Checkpoint], target_path: Optional[str] = None,
                          overrides: Sequence[str] = (), default_layer_ids: bool = False,
                          device: str = "cpu"):
    """The `TargetConfig` to load for ``ckpt``.

    Base: the target section of the checkpoint's ``run.yaml`` (so dtype, layer ids and
    chat-template switches match training), else the `TargetConfig` defaults.  Then
    ``target.key=value`` overrides (type-checked), then ``target_path``.  A group choice
    (``target=NAME``) or ``recipe=...`` composes from ``conf/`` instead of run.yaml.
    With ``default_layer_ids`` unset layer ids are filled from the checkpoint."""
    overrides = list(overrides)
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"not an override (key=value): {bad}")
    if any(o.split("=", 1)[0] in ("target", "recipe") for o in overrides):
        cfg = load_config(overrides).target
    else:
        other = [o for o in overrides if not o.startswith("target.")]
        if other:
            raise ConfigError(f"only target.* overrides apply here, got {other}")
        base = TargetConfig()
        run_target = (ckpt.run or {}).get("target") if ckpt is not None else None
        if isinstance(run_target, dict):
            known = {f.name for f in dataclasses.fields(TargetConfig)}
            base = TargetConfig(**{k: v for k, v in run_target.items() if k in known})
        node = as_node(base)
        if overrides:
            try:
                node = OmegaConf.merge(node, OmegaConf.from_dotlist([o[len("target."):] for o in overrides]))
            except Exception as e:   # omegaconf raises several validation error types
                raise ConfigError(f"bad target override: {e}") from e
        cfg = build(TargetConfig, OmegaConf.to_container(node, resolve=True), "target.")
    if target_path:
        cfg = dataclasses.replace(cfg, path=target_path)
    explicit_device = any(o.startswith("target.device=") for o in overrides)
    if not explicit_device:
        cfg = dataclasses.replace(cfg, device=device)
    if default_layer_ids and ckpt is not None and cfg.layer_ids is None and ckpt.layer_ids:
        cfg = dataclasses.replace(cfg, layer_ids=list(ckpt.layer_ids))
    return cfg


def load_target_for(ckpt: Optional[Checkpoint], target_path: Optional[str] = None,
                    overrides: Sequence[str] = (), default_layer_ids: bool = True):
    cfg = resolve_target_config(ckpt, target_path, overrides, default_layer_ids=default_layer_ids)
    log.info("loading target %s (%s, %s)", cfg.path, cfg.dtype, cfg.device)
    return load_target(cfg), cfg


def has_target_source(ckpt: Checkpoint, target_path: Optional[str], overrides: Sequence[str]) -> bool:
    return bool(target_path or overrides or (ckpt.run or {}).get("target"))


def target_overrides(values) -> List[str]:
    """``--target`` values → Hydra overrides: ``dtype=float32`` / ``target.dtype=float32`` →
    ``target.dtype=float32``; a bare ``NAME`` → the group choice ``target=NAME``."""
    out = []
    for v in values or []:
        if "=" not in v:
            out.append(f"target={v}")
            continue
        key = v.split("=", 1)[0]
        out.append(v if key == "target" or key.startswith("target.") or key == "recipe" else f"target.{v}")
    return out


# -- run metadata -------------------------------------------------------------------------------
def training_data(run: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The data section of run.yaml, reduced to what identifies the training set."""
    if not run:
        return {}
    data = run.get("data") or {}
    keys = ("source", "path", "hf_name", "hf_config", "hf_split", "regen_path", "max_samples", "online",
            "max_length")
    out = {k: data[k] for k in keys if data.get(k) not in (None, "", {})}
    train = run.get("train") or {}
    for k in ("max_steps", "steps", "epochs", "lr", "batch_size", "global_batch_size"):
        if train.get(k) is not None:
            out[f"train.{k}"] = train[k]
    if run.get("recipe"):
        out["recipe"] = run["recipe"]
    return out


def find_results(ckpt_path: Path, explicit: Optional[str] = None) -> Optional[Path]:
    """An eval ``results.json`` for this checkpoint: ``--results``, else next to it, else the run's eval/."""
    if explicit:
        p = Path(explicit)
        p = p / "results.json" if p.is_dir() else p
        if not p.is_file():
            raise ExportError(f"--results {explicit}: no results.json there")
        return p
    cands = [ckpt_path / "results.json", ckpt_path / "eval" / "results.json"]
    if ckpt_path.parent.name == "checkpoints":
        cands.append(ckpt_path.parent.parent / "eval" / "results.json")
    return next((c for c in cands if c.is_file()), None)


def read_results(path: Optional[Path]) -> Optional[Dict[str, Any]]:
    if path is None:
        return None
    try:
        res = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        log.warning("ignoring %s: %s", path, e)
        return None
    overall = res.get("overall") or {}
    out = {"path": str(path), "tau": overall.get("tau"), "acceptance_rate": overall.get("acceptance_rate"),
           "speedup": (res.get("speed") or {}).get("speedup"), "gamma": res.get("gamma"),
           "setup": res.get("setup") or {},
           "benchmarks": {n: (b.get("all_turns") or {}).get("tau")
                          for n, b in (res.get("benchmarks") or {}).items()}}
    return out


# -- output -----------------------------------------------------------------------------------------
def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def check_output_dir(out, force: bool = False) -> None:
    """Refuse a non-empty ``out`` unless ``force`` (the export then replaces it)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not force:
        raise ExportError(f"{out} exists and is not empty (pass --force to replace it)")


@dataclass
class ExportResult:
    fmt: str
    out: Path
    files: List[str] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)
    dropped: List[str] = field(default_factory=list)
    verified: Optional[Dict[str, float]] = None
