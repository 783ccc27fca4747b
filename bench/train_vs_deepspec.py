"""Our trainer against DeepSpec's own DSpark code (deepseek-ai/DeepSpec), speed and quality.

    python bench/train_vs_deepspec.py speed --deepspec PATH            # one step, interleaved, at SmolLM2 sizes
    python bench/train_vs_deepspec.py speed                            # our side only
    python bench/train_vs_deepspec.py quality --deepspec PATH --run-dir DIR --layers 5 --steps 2000 -- OVERRIDES
    python bench/train_vs_deepspec.py compare --ours RUN_DIR --theirs RUN_DIR   # time to DeepSpec's quality

**speed**: one draft training step (forward, loss, backward, optimizer) at the same sizes on the same seeded
inputs (default SmolLM2-135M: H 576, 9/3 heads, V 49,152, intermediate 1536, 30 target layers, 5 feature
layers, γ 7, 16 anchors × 4 sequences × 384 tokens, Markov rank 64 + confidence head).  Each side runs in
its own long-lived process at ``--threads`` (1) thread(s); the parent steps them in turn, one step each per
round, so every side meets the same machine state, and each step reports its wall time and its process CPU
time.  At one thread CPU time is the robust number: another process's load slows the wall clock, not the
CPU seconds the step itself spends.  The 1-minute load average is sampled every round; a run whose load
leaves the quiet range (< ``--quiet-load``, 1.7 on 2 cores: our one running worker is 1.0) is flagged in
the record.  Sides: ours and DeepSpec's at equal precision both ways (fp32; bf16 autocast), each with its
own optimizer (ours: the trainer's fused AdamW; theirs: torch AdamW), and DeepSpec's own bf16 setting (bf16
weights, fp32 master copy: their `BF16Optimizer`).  Their side is their Qwen3DSparkModel +
compute_dspark_loss from the checkout (`bench/deepspec_side.py`), with a dense attention mask where the
checkout has flex_attention only (no backward on a CPU).  Record: bench/results/train_vs_deepspec.json.

**quality**: DeepSpec's trainer on one of our training configs (`bench/deepspec_quality.py`); **compare**:
the training seconds (Σ step CPU time) each run needs to reach the other's final held-out E[τ].
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench.records import header, write_record  # noqa: E402

SIDES = {"ours_fp32": ("ours", "fp32"), "deepspec_fp32": ("deepspec", "fp32"),
         "ours_bf16": ("ours", "bf16"), "deepspec_bf16": ("deepspec", "bf16"),
         "deepspec_native": ("deepspec", "native")}
LABELS = {"ours_fp32": "ours, fp32", "deepspec_fp32": "DeepSpec, fp32", "ours_bf16": "ours, bf16 autocast",
          "deepspec_bf16": "DeepSpec, bf16 autocast", "deepspec_native": "DeepSpec, bf16 weights (its own setting)"}


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0   # Linux: KiB


def shared_inputs(c: dict) -> dict:
    """The seeded inputs and frozen weights both sides train on (identical tensors on both)."""
    import torch
    g = torch.Generator().manual_seed(c["seed"])
    S, T, H, V, A, gamma = c["seqs"], c["seq_len"], c["hidden"], c["vocab"], c["anchors"], c["gamma"]
    return {"embed": torch.empty(V, H).normal_(0, 0.02, generator=g),
            "head": torch.empty(V, H).normal_(0, 0.02, generator=g),
            "input_ids": torch.randint(0, V, (S, T), generator=g),
            "features": torch.randn(S, T, len(c["layer_ids"]) * H, generator=g),
            "last_hidden": torch.randn(S, T, H, generator=g),
            "anchors": torch.stack([torch.randperm(T - gamma - 1, generator=g)[:A].sort().values
                                    for _ in range(S)])}


def _head_only_target(c: dict, x: dict):
    """A target with the benchmark's sizes and no decoder layers (the features are inputs)."""
    import torch
    from transformers import AutoModelForCausalLM
    from deepspec.targets import TargetAdapter
    from deepspec.targets.tiny import tiny_config
    cfg = tiny_config("llama", c["vocab"], num_layers=c["target_layers"], hidden_size=c["hidden"])
    cfg.num_attention_heads, cfg.num_key_value_heads = c["heads"], c["kv_heads"]
    cfg.head_dim, cfg.intermediate_size = c["hidden"] // c["heads"], c["intermediate"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    model.model.layers = torch.nn.ModuleList()
    model = model.to_empty(device="cpu")
    model.get_input_embeddings().weight = torch.nn.Parameter(x["embed"], requires_grad=False)
    model.get_output_embeddings().weight = torch.nn.Parameter(x["head"], requires_grad=False)
    return TargetAdapter(model, None, layer_ids=c["layer_ids"], name="bench")


def ours_step(c: dict, x: dict):
    import torch
    from deepspec.config.draft import DraftConfig
    from deepspec.config.train import TrainConfig
    from deepspec.drafts import build_drafter
    from deepspec.train.optim import build_adamw, trainable_named_parameters
    target = _head_only_target(c, x)
    torch.manual_seed(c["seed"])
    draft = build_drafter(target, DraftConfig(algorithm="dspark", gamma=c["gamma"], num_layers=c["layers"],
                                              sequential_head="markov", head_rank=c["rank"],
                                              confidence_head=True, mask_token_id=0)).train()
    ones = torch.ones_like(x["input_ids"], dtype=torch.bool)
    batch = {"input_ids": x["input_ids"], "attention_mask": ones, "loss_mask": ones, "anchors": x["anchors"],
             "features": x["features"], "last_hidden": x["last_hidden"]}
    opt = build_adamw(trainable_named_parameters(draft), TrainConfig(lr=1e-4, weight_decay=0.0))
    return draft, (lambda: draft(batch)["loss"]), opt, "fused AdamW" if opt.defaults.get("fused") else "AdamW"


def deepspec_step(c: dict, x: dict, native_bf16: bool):
    import torch
    import deepspec_side as ds
    ck = ds.load_checkout(c["deepspec_path"])
    target = _head_only_target(c, x)
    margs = ds.model_args(ck, c["gamma"], c["layers"], c["layer_ids"], 0, c["anchors"], c["rank"])
    torch.manual_seed(c["seed"])
    model = ds.build_dspark(ck, target, margs, torch.bfloat16 if native_bf16 else torch.float32)
    dtype = torch.bfloat16 if native_bf16 else torch.float32
    lm = torch.ones(x["input_ids"].shape, dtype=dtype)
    feats, last = x["features"].to(dtype), x["last_hidden"].to(dtype)

    def step():
        out = model(input_ids=x["input_ids"], target_hidden_states=feats, loss_mask=lm,
                    target_last_hidden_states=last)
        loss = ck.loss.compute_dspark_loss(outputs=out, loss_decay_gamma=4.0, ce_loss_alpha=0.1,
                                           l1_loss_alpha=0.9, confidence_head_alpha=1.0)
        ck.metrics.reset()
        return loss
    if native_bf16:
        opt = ck.optim.BF16Optimizer(model, lr=1e-4, total_steps=10 ** 6, warmup_ratio=0.0)
        name = "their BF16Optimizer (bf16 weights, fp32 master copy, AdamW)"
    else:
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.0)
        name = "AdamW"
    mask = "dense mask patched in (the checkout's is flex-only)" if ck.patched_mask else "its own dense mask"
    return model, step, opt, f"{name}; attention: sdpa, {mask}"


def worker(key: str, c: dict) -> None:
    """One side in this process: build, then answer ``step`` (one timed step) and ``stats`` on stdin."""
    import contextlib
    import torch
    torch.set_num_threads(c["threads"])
    side, precision = SIDES[key]
    x = shared_inputs(c)
    baseline = _rss_mb()
    if side == "ours":
        model, step, opt, optimizer = ours_step(c, x)
    else:
        model, step, opt, optimizer = deepspec_step(c, x, precision == "native")
    autocast = precision == "bf16"
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    for line in sys.stdin:
        if line.strip() == "stats":
            print(json.dumps({"baseline_rss_mb": round(baseline, 1), "peak_rss_mb": round(_rss_mb(), 1),
                              "trainable_params": params, "optimizer": optimizer,
                              "torch": torch.__version__}), flush=True)
            continue
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            loss = step()
        loss.backward()
        opt.step()                       # their BF16Optimizer clears the gradients itself
        if isinstance(opt, torch.optim.Optimizer):
            opt.zero_grad(set_to_none=True)
        print(json.dumps({"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0,
                          "loss": float(loss.detach())}), flush=True)


def _start(key: str, c: dict) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(c["threads"]), "MKL_NUM_THREADS": str(c["threads"])}
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", key, "--spec", json.dumps(c)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=str(REPO))


def _ask(p: subprocess.Popen, what: str) -> dict:
    p.stdin.write(what + "\n")
    p.stdin.flush()
    line = p.stdout.readline()
    if not line:
        raise RuntimeError(f"a benchmark worker died (exit {p.wait()}); its stderr is above")
    return json.loads(line)


def interleave(keys, c: dict) -> dict:
    """Every side's steps in turn (round r: one step of each side), with the load average of each round."""
    procs = {k: _start(k, c) for k in keys}
    steps = {k: [] for k in keys}
    loads = []
    try:
        for r in range(c["warmup"] + c["steps"]):
            loads.append(round(os.getloadavg()[0], 2))
            for k in keys:
                s = _ask(procs[k], "step")
                if r >= c["warmup"]:
                    steps[k].append(s)
            print(f"round {r + 1}/{c['warmup'] + c['steps']}: " + ", ".join(
                f"{k} {c['positions'] / steps[k][-1]['cpu']:.0f} pos/CPU-s" for k in keys if steps[k]),
                file=sys.stderr, flush=True)
        stats = {k: _ask(procs[k], "stats") for k in keys}
    finally:
        for p in procs.values():
            p.stdin.close()
            p.wait(timeout=60)
    return {"steps": steps, "stats": stats, "loads": loads}


def summarize(c: dict, res: dict) -> dict:
    out = {}
    for k, st in res["steps"].items():
        cpu = [c["positions"] / s["cpu"] for s in st]
        wall = [c["positions"] / s["wall"] for s in st]
        out[k] = {"label": LABELS[k], "positions_per_cpu_s": round(statistics.median(cpu), 1),
                  "positions_per_cpu_s_range": [round(min(cpu), 1), round(max(cpu), 1)],
                  "positions_per_s": round(statistics.median(wall), 1), **res["stats"][k],
                  "loss_first": st[0]["loss"], "loss_last": st[-1]["loss"]}
    return out


def markdown(record: dict) -> str:
    s, c = record["summary"], record["config"]
    lines = ["| side | positions per CPU-second, median (range) | positions/s, wall | peak RSS MB | added MB |",
             "|---|---:|---:|---:|---:|"]
    for v in s.values():
        lo, hi = v["positions_per_cpu_s_range"]
        lines.append(f"| {v['label']} | {v['positions_per_cpu_s']:,.0f} ({lo:,.0f}–{hi:,.0f}) | "
                     f"{v['positions_per_s']:,.0f} | {v['peak_rss_mb']:,.0f} | "
                     f"{v['peak_rss_mb'] - v['baseline_rss_mb']:,.0f} |")
    for k, r in (record.get("ratios") or {}).items():
        lines.append(f"\n{k}: {r['per_cpu_s']:.2f}× per CPU-second" +
                     (f", {r['per_wall_s']:.2f}× per wall second" if "per_wall_s" in r else ""))
    loads = record["load_avg_1m"]
    lines.append(f"\nH {c['hidden']}, V {c['vocab']:,}, {c['layers']} draft layer(s), γ {c['gamma']}, {c['anchors']} "
                 f"anchors × {c['seqs']} sequences × {c['seq_len']} tokens, Markov rank {c['rank']}; {c['steps']} "
                 f"interleaved steps per side after {c['warmup']} warm-up, {c['threads']} thread(s); 1-minute load "
                 f"{min(loads):.2f}–{max(loads):.2f} ({'quiet' if record['quiet'] else 'NOT quiet'}).")
    return "\n".join(lines)


def speed(args) -> int:
    from deepspec.targets import default_layer_ids
    c = {k: getattr(args, k.replace("-", "_")) for k in ("hidden", "heads", "kv_heads", "intermediate", "vocab",
                                                         "target_layers", "layers", "gamma", "anchors", "seqs",
                                                         "seq_len", "rank", "steps", "warmup", "threads", "seed")}
    c["layer_ids"] = default_layer_ids(args.target_layers, args.feature_layers)
    c["positions"] = c["anchors"] * c["gamma"] * c["seqs"]
    keys = ["ours_fp32", "ours_bf16"]
    if args.deepspec:
        c["deepspec_path"] = str(Path(args.deepspec).resolve())
        keys = ["ours_fp32", "deepspec_fp32", "ours_bf16", "deepspec_bf16", "deepspec_native"]
    res = interleave(keys, c)
    summary = summarize(c, res)
    quiet = max(res["loads"]) < args.quiet_load
    record = {**header(bench="train_vs_deepspec"), "config": {k: v for k, v in c.items() if k != "deepspec_path"},
              "summary": summary, "load_avg_1m": res["loads"], "quiet": quiet, "quiet_load": args.quiet_load,
              "steps": res["steps"]}
    if args.deepspec:
        import deepspec_side as ds
        record["deepspec"] = ds.checkout_id(c["deepspec_path"])
        record["ratios"] = {f"ours/deepspec, {p}": {
            "per_cpu_s": round(summary[f"ours_{p}"]["positions_per_cpu_s"] / summary[f"deepspec_{p}"]["positions_per_cpu_s"], 3),
            "per_wall_s": round(summary[f"ours_{p}"]["positions_per_s"] / summary[f"deepspec_{p}"]["positions_per_s"], 3)}
            for p in ("fp32", "bf16")}
        record["ratios"]["ours bf16 / deepspec's own bf16 setting"] = {"per_cpu_s": round(
            summary["ours_bf16"]["positions_per_cpu_s"] / summary["deepspec_native"]["positions_per_cpu_s"], 3)}
    print(json.dumps({k: v for k, v in record.items() if k in ("summary", "ratios", "quiet")}, indent=1))
    out = write_record(record, "train_vs_deepspec", out=args.out, markdown=markdown(record))
    if not quiet:
        print(f"WARNING: the 1-minute load reached {max(res['loads']):.2f} (quiet: < {args.quiet_load}); the wall "
              "times are not comparable across runs, the CPU times still are", file=sys.stderr)
    print(f"wrote {out}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=list(SIDES), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    sub = ap.add_subparsers(dest="mode")
    sp = sub.add_parser("speed", help="one training step, ours vs DeepSpec's, interleaved")
    sp.add_argument("--deepspec", metavar="PATH", help="a DeepSpec checkout (omit: our side only)")
    for name, default in [("hidden", 576), ("heads", 9), ("kv-heads", 3), ("intermediate", 1536), ("vocab", 49152),
                          ("target-layers", 30), ("feature-layers", 5), ("layers", 1), ("gamma", 7), ("anchors", 16),
                          ("seqs", 4), ("seq-len", 384), ("rank", 64), ("steps", 20), ("warmup", 2), ("threads", 1),
                          ("seed", 0)]:
        sp.add_argument(f"--{name}", type=int, default=default)
    sp.add_argument("--quiet-load", type=float, default=1.7)
    sp.add_argument("--out", default=None, help="record path (default bench/results/train_vs_deepspec.json)")
    q = sub.add_parser("quality", help="DeepSpec's trainer on one of our training configs")
    q.add_argument("--deepspec", metavar="PATH", required=True)
    q.add_argument("--run-dir", required=True)
    for name, default in [("layers", 5), ("rank", 256), ("steps", 2000), ("eval-every", 250)]:
        q.add_argument(f"--{name}", type=int, default=default)
    q.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                   help="bf16: DeepSpec's own setting (bf16 weights, fp32 master copy)")
    q.add_argument("overrides", nargs="*", help="our training config's overrides (cache, split, batch, anchors)")
    cmp = sub.add_parser("compare", help="training seconds to the other run's final held-out E[τ]")
    cmp.add_argument("--ours", required=True)
    cmp.add_argument("--theirs", required=True)
    cmp.add_argument("--label", default="quality", help="record bench/results/train_vs_deepspec-LABEL.{json,md}")
    cmp.add_argument("--out", default=None, help="record path (default: from --label)")
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, json.loads(args.spec))
        return 0
    if args.mode == "quality":
        import deepspec_quality
        print(deepspec_quality.run(args))
        return 0
    if args.mode == "compare":
        import deepspec_quality
        rec = {**header(bench="train_vs_deepspec quality"),
               **deepspec_quality.compare(Path(args.ours), Path(args.theirs))}
        write_record(rec, "train_vs_deepspec", out=args.out, label=args.label,
                     markdown=deepspec_quality.compare_markdown(rec))
        return 0
    if args.mode == "speed":
        return speed(args)
    ap.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
