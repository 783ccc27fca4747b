"""Where training metrics go (rank 0 only): a tqdm bar, `metrics.jsonl`, TensorBoard and wandb.

`progress_postfix` is what the bar shows of a step's record; `config_as_dict` is the config
handed to wandb.

TensorBoard and wandb are optional sinks: if one cannot start (not installed, no login in
online mode, …) a warning is logged and training goes on.  wandb honours ``WANDB_MODE``
(``offline`` needs no login); the run id is kept in ``{run_dir}/wandb_run_id`` so a resumed
run appends to the same wandb run.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import uuid
from pathlib import Path
from typing import Any, Dict, Optional

from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

log = logging.getLogger("deepspec.train")


def progress_postfix(r: Dict) -> Dict[str, str]:
    """The progress bar's postfix for one step's ``record`` (loss, lr, tok/s, τ if known)."""
    tau = r.get("train/expected_tau")
    out = {"loss": f"{r['train/loss']:.4f}", "lr": f"{r['lr']:.2e}", "tok/s": f"{r['tokens_per_s']:.0f}"}
    if tau is not None:
        out["τ"] = f"{tau:.3f}"
    return out


def config_as_dict(cfg) -> Dict:
    """The config as a plain dict (``{}`` when it is not a dataclass)."""
    try:
        return dataclasses.asdict(cfg)
    except TypeError:
        return {}


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class MetricsLogger:
    def __init__(self, run_dir: Path, cfg, *, enabled: bool, total_steps: int, start_step: int,
                 config_dict: Optional[Dict[str, Any]] = None):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.jsonl = self.run_dir / "metrics.jsonl"
        self.bar = self.tb = self.wandb = None
        self._file_handler = self._redirect = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._attach_file_log()
        self._truncate_jsonl(start_step)
        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                        dynamic_ncols=True, disable=os.environ.get("DEEPSPEC_NO_PROGRESS") == "1")
        self._redirect = logging_redirect_tqdm()   # console log lines print above the bar
        self._redirect.__enter__()
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=start_step + 1)
            except Exception as e:  # tensorboard is optional
                log.warning("TensorBoard disabled: %s", e)
        if cfg.wandb:
            self.wandb = _start_wandb(self.run_dir, cfg, config_dict)

    # -- sinks ------------------------------------------------------------------------------------
    def _attach_file_log(self) -> None:
        h = logging.FileHandler(self.run_dir / "train.log")
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        h.setLevel(logging.INFO)
        root = logging.getLogger("deepspec")
        if root.level == logging.NOTSET or root.level > logging.INFO:
            root.setLevel(logging.INFO)
        root.addHandler(h)
        self._file_handler = h

    def _truncate_jsonl(self, start_step: int) -> None:
        """On resume, drop records of steps after the checkpoint (they are re-run)."""
        if not self.jsonl.is_file():
            return
        keep, dropped = [], 0
        for line in self.jsonl.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:   # torn last line of a killed run
                dropped += 1
                continue
            if int(rec.get("step", 0)) > start_step:
                dropped += 1
            else:
                keep.append(line)
        if dropped:
            tmp = self.jsonl.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(k + "\n" for k in keep))
            os.replace(tmp, self.jsonl)
            log.info("metrics.jsonl: dropped %d record(s) after step %d (re-run after resume)", dropped, start_step)

    def log(self, step: int, metrics: Dict[str, float], *, commit_bar: bool = True) -> None:
        if not self.enabled:
            return
        rec = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        with self.jsonl.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(float(v)):
                    self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            try:
                self.wandb.log(dict(metrics), step=step)
            except Exception as e:
                log.warning("wandb.log failed (%s); disabling wandb", e)
                self.wandb = None

    def progress(self, step: int, postfix: Dict[str, str]) -> None:
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.refresh()

    def write(self, msg: str) -> None:
        """A line above the bar (and in train.log)."""
        if self.enabled:
            log.info(msg)

    def close(self) -> None:
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.tb is not None:
            self.tb.flush()
            self.tb.close()
        if self.wandb is not None:
            try:
                self.wandb.finish()
            except Exception:
                pass
        if self._file_handler is not None:
            logging.getLogger("deepspec").removeHandler(self._file_handler)
            self._file_handler.close()
            self._file_handler = None
        self.tb = self.wandb = None


def _start_wandb(run_dir: Path, cfg, config_dict):
    try:
        import wandb
    except Exception as e:
        log.warning("train.wandb=true but wandb is unavailable (%s); continuing without it", e)
        return None
    id_file = run_dir / "wandb_run_id"
    try:
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        return wandb.init(project=cfg.wandb_project, entity=cfg.wandb_entity, name=cfg.wandb_run_name,
                          id=run_id, resume="allow", dir=str(run_dir), config=config_dict,
                          mode=os.environ.get("WANDB_MODE") or None)
    except Exception as e:  # no login, no network, …
        log.warning("wandb could not start (%s); continuing without it (set WANDB_MODE=offline to log locally)", e)
        return None
