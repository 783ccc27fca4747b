"""Benchmark (not a test): held-out learning curves of several drafters on one shared cache.

    .venv/bin/python bench/learning_curve.py --steps 160 --eval-every 40 --only dspark_markov eagle3

Reuses the regenerated data and cache of a work directory (`bench/workdir.py`: the same data and
target layers for every drafter; ``--prepare`` makes a missing one) and trains each drafter
for ``--steps`` with the trainer's held-out evaluation every ``--eval-every`` steps: expected
τ, per-position acceptance, CE and TV of the draft on the held-out sequences, teacher-forced.
The held-out sequences and their anchors are the same for every drafter (same seed), so the
curves are paired.  Writes `bench/results/learning_curve.{json,md,png}` (`--label L`:
`learning_curve-L.{json,md,png}`).

What it answers: whether the gap between drafters at a small budget is a difference in where
they converge or in how fast they start.

Ablations: ``--variant LABEL=DRAFTER[,override...]`` (repeatable) trains named variants instead of
``--only``, e.g. ``--variant markov_L3=dspark_markov,draft.num_layers=3``.  With ``--prepare`` a
missing work directory is regenerated and cached first (`bench.workdir.prepare`), so one command
reruns an ablation from nothing.

Each held-out point also carries ``train_wall_s``: the training seconds up to that step, the sum of
the trainer's per-step ``step_time_s`` in metrics.jsonl (data loading, forward/backward, optimizer
step) — held-out evaluations, checkpoint saves and start-up are **not** counted.  The PNG plots
held-out E[τ] against steps and against these seconds (and the held-out CE against steps); a record
whose metrics have no step times renders without the seconds panel's lines.

Resuming: nothing here deletes a run directory, and the trainer resumes from the newest complete
checkpoint in it (``train.resume``, on by default).  Each variant checkpoints every ``--save-every``
steps (default ``--eval-every``), so a killed job re-run with the same command continues every
variant from its last checkpoint (metrics.jsonl keeps the rows up to it; later ones are re-run), and a
variant whose final checkpoint exists is not started again (its curve is re-read).  The run directory
is named by the variant's label (or drafter and depth) and ``--steps``: changing a variant's
overrides under the same label resumes the old run, so give a changed variant a new label.
``--no-train`` trains nothing and records every variant's curve as it stands (``finished`` false for a
variant short of ``--steps``): a snapshot of a long job that another process is still running.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.records import header, record_path, write_record  # noqa: E402
from bench.workdir import DRAFTERS, prepare, shared_overrides  # noqa: E402
from deepspec.train.checkpoint import list_checkpoints  # noqa: E402

KEYS = ("eval/expected_tau", "eval/accept_rate/1", "eval/accept_rate/2", "eval/ce", "eval/tv")
WALL_CLOCK = ("train_wall_s: training seconds up to the eval step = the sum of the trainer's step_time_s "
              "(data loading + forward/backward + optimizer step); held-out evals, checkpoint saves and "
              "start-up excluded")


def curve(metrics_path: Path):
    """The held-out eval rows of a run's metrics.jsonl: [{step, train_wall_s, key: value}], by step, with the
    real-loop τ of ``train.decode_eval_*`` (``decode/tau_t0``, ``decode/tau_t1``, ...) where that step has one.

    ``train_wall_s`` accumulates ``step_time_s`` over the training rows up to the eval step (the rows
    of a resumed run are those kept up to its checkpoint plus the re-run ones).  With
    ``train.log_every`` > 1 a logged step's time stands for the unlogged steps since the previous
    logged one.  None where no training row precedes the eval (metrics without step times)."""
    evals, step_s, decode = {}, {}, {}
    for line in Path(metrics_path).read_text().splitlines():
        try:
            d = json.loads(line) if line.strip() else {}
        except json.JSONDecodeError:     # the torn last line of a killed run
            continue
        if "eval/expected_tau" in d:
            evals[int(d["step"])] = {"step": int(d["step"]), **{k: d.get(k) for k in KEYS}}
        elif "step_time_s" in d:
            step_s[int(d["step"])] = float(d["step_time_s"])
        taus = {k: v for k, v in d.items() if k.startswith("decode/tau_")}
        if taus:
            decode[int(d["step"])] = taus
    cum, total, prev = [], 0.0, 0
    for st in sorted(step_s):
        total += step_s[st] * (st - prev)
        prev = st
        cum.append((st, total))
    rows = []
    for st in sorted(evals):
        before = [c for s_, c in cum if s_ <= st]
        rows.append({**evals[st], **decode.get(st, {}), "train_wall_s": before[-1] if before else None})
    return rows


def decode_keys(record) -> list:
    """The real-loop τ keys (``decode/tau_t0`` ...) any variant of a record has, sorted."""
    return sorted({k for d in record["drafters"].values() for r in d["curve"] for k in r if k.startswith("decode/tau_")})


def start_step(checkpoints: Path) -> int:
    """The step a trainer resuming in ``checkpoints`` (``{run_dir}/checkpoints``) starts from: the newest
    complete checkpoint's, 0 when there is none."""
    found = list_checkpoints(checkpoints)
    return found[-1][0] if found else 0


def seconds_per_step(d, steps: int):
    """Training seconds per step of a record's variant: from the last held-out point's ``train_wall_s``,
    else (records before those times) the wall time of the trainer call ÷ steps."""
    last = d["curve"][-1] if d.get("curve") else {}
    if last.get("train_wall_s") is not None and last["step"] > 0:
        return last["train_wall_s"] / last["step"]
    return d["train_s"] / steps if d.get("train_s") else None


def parse_variants(specs, only, layers):
    """[(label, drafter, overrides)] from ``LABEL=DRAFTER[,override...]`` specs, or one per ``--only``
    drafter.  A variant without its own ``draft.num_layers`` gets ``--layers`` (Eagle3 stays at 1)."""
    out = []
    for spec in specs or []:
        label, sep, rest = spec.partition("=")
        parts = rest.split(",") if sep else []
        if not label or not parts or parts[0] not in DRAFTERS:
            raise SystemExit(f"--variant {spec!r}: expected LABEL=DRAFTER[,override...] with DRAFTER one of "
                             f"{sorted(DRAFTERS)}")
        if any("=" not in o for o in parts[1:]):
            raise SystemExit(f"--variant {spec!r}: every override after the drafter must be key=value")
        if label in (v[0] for v in out):
            raise SystemExit(f"--variant {spec!r}: label {label!r} used twice")
        out.append((label, parts[0], parts[1:]))
    if not out:
        out = [(name, name, []) for name in only]
    return [(label, d, ov if d == "eagle3" or any(o.startswith("draft.num_layers=") for o in ov)
             else ov + [f"draft.num_layers={layers}"]) for label, d, ov in out]


def markdown(record) -> str:
    names = list(record["drafters"])
    steps = sorted({r["step"] for d in record["drafters"].values() for r in d["curve"]})
    out = ["| step | " + " | ".join(f"{n} E[τ] (P₁)" for n in names) + " |",
           "|---:|" + "---:|" * len(names)]
    for s in steps:
        cells = []
        for n in names:
            r = next((r for r in record["drafters"][n]["curve"] if r["step"] == s), None)
            cells.append("—" if r is None else f"{r['eval/expected_tau']:.3f} ({r['eval/accept_rate/1']:.3f})")
        out.append(f"| {s} | " + " | ".join(cells) + " |")
    per_step = [seconds_per_step(record["drafters"][n], record["args"]["steps"]) for n in names]
    out.append("| s/step | " + " | ".join("—" if x is None else f"{x:.1f}" for x in per_step) + " |")
    last = [(record["drafters"][n]["curve"] or [{}])[-1].get("train_wall_s") for n in names]
    if any(x is not None for x in last):
        out.append("| train s | " + " | ".join("—" if x is None else f"{x:.0f}" for x in last) + " |")
    keys = decode_keys(record)
    if keys:    # real-loop τ while training: one column group per temperature
        out += ["", "Real-loop τ while training (`train.decode_eval_*`: the lossless loop on held-out prompts):", "",
                "| step | " + " | ".join(f"{n} τ {k.split('_', 1)[1]}" for k in keys for n in names) + " |",
                "|---:|" + "---:|" * (len(keys) * len(names))]
        for s in steps:
            rs = {n: next((r for r in record["drafters"][n]["curve"] if r["step"] == s), {}) for n in names}
            if not any(k in rs[n] for k in keys for n in names):
                continue
            out.append(f"| {s} | " + " | ".join("—" if rs[n].get(k) is None else f"{rs[n][k]:.3f}"
                                                 for k in keys for n in names) + " |")
    return "\n".join(out)


def plot(record, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    timed = False
    for i, (name, d) in enumerate(record["drafters"].items()):
        color = f"C{i % 10}"     # one colour per variant across the panels
        st = [r["step"] for r in d["curve"]]
        axes[0].plot(st, [r["eval/expected_tau"] for r in d["curve"]], marker="o", color=color, label=name)
        for k, style in zip(decode_keys(record), ("--", ":", "-.")):
            pts = [(r["step"], r[k]) for r in d["curve"] if r.get(k) is not None]
            if pts:
                axes[0].plot(*zip(*pts), linestyle=style, marker="x", color=color,
                             label=f"{name}, real-loop τ {k.split('_', 1)[1]}")
        axes[2].plot(st, [r["eval/ce"] for r in d["curve"]], marker="o", color=color, label=name)
        wall = [(r["train_wall_s"], r["eval/expected_tau"]) for r in d["curve"] if r.get("train_wall_s") is not None]
        if wall:
            axes[1].plot(*zip(*wall), marker="o", color=color, label=name)
            timed = True
    axes[0].set(xlabel="training step", ylabel="held-out E[τ] (teacher-forced); real-loop τ (dashed)")
    axes[1].set(xlabel="training seconds (Σ step time; evals excluded)", ylabel="held-out E[τ] (teacher-forced)")
    axes[2].set(xlabel="training step", ylabel="held-out CE (nats)")
    if not timed:
        axes[1].text(0.5, 0.5, "no per-step times in this record", ha="center", va="center",
                     transform=axes[1].transAxes, color="gray")
    for a in axes:
        a.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default=str(REPO / "bench" / "work" / "reference"),
                   help="work directory whose regen and cache are reused")
    p.add_argument("--samples", type=int, default=400, help="must match the work directory's regeneration")
    p.add_argument("--max-new-tokens", type=int, default=96, help="must match the work directory's regeneration")
    p.add_argument("--max-turns", type=int, default=1, help="must match the work directory's regeneration")
    p.add_argument("--anchors", type=int, default=16)
    p.add_argument("--layers", type=int, default=1, help="DSpark/DFlash depth (Eagle3 uses 1)")
    p.add_argument("--steps", type=int, default=160)
    p.add_argument("--eval-every", type=int, default=40)
    p.add_argument("--save-every", type=int, default=None,
                   help="checkpoint every N steps, where a killed run resumes (default: --eval-every; 0: only "
                        "the final checkpoint)")
    p.add_argument("--only", nargs="*", default=["dspark_markov", "eagle3"], choices=sorted(DRAFTERS))
    p.add_argument("--variant", nargs="*", default=[], metavar="LABEL=DRAFTER[,override...]",
                   help="named ablation variants, trained instead of --only")
    p.add_argument("--prepare", action="store_true",
                   help="regenerate and cache the work directory first if its cache is missing")
    p.add_argument("--extra", nargs="*", default=[], help="extra Hydra overrides for every drafter")
    p.add_argument("--label", default=None,
                   help="a separate experiment: bench/results/learning_curve-LABEL.{json,md,png}, runs under "
                        "<work>/curve/LABEL")
    p.add_argument("--no-train", action="store_true",
                   help="only record the curves as they stand (an unfinished variant shows its points so far)")
    p.add_argument("--out", default=None, help="record path (default: bench/results/learning_curve[-LABEL].json)")
    args = p.parse_args(argv)
    args.eval_samples, args.eval_new_tokens = 0, 0      # shared_overrides fields not used here
    out = Path(args.out) if args.out else record_path("learning_curve", args.label)

    from deepspec.config import load_config
    from deepspec.paths import checkpoints_dir
    from deepspec.train.loop import run as run_train
    work = Path(args.work)
    variants = parse_variants(args.variant, args.only, args.layers)
    stages = {}
    if not (work / "cache").is_dir():
        if not args.prepare:
            raise SystemExit(f"{work / 'cache'}: no cache; pass --prepare, or --work with a prepared directory")
        stages, _ = prepare(args, work)
    record = header(args=vars(args), stages=stages, wall_clock=WALL_CLOCK, drafters={})
    save_every = args.eval_every if args.save_every is None else args.save_every
    for label, name, extra in variants:
        if args.variant:        # labels are unique and name the variant's settings
            leaf = f"{label}-{args.steps}"
        else:                   # runs of another depth never resume this one
            leaf = f"{name}{'' if name == 'eagle3' else f'-L{args.layers}'}-{args.steps}"
        run_dir = work / "curve" / (args.label or "") / leaf
        ov = shared_overrides(args) + DRAFTERS[name] + extra + [
            f"run_dir={run_dir}", f"train.eval_every={args.eval_every}", f"train.save_every={save_every or args.steps}"]
        cfg = load_config(ov)
        start = start_step(checkpoints_dir(cfg)) if cfg.train.resume else 0
        # train_s: this invocation's trainer call (start-up, evals and saves included; 0 when already done)
        train_s = 0.0
        if start < args.steps and args.no_train:
            print(f"{label}: unfinished (checkpoint step {start} of {args.steps}); recording its curve so far")
        elif start < args.steps:      # the trainer resumes from `start`; a finished variant is not started
            t = time.perf_counter()
            run_train(cfg)
            train_s = time.perf_counter() - t
        else:
            print(f"{label}: finished earlier (checkpoint step {start} in {run_dir}); re-reading its curve")
        record["drafters"][label] = {"drafter": name, "overrides": extra, "run_dir": str(run_dir),
                                     "resumed_from_step": start, "train_s": train_s,
                                     "finished": start >= args.steps or not args.no_train,
                                     "load_avg_after": os.getloadavg(), "curve": curve(run_dir / "metrics.jsonl")}
    md = markdown(record)
    write_record(record, "learning_curve", str(out), markdown=md)
    plot(record, out.with_suffix(".png"))
    print(md)
    print(f"wrote {out} and its .md, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
