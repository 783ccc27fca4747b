"""`report.md` tables and PNG plots (matplotlib, Agg backend) from an eval summary."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from .benchmarks import domain_of

__all__ = ["write_report", "make_plots"]

_DOMAIN_COLORS = {"math": "#1f77b4", "code": "#2ca02c", "chat": "#d62728", "other": "#7f7f7f"}


def _f(x, nd: int = 2) -> str:
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return "–"
    if isinstance(x, int):
        return str(x)
    return f"{x:.{nd}f}"


def _ci(m: Mapping[str, Any], key: str, nd: int = 2) -> str:
    """``m[key]`` with its bootstrap interval ``m[key + "_ci95"]`` when there is one: ``2.31 [2.10, 2.52]``."""
    v, ci = _f(m.get(key), nd), m.get(f"{key}_ci95")
    return v if v == "–" or not ci else f"{v} [{_f(ci[0], nd)}, {_f(ci[1], nd)}]"


def _pct(x) -> str:
    return "–" if _f(x) == "–" else f"{100 * x:.1f}%"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> List[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(plt, fig, pdir: Path, name: str) -> str:
    """Lay out, write ``pdir/<name>.png`` and close ``fig``; returns the path relative to the report."""
    fig.tight_layout()
    fig.savefig(pdir / f"{name}.png", dpi=110)
    plt.close(fig)
    return f"plots/{name}.png"


def _plot_conditional_acceptance(plt, pdir: Path, summary: Mapping[str, Any]) -> str:
    """Conditional acceptance by position, one line per domain (macro over the domain's benchmarks)."""
    from matplotlib.ticker import MaxNLocator
    fig, ax = plt.subplots(figsize=(6, 4))
    any_line = False
    for d, m in summary.get("domains", {}).items():
        ca = m.get("conditional_acceptance") or []
        xs = [k + 1 for k, v in enumerate(ca) if v is not None and not math.isnan(v)]
        ys = [v for v in ca if v is not None and not math.isnan(v)]
        if xs:
            ax.plot(xs, ys, marker="o", label=d, color=_DOMAIN_COLORS.get(d))
            any_line = True
    ax.set_xlabel("draft position k")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))   # positions are whole numbers
    ax.set_ylabel("P(accept k | accepted k−1)")
    ax.set_ylim(0, 1.02)
    ax.set_title("Conditional acceptance by position")
    ax.grid(alpha=0.3)
    if any_line:
        ax.legend()
    return _save(plt, fig, pdir, "conditional_acceptance")


def _plot_tau_per_benchmark(plt, pdir: Path, summary: Mapping[str, Any]) -> str:
    """Bar per benchmark of τ over all turns, coloured by domain, with bootstrap error bars where known."""
    bench = summary.get("benchmarks", {})
    names = list(bench)
    fig, ax = plt.subplots(figsize=(max(5, 0.8 * len(names) + 2), 4))
    taus = [bench[n]["all_turns"]["tau"] for n in names]
    cis = [bench[n]["all_turns"].get("tau_ci95") for n in names]
    err = None
    if any(cis):   # asymmetric error bars from the bootstrap interval (none where a benchmark has none)
        err = [[t - c[0] if c and not math.isnan(t) else 0.0 for t, c in zip(taus, cis)],
               [c[1] - t if c and not math.isnan(t) else 0.0 for t, c in zip(taus, cis)]]
    ax.bar(range(len(names)), [0 if math.isnan(t) else t for t in taus], yerr=err, capsize=3 if err else 0,
           color=[_DOMAIN_COLORS.get(domain_of(n), "#7f7f7f") for n in names])
    for i, (t, c) in enumerate(zip(taus, cis)):
        if not math.isnan(t):   # above the error bar when there is one
            ax.text(i, max(t, c[1]) if c else t, f"{t:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30, ha="right")
    ax.set_ylabel("τ (accepted + 1 per round)")
    ax.set_title(f"Acceptance length τ per benchmark (γ={summary.get('gamma')})")
    return _save(plt, fig, pdir, "tau_per_benchmark")


def _plot_reliability(plt, pdir: Path, conf: Mapping[str, Any]) -> str:
    """Reliability diagram of cumulative confidence, raw and calibrated, against the diagonal."""
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], ls="--", color="gray", lw=1)
    for key, label in (("reliability_raw", "raw"), ("reliability_calibrated", "calibrated (STS)")):
        rel = conf.get(key)
        if not rel:
            continue
        pts = [(c, f) for c, f, n in zip(rel["mean_confidence"], rel["frequency"], rel["count"])
               if n and c is not None and not math.isnan(c)]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    label=f"{label} (ECE {rel['ece']:.3f}, n={rel['n']})")
    ax.set_xlabel("cumulative confidence Π c_i")
    ax.set_ylabel("observed prefix survival")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_title("Reliability of cumulative confidence")
    ax.legend(loc="upper left", fontsize=8)
    return _save(plt, fig, pdir, "reliability")


def _plot_threshold_sweep(plt, pdir: Path, sw: Mapping[str, Any]) -> str:
    """τ, verified tokens per round and their ratio against the confidence threshold."""
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(sw["threshold"], sw["tau"], marker="o", label="τ")
    ax.plot(sw["threshold"], sw["verified_per_round"], marker="s", label="verified tokens / round")
    ax.set_xlabel("threshold on cumulative confidence")
    ax.set_ylabel("tokens per round")
    ax2 = ax.twinx()
    ax2.plot(sw["threshold"], sw["tokens_per_verified"], color="k", ls=":", label="τ / verified")
    ax2.set_ylabel("τ per verified token")
    ax2.set_ylim(0, 1.05)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="center left")
    ax.set_title("Threshold sweep (replayed from the rollouts)")
    ax.grid(alpha=0.3)
    return _save(plt, fig, pdir, "threshold_sweep")


def make_plots(out_dir: Path, summary: Mapping[str, Any]) -> Dict[str, str]:
    """Write the PNGs under ``out_dir/plots``; returns {name: relative path}."""
    plt = _plt()
    pdir = Path(out_dir) / "plots"
    pdir.mkdir(parents=True, exist_ok=True)
    made: Dict[str, str] = {
        "conditional_acceptance": _plot_conditional_acceptance(plt, pdir, summary),
        "tau_per_benchmark": _plot_tau_per_benchmark(plt, pdir, summary),
    }
    conf = summary.get("confidence")
    if conf:
        made["reliability"] = _plot_reliability(plt, pdir, conf)
        sw = conf.get("threshold_sweep") or {}
        if sw.get("threshold"):
            made["threshold_sweep"] = _plot_threshold_sweep(plt, pdir, sw)
    return made


def _setup_lines(s: Mapping[str, Any]) -> List[str]:
    setup = s.get("setup") or {}
    return [] if not setup else [f"- target: `{setup.get('target')}`", f"- drafter: `{setup.get('drafter')}`",
            f"- γ = {s.get('gamma')}, verification policy: {setup.get('policy')}",
            f"- sampling: {setup.get('warp')}", f"- max_new_tokens = {setup.get('max_new_tokens')}, "
            f"max_samples = {setup.get('max_samples')}, device = {setup.get('device')}", ""]


def _summary_lines(s: Mapping[str, Any]) -> List[str]:
    """Macro τ / acceptance / speedup, the bootstrap note and the per-domain table."""
    ov = s.get("overall", {})
    bs = s.get("bootstrap")
    lines = ["## Summary", "",
             f"**Macro τ = {_ci(ov, 'tau')}** (mean over benchmarks of the per-benchmark τ; τ counts the "
             f"bonus/correction token), acceptance rate {_f(ov.get('acceptance_rate'), 3)}, "
             f"speedup {_ci(ov, 'speedup')}×.", ""]
    if bs:
        lines += [f"Brackets: {100 * bs['level']:.0f}% percentile-bootstrap intervals over requests "
                  f"({bs['resamples']} resamples, seed {bs['seed']}; macro numbers resample every benchmark "
                  "independently).", ""]
    dom = s.get("domains", {})
    if dom:
        lines += _table(["domain", "benchmarks", "requests", "macro τ", "acceptance rate", "speedup"],
                        [[d, ", ".join(m["benchmarks"]), m.get("requests", "–"), _ci(m, "tau"),
                          _f(m.get("acceptance_rate"), 3), _ci(m, "speedup")] for d, m in dom.items()])
        lines.append("")
    return lines


def _benchmark_lines(s: Mapping[str, Any]) -> List[str]:
    """One row per benchmark, split into all turns and turn 1 where the benchmark is multi-turn."""
    rows = []
    for name, b in s.get("benchmarks", {}).items():
        variants = [("", b["all_turns"])]
        if b.get("first_turn") is not None:
            variants = [(" (all turns)", b["all_turns"]), (" (turn 1)", b["first_turn"])]
        for suffix, m in variants:
            sp, bl = m.get("spec", {}), m.get("baseline") or {}
            rows.append([name + suffix, domain_of(name), m.get("requests"), m.get("rounds"), sp.get("generated_tokens"),
                         _ci(m, "tau"), _f(m.get("acceptance_rate"), 3), _f(m.get("verified_per_round")),
                         _f(sp.get("tokens_per_s"), 1), _f(bl.get("tokens_per_s"), 1), _ci(m, "speedup")])
    return (["## Per benchmark", ""]
            + _table(["benchmark", "domain", "requests", "rounds", "tokens", "τ", "accept rate",
                      "verified/round", "spec tok/s", "plain tok/s", "speedup"], rows)
            + [""])


def _position_lines(s: Mapping[str, Any]) -> List[str]:
    """Conditional acceptance and prefix survival by draft position, per domain."""
    dom = s.get("domains", {})
    g = int(s.get("gamma") or 0)
    if not (dom and g):
        return []
    lines = ["## Conditional acceptance by position (paper Fig. 2)", "",
             "P(draft token k accepted | tokens 1..k−1 accepted), macro over each domain's benchmarks.", ""]
    lines += _table(["domain"] + [f"k={k}" for k in range(1, g + 1)],
                    [[d] + [_f(v, 3) for v in (m.get("conditional_acceptance") or [])][:g] for d, m in dom.items()])
    lines += ["", "Prefix survival P(accepted ≥ k):", ""]
    lines += _table(["domain"] + [f"k={k}" for k in range(1, g + 1)],
                    [[d] + [_f(v, 3) for v in (m.get("prefix_survival") or [])][:g] for d, m in dom.items()])
    lines.append("")
    return lines


def _speed_lines(sp: Mapping[str, Any]) -> List[str]:
    """Throughput table, speedup and the time split of the speculative run."""
    spec, base = sp.get("spec", {}), sp.get("baseline")
    if not spec:
        return []
    tt = spec.get("time_s") or float("nan")

    def pct(x):
        return f"{_f(x, 3)} s ({100.0 * x / tt:.1f}%)" if tt and tt > 0 and not math.isnan(tt) else _f(x, 3)
    lines = ["## Speed and time split", ""]
    lines += _table(["", "tokens", "time", "tokens/s", "decode tokens/s"],
                    [["speculative", spec.get("generated_tokens"), _f(spec.get("time_s"), 2) + " s",
                      _f(spec.get("tokens_per_s"), 1), _f(spec.get("decode_tokens_per_s"), 1)]]
                    + ([["target only", base.get("generated_tokens"), _f(base.get("time_s"), 2) + " s",
                         _f(base.get("tokens_per_s"), 1), _f(base.get("decode_tokens_per_s"), 1)]] if base else []))
    lines += ["", f"Speedup (tokens/s, speculative ÷ target only): **{_f(sp.get('speedup'))}×**", "",
              "Time split of the speculative run:", "",
              f"- prefill (prompt forward, drafter init, first token): {pct(spec.get('prefill_s', 0.0))}",
              f"- draft (propose + advance): {pct(spec.get('draft_s', 0.0))}",
              f"- target verify forward: {pct(spec.get('verify_s', 0.0))}",
              f"- loop overhead (acceptance, cache rollback, bookkeeping): {pct(spec.get('overhead_s', 0.0))}", ""]
    return lines + _round_split_lines(sp.get("round_split"))


def _round_split_lines(rsplit: Optional[Mapping[str, Any]]) -> List[str]:
    """Mean per-round draft / verify / overhead times next to plain decoding."""
    if not (rsplit and rsplit.get("rounds")):
        return []
    lines = [f"Per verification round (mean of {rsplit['rounds']} rounds, "
             f"{_f(rsplit.get('tokens_per_round'))} tokens emitted each), with plain decoding "
             "measured in the same run:", ""]
    lines += _table(["draft ms", "verify ms", "overhead ms", "round ms", "overhead share",
                     "plain decode ms/token", "verify ÷ plain step"],
                    [[_f(rsplit.get("draft_ms")), _f(rsplit.get("verify_ms")), _f(rsplit.get("overhead_ms")),
                      _f(rsplit.get("round_ms")), _pct(rsplit.get("overhead_fraction")),
                      _f(rsplit.get("plain_decode_ms_per_token")), _f(rsplit.get("verify_over_plain_decode"))]])
    lines.append("")
    return lines


def _greedy_lines(gm: Optional[Mapping[str, Any]]) -> List[str]:
    if gm is None:
        return []
    lines = ["## Losslessness check (greedy)", "",
             f"{gm['matched']}/{gm['compared']} requests produced exactly the target-only greedy tokens."]
    if gm["matched"] < gm["compared"]:
        lines.append("Mismatches in low precision (bf16) can come from the different numerics of a "
                     "multi-token verify forward vs one-token decoding; in fp32 they indicate a bug.")
    lines.append("")
    return lines


def _confidence_lines(conf: Optional[Mapping[str, Any]]) -> List[str]:
    if not conf:
        return []
    lines = ["## Confidence", ""]
    for key, label in (("reliability_raw", "raw"), ("reliability_calibrated", "calibrated")):
        if conf.get(key):
            lines.append(f"- ECE of cumulative confidence ({label}): {_f(conf[key]['ece'], 4)} "
                         f"over {conf[key]['n']} observed positions")
    lines.append("")
    return lines


def _plots_and_files_lines(plots: Optional[Mapping[str, str]], files: Optional[Mapping[str, str]]) -> List[str]:
    lines: List[str] = []
    if plots:
        lines += ["## Plots", ""]
        for name, rel in plots.items():
            lines += [f"![{name}]({rel})", ""]
    if files:
        lines += ["## Files", ""] + [f"- `{v}`: {k}" for k, v in files.items()] + [""]
    return lines


def write_report(out_dir: Path, summary: Mapping[str, Any], plots: Optional[Mapping[str, str]] = None) -> Path:
    """Markdown report of a summary produced by `deepspec.eval.runner.evaluate`."""
    s = summary
    lines: List[str] = ["# deepspec eval report", ""]
    lines += _setup_lines(s)
    lines += _summary_lines(s)
    lines += _benchmark_lines(s)
    lines += _position_lines(s)
    lines += _speed_lines(s.get("speed", {}))
    lines += _greedy_lines(s.get("greedy_check"))
    lines += _confidence_lines(s.get("confidence"))
    lines += _plots_and_files_lines(plots, s.get("files"))
    path = Path(out_dir) / "report.md"
    path.write_text("\n".join(lines))
    return path
