"""The markdown of a `bench/decoding_table.py` record (one table for every drafter and transformers' rows).

    .venv/bin/python -m bench.table_markdown bench/results/decoding_table-LABEL.json   # re-renders its .md
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

from bench.eval_tables import fmt_ci

__all__ = ["markdown"]


def _f(x, nd: int = 2) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def _identical(r: Mapping[str, Any]) -> str:
    if r["temperature"] != 0:
        return "n/a (sampled)"
    g = r.get("greedy_check") if r["kind"] == "deepspec" else r.get("identical")
    return f"{g['matched']}/{g['compared']}" if g else "–"


def decode_speedup(speed: Mapping[str, Any]) -> Optional[float]:
    """Plain decoding's ms per token after the first ÷ speculative decoding's: the speedup once the prompt is
    read (the prefill, the same work for both, is left out), which is what a long answer approaches."""
    plain, spec = speed.get("plain_decode_ms_per_token"), speed.get("spec_decode_ms_per_token")
    return plain / spec if plain and spec else None


def _row(name: str, r: Mapping[str, Any], fastest: Dict[str, float], hf_plain: Dict[str, float]) -> str:
    T = f"{r['temperature']:g}"
    if r["kind"] == "deepspec":
        sp = r["speed"]
        tps, own = sp.get("spec_tokens_per_s"), sp.get("speedup_pooled")
        decode = decode_speedup(sp)
        split = f"{_f(sp.get('draft_ms'), 1)} | {_f(sp.get('verify_ms'), 1)} | {_f(sp.get('overhead_ms'), 1)}"
        what = r.get("policy") or r["setting"]
    else:
        tps = r["tokens_per_s"]
        own = tps / hf_plain[T] if hf_plain.get(T) else None
        decode, split, what = None, "– | – | –", "transformers generate"
    over = tps / fastest[T] if tps and fastest.get(T) else None
    return (f"| {name} | {what} | {T} | {r['dtype']} | {fmt_ci(r.get('tau'), r.get('tau_ci95'))} | {_f(own, 3)}× | "
            f"{_f(over, 3)}× | {_f(decode, 3)}{'×' if decode else ''} | {split} | {_identical(r)} |")


def markdown(rec: Mapping[str, Any]) -> str:
    a = rec["args"]
    fastest = rec["fastest_plain_tokens_per_s"]
    hf_plain = {f"{r['temperature']:g}": r["tokens_per_s"] for r in rec["rows"].values() if r.get("plain")}
    out = [f"# decoding_table{('-' + rec['label']) if rec.get('label') else ''}", "", f"`{rec['command']}`", "",
           f"{rec['date']}; {len(a['benchmarks'])} benchmarks × {a['max_samples']} prompts (first turns), "
           f"{a['max_new_tokens']} new tokens, {a['threads']} thread(s), evals one at a time; load at the end "
           f"{rec['machine']['loadavg_end']}.  Speedup: over the plain decoding of the same row's run (same dtype and "
           "temperature; transformers' rows: over transformers' plain generate) and over the fastest plain decoding "
           "measured in this run at that temperature (" + ", ".join(f"T={k}: {v:.1f} tokens/s" for k, v in fastest.items())
           + "); after the first token: the same row's speedup over its own plain decoding once the prompt is read "
           "(ms per token after the first; the prefill, the same work for both, left out).  Identical: greedy "
           "outputs equal to plain decoding in the same dtype, request for request.", "",
           "| row | decoding | T | dtype | macro τ [95% CI] | speedup over own plain | over the fastest plain | "
           "after the first token | draft ms | verify ms | overhead ms | identical |",
           "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    out += [_row(n, r, fastest, hf_plain) for n, r in rec["rows"].items()]
    if rec.get("notes"):
        out += ["", "Notes:", *(f"- {n}" for n in rec["notes"])]
    out += ["", f"Assisted generation: {rec['assisted_generation'] or 'run (rows above)'}."]
    if rec.get("tuning"):
        out += ["", "Chosen on the tuning prompts (speedup over own plain decoding):"]
        for k, v in rec["tuning"].items():
            got = [f"{c} {_f(x['speedup'], 3)}×" if "speedup" in x else f"{c}: {_f(x['tokens_per_s'], 1)} tokens/s"
                   for c, x in v["candidates"].items()]
            out.append(f"- {k}: {v['chosen']} ({', '.join(got)})")
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    """Re-render the markdown beside each record named (after a change of this file)."""
    for arg in (sys.argv[1:] if argv is None else argv):
        path = Path(arg)
        rec = json.loads(path.read_text())
        if rec.get("script") != "decoding_table":
            raise SystemExit(f"{path}: not a decoding_table record (script={rec.get('script')!r})")
        path.with_suffix(".md").write_text(markdown(rec))
        print(f"wrote {path.with_suffix('.md')}")


if __name__ == "__main__":
    main()
