"""The cache-size gate: does a lossy codec keep the drafter's acceptance length?

For every codec, from the SAME regen JSONL: build the cache, train the same drafter with the
same seed and steps on it (`deepspec.train.loop.run`, one ``run_dir`` per codec), evaluate
the final checkpoint on the same prompts (`deepspec.eval.runner.run`), and report τ, the
τ ratio to the first (lossless) codec, bytes/token vs DeepSpec's raw layout
``6 + 2·H·(L+1)`` and the codec's reconstruction error.

Eval τ on a few prompts is noisy (a handful of rounds decide it).  With
``data.heldout_fraction > 0`` the gate also scores every codec's drafter teacher-forced on
the same held-out sequences (never trained on) read from the FIRST codec's cache — the
lossless features a serving engine would feed it — as ``heldout``: expected τ and
per-position acceptance over thousands of positions, paired across codecs.  Writes ``gate.json`` and
``gate.md`` into the output directory.

    deepspec gate [OVERRIDES…] --regen PATH [--codecs bf16,fp8,lowrank] [--out DIR] [--tolerance 0.02]
    deepspec.plan.gate.run(cfg, codecs=["bf16", "fp8", "lowrank"], regen_path=..., out_dir=...)

Caches, runs and evals live under ``out/{cache,run,eval}-<label>``; a codec may be given with
its parameters as ``lowrank:rank=64:coef=fp8`` (label ``lowrank-r64-fp8``).
"""
from __future__ import annotations

import copy
import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .. import paths
from ..cache import CacheError, CacheReader
from ..cache.format import raw_bytes_per_token
from ..drafts.registry import load_drafter
from ..eval.runner import run as eval_run
from ..cache.writer import build_cache
from ..targets import load_target
from ..train.data import CachedSequences, build_micro_batch, split_heldout
from ..train.loop import run as train_run

log = logging.getLogger(__name__)

_CACHE_KEYS = {"rank": int, "coef": str, "lowrank_coef": str, "calib_tokens": int, "last_hidden": str,
               "last_hidden_codec": str, "margin": float, "fp8_margin": float, "layout": str,
               "zstd_level": int, "level": int}
_ALIASES = {"coef": "lowrank_coef", "last_hidden": "last_hidden_codec", "margin": "fp8_margin",
            "level": "zstd_level"}


def parse_codec(spec: str) -> Tuple[str, Dict[str, Any], str]:
    """``"lowrank:rank=64:coef=fp8"`` → (name, cache.* overrides, label)."""
    parts = [p for p in str(spec).split(":") if p]
    if not parts:
        raise CacheError("empty codec spec")
    name, over, label = parts[0], {}, [parts[0]]
    for p in parts[1:]:
        if "=" not in p:
            raise CacheError(f"codec spec {spec!r}: {p!r} is not key=value")
        k, v = p.split("=", 1)
        if k not in _CACHE_KEYS:
            raise CacheError(f"codec spec {spec!r}: unknown parameter {k!r} (known: {sorted(_CACHE_KEYS)})")
        over[_ALIASES.get(k, k)] = _CACHE_KEYS[k](v)
        label.append(("r" + v) if k == "rank" else (f"lh{v}" if k.startswith("last_hidden") else v))
    return name, over, "-".join(label)


def _cfg_for(cfg, name: str, over: Dict[str, Any], label: str, out: Path, regen: Path):
    c = copy.deepcopy(cfg)
    c.cache.codec = name
    for k, v in over.items():
        setattr(c.cache, k, v)
    c.cache.dir = str(out / f"cache-{label}")
    c.run_dir = str(out / f"run-{label}")
    c.data.regen_path = str(regen)
    c.data.online = False
    c.eval.out_dir = str(out / f"eval-{label}")
    if c.eval.decoding == "auto" and c.eval.tree_nodes is None:
        c.eval.decoding = "chain"       # the gate compares what each cache teaches the drafter: its chains
    return c


def _tau(summary: Dict[str, Any]) -> float:
    ov = summary.get("overall", {}) if isinstance(summary, dict) else {}
    t = ov.get("tau")
    return float(t) if isinstance(t, (int, float)) else float("nan")


def run(cfg, codecs: Sequence[str] = ("bf16", "fp8", "lowrank"), regen_path: Union[str, Path, None] = None,
        out_dir: Union[str, Path, None] = None, tolerance: float = 0.02, target=None) -> Dict[str, Any]:
    """Build, train and evaluate per codec; returns the gate report (also gate.json / gate.md)."""
    regen = Path(regen_path) if regen_path else paths.regen_path(cfg)
    if not regen.is_file():
        raise CacheError(f"gate: regen JSONL not found: {regen}")
    out = Path(out_dir) if out_dir else paths.run_dir(cfg) / "gate"
    out.mkdir(parents=True, exist_ok=True)
    specs = [parse_codec(s) for s in codecs]
    if not specs:
        raise CacheError("gate: no codec given")
    if target is None and cfg.data.heldout_fraction > 0:
        target = load_target(cfg.target)   # once, for every codec's held-out scoring
    rows: List[Dict[str, Any]] = []
    for name, over, label in specs:
        c = _cfg_for(cfg, name, over, label, out, regen)
        row: Dict[str, Any] = {"codec": label, "name": name, "overrides": over}
        t0 = time.perf_counter()
        cache_dir = build_cache(c, regen_path=regen, target=target, progress=False)
        row["build_s"] = time.perf_counter() - t0
        with CacheReader(cache_dir) as r:
            st, m = r.stats(), r.manifest
            L, H = len(m["layer_ids"]), int(m["hidden_size"])
            cols = m.get("stored_column_bytes") or {}
            tok = max(int(m["num_tokens"]), 1)
            row.update({"spec": m["codec"], "lossless": bool(r.codec.lossless), "tokens": int(m["num_tokens"]),
                        "samples": len(r), "bytes_per_token": st["bytes_per_token"],
                        "raw_bytes_per_token": raw_bytes_per_token(H, L),
                        "fraction_of_raw": st["bytes_per_token"] / raw_bytes_per_token(H, L),
                        "features_bytes_per_token": int(cols.get("features", 0)) / tok,
                        "last_hidden_bytes_per_token": int(cols.get("last_hidden", 0)) / tok,
                        "error": m.get("codec_error")})
        t0 = time.perf_counter()
        ckpt = train_run(c)
        row["train_s"] = time.perf_counter() - t0
        row["checkpoint"] = str(ckpt)
        row["train_final"] = _last_metrics(Path(c.run_dir))
        c.eval.checkpoint = str(ckpt)
        t0 = time.perf_counter()
        summary = eval_run(c)
        row["eval_s"] = time.perf_counter() - t0
        row["tau"] = _tau(summary)
        row["eval"] = {"overall": summary.get("overall"), "out_dir": c.eval.out_dir}
        row["cache_dir"] = str(cache_dir)
        row["heldout"] = _heldout_on(rows[0]["cache_dir"] if rows else cache_dir, c, ckpt, target)
        rows.append(row)
        log.info("gate %s: %.1f B/token (%.3f× raw), τ=%.3f", label, row["bytes_per_token"],
                 row["fraction_of_raw"], row["tau"])
    base = rows[0]
    for row in rows:
        ho, bho = row.get("heldout"), base.get("heldout")
        row["heldout_tau_ratio"] = (ho["expected_tau"] / bho["expected_tau"]) if ho and bho else None
        bt = base["tau"]
        row["tau_ratio"] = row["tau"] / bt if bt and not math.isnan(bt) else float("nan")
        row["within_tolerance"] = bool(abs(row["tau_ratio"] - 1.0) <= tolerance) if not math.isnan(row["tau_ratio"]) else False
    report = {"baseline": base["codec"], "baseline_lossless": base["lossless"], "tolerance": tolerance,
              "regen": str(regen), "target": cfg.target.path, "draft": cfg.draft.algorithm,
              "seed": cfg.seed, "train_steps": cfg.train.max_steps, "eval_benchmarks": list(cfg.eval.benchmarks),
              "eval_max_samples": cfg.eval.max_samples, "eval_max_new_tokens": cfg.eval.max_new_tokens,
              "eval_temperature": cfg.eval.temperature, "codecs": rows}
    (out / "gate.json").write_text(json.dumps(report, indent=1, default=str, allow_nan=True) + "\n")
    (out / "gate.md").write_text(format_markdown(report))
    return report


def _heldout_on(cache_dir, cfg, ckpt, target) -> Optional[Dict[str, Any]]:
    """Teacher-forced metrics of ``ckpt`` on the held-out split of ``cache_dir`` (one batch)."""
    tc = cfg.train
    if cfg.data.heldout_fraction <= 0:
        return None
    reader = CacheReader(cache_dir)
    source = CachedSequences(reader, cfg.data.max_length)
    _, held = split_heldout(source.sample_ids(), cfg.data.heldout_fraction, cfg.data.split_seed)
    if not held:
        return None
    drafter = load_drafter(ckpt, target)
    drafter.eval()
    batch = build_micro_batch(source, [(-1, i) for i in held], tc.anchors_per_sequence, cfg.seed)
    with torch.no_grad():
        m = drafter(batch)["metrics"]
    g = drafter.cfg.gamma
    return {"sequences": len(held), "positions": m.get("positions"), "expected_tau": m["expected_tau"],
            "tv": m.get("tv"), "accept_rate": [m.get(f"accept_rate/{k}") for k in range(1, g + 1)]}


def _last_metrics(run_dir: Path) -> Optional[Dict[str, Any]]:
    """The last training record of ``metrics.jsonl`` (if the logger wrote one)."""
    for p in sorted(run_dir.glob("**/metrics*.jsonl")):
        last = None
        for line in p.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and any(str(k).startswith("train/") for k in rec):
                last = rec
        if last:
            return {k: v for k, v in last.items() if k in ("step", "train/loss", "train/expected_tau", "train/tv")}
    return None


def _fmt(x, spec=".3f") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def format_markdown(rep: Dict[str, Any]) -> str:
    rows = rep["codecs"]
    lines = [f"# Cache-size gate ({rep['target']}, {rep['draft']}, seed {rep['seed']}, "
             f"{rep['train_steps']} train steps)", "",
             f"Baseline: `{rep['baseline']}`{' (lossless)' if rep['baseline_lossless'] else ' (NOT lossless)'}; "
             f"tolerance ±{rep['tolerance'] * 100:.1f} % of its τ.  Eval: {', '.join(rep['eval_benchmarks'])} "
             f"(max {rep['eval_max_samples']} prompts each, {rep['eval_max_new_tokens']} new tokens, "
             f"T={rep['eval_temperature']}).", "",
             "| codec | B/token | × DeepSpec raw | features B/tok | last_hidden B/tok | worst layer rel. MSE | "
             "τ | τ / baseline | within tol. | held-out E[τ] | E[τ] / baseline |",
             "|---|---:|---:|---:|---:|---:|---:|---:|:---:|---:|---:|"]
    for r in rows:
        err = r.get("error") or {}
        worst = max((e.get("rel_mse", 0.0) for e in err.get("features", [])), default=0.0)
        lines.append(f"| `{r['codec']}` | {r['bytes_per_token']:.1f} | {r['fraction_of_raw']:.3f} | "
                     f"{r['features_bytes_per_token']:.1f} | {r['last_hidden_bytes_per_token']:.1f} | "
                     f"{worst:.2e} | {r['tau']:.3f} | {r['tau_ratio']:.3f} | "
                     f"{'yes' if r['within_tolerance'] else 'no'} | "
                     f"{_fmt((r.get('heldout') or {}).get('expected_tau'))} | {_fmt(r.get('heldout_tau_ratio'))} |")
    raw = rows[0]["raw_bytes_per_token"]
    lines += ["", f"DeepSpec raw layout: {raw} B/token (6 + 2·H·(L+1)).  τ is the eval's macro mean "
                  "acceptance length (tokens per target forward).  Held-out E[τ]: teacher-forced expected "
                  "acceptance length on held-out sequences with the lossless features, paired across codecs."]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``deepspec gate``: the command line of `run`."""
    import argparse
    import sys
    from ..config import load_config
    p = argparse.ArgumentParser(prog="deepspec gate",
                                description="lossless vs lossy cache codecs: same drafter, seed, steps, prompts; compare τ")
    p.add_argument("overrides", nargs="*", help="config overrides (target, draft, train.max_steps, eval.*)")
    p.add_argument("--regen", default=None, help="regen JSONL (default: deepspec.paths.regen_path)")
    p.add_argument("--codecs", default="bf16,fp8,lowrank",
                   help="comma list; the first is the baseline; params as lowrank:rank=64:coef=fp8")
    p.add_argument("--out", default=None, help="output directory (default {run_dir}/gate)")
    p.add_argument("--tolerance", type=float, default=0.02, help="allowed relative τ loss (0.02 = 2%%)")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    rep = run(load_config(args.overrides), codecs=[c for c in args.codecs.split(",") if c], regen_path=args.regen,
              out_dir=args.out, tolerance=args.tolerance)
    print(format_markdown(rep))
    return 0
