"""Benchmark (not a test): the draft vocabulary size N side by side on the reference target.

    .venv/bin/python bench/draft_vocab.py --work bench/work/conv [--curve bench/results/learning_curve-vocab.json]

For N in {full, 32768, 16384, 8192} (``--sizes``), on the cache of a `bench/reference.py` work
directory: the coverage of the training split's answer tokens; the DSpark training step (forward +
loss + backward + the trainer's AdamW) time and peak RSS growth on real cached batches with the
trainer's defaults (bf16 autocast where the CPU has native bf16); and the draft pass of decoding
(`propose`, γ tokens) in ms per round on real prompts.  With ``--curve`` (a `bench/learning_curve.py`
record whose variants set draft.vocab_size) the held-out teacher-forced E[τ] after the same steps is
joined in.  Writes `bench/results/draft_vocab.{json,md}`.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.records import record_path  # noqa: E402


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def _reset_peak_rss() -> bool:
    """Reset this process's peak RSS (Linux: ``5`` into /proc/self/clear_refs), so the peak that follows
    is the measured section's and not the target's loading; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(args, argv) -> dict:
    """Every size in its own process (this script with ``argv`` + ``--size-worker N``), so each peak RSS
    is that size's alone."""
    import subprocess
    out, bf16 = {}, None
    for n in args.sizes:
        cmd = [sys.executable, __file__, *argv, "--size-worker", str(n)]
        p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=str(REPO))
        if p.returncode != 0:
            raise SystemExit(f"draft_vocab: the N={n} run failed (exit {p.returncode})")
        r = json.loads(p.stdout.strip().splitlines()[-1])
        bf16, lse = r.pop("bf16_autocast"), r.pop("target_lse")
        out.update(r["sizes"])
    return {"bf16_autocast": bf16, "target_lse": lse, "sizes": out}


def measure_sizes(args) -> dict:
    import contextlib
    import dataclasses

    import numpy as np
    import torch
    from deepspec.cache import CacheReader
    from deepspec.config import load_config
    from deepspec.data.vocab import count_answer_tokens, coverage, select_top
    from deepspec.drafts import build_drafter
    from deepspec.decoding.warp import make_warp
    from deepspec.targets import load_target
    from deepspec.train.anchors import sample_anchors
    from deepspec.train.data import CachedSequences, collate, split_heldout
    from deepspec.train.optim import build_adamw, trainable_named_parameters
    from deepspec.train.precision import use_bf16

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    cfg = load_config(["target=smollm2_135m", "draft=dspark", f"draft.num_layers={args.layers}",
                       f"draft.head_rank={args.rank}", f"cache.dir={work / 'cache'}", "train=cpu"])
    target = load_target(cfg.target)
    src = CachedSequences(CacheReader(work / "cache"), cfg.train.max_length)
    train_idx, _ = split_heldout(len(src), cfg.train.heldout_fraction, cfg.data.split_seed)
    counts = count_answer_tokens((src.tokens(i) for i in train_idx), target.vocab_size)
    V = target.vocab_size
    samples = [src[i] for i in train_idx[: args.seqs]]
    anchors = [sample_anchors(s["loss_mask"], args.anchors, seed=k) for k, s in enumerate(samples)]
    batch = collate(samples, anchors)
    # a format-2 cache stores the target's log-normaliser; for an older cache compute it here, as the
    # build would (--without-lse: the loss recomputes the full-V softmax each step, the pre-column path)
    if args.without_lse:
        batch.pop("target_lse", None)
    elif "target_lse" not in batch:
        batch["target_lse"] = target.log_normalizer(batch["last_hidden"]) * batch["attention_mask"]
    bf16 = use_bf16(None, torch.device("cpu"))
    ac = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    prompts = [s["input_ids"][: int(np.argmax(s["loss_mask"].numpy()))] for s in samples]
    out = {}
    for n in args.sizes:
        N = None if n in (0, V) else int(n)
        ids = select_top(counts, N or V, always=target.eos_token_ids)
        torch.manual_seed(0)
        base_rss = _rss_mb()
        _reset_peak_rss()
        d = build_drafter(target, dataclasses.replace(cfg.draft, vocab_size=N))
        if N:
            d.set_draft_vocab(ids)
        opt = build_adamw(trainable_named_parameters(d), cfg.train)
        d.train()
        times, cpu_times = [], []
        for k in range(args.warmup + args.steps):
            t0, c0 = time.perf_counter(), time.process_time()
            with ac():
                loss = d(batch)["loss"]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if k >= args.warmup:
                times.append(time.perf_counter() - t0)
                cpu_times.append(time.process_time() - c0)
        peak_growth = _peak_rss_mb() - base_rss
        d.eval()
        warp = make_warp(0.0)
        draft_ms = []
        with torch.no_grad():
            for p in prompts:
                if p.numel() < 2:
                    continue
                state = d.init_state(p[:-1], target.capture(p[None, :-1]).features[0])
                for r in range(args.rounds + 1):
                    t0 = time.perf_counter()
                    d.propose(state, int(p[-1]), cfg.draft.gamma, warp)
                    if r:
                        draft_ms.append(1000 * (time.perf_counter() - t0))
        label = "full" if N is None else str(N)
        out[label] = {"draft_vocab_size": N or V, "coverage": coverage(counts, ids),
                      "train_step_s": statistics.median(times), "train_step_s_min": min(times),
                      # CPU time of this process per step: with --threads 1 robust to other load
                      "train_step_cpu_s": statistics.median(cpu_times),
                      "positions_per_s": float(batch["anchors"].ge(0).sum()) * cfg.draft.gamma / statistics.median(times),
                      # peak RSS of this process above its RSS just before the drafter was built
                      "rss_growth_mb": peak_growth, "draft_pass_ms": statistics.median(draft_ms),
                      "trainable_params": sum(p.numel() for p in d.parameters() if p.requires_grad)}
        print(f"N={label}: coverage {out[label]['coverage']:.4f}, step {out[label]['train_step_s']:.3f}s "
              f"(cpu {out[label]['train_step_cpu_s']:.3f}s), "
              f"draft pass {out[label]['draft_pass_ms']:.1f} ms, peak RSS +{peak_growth:.0f} MB", file=sys.stderr,
              flush=True)
        del d, opt
    return {"bf16_autocast": bf16, "target_lse": not args.without_lse, "sizes": out}


def markdown(rec) -> str:
    rows = rec["sizes"]
    full = rows.get("full")
    cpu = all("train_step_cpu_s" in r for r in rows.values())
    key = "train_step_cpu_s" if cpu else "train_step_s"
    lines = [f"| N | coverage (train split) | train step {'CPU ' if cpu else ''}s | × vs full | draft pass ms/round | "
             "× vs full | peak RSS growth MB | held-out E[τ] |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label, r in rows.items():
        tau = (rec.get("heldout") or {}).get(label)
        lines.append(f"| {label} | {r['coverage']:.4f} | {r[key]:.3f} | "
                     f"{full[key] / r[key]:.2f} | {r['draft_pass_ms']:.1f} | "
                     f"{full['draft_pass_ms'] / r['draft_pass_ms']:.2f} | {r['rss_growth_mb']:.0f} | "
                     f"{'—' if tau is None else f'{tau:.3f}'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default=str(REPO / "bench" / "work" / "conv"))
    p.add_argument("--sizes", nargs="*", type=int, default=[0, 32768, 16384, 8192], help="0 = full vocabulary")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--rank", type=int, default=256)
    p.add_argument("--anchors", type=int, default=32)
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5, help="timed draft passes per prompt")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--without-lse", action="store_true",
                   help="no stored target log-normaliser: the loss takes the full-V softmax of the target")
    p.add_argument("--curve", default=None, help="learning_curve record with draft.vocab_size variants")
    p.add_argument("--out", default=str(record_path("draft_vocab")))
    p.add_argument("--size-worker", type=int, default=None, help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    if args.size_worker is not None:      # one size, in this process; the parent collects the JSON line
        args.sizes = [args.size_worker]
        print(json.dumps(measure_sizes(args)))
        return 0
    rec = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "command": " ".join([sys.executable, *sys.argv]),
           "args": vars(args), "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                           "loadavg_start": os.getloadavg()}}
    rec.update(measure(args, argv))
    if args.curve:
        curve = json.loads(Path(args.curve).read_text())
        held = {}
        for d in curve["drafters"].values():
            n = next((o.split("=", 1)[1] for o in d["overrides"] if o.startswith("draft.vocab_size=")), "null")
            if d["curve"]:
                held["full" if n in ("null", "None") else n] = d["curve"][-1]["eval/expected_tau"]
        rec["heldout"] = held
    rec["machine"]["loadavg_end"] = os.getloadavg()
    rec["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rec, indent=2) + "\n")
    md = markdown(rec)
    out.with_suffix(".md").write_text(md + "\n")
    print(md)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
