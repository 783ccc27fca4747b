"""Training throughput of `deepspec train`: tokens/s and peak RSS per drafter × strategy.

    python bench/train_throughput.py                       # reference target, every drafter/strategy
    python bench/train_throughput.py --drafters dspark --strategies single,ddp --steps 8
    python bench/train_throughput.py --online              # features from the target inside training

Builds (once, under --work) synthetic regenerated conversations and their hidden-state cache
for the target, then runs a few optimizer steps of each configuration in a fresh process
(torchrun with --nproc processes for ddp / fsdp / deepspeed), reading tokens/s from the
run's metrics.jsonl (median over the steps after the first) and each rank's peak RSS from
`getrusage`.  Writes bench/results/train_throughput.json (`--online`: train_throughput-online.json;
not a test: numbers depend on the machine).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.records import record_path  # noqa: E402


def overrides(args, work: Path, run_dir: Path, drafter: str, strategy: str):
    kw = {"run_dir": str(run_dir), "target.path": args.target, "draft.algorithm": drafter,
          "draft.num_layers": args.draft_layers, "data.regen_path": str(work / "regen.jsonl"),
          "data.max_length": args.max_length, "data.online": args.online, "cache.dir": str(work / "cache"),
          "train.strategy": strategy, "train.max_steps": args.steps, "train.save_every": 0,
          "train.eval_every": 0, "train.heldout_fraction": 0.0, "train.global_batch_sequences": args.global_batch,
          "train.micro_batch_sequences": args.micro_batch, "train.anchors_per_sequence": args.anchors,
          "train.max_length": args.max_length, "train.bf16": args.bf16, "train.tensorboard": False,
          "train.warmup_ratio": 0.0, "train.deepspeed_stage": args.deepspeed_stage}
    out = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in kw.items()]
    return out + list(args.set or [])


def worker(spec_path: str, out_path: str) -> None:
    """One configuration in this process (one rank under torchrun)."""
    from deepspec.config import load_config
    from deepspec.train.loop import run
    spec = json.loads(Path(spec_path).read_text())
    t0 = time.time()
    run(load_config(spec["overrides"]))
    rank = int(os.environ.get("RANK", "0"))
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    Path(f"{out_path}.rank{rank}").write_text(json.dumps({"rank": rank, "peak_rss_mb": rss_mb,
                                                          "wall_s": time.time() - t0}))


def launch(args, spec: dict, tag: str, world: int) -> dict:
    work = Path(args.work)
    spec_path, out_path = work / f"{tag}.json", work / f"{tag}.out"
    spec_path.write_text(json.dumps(spec))
    for p in work.glob(f"{tag}.out.rank*"):
        p.unlink()
    me = str(Path(__file__).resolve())
    if world == 1:
        cmd = [sys.executable, me, "--worker", str(spec_path), str(out_path)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
               me, "--worker", str(spec_path), str(out_path)]
    env = {**os.environ, "DEEPSPEC_NO_PROGRESS": "1", "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
    t0 = time.time()
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.time() - t0
    if p.returncode != 0:
        return {"error": (p.stdout + p.stderr)[-2000:], "wall_s": wall}
    ranks = [json.loads(f.read_text()) for f in sorted(work.glob(f"{tag}.out.rank*"))]
    recs = [json.loads(x) for x in (Path(spec["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "train/loss" in r]
    steady = recs[1:] or recs
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
            "step_time_s": statistics.median(r["step_time_s"] for r in steady),
            "tokens_per_step": statistics.mean(r["tokens"] for r in recs),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
            "peak_rss_mb_per_rank": [round(r["peak_rss_mb"], 1) for r in ranks],
            "loss_first": recs[0]["train/loss"], "loss_last": recs[-1]["train/loss"],
            "expected_tau_last": recs[-1].get("train/expected_tau"), "steps": len(recs), "wall_s": wall}


def prepare(args) -> None:
    """Synthetic regen JSONL + its cache for the target (reused across invocations)."""
    from deepspec.cache.writer import build_cache
    from tests.support.synthetic import write_regen_jsonl
    from deepspec.config import load_config
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    regen = work / "regen.jsonl"
    if not regen.is_file():
        write_regen_jsonl(regen, args.samples, seed=0, max_words=args.max_words)
    if not args.online and not (work / "cache" / "manifest.json").is_file():
        t0 = time.time()
        build_cache(load_config(overrides(args, work, work / "prep", "dspark", "single")), progress=False)
        print(f"built the cache in {time.time() - t0:.1f}s", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--target", default="reference:smollm2-135m")
    ap.add_argument("--drafters", default=None, help="comma list (default: every registered drafter)")
    ap.add_argument("--strategies", default="single,ddp,fsdp,deepspeed")
    ap.add_argument("--nproc", type=int, default=2, help="processes for ddp / fsdp / deepspeed")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--max-words", type=int, default=80)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--anchors", type=int, default=16)
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--deepspeed-stage", type=int, default=2)
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (default off: CPU)")
    ap.add_argument("--online", action="store_true", help="features from the target inside training")
    ap.add_argument("--set", nargs="*", help="extra config overrides, e.g. train.compile=true")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--work", default=str(REPO / "bench" / "work" / "train_throughput"))
    ap.add_argument("--out", default=None,
                    help="record path (default: bench/results/train_throughput.json, with --online "
                         "train_throughput-online.json)")
    args = ap.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0

    import torch
    from deepspec.drafts import available_drafters
    drafters = args.drafters.split(",") if args.drafters else available_drafters()
    strategies = args.strategies.split(",")
    prepare(args)
    work = Path(args.work)
    results = []
    for d in drafters:
        for s in strategies:
            world = 1 if s == "single" else args.nproc
            tag = f"{d}_{s}_{'online' if args.online else 'cache'}"
            run_dir = work / "runs" / tag
            if run_dir.exists():
                import shutil
                shutil.rmtree(run_dir)
            spec = {"overrides": overrides(args, work, run_dir, d, s), "run_dir": str(run_dir)}
            print(f"{d:8s} {s:10s} world={world} ...", end=" ", flush=True)
            r = {"drafter": d, "strategy": s, "world_size": world, **launch(args, spec, tag, world)}
            print("ERROR" if "error" in r else f"{r['tokens_per_s']:.0f} tok/s, peak RSS {r['peak_rss_mb']:.0f} MB",
                  flush=True)
            results.append(r)
    report = {
        "bench": "train_throughput", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "target": args.target,
        "data": "online" if args.online else "cache", "device": "cuda" if torch.cuda.is_available() else "cpu",
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                 "torch": torch.__version__},
        "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "out", "work")},
        "results": results,
    }
    out = Path(args.out) if args.out else record_path("train_throughput", "online" if args.online else None)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
