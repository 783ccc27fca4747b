"""Draft training step, ours vs DeepSpec's own DSpark code (deepseek-ai/DeepSpec), on this CPU.

    python bench/train_vs_deepspec.py --deepspec /path/to/DeepSpec     # both sides, SmolLM2-135M sizes
    python bench/train_vs_deepspec.py                                  # our side only
    python bench/train_vs_deepspec.py --deepspec DIR --hidden 960 --heads 15 --kv-heads 5 --intermediate 2560

Both sides run the same step at the same sizes (default: SmolLM2-135M, H 576, 9/3 heads,
V 49,152, intermediate 1536, 30 target layers; 5 feature layers, 1 draft layer, γ 7, 16
anchors × 4 sequences × 384 tokens, Markov rank 64 + confidence head, fp32): forward, loss,
backward and a plain AdamW step, on the same seeded inputs (token ids, target features, last
hidden states) and the same seeded frozen embedding / LM head.  Each run is a fresh process
(ours, DeepSpec, ours, DeepSpec … for --rounds), which keeps the two `deepspec` packages apart
and gives each its own peak RSS (getrusage high-water mark).  Draft positions/s = anchors × γ ×
sequences per step / step time, over the timed steps after --warmup.  "Added by training" =
peak RSS − RSS just before the drafter is built (imports, inputs and frozen weights already held).

DeepSpec's side is Qwen3DSparkModel + compute_dspark_loss from the checkout given by --deepspec
(never vendored), configured with the same sizes (Qwen3 = Llama + q/k norm; our draft layers
have q/k norm too), `attn_implementation="sdpa"` (PR #41's dense-mask path: flex_attention has
no CPU backward) and a 1-process gloo group for the loss's all-reduce.  A checkout without that
path gets an equivalent dense mask patched in at run time, stated in the record.  Their drafter
owns copies of the embedding and LM head (their `initialize_embeddings_and_head`); ours reads
the target's.  Writes bench/results/train_vs_deepspec.json (not a test: timings are the machine's).
"""
from __future__ import annotations

import argparse
import hashlib
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
SIDES = {"ours": "ours (dspark), fp32", "ours_defaults": "ours (dspark), trainer defaults",
         "deepspec": "DeepSpec (DSpark)"}
# "ours_defaults": what `deepspec train` does on this machine — bf16 autocast where the CPU computes bf16
# natively (train.bf16=null) and the trainer's fused AdamW; "ours" and DeepSpec: fp32, plain AdamW.


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0   # Linux: KiB


def _cpu_name() -> str:
    info = Path("/proc/cpuinfo")
    names = [ln.split(":", 1)[1].strip() for ln in (info.read_text().splitlines() if info.exists() else [])
             if ln.startswith("model name")]
    return names[0] if names else platform.processor()


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


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
            # our drafter takes its anchors (all valid: p + γ < T); DeepSpec's samples its own
            "anchors": torch.stack([torch.randperm(T - gamma - 1, generator=g)[:A].sort().values
                                    for _ in range(S)])}


def ours_step_fn(c: dict, x: dict):
    """Our dspark drafter on a head-only target: the features are inputs, so its decoder layers never run."""
    import torch
    from transformers import AutoModelForCausalLM
    from deepspec.config.draft import DraftConfig
    from deepspec.drafts import build_drafter
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
    target = TargetAdapter(model, None, layer_ids=c["layer_ids"], name="bench")
    torch.manual_seed(c["seed"])
    draft = build_drafter(target, DraftConfig(algorithm="dspark", gamma=c["gamma"], num_layers=c["layers"],
                                              sequential_head="markov", head_rank=c["rank"],
                                              confidence_head=True, mask_token_id=0)).train()
    ones = torch.ones_like(x["input_ids"], dtype=torch.bool)
    batch = {"input_ids": x["input_ids"], "attention_mask": ones, "loss_mask": ones, "anchors": x["anchors"],
             "features": x["features"], "last_hidden": x["last_hidden"]}
    return draft, lambda: draft(batch)["loss"], {}


def _dense_mask(*, anchor_positions, block_keep_mask, seq_len, block_size, device, **_):
    """Additive [B, 1, Q, KV] mask with DeepSpec's DSpark semantics, for checkouts without PR #41:
    query block i sees context < its anchor and its own block only; rows of dropped blocks see key 0."""
    import torch
    B, N = anchor_positions.shape
    kv = torch.arange(seq_len + N * block_size, device=device)
    qb = torch.arange(N * block_size, device=device) // block_size
    ctx = (kv < seq_len) & (kv.view(1, 1, -1) < anchor_positions[:, qb].unsqueeze(-1))
    own = (kv >= seq_len) & (qb.view(-1, 1) == (kv - seq_len).div(block_size, rounding_mode="floor"))
    ok = (ctx | own) & block_keep_mask[:, qb].unsqueeze(-1)
    ok[..., 0] |= ~ok.any(-1)
    return torch.zeros(ok.shape, device=device).masked_fill(~ok, torch.finfo(torch.float32).min).unsqueeze(1)


def deepspec_step_fn(c: dict, x: dict):
    import inspect
    import tempfile
    import torch
    import torch.distributed as dist
    from transformers import Qwen3Config
    from deepspec.modeling.dspark import common, loss as ds_loss
    from deepspec.modeling.dspark.qwen3 import modeling as qm
    from deepspec.modeling.dspark.qwen3.config import build_draft_config
    from deepspec.utils import metrics
    from deepspec.utils.config import ConfigNode

    if not dist.is_initialized():   # compute_dspark_loss all-reduces its denominators
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp(prefix='ds_gloo_')}",
                                rank=0, world_size=1)
    patched = "attn_implementation" not in inspect.signature(common.create_dspark_attention_mask).parameters
    if patched:
        qm.create_dspark_attention_mask = _dense_mask
    H = c["hidden"]
    tcfg = Qwen3Config(vocab_size=c["vocab"], hidden_size=H, intermediate_size=c["intermediate"],
                       num_hidden_layers=c["target_layers"], num_attention_heads=c["heads"],
                       num_key_value_heads=c["kv_heads"], head_dim=H // c["heads"], tie_word_embeddings=False)
    margs = ConfigNode(block_size=c["gamma"], num_draft_layers=c["layers"], target_layer_ids=c["layer_ids"],
                       mask_token_id=0, num_anchors=c["anchors"], markov_rank=c["rank"],
                       markov_head_type="vanilla", confidence_head_alpha=1.0, confidence_head_with_markov=True,
                       loss_decay_gamma=4.0, ce_loss_alpha=0.1, l1_loss_alpha=0.9, attn_implementation="sdpa")
    dcfg = build_draft_config(tcfg, margs)
    dcfg._attn_implementation = "sdpa"
    torch.manual_seed(c["seed"])
    model = qm.Qwen3DSparkModel(dcfg).float().train()
    src_e = torch.nn.Embedding(c["vocab"], H, _weight=x["embed"])
    src_h = torch.nn.Linear(H, c["vocab"], bias=False, device="meta")
    src_h.weight = torch.nn.Parameter(x["head"])
    model.initialize_embeddings_and_head(embed_tokens=src_e, lm_head=src_h, freeze=True)
    del src_e, src_h
    x.pop("embed"), x.pop("head")   # their drafter holds its own copies from here on
    lm = torch.ones(x["input_ids"].shape)

    def step():
        out = model(input_ids=x["input_ids"], target_hidden_states=x["features"], loss_mask=lm,
                    target_last_hidden_states=x["last_hidden"])
        loss = ds_loss.compute_dspark_loss(outputs=out, loss_decay_gamma=4.0, ce_loss_alpha=0.1,
                                           l1_loss_alpha=0.9, confidence_head_alpha=1.0)
        metrics.reset()   # their trainer flushes these every logging window
        return loss
    mask = "dense mask patched in by this benchmark (checkout predates PR #41)" if patched else \
        "DeepSpec's own dense mask (PR #41)"
    return model, step, {"attention": f"sdpa, {mask}"}


def worker(side: str, c: dict) -> dict:
    """One run in this process: build, warm up, time; returns the run's record."""
    if side == "deepspec":
        sys.path.insert(0, c["deepspec_path"])
    else:
        sys.path.insert(0, str(REPO))
    import torch
    import transformers
    torch.set_num_threads(c["threads"])
    x = shared_inputs(c)
    import deepspec
    if side == "deepspec":   # every module each side needs is imported before the baseline
        import deepspec.modeling.dspark.loss  # noqa: F401
        import deepspec.modeling.dspark.qwen3  # noqa: F401
    else:
        import deepspec.drafts  # noqa: F401
        import deepspec.targets.tiny  # noqa: F401
        import transformers.models.llama.modeling_llama  # noqa: F401
    baseline = _rss_mb()
    model, step, info = (deepspec_step_fn if side == "deepspec" else ours_step_fn)(c, x)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
    if side == "ours_defaults":
        import contextlib
        from deepspec.config.train import TrainConfig
        from deepspec.train.optim import build_adamw, trainable_named_parameters
        from deepspec.train.precision import use_bf16
        opt = build_adamw(trainable_named_parameters(model), TrainConfig(lr=1e-4, weight_decay=0.0))
        bf16 = use_bf16(None, torch.device("cpu"))
        info = {**info, "bf16_autocast": bf16, "optimizer": "fused AdamW" if opt.defaults.get("fused") else "AdamW"}
        plain_step = step

        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
                return plain_step()
    positions = c["anchors"] * c["gamma"] * c["seqs"]
    times, losses = [], []
    for i in range(c["warmup"] + c["steps"]):
        t0 = time.perf_counter()
        loss = step()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        losses.append(float(loss.detach()))
        if i >= c["warmup"]:
            times.append(dt)
        _log(f"  {side} step {i + 1}/{c['warmup'] + c['steps']}{' (warm-up)' if i < c['warmup'] else ''}: "
             f"{dt:.2f}s, {positions / dt:.0f} pos/s, loss {losses[-1]:.4f}")
    rates = [positions / t for t in times]
    peak = _rss_mb()
    return {"side": side, "package": str(Path(deepspec.__file__).parent), **info,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "trainable_params": sum(p.numel() for p in params), "positions_per_step": positions,
            "step_s": [round(t, 6) for t in times], "positions_per_s": round(statistics.median(rates), 1),
            "positions_per_s_min": round(min(rates), 1), "positions_per_s_max": round(max(rates), 1),
            "baseline_rss_mb": round(baseline, 1), "peak_rss_mb": round(peak, 1),
            "added_rss_mb": round(peak - baseline, 1), "loss_first": losses[0], "loss_last": losses[-1]}


def launch(side: str, c: dict) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(c["threads"]), "MKL_NUM_THREADS": str(c["threads"]),
           "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", side, "--spec", json.dumps(c)]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=str(REPO / "bench"))
    if p.returncode != 0:
        raise RuntimeError(f"{side} run failed (exit {p.returncode}); its stderr is above")
    return json.loads(p.stdout.strip().splitlines()[-1])


def checkout_id(path: str) -> dict:
    """Which DeepSpec code ran: the git commit when it is a checkout, and a hash of its DSpark sources."""
    root = Path(path)
    h = hashlib.sha256()
    for f in sorted((root / "deepspec" / "modeling" / "dspark").rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    r = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
    return {"path": str(root), "commit": r.stdout.strip() if r.returncode == 0 else None,
            "dspark_sources_sha256": h.hexdigest()}


def summarize(runs: list) -> dict:
    rates = [r["positions_per_step"] / t for r in runs for t in r["step_s"]]
    med = lambda k: round(statistics.median(r[k] for r in runs), 1)  # noqa: E731
    return {"runs": len(runs), "positions_per_s": round(statistics.median(rates), 1),
            "positions_per_s_min": round(min(rates), 1), "positions_per_s_max": round(max(rates), 1),
            "peak_rss_mb": med("peak_rss_mb"), "added_rss_mb": med("added_rss_mb"),
            "baseline_rss_mb": med("baseline_rss_mb")}


def render_train_vs_deepspec(record: dict) -> str:
    """Markdown: the record's table (medians over every timed step / run) and its configuration."""
    c, s = record["config"], record["summary"]
    sides = [k for k in ("deepspec", "ours", "ours_defaults") if k in s]
    ours = [k for k in sides if k != "deepspec"] if "deepspec" in sides else []
    head = "| | " + " | ".join(SIDES[k] for k in sides) + "".join(f" | {SIDES[k]} / DeepSpec" for k in ours) + " |"
    lines = [head, "|---" * (len(sides) + 1 + len(ours)) + "|"]
    def rate(v):
        return f"{v['positions_per_s']:,.0f} ({v['positions_per_s_min']:,.0f}–{v['positions_per_s_max']:,.0f})"
    rows = [("draft positions/s, median (min–max)", "positions_per_s", rate),
            ("peak RSS (MB)", "peak_rss_mb", lambda v: f"{v['peak_rss_mb']:,.0f}"),
            ("RSS added by training (MB)", "added_rss_mb", lambda v: f"{v['added_rss_mb']:,.0f}")]
    for label, key, fmt in rows:
        cells = [fmt(s[k]) for k in sides] + [f"{s[k][key] / s['deepspec'][key]:.2f}" for k in ours]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    m = record["machine"]
    lines.append("")
    lines.append(f"H {c['hidden']}, {c['heads']}/{c['kv_heads']} heads, V {c['vocab']:,}, intermediate "
                 f"{c['intermediate']}, {c['target_layers']} target layers, {len(c['layer_ids'])} feature layers, "
                 f"{c['layers']} draft layer(s), γ {c['gamma']}, {c['anchors']} anchors × {c['seqs']} sequences × "
                 f"{c['seq_len']} tokens, Markov rank {c['rank']} + confidence head, {c['threads']} threads; "
                 f"forward + loss + backward + AdamW, {c['steps']} timed steps per run after {c['warmup']} warm-up, "
                 f"{s[sides[0]]['runs']} run(s) per side, alternating processes; {m['cpu']}, torch {m['torch']}.")
    loads = [r["load_avg_1m"] for r in record.get("runs", [])]
    if loads:
        lines[-1] += f" 1-min load average at the runs' starts {min(loads):.1f}–{max(loads):.1f} on {m['cpus']} CPUs."
    for note in record.get("notes", []):
        lines.append(f"\n{note}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=list(SIDES), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--deepspec", metavar="PATH", help="a DeepSpec checkout (omit: our side only)")
    for name, default in [("hidden", 576), ("heads", 9), ("kv-heads", 3), ("intermediate", 1536), ("vocab", 49152),
                          ("target-layers", 30), ("feature-layers", 5), ("layers", 1), ("gamma", 7),
                          ("anchors", 16), ("seqs", 4), ("seq-len", 384), ("rank", 64), ("steps", 25),
                          ("warmup", 2), ("threads", 2), ("rounds", 3), ("seed", 0)]:
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "train_vs_deepspec.json"))
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, json.loads(args.spec))))
        return 0

    sys.path.insert(0, str(REPO))
    from deepspec.targets import default_layer_ids
    c = {k: v for k, v in vars(args).items() if k not in ("worker", "spec", "out", "deepspec", "rounds")}
    c["layer_ids"] = default_layer_ids(args.target_layers, args.feature_layers)
    sides = ["ours", "ours_defaults"]
    if args.deepspec:
        c["deepspec_path"] = str(Path(args.deepspec).resolve())
        sides.append("deepspec")
    runs = []
    for r in range(1, args.rounds + 1):
        for side in sides:
            _log(f"round {r}/{args.rounds}: {SIDES[side]} (load average {os.getloadavg()[0]:.2f}) ...")
            run = {"round": r, "load_avg_1m": round(os.getloadavg()[0], 2), **launch(side, c)}
            _log(f"round {r}/{args.rounds}: {SIDES[side]}: {run['positions_per_s']:.0f} pos/s, peak RSS "
                 f"{run['peak_rss_mb']:.0f} MB (+{run['added_rss_mb']:.0f} MB)")
            runs.append(run)
    summary = {k: summarize([r for r in runs if r["side"] == k]) for k in sides}
    record = {"bench": "train_vs_deepspec", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "machine": {"cpu": _cpu_name(), "cpus": os.cpu_count(), "platform": platform.platform(),
                          "python": platform.python_version(), "torch": runs[0]["torch"],
                          "transformers": runs[0]["transformers"]},
              "config": {k: v for k, v in c.items() if k != "deepspec_path"},
              "deepspec": checkout_id(c["deepspec_path"]) if args.deepspec else None,
              "runs": runs, "summary": summary, "notes": []}
    if args.deepspec:
        d = summary["deepspec"]
        record["ratios"] = {side: {k: round(summary[side][k] / d[k], 3) for k in ("positions_per_s", "peak_rss_mb",
                                                                               "added_rss_mb")}
                            for side in sides if side != "deepspec"}
        attention = next(r["attention"] for r in runs if r["side"] == "deepspec")
        record["notes"].append(
            f"DeepSpec: {attention} (flex_attention has no backward on CPU); its drafter "
            "holds its own copies of the embedding and LM head, ours reads the target's.")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(render_train_vs_deepspec(record))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
