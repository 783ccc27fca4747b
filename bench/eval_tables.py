"""The numbers and tables of `bench/eval_drafters.py`, from finished evals' output files.

- `eval_summary`: what the benchmark reports of one eval's results.json (τ and its interval per benchmark,
  domain and macro, conditional acceptance by position, speedups, the per-round split).
- `request_table` + `paired_ratio`: per-request totals from an eval's samples.jsonl and the paired,
  benchmark-stratified bootstrap of the ratio of two evals' macro τ (`deepspec.eval.bootstrap`'s resampling,
  the same index draws applied to both).
- `markdown`: the record's tables.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from bench.records import repo_relative
from deepspec.eval.bootstrap import (LEVEL, RequestTotals, benchmark_rng, macro_draws, percentile_interval,
                                     ratio_draws, resample_indices)
from deepspec.eval.metrics import nanmean

SPLIT_KEYS = ("draft_ms", "verify_ms", "overhead_ms", "round_ms", "overhead_fraction", "tokens_per_round",
              "verified_tokens_per_round", "plain_decode_ms_per_token", "spec_decode_ms_per_token",
              "verify_over_plain_decode", "rounds")
STAT_KEYS = ("requests", "rounds", "tau", "tau_ci95", "speedup", "speedup_ci95", "acceptance_rate",
             "conditional_acceptance", "prefix_survival")


# -- numbers -------------------------------------------------------------------------------------------

def _stats(m: Optional[Mapping[str, Any]]) -> Optional[Dict[str, Any]]:
    return None if m is None else {k: m.get(k) for k in STAT_KEYS if k in m}


def eval_summary(results: Mapping[str, Any]) -> Dict[str, Any]:
    """The numbers this benchmark reports, from one eval's results.json."""
    b = results["benchmarks"]
    speed = results.get("speed") or {}
    return {"setup": results.get("setup"), "drafter": results.get("drafter"), "gamma": results.get("gamma"),
            "benchmarks": {n: {**_stats(v["all_turns"]), "first_turn": _stats(v.get("first_turn"))}
                           for n, v in b.items()},
            "domains": {d: _stats(v) for d, v in results.get("domains", {}).items()},
            "macro": _stats(results["overall"]),
            "speed": {"speedup_pooled": speed.get("speedup"),
                      "spec_tokens_per_s": (speed.get("spec") or {}).get("tokens_per_s"),
                      "baseline_tokens_per_s": (speed.get("baseline") or {}).get("tokens_per_s"),
                      **{k: (speed.get("round_split") or {}).get(k) for k in SPLIT_KEYS}},
            "greedy_check": {k: (results.get("greedy_check") or {}).get(k) for k in ("compared", "matched")}
            if results.get("greedy_check") else None,
            "bootstrap": results.get("bootstrap")}


def request_table(rows: Sequence[Mapping[str, Any]]) -> Dict[str, Tuple[List[str], RequestTotals]]:
    """Per benchmark: the request ids (sorted) and their `RequestTotals`, from samples.jsonl rows."""
    by: Dict[str, List[Mapping[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["benchmark"], []).append(r)
    f = np.float64
    out = {}
    for name, rs in by.items():
        rs = sorted(rs, key=lambda r: r["request_id"])
        base = all(r.get("baseline") for r in rs)
        out[name] = ([r["request_id"] for r in rs], RequestTotals(
            tau_tokens=np.array([sum(a + 1 for a in r["accepted"]) for r in rs], dtype=f),
            rounds=np.array([len(r["accepted"]) for r in rs], dtype=f),
            spec_tokens=np.array([r["generated_tokens"] for r in rs], dtype=f),
            spec_time=np.array([r["time_s"] or 0.0 for r in rs], dtype=f),
            base_tokens=np.array([r["baseline"]["generated_tokens"] for r in rs], dtype=f) if base else None,
            base_time=np.array([r["baseline"]["time_s"] or 0.0 for r in rs], dtype=f) if base else None))
    return out


def _tau(t: RequestTotals) -> float:
    return float(t.tau_tokens.sum() / t.rounds.sum()) if t.rounds.sum() > 0 else float("nan")


def _div(a, b):
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.true_divide(a, b)


def paired_ratio(a: Mapping[str, Tuple[List[str], RequestTotals]], b: Mapping[str, Tuple[List[str], RequestTotals]],
                 resamples: int, seed: int = 0, level: float = LEVEL) -> Dict[str, Any]:
    """Macro τ of ``a`` ÷ macro τ of ``b`` (`request_table`s of evals on the same prompts), with a paired,
    benchmark-stratified percentile-bootstrap interval, and the same per benchmark."""
    if set(a) != set(b):
        raise ValueError(f"the evals ran different benchmarks: {sorted(a)} vs {sorted(b)}")
    per, draws_a, draws_b = {}, [], []
    for name in a:
        (ids_a, ta), (ids_b, tb) = a[name], b[name]
        if ids_a != ids_b:
            raise ValueError(f"{name}: the evals decoded different requests ({len(ids_a)} vs {len(ids_b)}; "
                             "same eval.max_samples / eval.multi_turn needed for a paired ratio)")
        tau_a, tau_b = _tau(ta), _tau(tb)
        e = {"requests": ta.n, "tau_a": tau_a, "tau_b": tau_b, "ratio": float(_div(tau_a, tau_b)), "ratio_ci95": None}
        if resamples > 0 and ta.n > 0:
            idx = resample_indices(ta.n, int(resamples), benchmark_rng(seed, name))
            xa, xb = ratio_draws(ta.tau_tokens, ta.rounds, idx), ratio_draws(tb.tau_tokens, tb.rounds, idx)
            draws_a.append(xa)
            draws_b.append(xb)
            e["ratio_ci95"] = percentile_interval(_div(xa, xb), level)
        per[name] = e
    ma, mb = nanmean(e["tau_a"] for e in per.values()), nanmean(e["tau_b"] for e in per.values())
    ci = percentile_interval(_div(macro_draws(draws_a), macro_draws(draws_b)), level) if draws_a else None
    return {"tau_a": ma, "tau_b": mb, "ratio": float(_div(ma, mb)), "ratio_ci95": ci, "benchmarks": per,
            "resamples": int(resamples), "seed": int(seed), "level": level,
            "unit": "request, paired (same indices for both), stratified by benchmark"}


def read_jsonl(path: Path) -> List[Dict[str, Any]]:
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


# -- the table ------------------------------------------------------------------------------------------

def _f(x, nd: int = 2) -> str:
    return "–" if x is None or (isinstance(x, float) and not np.isfinite(x)) else f"{x:.{nd}f}"


def fmt_ci(v, ci, nd: int = 2) -> str:
    """``v [lo, hi]`` (``v`` alone without an interval; – for no value)."""
    return _f(v, nd) if v is None or not ci else f"{_f(v, nd)} [{_f(ci[0], nd)}, {_f(ci[1], nd)}]"


def markdown(record: Mapping[str, Any]) -> str:
    ok = {k: d["result"] for k, d in record["drafters"].items() if d.get("result")}
    names = list(ok)
    ev = record["eval_settings"]
    out = [f"# eval_drafters{'-' + record['label'] if record.get('label') else ''}", "",
           f"`{repo_relative(record['command'])}`", "",
           f"{record['date']}; {ev['max_samples']} prompts × {len(ev['benchmarks'])} benchmarks, "
           f"{ev['max_new_tokens']} new tokens, temperature {ev['temperature']}, multi-turn {ev['multi_turn']}; "
           f"{record['machine']['cpus']} CPUs, {record['threads']} thread(s) per eval, {record['jobs']} at once, "
           f"load {_f(record['machine']['loadavg_start'][0])} → {_f(record['machine']['loadavg_end'][0])}", ""]
    for k, d in record["drafters"].items():
        if d.get("error"):
            out += [f"**{k}: failed** — {repo_relative(d['error'])}", ""]
    if names:
        out += ["τ (accepted + 1 per round) with the 95% bootstrap interval over requests; macro = mean over "
                "benchmarks (stratified interval).", "",
                "| benchmark | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        benches = list(dict.fromkeys(b for n in names for b in ok[n]["benchmarks"]))
        for b in benches:
            cells = [ok[n]["benchmarks"].get(b) or {} for n in names]
            out.append(f"| {b} | " + " | ".join(fmt_ci(c.get("tau"), c.get("tau_ci95")) for c in cells) + " |")
        out.append("| **macro** | " + " | ".join(fmt_ci(ok[n]["macro"]["tau"], ok[n]["macro"].get("tau_ci95"))
                                              for n in names) + " |")
        out.append("| requests | " + " | ".join(str(ok[n]["macro"].get("requests", "–")) for n in names) + " |")
        out.append("| checkpoint step | " + " | ".join(str(record["drafters"][n].get("checkpoint_step", "–"))
                                                    for n in names) + " |")
        out += ["", "Speed on this machine: speedup = speculative ÷ plain tokens/s (pooled; macro with its interval); "
                "per-round split in ms; plain = the target alone, ms per decoded token, same run.", "",
                "| drafter | γ | speedup | macro speedup | draft ms | verify ms | overhead ms | round ms | "
                "tokens/round | plain ms/token | verify ÷ plain | greedy identical |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for n in names:
            s, m, g = ok[n]["speed"], ok[n]["macro"], ok[n].get("greedy_check")
            out.append(f"| {n} | {ok[n].get('gamma', '–')} | {_f(s.get('speedup_pooled'))} | "
                       f"{fmt_ci(m.get('speedup'), m.get('speedup_ci95'))} | {_f(s.get('draft_ms'), 1)} | "
                       f"{_f(s.get('verify_ms'), 1)} | {_f(s.get('overhead_ms'), 1)} | {_f(s.get('round_ms'), 1)} | "
                       f"{_f(s.get('tokens_per_round'))} | {_f(s.get('plain_decode_ms_per_token'), 1)} | "
                       f"{_f(s.get('verify_over_plain_decode'))} | "
                       f"{'–' if not g else str(g['matched']) + '/' + str(g['compared'])} |")
        width = max(len(ok[n]["macro"].get("conditional_acceptance") or []) for n in names)
        if width:
            out += ["", "Conditional acceptance by draft position (macro over benchmarks): P(accept k | accepted k−1).",
                    "", "| drafter | " + " | ".join(f"c{k}" for k in range(1, width + 1)) + " |",
                    "|---|" + "---:|" * width]
            for n in names:
                c = list(ok[n]["macro"].get("conditional_acceptance") or [])
                out.append(f"| {n} | " + " | ".join(_f(x) for x in c + [None] * (width - len(c))) + " |")
    ratios = record.get("ratios") or {}
    if ratios:
        pairs = list(ratios)
        out += ["", "Paired ratios of macro τ (95% paired bootstrap over the shared prompts, stratified by benchmark).",
                "", "| benchmark | " + " | ".join(pairs) + " |", "|---|" + "---:|" * len(pairs)]
        benches = list(dict.fromkeys(b for r in ratios.values() if r.get("benchmarks") for b in r["benchmarks"]))
        for b in benches:
            cells = [(ratios[p].get("benchmarks") or {}).get(b) or {} for p in pairs]
            out.append(f"| {b} | " + " | ".join(fmt_ci(c.get("ratio"), c.get("ratio_ci95"), 3) for c in cells) + " |")
        out.append("| **macro** | " + " | ".join(
            ratios[p]["error"] if ratios[p].get("error") else
            f"{fmt_ci(ratios[p]['ratio'], ratios[p]['ratio_ci95'], 3)} ({_f(ratios[p]['tau_a'])} ÷ {_f(ratios[p]['tau_b'])})"
            for p in pairs) + " |")
    if record.get("notes"):
        out += ["", "Notes:", ""] + [f"- {repo_relative(n)}" for n in record["notes"]]
    return "\n".join(out) + "\n"
