"""The cache-size gate on the reference target (SmolLM2-135M-Instruct): bytes/token per codec
and τ of the same drafter trained on each cache.  Not a test: numbers depend on the machine.

    python bench/cache_gate.py                          # regenerate ~60 short ShareGPT conversations first
    python bench/cache_gate.py --regen path/regen.jsonl # reuse a regen JSONL
    python bench/cache_gate.py --codecs bf16,fp8,lowrank:rank=64 --steps 60 --prompts 3

Regeneration uses `deepspec.prepare.regenerate` (embedded HF engine, greedy,
--regen-tokens new tokens per assistant turn) on the first --n ShareGPT records.  Then
`deepspec.plan.gate.run` builds one cache per codec from that JSONL, trains the same dspark
drafter with the same seed for --steps steps on each and evaluates each final checkpoint
greedily on the same --prompts prompts of --benchmarks.  Writes
bench/results/cache_gate.json (+ .md) and keeps the work tree under --work.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.records import record_path  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--regen", default=None, help="existing regen JSONL (skip regeneration)")
    ap.add_argument("--n", type=int, default=60, help="conversations to regenerate")
    ap.add_argument("--regen-tokens", type=int, default=64)
    ap.add_argument("--codecs", default="bf16,fp8,lowrank:rank=64")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--max-length", type=int, default=192)
    ap.add_argument("--heldout", type=float, default=0.15,
                    help="fraction of sequences held out of training and scored teacher-forced on lossless features")
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--benchmarks", default="gsm8k,mt-bench")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per benchmark")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32", help="target compute dtype (fp32 is faster on most CPUs)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-data", default=str(REPO.parent / "shared" / "eval_datasets"))
    ap.add_argument("--work", default=str(REPO / "bench" / "work" / "cache_gate"))
    ap.add_argument("--out", default=str(record_path("cache_gate")), help="record path (its table: <stem>.md)")
    ap.add_argument("--fresh", action="store_true", help="delete --work first")
    args = ap.parse_args()

    import torch
    torch.set_num_threads(args.threads)
    from deepspec.config import load_config
    from deepspec.plan.gate import format_markdown, run

    work = Path(args.work)
    if args.fresh and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    base = [f"run_dir={work}", "target.path=reference:smollm2-135m", f"target.dtype={args.dtype}",
            "target.device=cpu", "seed=0"]
    t0 = time.perf_counter()
    if args.regen:
        regen = Path(args.regen)
        regen_s = None
    else:
        from deepspec.prepare import regenerate
        rcfg = load_config(base + ["data=sharegpt", f"data.max_samples={args.n}", "data.heldout_fraction=0",
                                   f"engine.max_new_tokens={args.regen_tokens}", "engine.temperature=0",
                                   "engine.batch_size=8"])
        regen = Path(regenerate(rcfg))
        regen_s = time.perf_counter() - t0
    overrides = base + [
        "draft=dspark", f"data.max_length={args.max_length}", "cache.shard_samples=32",
        f"cache.calib_tokens={args.calib_tokens}", "train.strategy=single", "train.global_batch_sequences=4",
        "train.micro_batch_sequences=4", "train.anchors_per_sequence=16", f"train.max_steps={args.steps}",
        "train.save_every=0", "train.eval_every=0", f"train.heldout_fraction={args.heldout}", "train.bf16=false",
        f"train.max_length={args.max_length}", f"eval.data_dir={args.eval_data}",
        f"eval.benchmarks=[{args.benchmarks}]", f"eval.max_samples={args.prompts}",
        f"eval.max_new_tokens={args.max_new_tokens}", "eval.temperature=0", "eval.progress=false",
        "eval.measure_baseline=false"]
    cfg = load_config(overrides)
    rep = run(cfg, codecs=[c for c in args.codecs.split(",") if c], regen_path=regen, out_dir=work / "gate")
    rep["bench"] = {"argv": sys.argv[1:], "regen_s": regen_s, "total_s": time.perf_counter() - t0,
                    "regen_records": sum(1 for _ in open(regen)), "overrides": overrides,
                    "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                "torch": torch.__version__, "threads": args.threads}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text(format_markdown(rep))
    print(format_markdown(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
