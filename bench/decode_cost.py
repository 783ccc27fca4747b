"""Benchmark (not a test): what a decoding round costs on this machine, in five modes.

    OMP_NUM_THREADS=1 .venv/bin/python bench/decode_cost.py verify --reps 15
    .venv/bin/python bench/decode_cost.py latency
    .venv/bin/python bench/decode_cost.py batched --rollouts eval/rollouts.jsonl --calibration calibration.json
    .venv/bin/python bench/decode_cost.py schedule [--rollouts eval/rollouts.jsonl] [--target tiny:llama]
    OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python bench/decode_cost.py row-invariant --reps 9

Modes, each with its record under `bench/results/`:

- ``verify`` (`verify_cost[-LABEL].{json,md}`): c(n), one KV-cached target forward over n new tokens (a
  verification; `TargetAdapter.decode`, the call of both the plain loop and the verification) after a
  prompt of ``--context`` tokens, per target dtype, sizes and dtypes interleaved round-robin so machine
  load hits them alike: medians, c(n) / c(1) of the same dtype and c(n) / c(1) of the fastest dtype (the
  honest plain baseline).  The speedup of lossless speculative decoding is τ · c(1) / (draft + c(ℓ+1)).
- ``latency`` (`eval_latency.json`): the eval loop's per-round split (draft, verify, overhead ms) next to
  plain decoding's ms per token of the same run, per drafter (random init: timings do not depend on what
  a draft learned, except through τ), prompts interleaved between the two loops.
- ``batched`` (`verify_batched.{json,md}`, `.sps.json`, `.sps_grid.json`): real batched verification
  forwards on this machine against the serving simulator's prediction, per policy and concurrency R, on
  the same replay of logged rollouts (`bench/schedule_replay.py`).
- ``schedule`` (`schedule_gain[-LABEL].{json,md}`, `.sps.json`, `.pareto-<table>.png`): simulated goodput
  of the prefix scheduler against fixed-length verification and static thresholds, per SPS table (one
  profiled here, and a synthetic GPU-like one) and R; logged rollouts, else synthetic ones.
- ``row-invariant`` (`row_invariant_cost[-LABEL].{json,md}`): what `eval.row_invariant` costs, batched
  against row-invariant verification forwards (a chain, a tree, one step) interleaved, median CPU ms, and
  whether the rows have the one-token steps' bits (`bench/row_invariant_timing.py`).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.records import header, part_path, record_path, write_record  # noqa: E402

PROMPTS = ["Explain how a hash table works, with an example in Python.",
           "What is 17 times 23? Show your steps.",
           "Write a short poem about the sea."]


# -- verify: c(n) per dtype -------------------------------------------------------------------------------

def ratios(ms: dict) -> dict:
    """{dtype: {n: ms}} -> per dtype and n: ms, ÷ same-dtype c(1), ÷ the fastest dtype's c(1)."""
    best = min(v[1] for v in ms.values())
    return {d: {n: {"ms": t, "over_own_step": t / v[1], "over_fastest_step": t / best} for n, t in v.items()}
            for d, v in ms.items()}


def verify_markdown(rec: dict) -> str:
    sizes = sorted({int(n) for v in rec["cost"].values() for n in v})
    m = rec["machine"]
    out = [f"# verify_cost{('-' + rec['label']) if rec.get('label') else ''}", "", f"`{rec['command']}`", "",
           f"{rec['date']}; {m['threads']} thread(s), load {m['loadavg_start']} → {m['loadavg_end']}; context "
           f"{rec['args']['context']} tokens, {rec['args']['reps']} rounds (median; the first dropped)", "",
           "| dtype | " + " | ".join(f"n={n}" for n in sizes) + " |", "|---|" + "---:|" * len(sizes)]
    for d, v in rec["cost"].items():
        for key, title, nd in (("ms", "ms", 1), ("over_own_step", "÷ own c(1)", 2),
                               ("over_fastest_step", "÷ fastest c(1)", 2)):
            out.append(f"| {d} {title} | " + " | ".join(f"{v[str(n)][key]:.{nd}f}" for n in sizes) + " |")
    return "\n".join(out) + "\n"


def verify(args) -> int:
    import torch
    from deepspec.config import TargetConfig
    from deepspec.targets import load_target
    torch.set_num_threads(args.threads)
    rec = header(label=args.label, args=vars(args))
    targets = {d: load_target(TargetConfig(path=args.target, device="cpu", dtype=d)) for d in args.dtypes}
    g = torch.Generator().manual_seed(0)
    vocab = targets[args.dtypes[0]].vocab_size
    prompt = torch.randint(0, vocab, (1, args.context), generator=g)
    times = {d: {n: [] for n in args.sizes} for d in targets}
    with torch.inference_mode():
        caches = {d: t.decode(prompt).past_key_values for d, t in targets.items()}
        for _ in range(args.reps):
            for n in args.sizes:
                x = torch.randint(0, vocab, (1, n), generator=g)
                for d, t in targets.items():          # interleaved: dtypes and sizes share the load
                    t0 = time.perf_counter()
                    t.decode(x, caches[d])
                    times[d][n].append(time.perf_counter() - t0)
                    t.rollback(caches[d], args.context)
    ms = {d: {n: 1e3 * statistics.median(v[1:]) for n, v in per.items()} for d, per in times.items()}
    rec["cost"] = {d: {str(n): r for n, r in v.items()} for d, v in ratios(ms).items()}
    rec["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    md = verify_markdown(rec)
    print(md)
    write_record(rec, "verify_cost", args.out, args.label or None, markdown=md)
    return 0


# -- latency: the eval loop's per-round split -------------------------------------------------------------

def split(specs, bases) -> dict:
    """Per-round draft / verify / overhead ms of speculative runs ``specs`` and the plain ms per token of
    ``bases`` (the same prompts)."""
    rounds = [r for s in specs for r in s.rounds]
    n = max(len(rounds), 1)
    d, v, o = (1e3 * sum(getattr(r, k) for r in rounds) / n for k in ("t_draft", "t_verify", "t_overhead"))
    steps = sum(b.num_tokens - 1 for b in bases)
    plain = 1e3 * sum(b.t_total - b.t_prefill for b in bases) / max(steps, 1)
    return {"rounds": len(rounds), "tau": sum(r.accepted + 1 for r in rounds) / n, "draft_ms": d, "verify_ms": v,
            "overhead_ms": o, "round_ms": d + v + o, "overhead_fraction": o / (d + v + o),
            "plain_decode_ms_per_token": plain, "verify_over_plain_decode": v / plain,
            "draft_over_plain_decode": d / plain,
            "greedy_equal": all(s.tokens == b.tokens for s, b in zip(specs, bases))}


def latency(args) -> int:
    import torch
    from deepspec.config import load_config
    from deepspec.drafts.registry import build_drafter
    from deepspec.decoding.warp import make_warp
    from deepspec.decoding.chain import speculative_generate
    from deepspec.decoding.loop import target_generate
    from deepspec.targets import load_target
    from deepspec.targets.chat import encode_prompt
    if args.threads:
        torch.set_num_threads(args.threads)
    rec = header(args=vars(args), drafters={})
    greedy, target = make_warp(0.0), None
    for algo in args.drafters:
        cfg = load_config([f"target.path={args.target}", f"target.device={args.device}", f"target.dtype={args.dtype}",
                           f"draft={algo}"] + ([f"draft.num_layers={args.layers}"] if algo != "eagle3" else []))
        if target is None:
            target = load_target(cfg.target)
            rec["target"] = {"path": args.target, "device": str(target.device), "dtype": str(target.dtype)}
        torch.manual_seed(0)
        drafter = build_drafter(target, cfg.draft).eval()
        ids = [encode_prompt(target.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS[: args.prompts]]
        kw = dict(warp=greedy, eos_token_ids=[])
        speculative_generate(target, drafter, ids[0], gamma=args.gamma, max_new_tokens=8, **kw)   # warm-up
        target_generate(target, ids[0], max_new_tokens=8, **kw)
        specs, bases = [], []
        t0 = time.perf_counter()
        for p in ids:   # interleaved: the same machine load for both
            specs.append(speculative_generate(target, drafter, p, gamma=args.gamma, max_new_tokens=args.new_tokens, **kw))
            bases.append(target_generate(target, p, max_new_tokens=args.new_tokens, **kw))
        r = rec["drafters"][algo] = {**split(specs, bases), "seconds": time.perf_counter() - t0}
        print(f"{algo}: draft {r['draft_ms']:.1f} ms, verify {r['verify_ms']:.1f} ms, overhead "
              f"{r['overhead_ms']:.1f} ms ({100 * r['overhead_fraction']:.1f}%) per round; plain decode "
              f"{r['plain_decode_ms_per_token']:.1f} ms/token; verify/plain {r['verify_over_plain_decode']:.2f}, "
              f"draft/plain {r['draft_over_plain_decode']:.2f}; greedy equal {r['greedy_equal']}", flush=True)
    write_record(rec, "eval_latency", args.out)
    return 0


# -- batched: real batched verification against the simulator ---------------------------------------------

def sps_table(a, target, gamma: int, out: Path):
    """(the SPS(B) table of ``--sps-table``, else one profiled here and saved as `<out stem>.sps.json`,
    where it came from)."""
    from deepspec.schedule.profile import SPSTable, profile_sps
    if a.sps_table:
        table = SPSTable.load(a.sps_table)
        ctx = table.meta.get("context_len")
        if ctx is not None and int(ctx) != a.context_len:
            print(f"WARNING: {a.sps_table} was profiled with context_len={ctx}, the replay uses --context-len "
                  f"{a.context_len}", flush=True)
        return table, a.sps_table
    t0 = time.time()
    table = profile_sps(target, a.profile_sizes, context_len=a.context_len, repeats=a.repeats, mode="requests",
                        tokens_per_request=a.tokens_per_request or gamma + 1, seed=a.seed)
    table.meta["profile_wall_s"] = round(time.time() - t0, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    src = str(table.save(part_path(out, "sps", "json")))
    print(f"profiled SPS on {table.device} in {table.meta['profile_wall_s']} s → {src}", flush=True)
    return table, src


def batched_at(a, R: int, target, traces, gamma: int, policies, table, cal, bar):
    """The rows of one concurrency R: each policy's replay with the real forwards; with ``--per-r-profile``
    also the predictions of R's own SPS table for the same forwards and a scheduler deciding with it.
    (rows, R's table as JSON or None)."""
    from bench import schedule_replay as sr
    from deepspec.schedule.prefix_scheduler import PrefixSchedulerPolicy, make_policy
    from deepspec.schedule.profile import profile_sps
    from deepspec.schedule.simulator import simulate
    table_r = None
    if a.per_r_profile:   # before this R's cache exists: the profile prefills its own contexts
        table_r = profile_sps(target, [R * t for t in range(1, gamma + 2)], context_len=a.context_len,
                              repeats=a.repeats, mode="requests", requests=R, seed=a.seed)
    cache, base = sr.prefill(target, R, a.context_len, a.seed)
    sr.warm(target, cache, base, R, gamma + 1, a.warmup)

    def replay(pol, tab, label):
        bar.set_postfix(R=R, policy=f"{pol.name} {label}")
        sim, ver = sr.measure(target, traces, pol, tab, R, a.steps, cache, base, a.draft_time_s, a.seed,
                              not a.random_tokens, bar)
        rows.append(sr.row(sim, ver, a.draft_time_s, tab, label))
        return ver
    rows = []
    for pol in policies:
        ver = replay(pol, table, "global")
        if table_r is not None and not isinstance(pol, PrefixSchedulerPolicy):
            # same decisions, so the same measured forwards; only the prediction changes
            sim_r = simulate(traces, pol, table_r, R, steps=a.steps, draft_time_s=a.draft_time_s, seed=a.seed)
            rows.append(sr.row(sim_r, ver, a.draft_time_s, table_r, "per-R"))
    if table_r is not None:
        replay(make_policy("scheduler", calibration=cal, sps_table=table_r, overhead_s=a.draft_time_s),
               table_r, "per-R")
    return rows, table_r.to_json() if table_r is not None else None


def batched(a) -> int:
    import torch
    from tqdm import tqdm
    from bench import schedule_replay as sr
    from bench.records import repo_relative
    from deepspec.config import TargetConfig
    from deepspec.schedule.calibration import Calibration
    from deepspec.schedule.prefix_scheduler import PrefixSchedulerPolicy, make_policy
    from deepspec.schedule.profile import SPSTable, device_name
    from deepspec.schedule.sps_grid import SPSGrid
    from deepspec.targets import load_target
    if a.threads:
        torch.set_num_threads(a.threads)
    out = Path(a.out)
    traces, info = sr.load_traces(a.rollouts)
    gamma = info["gamma"]
    cal = Calibration.load(a.calibration) if a.calibration else None
    target = load_target(TargetConfig(name=a.target, path=a.target, dtype=a.dtype, device="auto"))
    if not a.random_tokens:
        sr.check_vocab(traces, int(target.vocab_size), a.rollouts)
    print(f"rollouts: {a.rollouts}; γ={gamma}; {info['rounds']} rounds of {info['requests']} requests, "
          f"{info['rounds_with_draft_tokens']} with draft token ids; {sr.NOTE}", flush=True)
    rec = header(bench="verify_batched", args=vars(a), note=sr.NOTE, rollouts=info)
    table, table_src = sps_table(a, target, gamma, out)
    policies = [make_policy("fixed")] + [make_policy("threshold", calibration=cal, threshold=t) for t in a.thresholds] \
        + [make_policy("scheduler", calibration=cal, sps_table=table, overhead_s=a.draft_time_s)]
    if a.convex:
        policies.append(PrefixSchedulerPolicy(table.convexified(), cal, overhead_s=a.draft_time_s,
                                              name="scheduler-convex"))
    rows, per_r_tables = [], {}
    with tqdm(total=len(a.concurrency) * (len(policies) + a.per_r_profile) * a.steps, desc="verify", unit="step") as bar:
        for R in a.concurrency:
            r_rows, table_r = batched_at(a, R, target, traces, gamma, policies, table, cal, bar)
            rows += r_rows
            if table_r is not None:
                per_r_tables[R] = table_r
    md = sr.batched_markdown(rows)
    print(md)
    rec["machine"]["device"] = device_name(target.device)
    rec.update(calibration={"path": a.calibration, "temperatures": cal.temperatures} if cal else None,
               sps_table_source=table_src, sps_table=table.to_json(), per_r_sps_tables=per_r_tables or None,
               results=rows)
    write_record(rec, "verify_batched", str(out), markdown=md)
    if per_r_tables:   # the per-R profiles as one SPS(R, B) grid: `schedule.sps_table=` / `schedule --sps-table`
        grid = SPSGrid({int(r): SPSTable.from_json(t) for r, t in per_r_tables.items()}, device=table.device,
                       target=table.target, meta={"source": repo_relative(str(out.resolve()))})
        print(f"wrote {grid.save(part_path(out, 'sps_grid', 'json'))}", flush=True)
    return 0


# -- schedule: simulated goodput of the prefix scheduler --------------------------------------------------

def schedule_tables(a, out: Path) -> dict:
    """{name: SPS table}: ``--sps-table`` (a table or an SPS(R, B) grid) or one profiled here on
    ``--target`` (saved as `<out stem>.sps.json`), and the synthetic GPU-like table."""
    from bench import schedule_replay as sr
    from deepspec.schedule.profile import synthetic_gpu_table
    from deepspec.schedule.sps_grid import load_cost_model
    tables = {}
    if a.sps_table:
        tab = load_cost_model(a.sps_table)
        tables[f"profiled-{sr.slug(tab.target)}"] = tab
        print(f"loaded SPS table of {tab.target} on {tab.device}", flush=True)
    elif a.target:
        tab = sr.profile_here(a.target, a.profile_sizes, a.context_len, a.repeats, a.dtype, a.threads)
        tables[f"profiled-{sr.slug(tab.target)}"] = tab
        tab.save(part_path(out, "sps", "json"))
        print(f"profiled {tab.target} on {tab.device} in {tab.meta['profile_wall_s']} s:",
              dict(zip(tab.batch_tokens, [round(s, 1) for s in tab.steps_per_second])), flush=True)
    tables["synthetic-gpu"] = synthetic_gpu_table()
    return tables


def schedule(a) -> int:
    from bench import schedule_replay as sr
    from deepspec.schedule.calibration import fit_sts
    from deepspec.schedule.rollouts import group_by_request, is_synthetic, read_rollouts, synthetic_rollouts, to_arrays
    from deepspec.schedule.simulator import plot_pareto
    out = Path(a.out) if a.out else record_path("schedule_gain", a.label)
    out.parent.mkdir(parents=True, exist_ok=True)
    if a.rollouts:
        records, source = read_rollouts(a.rollouts), a.rollouts
    else:
        records = synthetic_rollouts(n_requests=128, rounds_per_request=48, gamma=a.gamma, seed=a.seed)
        source = "SYNTHETIC (deepspec.schedule.rollouts.synthetic_rollouts)"
    synthetic = is_synthetic(records)
    fit_recs, replay_recs = sr.split_requests(records, a.seed)
    fit = to_arrays(fit_recs)
    cal = fit_sts(fit.confidence, fit.accepted, verified=fit.verified)
    traces = group_by_request(replay_recs, fit.gamma)
    print(f"rollouts: {source}; γ={fit.gamma}; fit {len(fit)} rounds, replay {sum(len(t) for t in traces)} rounds "
          f"of {len(traces)} requests; STS T={[round(t, 2) for t in cal.temperatures]}", flush=True)
    tables = schedule_tables(a, out)
    rows, results = [], {}
    conc = sorted(set(a.concurrency) | set(a.pareto))
    for name, table in tables.items():
        res = sr.run_table(name, table, traces, cal, conc, a.steps, a.draft_time_s, a.seed)
        results[name] = [r.to_json() for r in res]
        rows += sr.summarize(name, res, a.concurrency)
        label = f"{table.target} on {table.device.split(' ')[0]}" if name != "synthetic-gpu" else "synthetic GPU-like SPS"
        keep = [r for r in res if r.concurrency in a.pareto and r.policy in ("fixed", "scheduler", "threshold0.3",
                                                                               "threshold0.5", "threshold0.7")]
        plot_pareto(keep, part_path(out, f"pareto-{name}", "png"),
                    title=f"{label}; {'SYNTHETIC rollouts' if synthetic else 'rollouts: ' + Path(source).name}")
    md = sr.schedule_markdown(rows)
    print(md)
    meta = {"rollouts": source, "synthetic_rollouts": synthetic, "gamma": fit.gamma, "temperatures": cal.temperatures,
            "steps": a.steps, "draft_time_s": a.draft_time_s, "tables": {k: v.to_json() for k, v in tables.items()}}
    write_record(header(meta=meta, summary=rows, results=results), "schedule_gain", str(out), markdown=md)
    return 0


# -- row-invariant: what row-invariant verification costs -------------------------------------------------

def row_invariant(args) -> int:
    from bench.row_invariant_timing import run
    return run(args)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = ap.add_subparsers(dest="mode", required=True)
    v = modes.add_parser("verify", help="c(n) of a verification against a plain step, per dtype (verify_cost)")
    v.add_argument("--target", default="reference:smollm2-135m")
    v.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    v.add_argument("--sizes", nargs="+", type=int, default=[1, 2, 3, 4, 6, 8])
    v.add_argument("--context", type=int, default=200)
    v.add_argument("--reps", type=int, default=9)
    v.add_argument("--threads", type=int, default=1)
    v.add_argument("--label", default="")
    v.add_argument("--out", default=None, help="record path (default: bench/results/verify_cost[-LABEL].json)")
    la = modes.add_parser("latency", help="the eval loop's per-round split next to plain decoding (eval_latency)")
    la.add_argument("--target", default="reference:smollm2-135m")
    la.add_argument("--device", default="cpu")
    la.add_argument("--dtype", default="auto")
    la.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = leave as is)")
    la.add_argument("--drafters", nargs="*", default=["dspark", "eagle3"])
    for flag, default in (("layers", 2), ("gamma", 7), ("new-tokens", 48), ("prompts", 2)):
        la.add_argument(f"--{flag}", type=int, default=default)
    la.add_argument("--out", default=None)
    b = modes.add_parser("batched", help="real batched verification vs the simulator (verify_batched)")
    b.add_argument("--rollouts", required=True, help="rollout JSONL logged by `deepspec eval` (fixed-length)")
    b.add_argument("--calibration", help="STS calibration JSON from `deepspec calibrate` (default: raw confidences)")
    b.add_argument("--profile-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    b.add_argument("--tokens-per-request", type=int, help="profile_sps requests mode (default 1+γ)")
    b.add_argument("--context-len", type=int, default=256)
    b.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    b.add_argument("--thresholds", type=float, nargs="+", default=[0.5], help="static threshold policies")
    b.add_argument("--convex", action="store_true", help="also run the scheduler deciding on the convex hull")
    b.add_argument("--per-r-profile", action="store_true",
                   help="also profile SPS(B) at each fixed concurrency R (B = R·1 … R·(1+γ)) and predict / "
                        "schedule with that table (rows labelled 'per-R')")
    b.add_argument("--steps", type=int, default=30)
    b.add_argument("--warmup", type=int, default=2, help="untimed forwards per R before the replays")
    b.add_argument("--random-tokens", action="store_true", help="ignore logged draft token ids")
    b.add_argument("--out", default=str(record_path("verify_batched")),
                   help="record path; its table is saved beside it as <stem>.sps.json (and <stem>.sps_grid.json)")
    s = modes.add_parser("schedule", help="simulated goodput of the prefix scheduler (schedule_gain)")
    s.add_argument("--rollouts", help="rollout JSONL logged by eval (default: synthetic rollouts)")
    s.add_argument("--gamma", type=int, default=7, help="draft length of synthetic rollouts")
    s.add_argument("--profile-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048])
    s.add_argument("--context-len", type=int, default=128)
    s.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    s.add_argument("--pareto", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    s.add_argument("--steps", type=int, default=200)
    s.add_argument("--label", default=None, help="a separate experiment: bench/results/schedule_gain-LABEL.json")
    s.add_argument("--out", default=None, help="record path (default: bench/results/schedule_gain[-LABEL].json)")
    ri = modes.add_parser("row-invariant", help="batched vs row-invariant verification forwards (row_invariant_cost)")
    ri.add_argument("--target", default="reference:smollm2-135m")
    ri.add_argument("--dtype", default="bfloat16")
    ri.add_argument("--contexts", nargs="+", type=int, default=[128, 512])
    ri.add_argument("--chain", type=int, default=8)
    ri.add_argument("--tree", type=int, default=16)
    ri.add_argument("--reps", type=int, default=7)
    ri.add_argument("--threads", type=int, default=1)
    ri.add_argument("--label", default="")
    ri.add_argument("--out", default=None, help="record path (default: bench/results/row_invariant_cost[-LABEL].json)")
    for m, target, threads in ((b, "reference:smollm2-135m", 2), (s, "tiny:llama", 1)):
        m.add_argument("--target", default=target, help="target to profile here" + ("" if m is b else " ('' = skip)"))
        m.add_argument("--sps-table", help="use this SPS table JSON instead of profiling")
        m.add_argument("--dtype", default="float32")
        m.add_argument("--threads", type=int, default=threads, help="torch threads (0 = torch's default)")
        m.add_argument("--repeats", type=int, default=3, help="timed steps per profiled size")
        m.add_argument("--draft-time-s", type=float, default=0.0)
        m.add_argument("--seed", type=int, default=0)
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.mode in ("verify", "row-invariant") and args.reps < 2:
        raise SystemExit("--reps must be >= 2 (the first round is dropped as warm-up)")
    return {"verify": verify, "latency": latency, "batched": batched, "schedule": schedule,
            "row-invariant": row_invariant}[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
