"""What `tools/ship_draft.py` writes beside a shipped draft's weights: ``provenance.json`` (every
number read from the training run, its data, the checkout and an optional `deepspec eval` result).
Its ``README.md`` model card is rendered from that record only (no number that was not measured) by
`deepspec.export.card.shipped_card`, beside the cards of `deepspec export`."""
from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

REPO = Path(__file__).resolve().parents[1]
CURVE_KEYS = ("eval/expected_tau", "eval/accept_rate/1")
_BANNER = re.compile(r"strategy (\S+) × (\d+) on (\w+)")


class ShipError(Exception):
    """A draft that cannot be shipped as asked; the message names the file or directory at fault."""


def display(path: Path) -> str:
    """``path`` relative to the checkout when inside it (how the run directories are named in the repo)."""
    p = Path(path).resolve()
    try:
        return str(p.relative_to(REPO))
    except ValueError:
        return str(p)


def resolve(path: str) -> Path:
    """A path from a run's config: absolute, else relative to the working directory or the checkout."""
    p = Path(path)
    if p.is_absolute():
        return p
    for base in (Path.cwd(), REPO):
        if (base / p).exists():
            return base / p
    return Path.cwd() / p


def finite(x: Any) -> Any:
    """JSON-safe: non-finite floats (a speed-up without a baseline) become null."""
    return None if isinstance(x, float) and not math.isfinite(x) else x


def git_commit() -> Optional[str]:
    r = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


# -- the run -------------------------------------------------------------------------------------
def heldout_rows(run_dir: Path, upto_step: int) -> List[Dict[str, Any]]:
    """The held-out eval rows (``step`` + ``eval/*``) of ``run_dir/metrics.jsonl`` up to ``upto_step``,
    one per step (a resumed run's later row wins), oldest first."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    rows: Dict[int, Dict[str, Any]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:   # a line being written when the run was killed
            continue
        ev = {k: finite(v) for k, v in rec.items() if k.startswith("eval/")}
        if ev and isinstance(rec.get("step"), int) and rec["step"] <= upto_step:
            rows[rec["step"]] = {"step": rec["step"], **ev}
    return [rows[s] for s in sorted(rows)]


def trained_on(run_dir: Path, meta: Mapping[str, Any]) -> str:
    """Where the run trained: the device of the last banner in ``train.log`` (none without it) and the
    checkpoint's strategy × world size."""
    log = Path(run_dir) / "train.log"
    found = _BANNER.findall(log.read_text(encoding="utf-8", errors="replace")) if log.is_file() else []
    device = found[-1][2] if found else "an unrecorded device"
    return f"{device} (strategy {meta.get('strategy')} × {meta.get('world_size')})"


def data_stats(cfg, run_dir: Path, target) -> Dict[str, Any]:
    """Sequences, tokens and answer tokens the run drew from (the cache manifest, or the regenerated
    conversations encoded as online training encodes them), plus where they are."""
    from deepspec.cache.union import open_caches
    from deepspec.train.data import OnlineSequences
    if cfg.data.online:
        path = resolve(cfg.data.regen_path) if cfg.data.regen_path else Path(run_dir) / "regen" / "regen.jsonl"
        seqs = OnlineSequences.from_jsonl(path, target, cfg.data.max_length)
        return {"path": path, "kind": "online data", "conversations": len(seqs), "tokens": sum(seqs.lengths()),
                "answer_tokens": int(sum(sum(m) for _, m in seqs.samples)), "regen_sha256": None,
                "sample_ids": seqs.sample_ids()}
    path = resolve(cfg.cache.dir) if cfg.cache.dir else Path(run_dir) / "cache"
    dirs = [(path, "cache.dir")] + [(resolve(d), f"cache.extra_dirs[{k}]") for k, d in enumerate(cfg.cache.extra_dirs)]
    for d, key in dirs:
        if not d.is_dir():
            raise ShipError(f"{d}: the run's cache is not there ({key} in run.yaml); it gives the data numbers")
    with open_caches([d for d, _ in dirs]) as reader:
        reader.validate(target)
        st = reader.stats()
        shas = [(r.manifest.get("source") or {}).get("sha256") for r in getattr(reader, "readers", [reader])]
        ids = [reader.sample_id(i) for i in range(len(reader))]
    return {"path": path, "kind": "cache" if len(dirs) == 1 else f"union of {len(dirs)} caches",
            "conversations": st["samples"], "tokens": st["tokens"], "answer_tokens": st["loss_tokens"],
            "regen_sha256": shas[0] if len(shas) == 1 else shas, "sample_ids": ids}


def heldout_split(cfg, data: Mapping[str, Any], meta: Mapping[str, Any]) -> Tuple[str, int]:
    """(how the held-out sequences were chosen, how many each eval scored); refuses data that changed since."""
    from deepspec.train.data import split_heldout
    tc = cfg.train
    n = int(data["conversations"])
    frac = cfg.data.heldout_fraction
    train, held = split_heldout(data["sample_ids"], frac, cfg.data.split_seed)
    want = meta.get("num_train_sequences")
    if want is not None and int(want) != len(train):
        raise ShipError(f"{data['path']}: {n} sequences split into {len(train)} train + {len(held)} held out, but "
                        f"the checkpoint trained on {want}: the data changed since training")
    text = (f"{frac * 100:g}% of the {data['kind']} by id hash (data.heldout_fraction={frac:g}, "
            f"data.split_seed={cfg.data.split_seed}): {len(held)} sequences")
    scored = len(held)
    if tc.eval_max_sequences and len(held) > tc.eval_max_sequences:
        scored = tc.eval_max_sequences
        text += f", the first {scored} evaluated (train.eval_max_sequences)"
    return text, scored


# -- the eval check ------------------------------------------------------------------------------
def _same(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def eval_check(results: Path, checkpoint: Path, raw: Mapping[str, torch.Tensor],
               shipped: Mapping[str, torch.Tensor], fingerprint: Mapping[str, str]) -> Dict[str, Any]:
    """The greedy τ, prompts and losslessness of a `deepspec eval` results.json, after checking that the
    eval decoded this draft: its drafter's weights file equals the checkpoint's or the bf16 cast."""
    from safetensors.torch import load_file
    results = Path(results)
    try:
        res = json.loads(results.read_text(encoding="utf-8"))
        setup, overall, drafter = res["setup"], res["overall"], res["drafter"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ShipError(f"{results}: not the results.json of a `deepspec eval` run ({type(e).__name__}: {e})") from None
    if not (setup.get("warp") or {}).get("greedy"):
        raise ShipError(f"{results}: not a greedy eval ({setup.get('warp')}); the eval check records greedy τ and "
                        "losslessness: run `deepspec eval` with eval.temperature=0")
    gc = res.get("greedy_check")
    if not gc:
        raise ShipError(f"{results}: no greedy check (the eval ran with eval.measure_baseline=false)")
    target = res.get("target") or {}
    diff = sorted(k for k in fingerprint if target.get(k) != fingerprint[k])
    if diff:
        raise ShipError(f"{results}: evaluated with another target than the draft's ({', '.join(diff)} differ)")
    src = resolve(str(drafter.get("source")))
    weights = src / "model.safetensors"
    if not weights.is_file():
        raise ShipError(f"{results}: its drafter {drafter.get('source')!r} has no model.safetensors here, so it "
                        "cannot be matched with the checkpoint being shipped")
    saved = load_file(str(weights))
    if _same(saved, raw):
        evaluated = f"checkpoint {checkpoint.name} in float32, before the bf16 cast"
    elif _same(saved, shipped):
        evaluated = "these bfloat16 weights"
    else:
        raise ShipError(f"{results}: evaluated {display(src)}, whose weights are not those of {display(checkpoint)}")
    return {"source": display(results), "evaluated": evaluated, "benchmarks": list(overall.get("benchmarks") or []),
            "prompts": overall.get("requests"), "max_new_tokens": setup.get("max_new_tokens"),
            "greedy_identical_to_target": f"{gc['matched']}/{gc['compared']}",
            "tau_greedy": finite(overall.get("tau")), "tau_greedy_pooled": finite((res.get("pooled") or {}).get("tau")),
            "speedup": finite((res.get("speed") or {}).get("speedup")), "device": setup.get("device"),
            "dtype": setup.get("dtype"), "policy": setup.get("policy")}


# -- the calibration -----------------------------------------------------------------------------
def calibration_record(path: Path, gamma: int) -> Dict[str, Any]:
    """What provenance.json says about a shipped calibration.json: where it came from and how well it fits."""
    from deepspec.schedule.calibration import Calibration
    try:
        cal = Calibration.load(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ShipError(f"{path}: not a calibration.json written by `deepspec calibrate` ({type(e).__name__}: {e})") from None
    if cal.gamma != gamma or len(cal.temperatures) != gamma:
        raise ShipError(f"{path}: calibrated for γ = {cal.gamma} ({len(cal.temperatures)} temperatures), "
                        f"the draft proposes γ = {gamma}")
    if cal.meta.get("synthetic"):
        raise ShipError(f"{path}: fitted on synthetic rollouts; ship a calibration fitted on this draft's own rollouts")
    return {"source": display(path), "rollouts": cal.meta.get("rollouts"), "requests": cal.meta.get("n_requests"),
            "rounds": cal.n_rounds, "temperatures": [round(float(t), 4) for t in cal.temperatures],
            "ece_before": finite(cal.ece_before[0]) if cal.ece_before else None,
            "ece_after": finite(cal.ece_after[0]) if cal.ece_after else None}


# -- provenance.json -----------------------------------------------------------------------------
def provenance(*, name: str, target_note: str, command: str, ship_command: str, run_dir: Path, checkpoint: Path,
               meta: Mapping[str, Any], draft_config: Mapping[str, Any], data: Mapping[str, Any], data_note: str,
               preparation: Sequence[str], heldout: Sequence[Mapping[str, Any]], split: str, trained: str,
               check: Optional[Mapping[str, Any]],
               calibration: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """The record of a shipped draft (the keys of the first, hand-made one, plus ``ship_command`` and
    ``data.regen_sha256``).  ``commit`` and ``machine`` are the checkout and machine that ran the tool;
    ``machine.trained_on`` is where the run trained (its train.log and checkpoint)."""
    d = {"source": data_note, "conversations": data["conversations"], "tokens": data["tokens"],
         "answer_tokens": data["answer_tokens"], "preparation": list(preparation)}
    if data.get("regen_sha256"):
        d["regen_sha256"] = data["regen_sha256"]
    return {
        "name": name, "target": target_note, "shipped": dt.datetime.now(dt.timezone.utc).date().isoformat(),
        "commit": git_commit(), "command": command, "ship_command": ship_command, "run_dir": display(run_dir),
        "checkpoint": checkpoint.name, "steps": int(meta["step"]), "config": dict(draft_config), "data": d,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "trained_on": trained},
        "weights_dtype": "bfloat16",
        "heldout": dict(heldout[-1]) if heldout else None,
        "heldout_curve": [{k: r[k] for k in ("step", *CURVE_KEYS) if k in r} for r in heldout],
        "heldout_split": split,
        "eval_check": dict(check) if check else None,
        "calibration": dict(calibration) if calibration else None,
    }
