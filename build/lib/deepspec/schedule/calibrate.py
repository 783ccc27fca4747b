"""`deepspec calibrate`: fit STS on logged rollouts and write calibration.json + a report.

Inputs: ``schedule.rollouts`` (JSONL, see `deepspec.schedule.rollouts`; default
``{eval_dir}/rollouts.jsonl``).  Outputs, in ``{eval.out_dir}/calibration`` when
``eval.out_dir`` is set, else ``calibration/`` beside the rollouts file:

- ``calibration.json`` (`Calibration`: per-position temperatures + ECE before/after)
- ``report.md``, ``metrics.json``, ``reliability.png``, ``threshold_sweep.png``

and ``{eval.checkpoint}/calibration.json`` when ``eval.checkpoint`` is set (policies load it
from there by default).
"""
from __future__ import annotations

import collections
import json
import logging
from pathlib import Path
from typing import Dict, Optional

import numpy as np

from ..config import save_config
from .calibration import calibration_metrics, fit_sts_from_config, threshold_sweep
from .report import markdown_report, plot_reliability, plot_threshold_sweep
from .rollouts import RolloutArrays, default_rollouts_path, is_synthetic, read_rollouts, to_arrays

log = logging.getLogger(__name__)


def output_dir(cfg, rollouts_path: Path) -> Path:
    if cfg.eval.out_dir:
        return Path(cfg.eval.out_dir) / "calibration"
    return Path(rollouts_path).parent / "calibration"


def _subset(arr, idx):
    return RolloutArrays(arr.confidence[idx], arr.accepted[idx], arr.verified[idx],
                         [arr.request_ids[i] for i in idx], None if arr.rounds is None else arr.rounds[idx])


def heldout_metrics(arr, schedule_cfg, fraction: float = 0.2, seed: int = 0):
    """Fit on (1−fraction) of the requests, report on the rest (None if too few requests)."""
    ids = sorted(set(arr.request_ids))
    if len(ids) < 5 or fraction <= 0:
        return None
    rng = np.random.default_rng(seed)
    held = set(rng.choice(ids, size=max(1, int(round(fraction * len(ids)))), replace=False).tolist())
    mask = np.array([r in held for r in arr.request_ids])
    tr, te = _subset(arr, np.flatnonzero(~mask)), _subset(arr, np.flatnonzero(mask))
    cal = fit_sts_from_config(tr, schedule_cfg)
    return calibration_metrics(te.confidence, te.accepted, cal, verified=te.verified)


def run(cfg, out_dir: Optional[str] = None) -> Dict[str, str]:
    """Fit STS on ``cfg.schedule.rollouts`` and write the calibration + report."""
    src = default_rollouts_path(cfg)
    if not Path(src).is_file():
        raise FileNotFoundError(f"no rollouts at {src}: run eval with rollout logging or set schedule.rollouts=PATH")
    records = read_rollouts(src)
    gammas = collections.Counter(r.gamma for r in records if r.confidence is not None)
    if not gammas:
        raise ValueError(f"{src}: no record carries confidences (does the drafter have a confidence head?)")
    gamma = gammas.most_common(1)[0][0]
    if len(gammas) > 1:
        log.warning("%s mixes draft lengths %s; calibrating γ=%d only", src, dict(gammas), gamma)
    arr = to_arrays(records, gamma)
    synthetic = is_synthetic(records)
    cal = fit_sts_from_config(arr, cfg.schedule)
    n_requests = len(set(arr.request_ids))
    cal.meta.update({"rollouts": str(src), "synthetic": synthetic, "n_requests": n_requests})
    if cfg.eval.checkpoint:
        cal.meta["checkpoint"] = str(cfg.eval.checkpoint)

    out = Path(out_dir) if out_dir else output_dir(cfg, Path(src))
    out.mkdir(parents=True, exist_ok=True)
    paths = {"calibration": str(cal.save(out / "calibration.json"))}
    try:
        paths["config"] = str(save_config(cfg, out))
    except Exception as e:  # a plain dataclass tree that OmegaConf cannot take should not stop calibration
        log.warning("could not write resolved_config.yaml: %s", e)
    metrics = calibration_metrics(arr.confidence, arr.accepted, cal, verified=arr.verified)
    held = heldout_metrics(arr, cfg.schedule)
    surv_cal, surv_raw = cal.survival(arr.confidence), np.cumprod(arr.confidence, axis=1)
    sweep_cal = threshold_sweep(surv_cal, arr.accepted)
    sweep_raw = threshold_sweep(surv_raw, arr.accepted)
    tag = " [SYNTHETIC]" if synthetic else ""
    img1 = plot_reliability(arr.confidence, arr.accepted, cal, out / "reliability.png", observed=arr.observed(),
                            title=f"Reliability of cumulative confidence{tag}")
    img2 = plot_threshold_sweep(sweep_cal, out / "threshold_sweep.png", sweep_raw=sweep_raw, gamma=gamma,
                                title=f"Static threshold sweep{tag}")
    (out / "metrics.json").write_text(json.dumps({"fit": metrics, "heldout": held, "sweep_calibrated": sweep_cal,
                                                  "sweep_raw": sweep_raw, "calibration": cal.to_json()}, indent=2))
    (out / "report.md").write_text(markdown_report(cal, metrics, source=str(src), synthetic=synthetic,
                                                   n_requests=n_requests, heldout=held, sweep=sweep_cal,
                                                   images=[str(img1), str(img2)]))
    paths.update(report=str(out / "report.md"), metrics=str(out / "metrics.json"),
                 reliability=str(img1), threshold_sweep=str(img2), out_dir=str(out))
    if cfg.eval.checkpoint:
        ck = Path(cfg.eval.checkpoint)
        if not ck.is_dir():
            raise FileNotFoundError(f"eval.checkpoint={ck} is not a directory")
        paths["checkpoint_calibration"] = str(cal.save(ck / "calibration.json"))
    log.info("calibration: T=%s; ECE %s -> %s; wrote %s", [round(t, 3) for t in cal.temperatures],
             [round(e, 4) for e in cal.ece_before], [round(e, 4) for e in cal.ece_after], out)
    return paths
