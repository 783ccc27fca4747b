"""DeepSpec's trainer as a row of the drafter table (`bench/train_vs_deepspec.py quality`).

Trains DeepSpec's own DSpark (`bench/deepspec_side.py`: their model, loss, optimizer and loop) on the cache and
held-out split of one of our training configs, on the same sequences in the same order as our trainer, and
writes a run directory our tools read like one of ours:

    RUN_DIR/run.yaml                      our resolved config of the same run (draft = the converted drafter's)
    RUN_DIR/metrics.jsonl                 per step: train/loss, lr, step_time_s, step_cpu_s; every
                                          --eval-every steps: eval/* from OUR held-out evaluation
    RUN_DIR/checkpoints/step_N/           their weights converted into our DSpark (config.json + safetensors)
    RUN_DIR/deepspec_check.json           the conversion check and what ran

Before training, the conversion is checked: with the anchors fixed, their loss on held-out sequences and our
loss of the converted drafter must agree (same formula: 0.1·CE + 0.9·L1 + BCE(conf), decayed weights).
"""
from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from bench import deepspec_side as ds
from deepspec.cache.union import open_caches
from deepspec.config import load_config, to_yaml
from deepspec.drafts import build_drafter
from deepspec.targets import load_target
from deepspec.train.accumulate import Accumulator
from deepspec.train.data import (CachedSequences, GlobalBatchPlan, build_micro_batch, heldout_micro_batches,
                                 split_heldout)
from deepspec.train.precision import use_bf16


def heldout_metrics(drafter, source, held: Sequence[int], cfg) -> Dict[str, float]:
    """The trainer's held-out evaluation (`Trainer.evaluate`, one process): the same micro-batches, anchors and
    precision, metrics averaged over micro-batches."""
    tc = cfg.train
    acc = Accumulator()
    bf16 = use_bf16(tc.bf16, torch.device("cpu"))
    drafter.eval()
    with torch.no_grad():
        for items, weight in heldout_micro_batches(held, tc.micro_batch_sequences, 0, 1, tc.eval_max_sequences):
            batch = build_micro_batch(source, items, tc.anchors_per_sequence, cfg.seed, tc.pad_to_multiple_of)
            with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
                out = drafter(batch)
            if weight > 0:
                acc.add(out, tokens=batch["attention_mask"].sum())
    drafter.train()
    out = {"eval/loss": acc.loss_sum() / max(acc.n, 1)}
    out.update({f"eval/{k}": s / c for k, (s, c) in acc.metrics.items() if c > 0})
    return out


def conversion_check(ck, model, drafter, source, held: Sequence[int], cfg, n: int = 2) -> Dict[str, float]:
    """Their loss and ours on the same sequences and anchors (their anchor sampler replaced by ours for the
    check), fp32; the relative difference must be tiny for the converted weights to be theirs."""
    ds.to_ours(model, drafter)
    items = [(-1, i) for i in list(held)[:n]]
    batch = build_micro_batch(source, items, cfg.train.anchors_per_sequence, cfg.seed)
    anchors = batch["anchors"]
    keep = anchors >= 0
    original = ck.modeling.sample_anchor_positions
    ck.modeling.sample_anchor_positions = lambda **_: (anchors.clamp_min(0), keep)
    try:
        with torch.no_grad():
            out = model(input_ids=batch["input_ids"], target_hidden_states=batch["features"].float(),
                        loss_mask=batch["loss_mask"].float(), target_last_hidden_states=batch["last_hidden"].float())
            theirs = float(ck.loss.compute_dspark_loss(outputs=out, loss_decay_gamma=4.0, ce_loss_alpha=0.1,
                                                       l1_loss_alpha=0.9, confidence_head_alpha=1.0))
            drafter.eval()
            ours = float(drafter(batch)["loss"])
            drafter.train()
    finally:
        ck.modeling.sample_anchor_positions = original
        ck.metrics.reset()
    rel = abs(theirs - ours) / max(abs(theirs), 1e-12)
    if not rel < 1e-3:
        raise RuntimeError(f"conversion check failed: DeepSpec's loss {theirs:.6f} vs ours {ours:.6f} on the same "
                           f"anchors (relative {rel:.2e}); the converted weights would not be theirs")
    return {"their_loss": theirs, "our_loss": ours, "relative_difference": rel}


def run(args) -> Path:
    run_dir = Path(args.run_dir)
    cfg = load_config([*args.overrides, f"run_dir={run_dir}", "draft=dspark", "draft.sequential_head=markov",
                       f"draft.num_layers={args.layers}", f"draft.head_rank={args.rank}", "draft.vocab_size=null",
                       f"train.max_steps={args.steps}"])
    tc = cfg.train
    target = load_target(cfg.target)
    reader = open_caches([cfg.cache.dir, *cfg.cache.extra_dirs])
    reader.validate(target, layer_subset=True)
    source = CachedSequences(reader, cfg.data.max_length, target.layer_ids)
    train_idx, held = split_heldout(source.sample_ids(), cfg.data.heldout_fraction, cfg.data.split_seed)
    plan = GlobalBatchPlan(train_idx, tc.global_batch_sequences, 1, 1, cfg.seed, source.lengths())
    ck = ds.load_checkout(args.deepspec)
    margs = ds.model_args(ck, cfg.draft.gamma, args.layers, target.layer_ids, build_drafter(target, cfg.draft)
                          .mask_token_id, tc.anchors_per_sequence, args.rank)
    torch.manual_seed(cfg.seed)
    model = ds.build_dspark(ck, target, margs, torch.float32)
    drafter = build_drafter(target, cfg.draft)
    check = conversion_check(ck, model, drafter, source, held, cfg)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.precision]
    model = model.to(dtype)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.yaml").write_text(to_yaml(cfg))
    ds.write_json(run_dir / "deepspec_check.json", {"checkout": args.deepspec, "patched_mask": ck.patched_mask,
                                                    "precision": args.precision, "conversion_check": check,
                                                    "train_sequences": len(train_idx), "heldout": len(held)})
    metrics = open(run_dir / "metrics.jsonl", "w")

    def batches(step: int) -> List[Dict[str, torch.Tensor]]:
        return [ds.their_batch(source[i], dtype) for ref in plan.micro_batches(step * tc.global_batch_sequences, 0)
                for _, i in ref.items]

    def on_step(step: int, rec: Dict) -> None:
        metrics.write(json.dumps({"step": step, **rec}) + "\n")
        if step % args.eval_every == 0 or step == args.steps:
            ds.to_ours(model, drafter)
            ev = heldout_metrics(drafter, source, held, cfg)
            metrics.write(json.dumps({"step": step, **{k: (None if isinstance(v, float) and math.isnan(v) else v)
                                                       for k, v in ev.items()}}) + "\n")
            out = run_dir / "checkpoints" / f"step_{step}"
            drafter.save_pretrained(out)
            (out / "run.yaml").write_text(to_yaml(cfg))     # as our checkpoints carry it: evals read the config
            print(f"step {step}: loss {rec['train/loss']:.4f}, held-out E[τ] {ev['eval/expected_tau']:.3f}",
                  flush=True)
        metrics.flush()

    try:
        ds.train(ck, model, batches, args.steps, tc.lr, tc.warmup_ratio, tc.grad_clip, on_step)
    finally:
        metrics.close()
    return run_dir / "checkpoints" / f"step_{args.steps}"


def _curve(run_dir: Path) -> List[Tuple[float, float, int, Optional[float]]]:
    """(cumulative training CPU seconds, held-out E[τ], step, position-1 acceptance) at each held-out
    evaluation of a run's metrics.jsonl."""
    cpu, out = 0.0, []
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    last_step = 0
    for r in sorted(rows, key=lambda r: (r["step"], "eval/expected_tau" in r)):
        if "step_cpu_s" in r and r["step"] > last_step:
            cpu += r["step_cpu_s"] * (r["step"] - last_step)
            last_step = r["step"]
        if "eval/expected_tau" in r:
            out.append((cpu, r["eval/expected_tau"], r["step"], r.get("eval/accept_rate/1")))
    return out


def _seconds_to(curve, tau: float):
    """The training CPU seconds at which a curve first reaches ``tau`` (linear between evaluations), or None."""
    prev = (0.0, 1.0)
    for point in curve:
        if point[1] >= tau:
            (c0, t0), (c1, t1) = prev[:2], point[:2]
            return c0 + (c1 - c0) * ((tau - t0) / (t1 - t0) if t1 != t0 else 1.0)
        prev = point
    return None


def compare(ours: Path, theirs: Path) -> Dict:
    """Final held-out E[τ] of each run, the training CPU seconds each needs to reach the other's, and both
    curves (step, CPU seconds so far, held-out E[τ], position-1 acceptance)."""
    a, b = _curve(ours), _curve(theirs)
    out = {"ours": {"run_dir": str(ours), "final_tau": a[-1][1], "steps": a[-1][2], "cpu_s": a[-1][0]},
           "deepspec": {"run_dir": str(theirs), "final_tau": b[-1][1], "steps": b[-1][2], "cpu_s": b[-1][0]}}
    t_ours = _seconds_to(a, b[-1][1])
    out["ours_seconds_to_deepspec_final"] = t_ours
    out["speedup_to_equal_quality"] = b[-1][0] / t_ours if t_ours else None
    t_theirs = _seconds_to(b, a[-1][1])
    out["deepspec_seconds_to_ours_final"] = t_theirs
    out["speedup_to_our_final"] = t_theirs / a[-1][0] if t_theirs else None
    out["cpu_s_per_step_ratio"] = (b[-1][0] / b[-1][2]) / (a[-1][0] / a[-1][2])
    out["curves"] = {side: [{"step": st, "cpu_s": round(c, 1), "expected_tau": t, "accept_1": p}
                            for c, t, st, p in curve]
                     for side, curve in (("ours", a), ("deepspec", b))}
    return out


def compare_markdown(rec: Dict) -> str:
    """The compare record as a table: held-out E[τ] (P₁) of both trainers at each evaluation step."""
    ours = {r["step"]: r for r in rec["curves"]["ours"]}
    theirs = {r["step"]: r for r in rec["curves"]["deepspec"]}
    fmt = lambda r: "–" if r is None else (f"{r['expected_tau']:.3f} ({r['accept_1']:.3f})"   # noqa: E731
                                           if r.get("accept_1") is not None else f"{r['expected_tau']:.3f}")
    lines = [f"# Our trainer against DeepSpec's on the same data ({rec['date'][:10]})", "",
             f"`{rec['command']}`", "",
             "| step | ours: held-out E[τ] (P₁) | DeepSpec: held-out E[τ] (P₁) | ours: CPU s | DeepSpec: CPU s |",
             "|---:|---:|---:|---:|---:|"]
    for st in sorted(set(ours) | set(theirs)):
        o, t = ours.get(st), theirs.get(st)
        lines.append(f"| {st} | {fmt(o)} | {fmt(t)} | {o['cpu_s'] if o else '–'} | {t['cpu_s'] if t else '–'} |")
    lines += ["", f"Training CPU seconds per step, DeepSpec ÷ ours: {rec['cpu_s_per_step_ratio']:.2f}.",
              "DeepSpec's CPU seconds to our final held-out E[τ] ÷ ours: "
              + (f"{rec['speedup_to_our_final']:.2f}" if rec["speedup_to_our_final"] else "not reached") + ".",
              "Our CPU seconds to DeepSpec's final: "
              + (f"{rec['ours_seconds_to_deepspec_final']:.0f}" if rec["ours_seconds_to_deepspec_final"]
                 else "not reached") + "."]
    return "\n".join(lines) + "\n"
