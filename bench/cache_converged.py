"""Benchmark (not a test): the lossy-cache gate at convergence.

The same drafter (same config, seed, data order and steps) trained on the lossless cache and on lossy
transcodes of it (`deepspec cache transcode`), each scored

- teacher-forced on the held-out split read from the **lossless** cache (what the drafter will see at
  serving time: the target's real features), and on its own cache (the run's last held-out evaluation);
- in the real decoding loop (`bench/eval_drafters.py`: τ with its interval and the paired ratio to the
  lossless run, from that script's record);
- by bytes per token, against DeepSpec's raw layout ``6 + 2·H·(L+1)``.

    .venv/bin/python bench/cache_converged.py --run bf16=RUN:CACHE fp8=RUN:CACHE lr64=RUN:CACHE \
        --evals bench/results/eval_drafters-cache_gate_t1.json --label converged

The first ``--run`` is the lossless baseline.  A further run on a lossless cache (the same data, another seed)
is a control: its ratio is the run-to-run spread a codec's ratio must be read against.  Writes
``bench/results/cache_gate-LABEL.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.deepspec_quality import heldout_metrics  # noqa: E402
from bench.eval_drafters import final_checkpoint  # noqa: E402
from bench.records import header, write_record  # noqa: E402
from deepspec.cache import CacheReader  # noqa: E402
from deepspec.cache.format import raw_bytes_per_token  # noqa: E402
from deepspec.config.loader import config_from_yaml  # noqa: E402
from deepspec.drafts.registry import load_drafter  # noqa: E402
from deepspec.targets import load_target  # noqa: E402
from deepspec.train.data import CachedSequences, split_heldout  # noqa: E402


def last_heldout(run_dir: Path) -> Dict[str, float]:
    """The run's last held-out evaluation (on its own cache) from metrics.jsonl."""
    last = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "eval/expected_tau" in rec:
            last = rec
    return last


def cache_row(path: Path) -> Dict:
    r = CacheReader(path)
    st, m = r.stats(), r.manifest
    raw = raw_bytes_per_token(r.hidden_size, len(r.layer_ids))
    err = m.get("codec_error") or {}
    return {"cache": str(path), "codec": m["codec"], "lossless": bool(r.codec.lossless),
            "bytes_per_token": st["bytes_per_token"], "fraction_of_raw": st["bytes_per_token"] / raw,
            "feature_cosine": [e["cosine"] for e in err.get("features", [])],
            "feature_rel_mse": [e["rel_mse"] for e in err.get("features", [])]}


def run(args) -> Dict:
    torch.set_num_threads(args.threads)
    runs = []
    for spec in args.run:
        label, rest = spec.split("=", 1)
        run_dir, cache = rest.rsplit(":", 1)
        runs.append((label, Path(run_dir), Path(cache)))
    base_cache = runs[0][2]
    ck0, _ = final_checkpoint(runs[0][1])
    cfg = config_from_yaml(ck0 / "run.yaml")
    target = load_target(cfg.target)
    reader = CacheReader(base_cache).validate(target, layer_subset=True)
    source = CachedSequences(reader, cfg.data.max_length, target.layer_ids)
    _, held = split_heldout(source.sample_ids(), cfg.data.heldout_fraction, cfg.data.split_seed)
    evals = json.loads(Path(args.evals).read_text()) if args.evals else {}
    rows: Dict[str, Dict] = {}
    for label, run_dir, cache in runs:
        ck, step = final_checkpoint(run_dir)
        run_cfg = config_from_yaml(ck / "run.yaml")
        drafter = load_drafter(ck, target)
        lossless = heldout_metrics(drafter, source, held, run_cfg)
        own = last_heldout(run_dir)
        row = {**cache_row(cache), "run_dir": str(run_dir), "checkpoint_step": step,
               "heldout_expected_tau_lossless_features": lossless["eval/expected_tau"],
               "heldout_expected_tau_own_cache": own.get("eval/expected_tau"), "own_cache_eval_step": own.get("step")}
        res = evals.get("drafters", {}).get(label, {}).get("result")
        if res:
            row["eval_tau"] = res["macro"]["tau"]
            row["eval_tau_ci95"] = res["macro"].get("tau_ci95")
        ratio = evals.get("ratios", {}).get(f"{label}/{runs[0][0]}")
        if ratio:
            row["eval_tau_ratio"], row["eval_tau_ratio_ci95"] = ratio["ratio"], ratio["ratio_ci95"]
        rows[label] = row
        print(label, json.dumps({k: v for k, v in row.items() if not isinstance(v, (list, dict))}), flush=True)
    base = rows[runs[0][0]]
    for row in rows.values():
        row["heldout_ratio_lossless_features"] = (row["heldout_expected_tau_lossless_features"]
                                                  / base["heldout_expected_tau_lossless_features"])
    return {"baseline": runs[0][0], "heldout_sequences": len(held), "tolerance": args.tolerance,
            "eval_record": args.evals, "codecs": rows}


def markdown(rec: Dict) -> str:
    tol = rec["tolerance"]
    lines = [f"# cache_gate-{rec.get('label')}", "", f"`{rec['command']}`", "",
             f"{rec['date']}; held-out E[τ] on {rec['heldout_sequences']} sequences read from the lossless cache "
             f"(and, for reference, from each run's own cache); eval τ from `{rec['eval_record']}` (paired ratio to "
             f"{rec['baseline']}); within tolerance = ratio ≥ {1 - tol:.2f}.", "",
             "| cache | codec | B/token | × raw | held-out E[τ] (lossless features) | ratio | held-out E[τ] (own "
             "cache) | eval τ | eval ratio [95%] | within |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for label, r in rec["codecs"].items():
        c = r["codec"]
        params = ",".join(f"{k}={v}" for k, v in sorted(c["params"].items()) if k in ("rank", "coef"))
        er = r.get("eval_tau_ratio")
        ci = r.get("eval_tau_ratio_ci95")
        within = "baseline" if label == rec["baseline"] else "control" if r["lossless"] else "–" if er is None else (
            "yes" if er >= 1 - tol and r["heldout_ratio_lossless_features"] >= 1 - tol else "no")
        lines.append(
            f"| {label} | {c['name']}{(' ' + params) if params else ''} | {r['bytes_per_token']:,.0f} | "
            f"{r['fraction_of_raw']:.3f} | {r['heldout_expected_tau_lossless_features']:.3f} | "
            f"{r['heldout_ratio_lossless_features']:.3f} | {r['heldout_expected_tau_own_cache'] or float('nan'):.3f} | "
            + (f"{r['eval_tau']:.3f} | " if r.get("eval_tau") is not None else "– | ")
            + (f"{er:.3f} [{ci[0]:.3f}, {ci[1]:.3f}] | " if er is not None and label != rec["baseline"] else "– | ")
            + f"{within} |")
    cos = [f"{label}: {min(r['feature_cosine']):.4f}–{max(r['feature_cosine']):.4f}"
           for label, r in rec["codecs"].items() if r["feature_cosine"]]
    if cos:
        lines += ["", "Per-layer feature cosine measured at calibration: " + "; ".join(cos) + "."]
    return "\n".join(lines) + "\n"


def main(argv: List[str] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", nargs="+", required=True, metavar="LABEL=RUN_DIR:CACHE_DIR",
                   help="the lossless baseline first, then the lossy runs")
    p.add_argument("--evals", default=None, help="a bench/eval_drafters.py record holding these labels and ratios")
    p.add_argument("--tolerance", type=float, default=0.02)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--label", default="converged")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rec = {**header(label=args.label), **run(args)}
    write_record(rec, "cache_gate", args.out, label=args.label, markdown=markdown(rec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
