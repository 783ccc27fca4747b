"""Online (target inside training) vs cached training on CPU: tokens/s and peak RSS.
Not a test: numbers depend on the machine (and on its load).

    python bench/online_vs_cached.py                 # reference target, 10 steps per mode
    python bench/online_vs_cached.py --steps 10 --regen bench/work/cache_gate/regen/regen.jsonl

Each mode (`cached`: cache built first, `data.online=false`; `online`: `data.online=true`)
runs `deepspec.train.loop.run` in a fresh process with the same drafter, seed, batches and
steps; tokens/s is the median over steps after the first of the run's metrics.jsonl, peak
RSS from getrusage of that process.  A third measurement times the target forward alone
(what online mode adds per micro-batch): the full capture vs a forward stopped after the
deepest captured layer (an exception raised from that layer's forward hook) — the saving
early exit could give a drafter that needs no target distribution (every registered drafter
needs last_hidden, so training does not use it).  Writes bench/results/online_vs_cached.json.
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


def overrides(args, work: Path, mode: str):
    return [f"run_dir={work / ('run-' + mode)}", f"target.path={args.target}", f"target.dtype={args.dtype}",
            "target.device=cpu", "seed=0", "draft=dspark", f"data.regen_path={args.regen}",
            f"data.max_length={args.max_length}", f"data.online={'true' if mode == 'online' else 'false'}",
            f"cache.dir={work / 'cache'}", "cache.shard_samples=32", "train.strategy=single",
            "train.global_batch_sequences=4", "train.micro_batch_sequences=4", "train.anchors_per_sequence=16",
            f"train.max_steps={args.steps}", "train.save_every=0", "train.eval_every=0",
            "train.heldout_fraction=0", "train.bf16=false", f"train.max_length={args.max_length}",
            "train.resume=false", "train.num_workers=0"]


def worker(mode: str, ov_json: str, out: str) -> None:
    import torch
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    from deepspec.config import load_config
    from deepspec.train.loop import run
    cfg = load_config(json.loads(ov_json))
    t0 = time.perf_counter()
    run(cfg)
    wall = time.perf_counter() - t0
    recs = [json.loads(l) for l in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines() if l.strip()]
    tps = [r["tokens_per_s"] for r in recs if "tokens_per_s" in r]
    Path(out).write_text(json.dumps({
        "mode": mode, "wall_s": wall, "steps": len(tps),
        "tokens_per_s_median": statistics.median(tps[1:] or tps) if tps else None, "tokens_per_s": tps,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def forward_probe(args) -> dict:
    """Target forward alone: full capture vs stopping after the deepest captured layer."""
    import torch
    torch.set_num_threads(args.threads)
    from deepspec.config import load_config
    from deepspec.targets import load_target
    cfg = load_config(overrides(args, Path(args.work), "probe"))
    target = load_target(cfg.target)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 1000, (4, args.max_length), generator=g)

    class _Stop(Exception):
        pass

    def truncated():
        """The captured layers recorded as in `capture`, then stop after the deepest one."""
        recorded = {}

        def record(i):
            return lambda m, inp, o: recorded.__setitem__(i, o[0] if isinstance(o, (tuple, list)) else o)
        hooks = [target.layers[i].register_forward_hook(record(i)) for i in sorted(set(target.layer_ids))]
        hooks.append(target.layers[max(target.layer_ids)].register_forward_hook(
            lambda m, i, o: (_ for _ in ()).throw(_Stop())))
        try:
            with torch.inference_mode():
                try:
                    target.decoder(input_ids=ids, use_cache=False)
                except _Stop:
                    pass
        finally:
            for h in hooks:
                h.remove()

    def full():
        target.capture(ids)

    out = {}
    for name, fn in (("full_capture", full), ("stop_after_deepest_layer", truncated)):
        fn()
        ts = []
        for _ in range(args.probe_reps):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        out[name] = {"median_s": statistics.median(ts), "tokens_per_s": ids.numel() / statistics.median(ts)}
    out["deepest_layer"] = max(target.layer_ids)
    out["num_layers"] = target.num_layers
    out["batch"] = list(ids.shape)
    out["saving"] = 1 - out["stop_after_deepest_layer"]["median_s"] / out["full_capture"]["median_s"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--target", default="reference:smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--regen", default=None, help="regen JSONL (default: 32 synthetic conversations)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--max-length", type=int, default=192)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--probe-reps", type=int, default=3)
    ap.add_argument("--work", default=str(REPO / "bench" / "work" / "online_vs_cached"))
    ap.add_argument("--out", default=str(record_path("online_vs_cached")), help="record path")
    args = ap.parse_args()
    if args.worker:
        worker(*args.worker)
        return 0
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if not args.regen:
        from tests.support.synthetic import write_regen_jsonl
        args.regen = str(write_regen_jsonl(work / "regen.jsonl", 32, seed=0, max_words=80))
    import torch
    torch.set_num_threads(args.threads)
    from deepspec.cache.writer import build_cache
    from deepspec.config import load_config
    t0 = time.perf_counter()
    build_cache(load_config(overrides(args, work, "cached")), progress=False)
    build_s = time.perf_counter() - t0
    results = {}
    env = {**os.environ, "BENCH_THREADS": str(args.threads), "PYTHONPATH": str(REPO)}
    for mode in ("cached", "online"):
        out = work / f"{mode}.json"
        subprocess.run([sys.executable, __file__, "--worker", mode, json.dumps(overrides(args, work, mode)),
                        str(out)], check=True, env=env)
        results[mode] = json.loads(out.read_text())
        print(mode, {k: v for k, v in results[mode].items() if k != "tokens_per_s"}, flush=True)
    probe = forward_probe(args)
    rep = {"target": args.target, "dtype": args.dtype, "steps": args.steps, "regen": args.regen,
           "max_length": args.max_length, "cache_build_s": build_s, "modes": results,
           "online_over_cached_tokens_per_s": (results["online"]["tokens_per_s_median"] /
                                               results["cached"]["tokens_per_s_median"]),
           "target_forward_probe": probe,
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": args.threads,
                       "torch": torch.__version__, "loadavg": os.getloadavg()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rep, indent=1) + "\n")
    print(json.dumps({k: v for k, v in rep.items() if k != "modes"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
