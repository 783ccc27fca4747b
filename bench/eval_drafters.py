"""Benchmark (not a test): trained drafters evaluated side by side with `deepspec eval`, and paired τ ratios.

    OMP_NUM_THREADS=1 .venv/bin/python bench/eval_drafters.py --curve bench/results/learning_curve-diag.json \
        bench/results/learning_curve-diag2.json --only dspark eagle3 dflash --jobs 2 \
        --ratio dspark/eagle3 dspark/dflash --label diag

Drafters come from `bench/learning_curve.py` records (``--curve``: every variant's ``run_dir``) and/or
``--run LABEL=RUN_DIR``.  Each is evaluated at the final (newest complete) checkpoint of its run
directory (``RUN_DIR/checkpoints/step_N``, what `deepspec.train.loop.run` returns; a checkpoint directory
given instead is taken as it is) with the run's own resolved config (``RUN_DIR/run.yaml``, else the
checkpoint's copy: same target, draft and γ) plus the eval
settings here, by the project's evaluator (`deepspec.eval.runner.run`) in its own subprocess
(``--threads`` torch/OpenMP threads, default 1; up to ``--jobs`` at once).  Outputs go to
``--work/eval/LABEL``; the evaluator reuses a directory whose results.json was written for the same
config, checkpoint files and prompts, so a killed run re-run with the same command only decodes the
evals that had not finished (``--rerun`` decodes every one again).

Collected per drafter (from each results.json): τ (acceptance length, bonus token included) per
benchmark with its 95% bootstrap interval over requests, the macro τ (mean over benchmarks) and its
stratified interval, conditional acceptance by position, the speedup over plain decoding (pooled, and
the macro with its interval) and the per-round split (draft / verify / overhead ms) next to plain
decoding's ms per token measured in the same run.

``--ratio A/B``: macro τ of A ÷ macro τ of B with a 95% **paired** bootstrap interval.  Both evals
decode the same prompts, so each resample draws one set of request indices per benchmark (stratified
by benchmark, seeded from (``--seed``, benchmark) as the evaluator's own intervals are) and applies it
to A's and B's per-request totals (samples.jsonl) alike; the ratio of the two macro means is taken per
resample.  Under greedy decoding both evals decode the target's own greedy text, so the requests (turns
of mt-bench included) are the same; sampled evals are paired by prompt only.

The record keeps each eval's per-request totals (``request_totals``), so ``--from-record RECORD.json:NAME``
brings a drafter of an earlier record into this one, ratios included, without its eval directory: its eval
settings must equal this run's (same prompts, budget, temperature, seed and extra overrides), else the
script stops naming the setting that differs.

``--no-eval`` decodes nothing and combines evals that finished earlier under ``--work/eval/LABEL`` (for
instance one invocation per drafter, started as each training run finished) into one record with the
ratios; each eval keeps the settings it ran with (its results.json and eval_drafters.yaml say which).

``--confidence NAME=EVAL_DIR …`` decodes no draft: it takes finished greedy first-turn evals of the same
prompts and target (e.g. those under ``--work/eval/``), decodes the prompts once more with the target
alone (``--paths`` keeps that greedy path for later analyses) and reports how confident the target is
along its own output (share of tokens per bin of its top-1 probability) and how often each drafter's
position passes per bin, at position 1 and over all positions, with the position-1 misses that propose
the anchor token again or skip one token.

Writes `bench/results/eval_drafters.{json,md}` (``--label L``: `eval_drafters-L.{json,md}`), with
``--confidence`` `bench/results/target_confidence[-L].{json,md}`; the numbers and tables are
`bench/eval_tables.py`'s.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.eval_tables import (acceptance, bin_names, cached_paths, confidence_markdown, eval_settings,  # noqa: E402
                               eval_summary, fmt_ci, greedy_paths, markdown, paired_ratio, read_jsonl, read_rounds,
                               request_table, target_shares, totals_from_json, totals_to_json)
from bench.records import header, relative_paths, repo_relative, write_record  # noqa: E402
from bench.workdir import DOMAIN_BENCHES  # noqa: E402
from deepspec.train.checkpoint import CheckpointError, is_complete, latest_checkpoint, run_config_path  # noqa: E402

LABEL_RE = re.compile(r"[A-Za-z0-9_.-]+")


# -- which drafters, which checkpoints ------------------------------------------------------------------

def resolve_path(path: str, bases: Sequence[Path]) -> Path:
    """``path`` itself when absolute, else the first of ``base / path`` that exists (else the first)."""
    p = Path(path)
    if p.is_absolute():
        return p
    for b in bases:
        if (Path(b) / p).exists():
            return Path(b) / p
    return Path(bases[0]) / p


def final_checkpoint(run_dir: Path) -> Tuple[Path, int]:
    """(checkpoint directory, its step) of a run: the newest complete ``run_dir/checkpoints/step_N``; a
    complete checkpoint directory given instead of a run directory is itself, and so is a weights-only
    ``step_N`` directory (``config.json`` + ``run.yaml``, no training state: a converted checkpoint such as
    `bench/deepspec_quality.py` writes), named explicitly."""
    run_dir = Path(run_dir)
    m = re.fullmatch(r"step_(\d+)", run_dir.name)
    if m and not is_complete(run_dir) and (run_dir / "config.json").is_file() and (run_dir / "run.yaml").is_file():
        return run_dir, int(m.group(1))
    ck = run_dir if is_complete(run_dir) else latest_checkpoint(run_dir / "checkpoints")
    if ck is None:
        raise SystemExit(f"{run_dir}: no complete checkpoint (checkpoints/step_N with training_state/meta.json; "
                         "a weights-only checkpoint is named by its step_N directory)")
    return ck, int(json.loads((ck / "training_state" / "meta.json").read_text())["step"])


def curve_drafters(curve: Path) -> Dict[str, Dict[str, Any]]:
    """``{label: {drafter, overrides, run_dir, curve}}`` of a `bench/learning_curve.py` record; relative run
    directories are found from the working directory or the checkout the record sits in."""
    curve = Path(curve)
    record = json.loads(curve.read_text())
    bases = [Path.cwd(), curve.resolve().parents[2], REPO]
    return {label: {"drafter": d.get("drafter"), "overrides": d.get("overrides", []), "curve": str(curve),
                    "run_dir": resolve_path(d["run_dir"], bases)} for label, d in record["drafters"].items()}


def select_drafters(curves: Sequence[str], runs: Sequence[str], only: Sequence[str]) -> Dict[str, Dict[str, Any]]:
    """Every drafter to evaluate, by label: those of the ``--curve`` records, then the ``--run`` entries."""
    out: Dict[str, Dict[str, Any]] = {}

    def add(label, entry):
        if not LABEL_RE.fullmatch(label):
            raise SystemExit(f"drafter label {label!r}: use letters, digits, '_', '.', '-'")
        if label in out:
            raise SystemExit(f"drafter label {label!r} given twice (in {out[label].get('curve') or '--run'} and "
                             f"{entry.get('curve') or '--run'}); pick with --only or pass --run NEW=RUN_DIR")
        out[label] = entry
    for c in curves:
        for label, e in curve_drafters(Path(c)).items():
            if not only or label in only:
                add(label, e)
    for spec in runs:
        label, sep, path = spec.partition("=")
        if not sep or not path:
            raise SystemExit(f"--run {spec!r}: expected LABEL=RUN_DIR")
        add(label, {"drafter": None, "overrides": [], "curve": None, "run_dir": resolve_path(path, [Path.cwd()])})
    missing = [x for x in only if x not in out]
    if missing:
        raise SystemExit(f"--only {missing}: not among the drafters {sorted(out)}")
    if not out:
        raise SystemExit("no drafters: pass --curve RECORD and/or --run LABEL=RUN_DIR")
    return out


def eval_config(run_yaml: Path, checkpoint: Path, out_dir: Path, overrides: Sequence[str]):
    """The training run's resolved config with ``eval.checkpoint``, ``eval.out_dir`` and the overrides."""
    from deepspec.config import config_from_yaml, with_overrides
    cfg = config_from_yaml(run_yaml)
    return with_overrides(cfg, [f"eval.checkpoint={checkpoint}", f"eval.out_dir={out_dir}", "eval.progress=false",
                                "eval.decoding=chain", *overrides])


# -- the evals, each in its own process ---------------------------------------------------------------

def worker(config_yaml: str, threads: int) -> int:
    """Subprocess body: one `deepspec eval` of a saved config."""
    import logging
    import torch
    from deepspec.config import config_from_yaml
    from deepspec.eval.runner import run
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(threads)
    run(config_from_yaml(config_yaml))
    return 0


def run_eval(job: Dict[str, Any], threads: int) -> Dict[str, Any]:
    """Run one eval subprocess; ({reused, eval_s, returncode, load_avg_after})."""
    out = Path(job["eval_dir"])
    res = out / "results.json"
    before = res.stat().st_mtime_ns if res.is_file() else None
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false"}
    t = time.perf_counter()
    with open(out / "eval_drafters.log", "a") as log:
        log.write(f"\n== {dt.datetime.now().isoformat(timespec='seconds')} {job['label']}\n")
        log.flush()
        rc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", job["config"],
                             "--threads", str(threads)], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    after = res.stat().st_mtime_ns if res.is_file() else None
    return {"returncode": rc, "eval_s": time.perf_counter() - t, "reused": rc == 0 and before is not None
            and before == after, "load_avg_after": os.getloadavg()}


# -- the command ----------------------------------------------------------------------------------------

def parse_ratios(specs: Sequence[str], labels: Sequence[str]) -> List[Tuple[str, str]]:
    out = []
    for spec in specs:
        a, sep, b = spec.partition("/")
        if not sep or a not in labels or b not in labels or a == b:
            raise SystemExit(f"--ratio {spec!r}: expected A/B with two different drafters among {sorted(labels)}")
        out.append((a, b))
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--curve", nargs="+", action="extend", default=[], metavar="RECORD",
                   help="bench/learning_curve.py records whose drafters (run_dir) are evaluated")
    p.add_argument("--run", nargs="+", action="extend", default=[], metavar="LABEL=RUN_DIR",
                   help="more drafters: a training run directory (or one of its checkpoints)")
    p.add_argument("--only", nargs="+", default=[], metavar="LABEL", help="evaluate only these labels of the records")
    p.add_argument("--ratio", nargs="+", default=[], metavar="A/B", help="paired macro-τ ratios to report")
    p.add_argument("--benchmarks", nargs="+", default=DOMAIN_BENCHES)
    p.add_argument("--max-samples", type=int, default=20, help="prompts per benchmark")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (requests paired exactly)")
    p.add_argument("--multi-turn", action=argparse.BooleanOptionalAction, default=True,
                   help="every turn of mt-bench (default) or the first only")
    p.add_argument("--data-dir", default=str(REPO.parent / "shared" / "eval_datasets"))
    p.add_argument("--extra", nargs="*", default=[], metavar="KEY=VALUE", help="more config overrides (eval.gamma=4)")
    p.add_argument("--jobs", type=int, default=1, help="evals at once, each its own process")
    p.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads per eval")
    p.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples (the evals' and the ratios')")
    p.add_argument("--seed", type=int, default=0, help="eval.seed and the ratios' bootstrap seed")
    p.add_argument("--rerun", action="store_true", help="decode again even where a finished eval matches")
    p.add_argument("--work", default=None, help="evals go to WORK/eval/LABEL (default bench/work/eval_drafters[-LABEL])")
    p.add_argument("--label", default=None, help="record as bench/results/eval_drafters-LABEL.{json,md}")
    p.add_argument("--no-eval", action="store_true",
                   help="decode nothing: combine the finished evals under --work/eval/LABEL (each with the settings "
                        "it ran with, e.g. from separate invocations) into one record with the ratios")
    p.add_argument("--confidence", nargs="+", default=None, metavar="NAME=EVAL_DIR",
                   help="decode nothing: analyse these finished greedy first-turn evals of the same prompts and "
                        "target against the target's confidence (record target_confidence[-LABEL].{json,md})")
    p.add_argument("--paths", default=None, metavar="JSON",
                   help="with --confidence: keep the target's greedy paths here (read when written for the same "
                        "target and prompts, else decoded and written)")
    p.add_argument("--from-record", nargs="+", action="extend", default=[], metavar="RECORD.json:NAME",
                   help="a drafter of an earlier eval_drafters record (its results and per-request totals) in "
                        "this record and its ratios, decoded by nobody here; same eval settings required")
    p.add_argument("--out", default=None, help="record path (default: bench/results/eval_drafters[-LABEL].json)")
    p.add_argument("--note", action="append", default=[], metavar="TEXT",
                   help="a line of the record's notes (e.g. what was sized down and why); repeatable")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p


def eval_jobs(args, drafters: Dict[str, Dict[str, Any]], work: Path) -> List[Dict[str, str]]:
    """One eval job per drafter at its final checkpoint: its config written to ``work/eval/LABEL`` (unless
    ``--no-eval``), the drafter's entry completed with its checkpoint, step and eval directory."""
    from deepspec.config import to_yaml
    settings_overrides = [f"eval.benchmarks=[{','.join(args.benchmarks)}]", f"eval.max_samples={args.max_samples}",
                          f"eval.max_new_tokens={args.max_new_tokens}", f"eval.temperature={args.temperature}",
                          f"eval.multi_turn={str(args.multi_turn).lower()}",
                          f"eval.data_dir={Path(args.data_dir).resolve()}",
                          f"eval.bootstrap_resamples={args.resamples}", f"eval.seed={args.seed}",
                          f"eval.rerun={str(args.rerun).lower()}", *args.extra]
    jobs = []
    for label, d in drafters.items():
        ck, step = final_checkpoint(d["run_dir"])
        eval_out = (work / "eval" / label).resolve()
        try:
            cfg = eval_config(run_config_path(d["run_dir"], ck), ck.resolve(), eval_out, settings_overrides)
        except CheckpointError as e:
            raise SystemExit(str(e)) from None
        if not args.no_eval:
            eval_out.mkdir(parents=True, exist_ok=True)
            (eval_out / "eval_drafters.yaml").write_text(to_yaml(cfg))
        d.update(run_dir=str(d["run_dir"]), checkpoint=str(ck), checkpoint_step=step,
                 train_max_steps=cfg.train.max_steps, algorithm=cfg.draft.algorithm, eval_dir=str(eval_out))
        if step < cfg.train.max_steps:
            print(f"{label}: newest checkpoint is step {step} of {cfg.train.max_steps} (training not finished)")
        jobs.append({"label": label, "eval_dir": str(eval_out), "config": str(eval_out / "eval_drafters.yaml")})
    return jobs


def collect(args, job: Dict[str, str], d: Dict[str, Any]) -> None:
    """Run (or, with ``--no-eval``, find) one drafter's eval and put its summary or error into ``d``."""
    if args.no_eval:   # what an earlier invocation decoded, as it is
        done = (Path(job["eval_dir"]) / "results.json").is_file()
        r = {"returncode": 0 if done else 1, "reused": True, "eval_s": 0.0}
    else:
        r = run_eval(job, args.threads)
    d.update({k: v for k, v in r.items() if k != "returncode"})
    res = Path(job["eval_dir"]) / "results.json"
    if r["returncode"] != 0 or not res.is_file():
        d["error"] = f"eval exited with {r['returncode']}; see {Path(job['eval_dir']) / 'eval_drafters.log'}"
        print(f"{job['label']}: {d['error']}", flush=True)
        return
    d["result"] = eval_summary(json.loads(res.read_text()))
    d["request_totals"] = totals_to_json(request_table(read_jsonl(Path(job["eval_dir"]) / "samples.jsonl")))
    m = d["result"].get("macro") or {}
    print(f"{job['label']}: {'reused' if r['reused'] else 'evaluated'} in {r['eval_s']:.0f} s, macro τ "
          f"{fmt_ci(m.get('tau'), m.get('tau_ci95'), 3)}", flush=True)


def ratios(drafters: Dict[str, Dict[str, Any]], pairs, resamples: int, seed: int) -> Dict[str, Any]:
    out = {}
    for a, b in pairs:
        key = f"{a}/{b}"
        if not (drafters[a].get("result") and drafters[b].get("result")):
            out[key] = {"error": "an eval failed"}
            continue
        try:
            ta, tb = request_tables(drafters[a], a), request_tables(drafters[b], b)
            out[key] = paired_ratio(ta, tb, resamples, seed)
        except ValueError as e:
            out[key] = {"error": str(e)}
    return out


def request_tables(d: Dict[str, Any], label: str):
    """A drafter's per-request totals, as `collect` (or, with ``--from-record``, an earlier record) kept them."""
    if not d.get("request_totals"):
        raise ValueError(f"{label}: no per-request totals (its eval wrote no samples.jsonl, or its record kept none)")
    return totals_from_json(d["request_totals"])


# what must be equal for two evals' requests to pair (the bootstrap's resample count does not change them)
PAIRING_SETTINGS = ("benchmarks", "max_samples", "max_new_tokens", "temperature", "multi_turn", "data_dir", "seed",
                    "extra")


def imported_drafters(specs: Sequence[str], settings: Dict[str, Any], taken: Sequence[str]) -> Dict[str, Dict[str, Any]]:
    """``--from-record RECORD.json:NAME``: drafters of earlier records, with their results and totals."""
    out: Dict[str, Dict[str, Any]] = {}
    for spec in specs:
        path, sep, name = spec.rpartition(":")
        if not sep or not path or not name:
            raise SystemExit(f"--from-record {spec!r}: expected RECORD.json:NAME")
        rec_path = resolve_path(path, [Path.cwd(), REPO])
        try:
            rec = json.loads(rec_path.read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"--from-record {spec!r}: cannot read {rec_path}: {e}") from None
        d = (rec.get("drafters") or {}).get(name)
        if d is None:
            raise SystemExit(f"--from-record {spec!r}: {rec_path} has no drafter {name!r} "
                             f"(it has {sorted(rec.get('drafters') or {})})")
        if not d.get("request_totals"):
            raise SystemExit(f"--from-record {spec!r}: {rec_path} kept no per-request totals for {name!r} "
                             "(records written before they were kept); evaluate it again")
        theirs = rec.get("eval_settings") or {}
        for key in PAIRING_SETTINGS:     # as records write them: absolute paths cut (`relative_paths`)
            if relative_paths(theirs.get(key)) != relative_paths(settings.get(key)):
                raise SystemExit(f"--from-record {spec!r}: eval_settings.{key} is {theirs.get(key)!r} there and "
                                 f"{settings.get(key)!r} here; the requests would not pair")
        if name in out or name in taken:
            raise SystemExit(f"--from-record {spec!r}: a drafter named {name!r} is already in this record")
        out[name] = {**d, "from_record": repo_relative(str(rec_path)), "eval_dir": None, "reused": True,
                     "eval_s": 0.0}
    return out


def confidence(args) -> int:
    """``--confidence``: the finished greedy evals against the target's confidence along its greedy path."""
    evals, key, cfg = {}, None, None
    for spec in args.confidence:
        name, sep, d = spec.partition("=")
        if not sep or not name or not d:
            raise SystemExit(f"--confidence {spec!r}: expected NAME=EVAL_DIR")
        c, k = eval_settings(Path(d))
        if key is not None and k != key:
            raise SystemExit(f"--confidence {name}: its target or prompts {k} differ from the first eval's {key}")
        cfg, key = cfg or c, key or k
        evals[name] = (Path(d), read_rounds(Path(d) / "rollouts.jsonl"))
    paths, bench_of = cached_paths(Path(args.paths), cfg, key) if args.paths else greedy_paths(cfg)
    record = header(settings={"target": key[0], "dtype": key[1], "benchmarks": list(key[3]), "max_samples": key[4],
                              "max_new_tokens": key[5]},
                    bins=bin_names(), target=target_shares(paths, bench_of),
                    drafters={n: {"eval_dir": str(d.resolve()), **acceptance(rs, paths)} for n, (d, rs) in evals.items()})
    record["command"] = repo_relative(record["command"])
    md = confidence_markdown(record)
    print(md)
    write_record(record, "target_confidence", args.out, args.label, markdown=md)
    return 0


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.worker:
        return worker(args.worker, args.threads)
    if args.confidence:
        return confidence(args)
    work = Path(args.work or REPO / "bench" / "work" / f"eval_drafters{'-' + args.label if args.label else ''}")
    drafters = select_drafters(args.curve, args.run, args.only) if (args.curve or args.run or not args.from_record) else {}
    settings = {"benchmarks": list(args.benchmarks), "max_samples": args.max_samples,
                "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                "multi_turn": args.multi_turn, "data_dir": str(Path(args.data_dir).resolve()),
                "bootstrap_resamples": args.resamples, "seed": args.seed, "extra": list(args.extra)}
    imported = imported_drafters(args.from_record, settings, list(drafters))
    jobs = eval_jobs(args, drafters, work)
    drafters.update(imported)
    pairs = parse_ratios(args.ratio, list(drafters))
    import torch  # noqa: F401  (loaded, so header() records its version and threads)
    record = header(label=args.label, args=vars(args), jobs=args.jobs, threads=args.threads,
                    eval_settings=settings, drafters=drafters, notes=list(args.note))
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        list(pool.map(lambda job: collect(args, job, drafters[job["label"]]), jobs))
    record["machine"]["loadavg_end"] = list(os.getloadavg())
    record["ratios"] = ratios(drafters, pairs, args.resamples, args.seed)
    md = markdown(record)
    print(md)
    write_record(record, "eval_drafters", args.out, args.label, markdown=md)
    return 0 if all(d.get("result") for d in drafters.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
