"""What the prepared device run (run.py) measured: each stage's numbers read back from its files, the GPU
goals checked against them, and the markdown summary.  Imported by run.py (its own folder is on sys.path
when it runs as a script)."""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Dict, Optional

# the baseline the GPU goals are stated against, on one H200: regeneration through transformers' `generate`
# (tok/s), the unfused training step (s/step), eval s/request
BEFORE = {"regen_tok_s": 2400.0, "train_dspark_step_s": 1.13, "train_eagle3_step_s": 2.56, "eval_s_per_request": 14.5}


def regen_metrics(work: Path) -> Dict[str, Any]:
    job = read_json(work / "regen" / "regen.jsonl.job.json") or {}
    out = {k: job.get(k) for k in ("ok", "failed", "num_tokens")}
    out.update(job.get("speed") or {})
    log = (work / "logs" / "regen.log")
    text = log.read_text(errors="replace") if log.is_file() else ""
    for line in text.splitlines():
        if line.startswith("[engine]"):
            out["engine"] = line[len("[engine]"):].strip()
    return out


def cache_metrics(work: Path, seconds: Optional[float]) -> Dict[str, Any]:
    man = read_json(work / "cache" / "manifest.json")
    if not man:
        return {}
    shards = man.get("shards") or []
    tok = sum(int(s.get("tokens", 0)) for s in shards)
    size = sum(int(s.get("bytes", 0)) for s in shards)
    return {"samples": sum(int(s.get("samples", 0)) for s in shards), "tokens": tok, "bytes": size,
            "bytes_per_token": round(size / tok, 1) if tok else None,
            "tokens_per_s_incl_startup": round(tok / seconds, 1) if seconds else None}


def train_metrics(work: Path, name: str) -> Dict[str, Any]:
    path = work / "runs" / name / "metrics.jsonl"
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "step_time_s" in r:
                rows.append(r)
    if not rows:
        return {"steps": 0}
    warm = rows[2:] or rows[1:] or rows      # the first steps compile kernels and fill the loader
    st = statistics.median(r["step_time_s"] for r in warm)
    dt_ = statistics.median(r.get("data_time_s", 0.0) for r in warm)
    ck = sorted((work / "runs" / name / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    return {"steps": int(rows[-1].get("step", len(rows))), "step_s": round(st, 4), "steps_per_s": round(1 / st, 3),
            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in warm), 1),
            "data_time_s": round(dt_, 4), "data_fraction": round(dt_ / st, 4) if st else None,
            "final_loss": rows[-1].get("train/loss"), "expected_tau": rows[-1].get("train/expected_tau"),
            "checkpoint": str(ck[-1]) if ck else None}


def eval_metrics(work: Path, name: str) -> Dict[str, Any]:
    res = read_json(work / "eval" / name / "results.json")
    if not res:
        return {}
    sp = res.get("speed") or {}
    rs = sp.get("round_split") or {}
    spec = sp.get("spec") or {}
    gc = res.get("greedy_check") or {}
    return {"tau": (res.get("overall") or {}).get("tau"), "speedup": sp.get("speedup"),
            "requests": spec.get("requests"), "tokens": spec.get("generated_tokens"),
            "s_per_request": (spec["time_s"] / spec["requests"]) if spec.get("requests") else None,
            "spec_tokens_per_s": spec.get("tokens_per_s"),
            "baseline_tokens_per_s": (sp.get("baseline") or {}).get("tokens_per_s"),
            **{k: rs.get(k) for k in ("draft_ms", "verify_ms", "overhead_ms", "round_ms", "overhead_fraction",
                                      "plain_decode_ms_per_token", "verify_over_plain_decode", "tokens_per_round")},
            "greedy_matched": gc.get("matched"), "greedy_compared": gc.get("compared")}


def pytest_summary(log: Path) -> Optional[str]:
    """The last line pytest printed ("9 passed in 31.2s")."""
    lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()] if log.is_file() else []
    return lines[-1] if lines else None


def read_json(p: Path) -> Optional[Dict[str, Any]]:
    try:
        return json.loads(Path(p).read_text())
    except (OSError, json.JSONDecodeError):
        return None


# -- record and summary ----------------------------------------------------------------------------
def goals(rec: Dict[str, Any]) -> Dict[str, Any]:
    """The GPU goals, checked where this run measured them (CPU runs: reported, not judged): regeneration ≥ 5×
`generate`, a DSpark training step ≥ 8× the baseline's, verification ≤ 1.3 plain steps, loop overhead ≤ 10%."""
    g: Dict[str, Any] = {}
    ab = rec.get("regen_ab") or {}
    if ab.get("speedup"):
        g["regen_speedup_vs_generate"] = {"value": ab["speedup"], "goal": ">= 5", "met": ab["speedup"] >= 5}
    tr = rec.get("train", {}).get("dspark", {})
    if tr.get("steps_per_s"):
        x = tr["steps_per_s"] * BEFORE["train_dspark_step_s"]      # steps/s now ÷ steps/s of the baseline
        g["train_dspark_vs_before"] = {"value": round(x, 2), "goal": ">= 8", "met": x >= 8}
    for name, ev in (rec.get("eval") or {}).items():
        if ev.get("verify_over_plain_decode") is not None:
            v = ev["verify_over_plain_decode"]
            g[f"eval_{name}_verify_over_plain"] = {"value": round(v, 3), "goal": "<= 1.3", "met": v <= 1.3}
        if ev.get("overhead_fraction") is not None:
            o = ev["overhead_fraction"]
            g[f"eval_{name}_overhead_share"] = {"value": round(o, 4), "goal": "<= 0.10", "met": o <= 0.10}
    return g


def _f(x, nd=2) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def summary_md(rec: Dict[str, Any]) -> str:
    e = rec.get("env") or {}
    L = [f"# Device run ({'tiny CPU scale' if rec['tiny'] else 'reference scale'}) — {rec['date']}", "",
         f"GPU: {e.get('gpu') or 'none'}; torch {e.get('torch')} (CUDA {e.get('cuda')}), transformers "
         f"{e.get('transformers')}, Python {e.get('python')}, {e.get('cpus')} CPUs.  "
         f"Total {_f(rec.get('total_s'), 1)} s.", "",
         "## Stages", "", "| stage | status | seconds | limit s |", "|---|---|---|---|"]
    for k, s in rec["stages"].items():
        L.append(f"| {k} | {s.get('status')} | {_f(s.get('seconds'), 1)} | {_f(s.get('limit_s'), 0)} |")
    r = rec.get("regen") or {}
    L += ["", "## Regeneration", "",
          f"{_f(r.get('ok'))} samples, {_f(r.get('new_tokens'))} new tokens in {_f(r.get('seconds'), 1)} s: "
          f"**{_f(r.get('tokens_per_s'), 0)} tok/s** ({r.get('engine', '')}).  Baseline on one H200: "
          f"{BEFORE['regen_tok_s']:.0f} tok/s."]
    ab = rec.get("regen_ab") or {}
    if ab.get("loops"):
        L += ["", f"Same {ab.get('prompts')} prompts, same batch, greedy: " + "; ".join(
            f"{k} {_f(v.get('tokens_per_s'), 0)} tok/s" for k, v in ab["loops"].items())
              + f"; speedup {_f(ab.get('speedup'))}×; identical answers {ab.get('identical')}/{ab.get('prompts')}."]
    c = rec.get("cache") or {}
    if c:
        L += ["", f"Cache: {c.get('samples')} samples, {c.get('tokens')} tokens, "
                  f"{_f(c.get('bytes_per_token'), 0)} B/token."]
    L += ["", "## Training (same step budget each)", "",
          "| drafter | steps | step/s | tokens/s | data share | final loss | E[τ] (train) |",
          "|---|---|---|---|---|---|---|"]
    for k, t in (rec.get("train") or {}).items():
        L.append(f"| {k} | {t.get('steps')} | {_f(t.get('steps_per_s'))} | {_f(t.get('tokens_per_s'), 0)} | "
                 f"{_pct(t.get('data_fraction'))} | "
                 f"{_f(t.get('final_loss'), 3)} | {_f(t.get('expected_tau'), 3)} |")
    L += ["", "## Eval (greedy, γ 7)", "",
          "| drafter | τ | speedup | s/request | draft ms | verify ms | overhead ms | overhead share "
          "| plain decode ms/token | verify ÷ plain | greedy equal |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for k, v in (rec.get("eval") or {}).items():
        L.append(f"| {k} | {_f(v.get('tau'), 3)} | {_f(v.get('speedup'))}× | {_f(v.get('s_per_request'))} | "
                 f"{_f(v.get('draft_ms'))} | {_f(v.get('verify_ms'))} | {_f(v.get('overhead_ms'))} | "
                 f"{_pct(v.get('overhead_fraction'))} | "
                 f"{_f(v.get('plain_decode_ms_per_token'))} | {_f(v.get('verify_over_plain_decode'))} | "
                 f"{v.get('greedy_matched')}/{v.get('greedy_compared')} |")
    if rec.get("cuda_tests"):
        L += ["", f"CUDA-marked tests (tests/integration/test_cuda.py): {rec['cuda_tests']}"]
    gl = rec.get("goals") or {}
    if gl:
        L += ["", "## GPU goals", "", "| goal | value | target | met |", "|---|---|---|---|"]
        for k, v in gl.items():
            L.append(f"| {k} | {v['value']} | {v['goal']} | {'yes' if v['met'] else 'no'} |")
    return "\n".join(L) + "\n"
