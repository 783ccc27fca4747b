"""The per-process measurements of `bench/train_speed.py` ``memory`` and ``vocab``: one draft training
step's peak memory, and one draft vocabulary size's coverage, step time, RSS and draft pass.  Each runs
in a fresh process (`train_speed.run_worker`), so each peak is that configuration's alone."""
from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import sys
import time
from pathlib import Path


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0   # Linux: KiB


def memory_step(spec: dict) -> dict:
    """Peak memory of one forward + backward of a draft on a tiny random Llama with ``vocab`` tokens,
    the loss chunked by ``spec["chunk"]`` anchors (0: unchunked)."""
    import torch
    from deepspec.config.draft import DraftConfig, LossConfig
    from deepspec.drafts import build_drafter
    from deepspec.targets import TargetAdapter
    from deepspec.targets.tiny import tiny_model, tiny_tokenizer
    a = argparse.Namespace(**spec["args"])
    dev = torch.device(a.device)
    model = tiny_model("llama", a.vocab, num_layers=4, hidden_size=a.hidden).to(dev)
    target = TargetAdapter(model, tiny_tokenizer("llama"), num_feature_layers=2, name="bench")
    cfg = DraftConfig(algorithm=a.algorithm, gamma=a.gamma, num_layers=a.layers, sequential_head=a.head,
                      head_rank=a.rank, ttt_steps=a.gamma, loss=LossConfig(chunk_size=spec["chunk"]))
    torch.manual_seed(0)
    draft = build_drafter(target, cfg)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g).to(dev)
    cap = target.capture(ids)
    ones = torch.ones_like(ids, dtype=torch.bool)
    anchors = torch.stack([torch.randperm(a.seq - a.gamma - 1, generator=g)[:a.anchors].sort().values
                           for _ in range(a.batch)]).to(dev)
    batch = {"input_ids": ids, "loss_mask": ones, "attention_mask": ones, "features": cap.features.clone(),
             "last_hidden": cap.last_hidden.clone(), "anchors": anchors}
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() / 2 ** 20 if cuda else _rss_mb()
    t0 = time.perf_counter()
    out = draft(batch)
    out["loss"].backward()
    if cuda:
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2 ** 20 - base if cuda else _rss_mb() - base
    return {"chunk": spec["chunk"], "peak_mb": round(peak, 1), "seconds": round(time.perf_counter() - t0, 2),
            "loss": round(float(out["loss"]), 6)}


# -- the draft vocabulary size ---------------------------------------------------------------------------

def _statm_rss_mb() -> float:
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
    return _rss_mb()


def _train_batch(args, cfg, target, src, train_idx):
    """A batch of the first ``args.seqs`` training sequences with the log-normaliser the loss reads."""
    from deepspec.train.anchors import sample_anchors
    from deepspec.train.data import collate
    samples = [src[i] for i in train_idx[: args.seqs]]
    batch = collate(samples, [sample_anchors(s["loss_mask"], args.anchors, seed=k) for k, s in enumerate(samples)])
    # a format-2 cache stores the target's log-normaliser; for an older cache compute it here, as the build
    # would (--without-lse: the loss recomputes the full-V softmax each step)
    if args.without_lse:
        batch.pop("target_lse", None)
    elif "target_lse" not in batch:
        batch["target_lse"] = target.log_normalizer(batch["last_hidden"]) * batch["attention_mask"]
    return samples, batch


def _draft_pass_ms(d, target, prompts, rounds: int, gamma: int) -> float:
    """Median ms of one greedy `propose` of ``gamma`` tokens (the first pass per prompt untimed)."""
    import torch
    from deepspec.decoding.warp import make_warp
    warp, ms = make_warp(0.0), []
    with torch.no_grad():
        for p in prompts:
            if p.numel() < 2:
                continue
            state = d.init_state(p[:-1], target.capture(p[None, :-1]).features[0])
            for r in range(rounds + 1):
                t0 = time.perf_counter()
                d.propose(state, int(p[-1]), gamma, warp)
                if r:
                    ms.append(1000 * (time.perf_counter() - t0))
    return statistics.median(ms)


def vocab_size(spec: dict) -> dict:
    """One draft vocabulary size ``spec["size"]`` (0 = full) on the cache of ``args.work``: coverage of
    the training split's answer tokens, the DSpark training step (trainer defaults, bf16 autocast where
    the CPU has native bf16) and its peak RSS growth, the draft pass of decoding."""
    import dataclasses

    import numpy as np
    import torch
    from deepspec.cache import CacheReader
    from deepspec.config import load_config
    from deepspec.data.vocab import count_answer_tokens, coverage, select_top
    from deepspec.drafts import build_drafter
    from deepspec.targets import load_target
    from deepspec.train.data import CachedSequences, split_heldout
    from deepspec.train.optim import build_adamw, trainable_named_parameters
    from deepspec.train.precision import use_bf16
    args = argparse.Namespace(**spec["args"])
    work = Path(args.work)
    cfg = load_config(["target=smollm2_135m", "draft=dspark", f"draft.num_layers={args.layers}",
                       f"draft.head_rank={args.rank}", f"cache.dir={work / 'cache'}", "train=cpu"])
    target = load_target(cfg.target)
    src = CachedSequences(CacheReader(work / "cache"), cfg.data.max_length)
    train_idx, _ = split_heldout(src.sample_ids(), cfg.data.heldout_fraction, cfg.data.split_seed)
    V = target.vocab_size
    counts = count_answer_tokens((src.tokens(i) for i in train_idx), V)
    samples, batch = _train_batch(args, cfg, target, src, train_idx)
    bf16 = use_bf16(None, torch.device("cpu"))
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    N = None if spec["size"] in (0, V) else int(spec["size"])
    ids = select_top(counts, N or V, always=target.eos_token_ids)
    torch.manual_seed(0)
    base_rss = _statm_rss_mb()
    _reset_peak_rss()
    d = build_drafter(target, dataclasses.replace(cfg.draft, vocab_size=N))
    if N:
        d.set_draft_vocab(ids)
    opt = build_adamw(trainable_named_parameters(d), cfg.train)
    d.train()
    times, cpu_times = [], []
    for k in range(args.warmup + args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        with autocast():
            loss = d(batch)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if k >= args.warmup:
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
    growth = _peak_rss_mb() - base_rss
    d.eval()
    prompts = [s["input_ids"][: int(np.argmax(s["loss_mask"].numpy()))] for s in samples]
    row = {"draft_vocab_size": N or V, "coverage": coverage(counts, ids), "train_step_s": statistics.median(times),
           "train_step_s_min": min(times),
           # CPU time of this process per step: with --threads 1 robust to other load
           "train_step_cpu_s": statistics.median(cpu_times),
           "positions_per_s": float(batch["anchors"].ge(0).sum()) * cfg.draft.gamma / statistics.median(times),
           # peak RSS of this process above its RSS just before the drafter was built
           "rss_growth_mb": growth, "draft_pass_ms": _draft_pass_ms(d, target, prompts, args.rounds, cfg.draft.gamma),
           "trainable_params": sum(p.numel() for p in d.parameters() if p.requires_grad)}
    label = "full" if N is None else str(N)
    print(f"N={label}: coverage {row['coverage']:.4f}, step {row['train_step_s']:.3f}s (cpu "
          f"{row['train_step_cpu_s']:.3f}s), draft pass {row['draft_pass_ms']:.1f} ms, peak RSS +{growth:.0f} MB",
          file=sys.stderr, flush=True)
    return {"label": label, "size": row, "bf16_autocast": bf16, "target_lse": not args.without_lse}


def heldout_by_size(curve: dict) -> dict:
    """{N label: the last held-out E[τ]} of a `bench/learning_curve.py` record's draft.vocab_size variants."""
    held = {}
    for d in curve["drafters"].values():
        n = next((o.split("=", 1)[1] for o in d["overrides"] if o.startswith("draft.vocab_size=")), "null")
        if d["curve"]:
            held["full" if n in ("null", "None") else n] = d["curve"][-1]["eval/expected_tau"]
    return held


def markdown(rec: dict) -> str:
    rows = rec["sizes"]
    full = rows.get("full") or next(iter(rows.values()))
    cpu = all("train_step_cpu_s" in r for r in rows.values())
    key = "train_step_cpu_s" if cpu else "train_step_s"
    lines = [f"| N | coverage (train split) | train step {'CPU ' if cpu else ''}s | × vs full | draft pass ms/round | "
             "× vs full | peak RSS growth MB | held-out E[τ] |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label, r in rows.items():
        tau = (rec.get("heldout") or {}).get(label)
        lines.append(f"| {label} | {r['coverage']:.4f} | {r[key]:.3f} | {full[key] / r[key]:.2f} | "
                     f"{r['draft_pass_ms']:.1f} | {full['draft_pass_ms'] / r['draft_pass_ms']:.2f} | "
                     f"{r['rss_growth_mb']:.0f} | {'—' if tau is None else f'{tau:.3f}'} |")
    return "\n".join(lines)
