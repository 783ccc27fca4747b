"""The converged-drafters section of `docs/benchmarks.md` (issue 21), rendered from records only.

Reads a `bench/learning_curve.py` record of the four drafters trained to a plateau (held-out E[τ] per
step), the `bench/eval_drafters.py` record of the same checkpoints (eval τ with bootstrap intervals,
paired ratios, per-round speed) and, when present, labelled curve records that change one setting of
a baseline variant (depth, anchors per sequence, the context encoder, the Eagle3 layout): each is compared with its
baseline at the last step both reached.  The verdicts against the paper's margins are computed here
from those numbers; nothing is typed in by hand.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from bench.eval_tables import fmt_ci

# The paper's macro-τ margins on Qwen3 (issue 21's goal): DSpark over DFlash and over Eagle3.
GOALS = {"dflash": 1.16, "eagle3": 1.30}
# The DSpark variants of a record, by sequential head.
DSPARK_LABELS = {"dspark": "DSpark (Markov)", "dspark_rnn": "DSpark (RNN)"}


def _curve(entry: Mapping) -> Dict[int, dict]:
    return {int(p["step"]): p for p in entry.get("curve") or [] if "eval/expected_tau" in p}


def _final(entry: Mapping) -> Optional[dict]:
    c = _curve(entry)
    return c[max(c)] if c else None


def _verdict(ratio: Optional[float], goal: float) -> str:
    return "–" if ratio is None else ("met" if ratio >= goal else "not met")


RATIO_HEADER = ("| ratio | held-out E[τ] | eval macro τ [95% paired CI] | goal | held-out | eval |",
                "|---|---:|---|---:|---|---|")


def _ratio_row(label: str, held: Optional[float], r: Mapping, goal: Optional[float]) -> str:
    """``| A / B | held-out | eval [CI] | goal | verdict held-out | verdict eval |`` (– without a goal)."""
    head = f"| {label} | {fmt_ci(held, None, 3)} | {fmt_ci(r.get('ratio'), r.get('ratio_ci95'), 3)} | "
    if goal is None:
        return head + "– | – | – |"
    return head + f"{goal:.2f} | {_verdict(held, goal)} | {_verdict(r.get('ratio'), goal)} |"


def heldout_table(curve: Mapping) -> List[str]:
    out = ["| drafter | steps | held-out E[τ] | P(1st accepted) | training s |", "|---|---:|---:|---:|---:|"]
    for name, e in curve["drafters"].items():
        f = _final(e) or {}
        out.append(f"| {name} | {f.get('step', '–')} | {fmt_ci(f.get('eval/expected_tau'), None, 3)} | "
                   f"{fmt_ci(f.get('eval/accept_rate/1'), None, 3)} | {fmt_ci(f.get('train_wall_s'), None, 0)} |")
    return out


def eval_table(ev: Mapping) -> List[str]:
    out = ["| drafter | macro τ [95% CI] | speedup [95% CI] | draft ms | verify ms | plain ms/token | "
           "greedy identical |", "|---|---|---|---:|---:|---:|---:|"]
    for name, e in ev["drafters"].items():
        r = e.get("result") or {}
        m, s, g = r.get("macro") or {}, r.get("speed") or {}, r.get("greedy_check") or {}
        out.append(f"| {name} | {fmt_ci(m.get('tau'), m.get('tau_ci95'), 2)} | "
                   f"{fmt_ci(m.get('speedup'), m.get('speedup_ci95'), 2)} | {fmt_ci(s.get('draft_ms'), None, 1)} | "
                   f"{fmt_ci(s.get('verify_ms'), None, 1)} | {fmt_ci(s.get('plain_decode_ms_per_token'), None, 1)} | "
                   + (f"{g.get('matched')}/{g.get('compared')} |" if g else "– |"))
    return out


def ratio_rows(curve: Mapping, ev: Mapping) -> Tuple[List[str], List[str]]:
    """The goal table and one verdict line per DSpark head and baseline."""
    held = {n: (_final(e) or {}).get("eval/expected_tau") for n, e in curve["drafters"].items()}
    rows = list(RATIO_HEADER)
    lines = []
    for ds, ds_name in DSPARK_LABELS.items():
        for other, goal in GOALS.items():
            if ds not in held or other not in held:
                continue
            h = held[ds] / held[other] if held[ds] and held[other] else None
            r = (ev.get("ratios") or {}).get(f"{ds}/{other}") or {}
            e = r.get("ratio")
            rows.append(_ratio_row(f"{ds_name} / {other}", h, r, goal))
            lines.append(f"- {ds_name} / {other} ≥ {goal:.2f}: held-out {fmt_ci(h, None, 3)} ({_verdict(h, goal)}), "
                         f"eval {fmt_ci(e, r.get('ratio_ci95'), 3)} ({_verdict(e, goal)})")
    for other in GOALS:   # the ordering itself, from the eval's paired intervals of every DSpark head
        cis = [((ev.get("ratios") or {}).get(f"{ds}/{other}") or {}).get("ratio_ci95") for ds in DSPARK_LABELS]
        cis = [c for c in cis if c]
        if cis:
            word = ("holds (every DSpark head's interval above 1)" if all(c[0] > 1 for c in cis) else
                    "is reversed (every DSpark head's interval below 1)" if all(c[1] < 1 for c in cis) else
                    "is not resolved by the intervals")
            lines.append(f"- ordering DSpark > {other} on this target: {word}")
    return rows, lines


def _setting(rec: Mapping, entry: Mapping) -> Tuple:
    a = rec.get("args") or {}
    ov = sorted(o for o in entry.get("overrides") or [] if not o.startswith("draft.num_layers="))
    layers = next((o.split("=", 1)[1] for o in entry.get("overrides") or [] if o.startswith("draft.num_layers=")),
                  str(a.get("layers")))
    return ov, layers, a.get("anchors")


def _other_schedule(base_rec: Mapping, rec: Mapping) -> bool:
    """Both records name their step count and the counts differ (a cosine schedule of another length)."""
    bs, vs = (base_rec.get("args") or {}).get("steps"), (rec.get("args") or {}).get("steps")
    return bs is not None and vs is not None and bs != vs


def changes(base_rec: Mapping, base: Mapping, rec: Mapping, entry: Mapping) -> List[str]:
    """What a variant changes against a baseline run: depth, anchors per sequence, schedule, draft overrides."""
    (bo, bl, ba), (vo, vl, va) = _setting(base_rec, base), _setting(rec, entry)
    parts = []
    if vl != bl and entry.get("drafter") != "eagle3":
        parts.append(f"{bl} → {vl} layers")
    if va != ba:
        parts.append(f"{ba} → {va} anchors per sequence")
    if _other_schedule(base_rec, rec):
        parts.append(f"{base_rec['args']['steps']} → {rec['args']['steps']} steps")
    parts += [f"`{o}`" for o in vo if o not in bo]
    parts += [f"without `{o}`" for o in bo if o not in vo]
    return parts


def change_of(base_rec: Mapping, base: Mapping, rec: Mapping, entry: Mapping) -> str:
    return ", ".join(changes(base_rec, base, rec, entry)) or "nothing"


def variant_rows(base_rec: Mapping, variants: Sequence[Tuple[Mapping, str, Mapping, str]]) -> List[str]:
    """``variants``: (record, variant label, baseline record, baseline label in it); a baseline other than
    ``base_rec`` (a one-change run nearer to the variant) is named in the variant column."""
    out = ["| variant | change | last step | held-out E[τ] (P₁) | baseline at that step (P₁) | Δ E[τ] | "
           "training s (baseline) |", "|---|---|---:|---:|---:|---:|---:|"]
    for rec, name, brec, base_name in variants:
        entry, base = rec["drafters"][name], brec["drafters"][base_name]
        against = "" if brec is base_rec else f" vs {base_name} ({(brec.get('args') or {}).get('label', '')})"
        vc, bc = _curve(entry), _curve(base)
        if _other_schedule(brec, rec):
            if not (vc and bc):   # another schedule: each run's last evaluation, not a mid-schedule point
                continue
            s, v, b = f"{max(vc)} vs {max(bc)}", vc[max(vc)], bc[max(bc)]
        else:
            common = sorted(set(vc) & set(bc))
            if not common:
                continue
            s = common[-1]
            v, b = vc[s], bc[s]
        out.append(f"| {name} ({rec.get('args', {}).get('label', '')}){against} | {change_of(brec, base, rec, entry)} | {s} | "
                   f"{fmt_ci(v['eval/expected_tau'], None, 3)} ({fmt_ci(v.get('eval/accept_rate/1'), None, 3)}) | "
                   f"{fmt_ci(b['eval/expected_tau'], None, 3)} ({fmt_ci(b.get('eval/accept_rate/1'), None, 3)}) | "
                   f"{v['eval/expected_tau'] - b['eval/expected_tau']:+.3f} | "
                   f"{fmt_ci(v.get('train_wall_s'), None, 0)} ({fmt_ci(b.get('train_wall_s'), None, 0)}) |")
    return out


DATA_PREFIXES = ("cache.", "data.", "train.heldout", "engine.")


def data_key(rec: Mapping) -> Tuple[str, ...]:
    """What chooses a curve record's training data or its held-out split — its work directory (whose regen
    and cache it reads) and the overrides that pick data, held-out split or regeneration settings: two
    runs' held-out E[τ] compare only when these are equal."""
    a = rec.get("args") or {}
    work = (f"--work {Path(a['work']).as_posix()}",) if a.get("work") else ()
    return work + tuple(sorted(o for o in a.get("extra") or [] if o.startswith(DATA_PREFIXES)))


def load_records(results: Path, labels: Sequence[str]) -> List[Mapping]:
    """The `learning_curve-<label>.json` records that exist, in label order, each read once."""
    return [json.loads(p.read_text()) for label in labels
            if (p := results / f"learning_curve-{label}.json").is_file()]


def find_variants(records: Sequence[Mapping], base_rec: Mapping) -> List[Tuple[Mapping, str, Mapping, str]]:
    """Each variant of the curve ``records`` paired with its nearest baseline: the run of the same drafter
    class (the same `drafter` field; Eagle3 variants with Eagle3) that differs from it in the fewest settings,
    among ``base_rec`` and the other ``records`` with the same schedule (``base_rec`` wins a tie).  A record
    trained on other data (or another held-out split) is no one-change variant and is left out."""
    same = [r for r in records if data_key(r) == data_key(base_rec)]
    out = []
    for rec in same:
        for name, entry in rec["drafters"].items():
            cands = [(base_rec, n, b) for n, b in base_rec["drafters"].items() if b.get("drafter") == entry.get("drafter")]
            if not cands:
                continue
            cands += [(r, n, b) for r in same if r is not rec and not _other_schedule(r, rec)
                      for n, b in r["drafters"].items() if b.get("drafter") == entry.get("drafter")]
            brec, bname, _ = min(cands, key=lambda c: len(changes(c[0], c[2], rec, entry)))
            out.append((rec, name, brec, bname))
    return out


def _run_key(run_dir: str) -> str:
    """`<label dir>/<variant dir>` of a run directory, the same in curve records (repo-relative) and eval
    records (absolute)."""
    return "/".join(Path(run_dir).parts[-2:])


def heldout_by_run(curve_records: Sequence[Mapping]) -> Dict[str, dict]:
    """Final held-out point of every run with a curve, by run directory, with its record's `data_key`."""
    return {_run_key(e["run_dir"]): {**f, "data": data_key(rec)} for rec in curve_records
            for e in rec["drafters"].values() if e.get("run_dir") and (f := _final(e))}


def paired_rows(ev: Mapping, held: Mapping[str, dict]) -> List[str]:
    """Every ratio of a combined eval record (`bench/eval_drafters.py --ratio`): the held-out E[τ] ratio of
    the same two runs where their curves are recorded on the same held-out split, the eval ratio with its
    paired interval, and the paper's margin where a DSpark run is divided by a DFlash or an Eagle3 run."""
    algo = {n: e.get("algorithm") for n, e in ev["drafters"].items()}
    run = {n: _run_key(e["run_dir"]) for n, e in ev["drafters"].items() if e.get("run_dir")}
    out = list(RATIO_HEADER)
    for pair, r in (ev.get("ratios") or {}).items():
        a, b = pair.split("/")
        fa, fb = (held.get(run.get(x, "")) or {} for x in (a, b))
        ha, hb = fa.get("eval/expected_tau"), fb.get("eval/expected_tau")
        h = ha / hb if ha and hb and fa.get("data") == fb.get("data") else None
        goal = GOALS.get(algo.get(b)) if algo.get(a) == "dspark" else None
        out.append(_ratio_row(f"{a} / {b}", h, r, goal))
    return out


def render_converged(results: Path, label: str = "converge",
                     variant_labels: Sequence[str] = ("converge_L3", "converge_a128", "converge_ctx", "converge_e3engine",
                                                      "converge_r64", "converge_w1emb", "converge_w1emb_markov",
                                                      "converge_w1emb_2k", "converge_2k", "converge_e3engine_2k",
                                                      "converge_data3k_r384", "converge_tinit_last",
                                                      "converge_tinit_first", "converge_data4k_r384", "converge_fnorm",
                                                      "converge_eproj", "converge_eproj_dflash"),
                     data_labels: Sequence[str] = ("converge_data3k", "converge_greedy", "converge_topp",
                                                   "converge_data4k")) -> List[str]:
    cp, ep = results / f"learning_curve-{label}.json", results / f"eval_drafters-{label}.json"
    if not (cp.is_file() and ep.is_file()):
        return []
    curve, ev = json.loads(cp.read_text()), json.loads(ep.read_text())
    a, es = curve.get("args") or {}, ev.get("eval_settings") or {}
    rows, lines = ratio_rows(curve, ev)
    e3 = (curve["drafters"].get("eagle3") or {}).get("overrides") or []
    layout = next((o.split("=", 1)[1] for o in e3 if o.startswith("draft.eagle3_layout=")), "native")
    if "eagle3" in curve["drafters"]:
        lines.append(f"- `eagle3` in these rows is deepspec's `{layout}` Eagle3 layout"
                     + (" (the EAGLE-3 layer of the engines and of DeepSpec's baseline is `draft.eagle3_layout="
                        "engine`; where a run of it is recorded it appears below)" if layout == "native" else ""))
    out = ["## 6. Converged drafters (issue 21)", "",
           f"Records `{cp.relative_to(results.parent.parent)}` ({curve.get('date', '')}) and "
           f"`{ep.relative_to(results.parent.parent)}` ({ev.get('date', '')}); commands in "
           "[bench/README.md](../bench/README.md), analysis in [benchmarks-notes.md](benchmarks-notes.md).", "",
           f"- training: {a.get('steps')} steps (cosine to 0), {a.get('anchors')} anchors per sequence, "
           f"depth {a.get('layers')} for the parallel drafters (Eagle3: 1 layer), one shared cache, held-out "
           "split of the training data (never the eval prompts)",
           f"- eval: {es.get('max_samples')} prompts × {len(es.get('benchmarks') or [])} benchmarks "
           f"({', '.join(es.get('benchmarks') or [])}), {es.get('max_new_tokens')} new tokens, "
           f"temperature {es.get('temperature')}, {' '.join(es.get('extra') or [])}; intervals: bootstrap over "
           "requests (ratios: paired, stratified by benchmark)", "",
           f"![learning curves](../bench/results/learning_curve-{label}.png)", "",
           "### Held-out E[τ] at the end of training", "", *heldout_table(curve), "",
           "### Eval τ and speed", "", *eval_table(ev), "",
           "### The paper's margins on this target", "", *rows, "", *lines, ""]
    variant_recs = load_records(results, [v for v in variant_labels if v not in data_labels])
    variants = find_variants(variant_recs, curve)
    if variants:
        out += ["### One change at a time against the converged run (held-out E[τ], same schedule)", "",
                "Each variant is compared with the drafter of the run above that it changes, at the last step both "
                "reached (a variant stopped early is compared at that step; a variant with a longer schedule at "
                "each run's last step).", "",
                *variant_rows(curve, variants), ""]
    data_recs = [(lab, json.loads(p.read_text())) for lab in data_labels
                 if (p := results / f"learning_curve-{lab}.json").is_file()]
    for lab, rec in data_recs:
        ra = rec.get("args") or {}
        out += [f"### Other training data: `{lab}` ({rec.get('date', '')})", "",
                f"{ra.get('steps')} steps, {ra.get('anchors')} anchors per sequence, depth {ra.get('layers')}, with "
                + ", ".join(f"`{o.replace(str(results.parent.parent) + '/', '')}`" for o in data_key(rec))
                + ". Its held-out split is drawn from its own data, so "
                "its held-out E[τ] compares with the runs above only through the eval prompts (paired rows below).",
                "", *heldout_table(rec), ""]
        on_it = find_variants(variant_recs, rec)
        if on_it:
            out += [f"One change at a time against `{lab}` (its data and held-out split):", "",
                    *variant_rows(rec, on_it), ""]
    vp = results / f"eval_drafters-{label}_variants.json"
    if vp.is_file():
        vev = json.loads(vp.read_text())
        held = heldout_by_run([curve, *variant_recs, *(r for _, r in data_recs)])
        out += ["### The one-change runs in eval, paired with the converged drafters", "",
                f"`{vp.relative_to(results.parent.parent)}` ({vev.get('date', '')}): the same prompts and settings; "
                "held-out ratios from the runs' final held-out evaluations where both runs share a held-out split.",
                "", *paired_rows(vev, held), ""]
    return out
