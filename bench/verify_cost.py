"""What one verification forward costs against one plain decoding step, per target dtype.

The speedup of lossless speculative decoding is τ · c(1) / (draft + c(ℓ+1)) where c(n) is the time of a
KV-cached target forward over n new tokens.  This measures c(n) for n = 1..8 with the target in each
dtype (`TargetAdapter.decode`, the call both the plain loop and the verification make), after a prompt of
``--context`` tokens, the sizes interleaved round-robin so machine load hits them alike, and reports
medians plus the ratios that matter: c(n) / c(1) of the same dtype, and c(n) / c(1) of the fastest dtype
(the honest plain baseline).  Writes `bench/results/verify_cost.{json,md}`.

    .venv/bin/python bench/verify_cost.py                         # SmolLM2-135M, CPU, 1 thread
    .venv/bin/python bench/verify_cost.py --threads 2 --label t2
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.records import write_record  # noqa: E402


def ratios(ms: dict) -> dict:
    """{dtype: {n: ms}} -> per dtype and n: ms, ÷ same-dtype c(1), ÷ the fastest dtype's c(1)."""
    best = min(v[1] for v in ms.values())
    return {d: {n: {"ms": t, "over_own_step": t / v[1], "over_fastest_step": t / best} for n, t in v.items()}
            for d, v in ms.items()}


def markdown(rec: dict) -> str:
    sizes = sorted({int(n) for v in rec["cost"].values() for n in v})
    out = [f"# verify_cost{('-' + rec['label']) if rec.get('label') else ''}", "", f"`{rec['command']}`", "",
           f"{rec['date']}; {rec['machine']['threads']} thread(s), load {rec['machine']['loadavg_start']} → "
           f"{rec['machine']['loadavg_end']}; context {rec['args']['context']} tokens, {rec['args']['reps']} rounds "
           "(median; the first dropped)", "",
           "| dtype | " + " | ".join(f"n={n}" for n in sizes) + " |", "|---|" + "---:|" * len(sizes)]
    for d, v in rec["cost"].items():
        out.append(f"| {d} ms | " + " | ".join(f"{v[str(n)]['ms']:.1f}" for n in sizes) + " |")
        out.append(f"| {d} ÷ own c(1) | " + " | ".join(f"{v[str(n)]['over_own_step']:.2f}" for n in sizes) + " |")
        out.append(f"| {d} ÷ fastest c(1) | " + " | ".join(f"{v[str(n)]['over_fastest_step']:.2f}" for n in sizes) + " |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="reference:smollm2-135m")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--sizes", nargs="+", type=int, default=[1, 2, 3, 4, 6, 8])
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--label", default="")
    args = ap.parse_args(argv)
    if args.reps < 2:
        ap.error("--reps must be >= 2 (the first round is dropped as warm-up)")

    import torch
    torch.set_num_threads(args.threads)
    from deepspec.config import TargetConfig
    from deepspec.targets import load_target

    load0 = list(os.getloadavg())
    targets = {d: load_target(TargetConfig(path=args.target, device="cpu", dtype=d)) for d in args.dtypes}
    g = torch.Generator().manual_seed(0)
    vocab = targets[args.dtypes[0]].vocab_size
    prompt = torch.randint(0, vocab, (1, args.context), generator=g)
    caches = {}
    with torch.inference_mode():
        for d, t in targets.items():
            caches[d] = t.decode(prompt).past_key_values
        times = {d: {n: [] for n in args.sizes} for d in targets}
        for rep in range(args.reps):
            for n in args.sizes:
                x = torch.randint(0, vocab, (1, n), generator=g)
                for d, t in targets.items():          # interleaved: dtypes and sizes share the load
                    t0 = time.perf_counter()
                    t.decode(x, caches[d])
                    times[d][n].append(time.perf_counter() - t0)
                    t.rollback(caches[d], args.context)
    ms = {d: {n: 1e3 * statistics.median(v[1:]) for n, v in per.items()} for d, per in times.items()}
    cost = {d: {str(n): r for n, r in v.items()} for d, v in ratios(ms).items()}
    rec = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "label": args.label,
           "command": " ".join([Path(sys.executable).name, *sys.argv]), "args": vars(args),
           "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                       "cpus": os.cpu_count(), "loadavg_start": [round(x, 2) for x in load0],
                       "loadavg_end": [round(x, 2) for x in os.getloadavg()]},
           "cost": cost}
    md = markdown(rec)
    print(md)
    path = write_record(rec, "verify_cost", label=args.label or None)
    path.with_suffix(".md").write_text(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
