"""Benchmark (not a test): one draft decoded with chain and with tree verification, each against plain decoding.

    OMP_NUM_THREADS=1 .venv/bin/python bench/tree_speed.py --label shipped \
        --settings chain@float32 chain@bfloat16 tree16x4@bfloat16

Each setting is ``KIND@DTYPE``: ``chain`` (verify the γ drafts), ``treeNxW`` (`eval.tree_nodes=N
eval.tree_width=W`) or ``treeNxWlK[mM]`` (the same with prompt lookup, `eval.lookup_ngram=K`,
`eval.lookup_min_ngram=M`, default 1), with the target in DTYPE.  Every setting is one greedy `deepspec eval` of the same
prompts (first turns, ``--max-new-tokens``) in its own process, one after the other (so no two share the
CPU), with its own plain-decoding baseline in the same dtype, request by request.  Reported per setting:
macro τ with its bootstrap interval, the speedup over that baseline, and the per-round split (draft /
verify / overhead ms) beside plain decoding's ms per token.  Speeds of different settings are not divided
by each other: they ran minutes apart, and a shared machine drifts (on the 2-core VM of 2026-12-05 the
same plain bf16 step measured 55–67 ms in consecutive runs).  Which dtype decodes plainly faster is
`bench/verify_cost.py`'s question (sizes and dtypes interleaved).
Paired τ ratios: each tree over the chain of the same dtype.  Outputs go to ``--work/LABEL/SETTING``; a
finished eval with the same config and checkpoint files is reused; ``--no-eval`` decodes nothing and
combines the evals already finished there (each keeps the settings it ran with: its results.json says
which).  Writes `bench/results/tree_speed[-LABEL].{json,md}`.
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
from typing import Any, Dict, List

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.eval_tables import eval_summary, fmt_ci, paired_ratio, read_jsonl, request_table  # noqa: E402
from bench.records import repo_relative, write_record  # noqa: E402
from bench.reference import DOMAIN_BENCHES  # noqa: E402

SETTING = re.compile(r"^(chain|tree(\d+)x(\d+)(?:l(\d+)(?:m(\d+))?)?)@(float32|bfloat16|float16)$")


def parse_setting(s: str) -> Dict[str, Any]:
    m = SETTING.match(s)
    if not m:
        raise SystemExit(f"--settings {s!r}: expected chain@DTYPE, treeNxW@DTYPE, treeNxWlK@DTYPE or "
                         "treeNxWlKmM@DTYPE (DTYPE float32, bfloat16, float16)")
    tree = (int(m.group(2)), int(m.group(3))) if m.group(2) else None
    if tree and min(tree) < 1:
        raise SystemExit(f"--settings {s!r}: tree nodes and width must be ≥ 1")
    lookup = int(m.group(4)) if m.group(4) else 0
    lookup_min = int(m.group(5)) if m.group(5) else 1
    if m.group(4) and not 1 <= lookup_min <= lookup:
        raise SystemExit(f"--settings {s!r}: the lookup n-grams need 1 ≤ M (mM) ≤ K (lK)")
    return {"name": s, "tree": tree, "lookup": lookup, "lookup_min": lookup_min, "dtype": m.group(6)}


def overrides(args, setting: Dict[str, Any], out: Path) -> List[str]:
    ckpt = "null" if args.checkpoint == "none" else args.checkpoint
    ov = [f"target={args.target}", f"target.dtype={setting['dtype']}", f"eval.checkpoint={ckpt}",
          f"eval.data_dir={args.data_dir}", f"eval.benchmarks=[{','.join(args.benchmarks)}]",
          f"eval.max_samples={args.max_samples}", f"eval.max_new_tokens={args.max_new_tokens}",
          "eval.temperature=0", "eval.multi_turn=false", "eval.progress=false",
          f"eval.bootstrap_resamples={args.resamples}", f"eval.out_dir={out}"]
    return ov + setting_overrides(setting) + list(args.extra)


def setting_overrides(setting: Dict[str, Any]) -> List[str]:
    """The eval keys of a setting, every one stated (eval.decoding=auto would fill unset ones)."""
    if not setting["tree"]:
        return ["eval.decoding=chain"]
    return ["eval.decoding=tree", f"eval.tree_nodes={setting['tree'][0]}", f"eval.tree_width={setting['tree'][1]}",
            f"eval.lookup_ngram={setting.get('lookup') or 0}", f"eval.lookup_min_ngram={setting.get('lookup_min', 1)}"]


def run_setting(args, setting: Dict[str, Any], out: Path) -> Dict[str, Any]:
    if args.no_eval:
        if not (out / "results.json").is_file() or not (out / "samples.jsonl").is_file():
            raise SystemExit(f"--no-eval: {out} holds no finished eval of {setting['name']}")
        return json.loads((out / "results.json").read_text())
    cmd = [sys.executable, "-m", "deepspec.cli", "eval", *overrides(args, setting, out)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    print(f"[{setting['name']}] {' '.join(cmd[3:])}", flush=True)
    subprocess.run(cmd, check=True, env=env, cwd=REPO)
    return json.loads((out / "results.json").read_text())


def collect(results: Dict[str, Dict[str, Any]], dirs: Dict[str, Path], settings, resamples: int, seed: int):
    summaries = {n: eval_summary(r) for n, r in results.items()}
    for n, d in dirs.items():     # prompt lookup: the share of accepted tokens only its chain proposed
        rolls = read_jsonl(d / "rollouts.jsonl") if (d / "rollouts.jsonl").is_file() else []
        if any("lookup_accepted" in r for r in rolls):
            acc = sum(r["accepted"] for r in rolls)
            summaries[n]["lookup_share"] = sum(r.get("lookup_accepted", 0) for r in rolls) / acc if acc else 0.0
    tables = {n: request_table(read_jsonl(d / "samples.jsonl")) for n, d in dirs.items()}
    ratios = {}
    for st in settings:
        chain = f"chain@{st['dtype']}"
        if st["tree"] and chain in tables:
            ratios[f"{st['name']} / {chain}"] = paired_ratio(tables[st["name"]], tables[chain], resamples, seed)
    return summaries, ratios


def markdown(rec: Dict[str, Any]) -> str:
    a = rec["args"]
    out = [f"# tree_speed{('-' + rec['label']) if rec.get('label') else ''}", "", f"`{rec['command']}`", "",
           f"{rec['date']}; draft `{a['checkpoint']}`; {len(a['benchmarks'])} benchmarks × {a['max_samples']} prompts "
           f"(first turns), {a['max_new_tokens']} new tokens, greedy, {a['threads']} thread(s); settings run one at a "
           "time, each against plain decoding in its own dtype in the same run (speeds of different runs are not "
           "compared: the machine drifts between them).", "",
           "| setting | macro τ [95% CI] | verified / round | speedup over plain | draft ms | verify ms | overhead ms "
           "| plain ms/token | greedy identical |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for n, s in rec["settings"].items():
        sp, m, g = s["speed"], s["macro"], s.get("greedy_check") or {}
        out.append(f"| {n} | {fmt_ci(m.get('tau'), m.get('tau_ci95'))} | {sp.get('verified_tokens_per_round') or float('nan'):.1f} "
                   f"| {sp['speedup_pooled']:.3f}× | {sp['draft_ms']:.1f} "
                   f"| {sp['verify_ms']:.1f} | {sp['overhead_ms']:.1f} | {sp['plain_decode_ms_per_token']:.1f} "
                   f"| {g.get('matched')}/{g.get('compared')} |")
    shares = {n: s["lookup_share"] for n, s in rec["settings"].items() if s.get("lookup_share") is not None}
    if shares:
        out += ["", "Accepted draft tokens that only the prompt-lookup chain proposed: "
                + ", ".join(f"{n} {v:.1%}" for n, v in shares.items()) + "."]
    if rec["ratios"]:
        out += ["", "| paired τ ratio | macro [95% CI] |", "|---|---|"]
        out += [f"| {k} | {fmt_ci(v['ratio'], v['ratio_ci95'], 3)} |" for k, v in rec["ratios"].items()]
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=str(REPO / "deepspec" / "shipped" / "smollm2-135m-dspark"),
                   help="the draft; none = the draft config's reference drafter (e.g. --extra "
                        "draft.algorithm=no_draft: prompt lookup alone)")
    p.add_argument("--target", default="smollm2_135m", help="the target config group")
    p.add_argument("--settings", nargs="+", default=["chain@float32", "chain@bfloat16", "tree16x4@bfloat16"])
    p.add_argument("--benchmarks", nargs="+", default=DOMAIN_BENCHES)
    p.add_argument("--max-samples", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--data-dir", default=str(REPO.parent / "shared" / "eval_datasets"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--resamples", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--extra", nargs="*", default=[], metavar="KEY=VALUE", help="more eval overrides")
    p.add_argument("--work", default=str(REPO / "bench" / "work" / "tree_speed"))
    p.add_argument("--label", default=None)
    p.add_argument("--no-eval", action="store_true", help="combine the evals finished under --work/LABEL")
    p.add_argument("--out", default=None, help="record path (default: bench/results/tree_speed[-LABEL].json)")
    args = p.parse_args(argv)
    settings = [parse_setting(s) for s in args.settings]
    if len({s["name"] for s in settings}) != len(settings):
        raise SystemExit("--settings: each setting once")
    work = Path(args.work) / (args.label or "default")
    dirs = {s["name"]: work / s["name"].replace("@", "_") for s in settings}
    results = {s["name"]: run_setting(args, s, dirs[s["name"]]) for s in settings}
    summaries, ratios = collect(results, dirs, settings, args.resamples, args.seed)
    rec = {"script": "tree_speed", "label": args.label, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "command": repo_relative(" ".join([Path(sys.executable).name, *sys.argv])),
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
           "args": {k: (repo_relative(v) if isinstance(v, str) else v) for k, v in vars(args).items()},
           "settings": summaries, "ratios": ratios}
    path = write_record(rec, "tree_speed", out=args.out, label=args.label)
    path.with_suffix(".md").write_text(markdown(rec))
    print(markdown(rec))


if __name__ == "__main__":
    main()
