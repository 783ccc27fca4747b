"""The numbers and tables of `bench/eval_drafters.py`, from finished evals' output files (`eval_summary` and
`fmt_ci` also serve `bench/decoding_table.py`).

- `eval_summary`: what the benchmark reports of one eval's results.json (τ and its interval per benchmark,
  domain and macro, conditional acceptance by position, speedups, the per-round split).
- `request_table` + `paired_ratio`: per-request totals from an eval's samples.jsonl and the paired,
  benchmark-stratified bootstrap of the ratio of two evals' macro τ (`deepspec.eval.bootstrap`'s resampling,
  the same index draws applied to both); `totals_to_json` / `totals_from_json`: those totals as a record
  keeps them (a later record pairs with a drafter of an earlier one whose eval directory is gone).
- `markdown`: the record's tables.
- the ``--confidence`` analysis (`greedy_paths`, `target_shares`, `acceptance`, `confidence_markdown`): finished
  greedy evals of the same prompts against the target's confidence along its own greedy path.  The
  prompts are decoded once more with the target alone (its greedy path, in the evals' dtype), with the
  target's top-1 probability (softmax at temperature 1) at every token; a round that starts after m output
  tokens checks draft position k against the target's distribution of output token m + k − 1, reached
  when the k − 1 positions before it passed.  Acceptance per bin of that probability, at position 1 and
  over all positions, from each eval's rollouts, and how many position-1 misses propose the anchor token
  again or the token after the next one.  A round whose accepted drafts are not the plain greedy path's
  tokens (a bf16 verification that rounded a near-tie the other way) ends that request's analysis there;
  the count is recorded.
"""
from __future__ import annotations

import bisect
import dataclasses
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


TOTAL_FIELDS = tuple(f.name for f in dataclasses.fields(RequestTotals))


def totals_to_json(table: Mapping[str, Tuple[List[str], RequestTotals]]) -> Dict[str, Dict[str, Any]]:
    """A `request_table` as a record keeps it, so later records can pair with this eval without its directory."""
    return {name: {"ids": list(ids), **{f: None if getattr(t, f) is None else getattr(t, f).tolist()
                                          for f in TOTAL_FIELDS}}
            for name, (ids, t) in table.items()}


def totals_from_json(data: Mapping[str, Mapping[str, Any]]) -> Dict[str, Tuple[List[str], RequestTotals]]:
    """`totals_to_json`'s inverse."""
    def arr(v):
        return None if v is None else np.asarray(v, dtype=np.float64)
    return {name: (list(d["ids"]), RequestTotals(**{f: arr(d.get(f)) for f in TOTAL_FIELDS}))
            for name, d in data.items()}


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


# -- the target's confidence -------------------------------------------------------------------------

EDGES = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0)
Path_ = Tuple[List[int], List[float]]      # the target's greedy tokens and their top-1 probabilities


def bin_of(p: float) -> int:
    """Index of ``p``'s bin in EDGES (the last bin is closed: 1.0 falls in [0.9, 1.0])."""
    return min(max(bisect.bisect_right(EDGES, p) - 1, 0), len(EDGES) - 2)


def bin_names() -> List[str]:
    return [f"[{a:.1f}, {b:.1f}{']' if b == 1.0 else ')'}" for a, b in zip(EDGES[:-1], EDGES[1:])]


def read_rounds(path: Path) -> Dict[str, List[dict]]:
    """Rounds of ``path`` (rollouts.jsonl) by request id, in round order."""
    out: Dict[str, List[dict]] = {}
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        r = json.loads(line)
        missing = [k for k in ("request_id", "round", "accepted", "verified", "draft_tokens") if k not in r]
        if missing:
            raise SystemExit(f"{path}:{i}: no {missing} in this rollout line")
        if not 0 <= int(r["accepted"]) <= int(r["verified"]) <= len(r["draft_tokens"]):
            raise SystemExit(f"{path}:{i}: accepted {r['accepted']}, verified {r['verified']} and "
                             f"{len(r['draft_tokens'])} drafts do not fit")
        out.setdefault(r["request_id"], []).append(r)
    for rid, rs in out.items():
        if [int(r["round"]) for r in rs] != list(range(len(rs))):
            raise SystemExit(f"{path}: the rounds of {rid} are not 0..{len(rs) - 1} in order")
    return out


def target_shares(paths: Mapping[str, Path_], bench_of: Mapping[str, str]) -> Dict[str, object]:
    """Share of output tokens per confidence bin, overall and per benchmark, and the mean top-1."""
    nb = len(EDGES) - 1
    tokens, by_bench, total_p = [0] * nb, {}, 0.0
    for rid, (_, top1) in paths.items():
        counts = by_bench.setdefault(bench_of.get(rid, ""), [0] * nb)
        for p in top1:
            b = bin_of(p)
            tokens[b] += 1
            counts[b] += 1
            total_p += p
    n = sum(tokens)
    return {"tokens": n, "mean_top1": total_p / n if n else None,
            "share": [t / n if n else None for t in tokens],
            "share_by_benchmark": {b: [c / sum(v) for c in v] for b, v in by_bench.items() if sum(v)}}


def acceptance(rounds: Mapping[str, Sequence[Mapping]], paths: Mapping[str, Path_]) -> Dict[str, object]:
    """Acceptance per bin of the target's top-1 probability, at position 1 and over all positions."""
    nb = len(EDGES) - 1
    pos1 = [[0, 0] for _ in range(nb)]      # [reached, passed]
    every = [[0, 0] for _ in range(nb)]
    used = diverged = 0
    kinds = {"anchor": 0, "skip": 0}       # position-1 misses that propose x_p again / x_{p+2}
    for rid, rs in rounds.items():
        if rid not in paths:
            raise SystemExit(f"request {rid} of the rollouts is not among the evaluated prompts")
        toks, top1 = paths[rid]
        m = 1                                # output tokens before the round (the prefill token)
        for r in rs:
            n, ell, d = int(r["accepted"]), int(r["verified"]), r["draft_tokens"]
            if m + n > len(toks) or d[:n] != toks[m: m + n] or (n < ell and m + n < len(toks) and d[n] == toks[m + n]):
                diverged += 1                # not the plain greedy path from here on
                break
            used += 1
            if ell >= 1 and n == 0:
                kinds["anchor"] += int(d[0] == toks[m - 1])
                kinds["skip"] += int(m + 1 < len(toks) and d[0] == toks[m + 1])
            for k in range(1, min(n + 1, ell) + 1):
                if m + k - 1 >= len(top1):
                    break
                b, passed = bin_of(top1[m + k - 1]), int(n >= k)
                every[b][0] += 1
                every[b][1] += passed
                if k == 1:
                    pos1[b][0] += 1
                    pos1[b][1] += passed
            m += n + 1

    def rate(c):
        return c[1] / c[0] if c[0] else None

    def block(cs):
        return {"reached": [c[0] for c in cs], "acceptance": [rate(c) for c in cs],
                "overall": rate([sum(c[0] for c in cs), sum(c[1] for c in cs)])}

    reached1 = sum(c[0] for c in pos1)
    return {"rounds_used": used, "requests_diverged": diverged, "position1": block(pos1),
            "all_positions": block(every),
            "position1_misses": {"repeat_anchor": kinds["anchor"] / reached1 if reached1 else None,
                                 "skip_one": kinds["skip"] / reached1 if reached1 else None}}


def greedy_paths(cfg) -> Tuple[Dict[str, Path_], Dict[str, str]]:
    """The target's greedy output on the eval's first turns (`target_generate`, the evals' own baseline
    decoder), with the top-1 probability of each token from one forward over prompt and output."""
    import torch
    from tqdm.auto import tqdm
    from deepspec.eval.benchmarks import load_benchmarks
    from deepspec.decoding.warp import make_warp
    from deepspec.decoding.loop import target_generate
    from deepspec.targets import load_target
    from deepspec.targets.chat import encode_prompt
    ec = cfg.eval
    benches = load_benchmarks(ec.data_dir, ec.benchmarks, ec.max_samples)
    target = load_target(cfg.target)
    kw = dict(getattr(target, "chat_template_kwargs", {}) or {})
    greedy = make_warp(0.0)
    paths, bench_of = {}, {}
    todo = [s for ss in benches.values() for s in ss]
    for s in tqdm(todo, desc="target greedy path", unit="req"):
        ids = encode_prompt(target.tokenizer, [{"role": "user", "content": s.turns[0]}], **kw)
        toks = target_generate(target, ids, max_new_tokens=ec.max_new_tokens, warp=greedy).tokens
        with torch.inference_mode():
            rows = target.decode(torch.tensor([ids + toks[:-1]])).logits[0, len(ids) - 1:].float()
        top1 = (rows.amax(-1) - rows.logsumexp(-1)).exp().tolist()
        paths[s.id], bench_of[s.id] = (toks, top1), s.benchmark
    return paths, bench_of


def cached_paths(file: Path, cfg, key) -> Tuple[Dict[str, Path_], Dict[str, str]]:
    """`greedy_paths`, kept in ``file`` with the settings it was decoded for (a file for other settings
    is decoded again and replaced)."""
    want = json.loads(json.dumps(list(key)))
    if file.is_file():
        saved = json.loads(file.read_text())
        if saved.get("settings") == want:
            return {k: (v[0], v[1]) for k, v in saved["paths"].items()}, saved["benchmark"]
        print(f"{file}: decoded for other settings {saved.get('settings')}; decoding again")
    paths, bench_of = greedy_paths(cfg)
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps({"settings": want, "paths": paths, "benchmark": bench_of}))
    return paths, bench_of


def eval_settings(eval_dir: Path):
    """The eval's resolved config and what must agree between evals analysed together."""
    from deepspec.config import config_from_yaml
    cfg = config_from_yaml(eval_dir / "resolved_config.yaml")
    ec, tc = cfg.eval, cfg.target
    if ec.temperature != 0 or ec.multi_turn:
        raise SystemExit(f"{eval_dir}: needs a greedy first-turn eval (eval.temperature=0 eval.multi_turn=false)")
    res = eval_dir / "results.json"
    if res.is_file() and str(json.loads(res.read_text()).get("setup", {}).get("policy", "")).startswith("tree("):
        raise SystemExit(f"{eval_dir}: needs chain rollouts (eval.decoding=chain); this eval verified draft trees")
    return cfg, (tc.path, str(tc.dtype), ec.data_dir, tuple(ec.benchmarks), ec.max_samples, ec.max_new_tokens)


def confidence_markdown(record: Mapping) -> str:
    names = bin_names()
    t = record["target"]
    lines = [f"# Draft acceptance against the target's confidence ({record['date']})", "",
             f"`{record['command']}`", "",
             f"## The target's confidence along its greedy output ({t['tokens']:,} tokens)", "",
             "| benchmark | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for bench, share in t["share_by_benchmark"].items():
        lines.append(f"| {bench} | " + " | ".join(_f(x, 2) for x in share) + " |")
    lines.append("| **all** | " + " | ".join(_f(x, 2) for x in t["share"]) + " |")
    lines += ["", f"Mean top-1 probability: {_f(t['mean_top1'], 3)}."]
    for key, title in (("position1", "Acceptance at draft position 1"),
                       ("all_positions", "Conditional acceptance, all positions")):
        lines += ["", f"## {title}, by the target's top-1 probability there", "",
                  "| drafter | " + " | ".join(names) + " | overall |", "|---|" + "---:|" * (len(names) + 1)]
        for name, a in record["drafters"].items():
            cells = [f"{_f(r, 2)} ({n:,})" for r, n in zip(a[key]["acceptance"], a[key]["reached"])]
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {_f(a[key]['overall'], 3)} |")
    lines += ["", "## Position-1 misses that propose the anchor token again (x_p) or skip a token (x_p+2)", "",
              "| drafter | repeat the anchor | skip one token |", "|---|---:|---:|"]
    for name, a in record["drafters"].items():
        mk = a["position1_misses"]
        lines.append(f"| {name} | {_f(mk['repeat_anchor'], 3)} | {_f(mk['skip_one'], 3)} |")
    lines += ["", "(as fractions of the rounds that reached position 1)", "",
              "(n) = positions reached in that bin. Rounds used / requests that left the plain greedy path: " +
              ", ".join(f"{n} {a['rounds_used']} / {a['requests_diverged']}" for n, a in record["drafters"].items()) + "."]
    return "\n".join(lines) + "\n"
