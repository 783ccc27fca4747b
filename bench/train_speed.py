"""Benchmark (not a test): what a draft training step costs, in four modes.

    .venv/bin/python bench/train_speed.py strategies --drafters dspark --strategies single,ddp --steps 8
    .venv/bin/python bench/train_speed.py online --steps 4 --threads 1 --probe-reps 2
    .venv/bin/python bench/train_speed.py memory --algorithm eagle3 --chunks 0,4,16
    .venv/bin/python bench/train_speed.py vocab --work bench/work/conv --curve bench/results/learning_curve-vocab.json

Modes, each with its record under `bench/results/`:

- ``strategies`` (`train_throughput.json`; ``--online``: `train_throughput-online.json`): tokens/s and
  peak RSS of `deepspec train` per drafter × strategy (single, DDP, FSDP, DeepSpeed) on synthetic
  conversations and their cache, each configuration a fresh process (torchrun with ``--nproc``
  processes for the distributed ones); tokens/s is the median of metrics.jsonl after the first step.
- ``online`` (`online_vs_cached.json`): the same drafter, batches and seed trained with features from
  the cache and with the target inside training (``data.online``), each a fresh single process; then
  the target forward alone (what online mode adds per micro-batch), the full capture against a forward
  stopped after the deepest captured layer.
- ``memory`` (`draft_memory.json`): peak memory of one draft training step (forward + backward) with
  the loss unchunked and chunked (``draft.loss.chunk_size``), on a tiny random Llama with an enlarged
  vocabulary, each chunk size a fresh process.  On CUDA the peak is ``max_memory_allocated``; on CPU
  the growth of the resident-set high-water mark during the step.
- ``vocab`` (`draft_vocab.{json,md}`): the draft vocabulary size N (full, 32k, 16k, 8k) on a cache of
  the reference target: coverage of the training split's answer tokens, the DSpark training step
  (forward + loss + backward + AdamW) time and peak RSS growth, the draft pass of decoding (`propose`)
  in ms per round; each size a fresh process.  ``--curve`` joins the held-out E[τ] of a
  `bench/learning_curve.py` record whose variants set ``draft.vocab_size``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.records import header, write_record  # noqa: E402


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0   # Linux: KiB


def run_worker(spec: dict, work: Path, tag: str, world: int = 1, timeout: int = 3600) -> dict:
    """Run ``spec`` in a fresh process of this script (``world`` > 1: ranks under torchrun): rank 0's
    result with the peak RSS of every rank, or {"error": the output's tail}."""
    spec_path, out = work / f"{tag}.json", work / f"{tag}.out"
    spec_path.write_text(json.dumps({**spec, "out": str(out)}))
    for f in work.glob(f"{tag}.out.rank*"):
        f.unlink()
    me = str(Path(__file__).resolve())
    cmd = [sys.executable, me] if world == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                   "--nproc_per_node", str(world), me]
    env = {**os.environ, "DEEPSPEC_NO_PROGRESS": "1", "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
    t0 = time.time()
    p = subprocess.run(cmd + ["--worker", str(spec_path)], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=timeout)
    ranks = [json.loads(f.read_text()) for f in sorted(work.glob(f"{tag}.out.rank*"))]
    if p.returncode != 0 or not ranks:
        return {"error": (p.stdout + p.stderr)[-2000:], "wall_s": time.time() - t0}
    return {**ranks[0], "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
            "peak_rss_mb_per_rank": [round(r["peak_rss_mb"], 1) for r in ranks], "wall_s": time.time() - t0}


def worker(spec_path: str) -> int:
    """One measurement in this process (one rank under torchrun), what ``spec["kind"]`` names; each rank
    leaves its result and peak RSS in ``<out>.rank<N>``."""
    import torch
    from bench import draft_costs
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    fn = {"train": train_worker, "memory": draft_costs.memory_step, "vocab": draft_costs.vocab_size}[spec["kind"]]
    result = fn(spec)
    rank = int(os.environ.get("RANK", "0"))
    Path(f"{spec['out']}.rank{rank}").write_text(json.dumps({**result, "peak_rss_mb": _rss_mb()}))
    return 0


# -- strategies and online: `deepspec train` in a fresh process ----------------------------------------

def train_overrides(args, work: Path, run_dir: Path, drafter: str, strategy: str, online: bool) -> list:
    kw = {"run_dir": run_dir, "target.path": args.target, "target.dtype": args.dtype, "draft.algorithm": drafter,
          "draft.num_layers": args.draft_layers, "data.regen_path": args.regen or work / "regen.jsonl",
          "data.max_length": args.max_length, "data.online": online, "data.heldout_fraction": 0.0,
          "cache.dir": work / "cache", "train.strategy": strategy, "train.max_steps": args.steps,
          "train.save_every": 0, "train.eval_every": 0, "train.global_batch_sequences": args.global_batch,
          "train.micro_batch_sequences": args.micro_batch, "train.anchors_per_sequence": args.anchors,
          "train.bf16": args.bf16, "train.tensorboard": False, "train.warmup_ratio": 0.0, "train.resume": False,
          "train.deepspeed_stage": args.deepspeed_stage, "seed": 0}
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in kw.items()] + list(args.set or [])


def train_worker(spec: dict) -> dict:
    from deepspec.config import load_config
    from deepspec.train.loop import run
    cfg = load_config(spec["overrides"])
    run(cfg)
    recs = [json.loads(x) for x in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    recs = [r for r in recs if "train/loss" in r]
    steady = recs[1:] or recs
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
            "step_time_s": statistics.median(r["step_time_s"] for r in steady),
            "tokens_per_step": statistics.mean(r["tokens"] for r in recs), "steps": len(recs),
            "loss_first": recs[0]["train/loss"], "loss_last": recs[-1]["train/loss"],
            "expected_tau_last": recs[-1].get("train/expected_tau")}


def prepare_data(args, work: Path, online: bool) -> float:
    """Synthetic regen JSONL (unless ``--regen``) and, unless only online runs follow, its cache (both
    reused across invocations); the cache build's seconds (0 when reused)."""
    from deepspec.config import load_config
    from deepspec.cache.writer import build_cache
    from tests.support.synthetic import write_regen_jsonl
    work.mkdir(parents=True, exist_ok=True)
    if not args.regen and not (work / "regen.jsonl").is_file():
        write_regen_jsonl(work / "regen.jsonl", args.samples, seed=0, max_words=args.max_words)
    if online or (work / "cache" / "manifest.json").is_file():
        return 0.0
    t0 = time.time()
    build_cache(load_config(train_overrides(args, work, work / "prep", "dspark", "single", False)), progress=False)
    return time.time() - t0


def train_run(args, work: Path, drafter: str, strategy: str, online: bool) -> dict:
    world = 1 if strategy == "single" else args.nproc
    tag = f"{drafter}_{strategy}_{'online' if online else 'cache'}"
    run_dir = work / "runs" / tag
    shutil.rmtree(run_dir, ignore_errors=True)
    spec = {"kind": "train", "threads": args.threads,
            "overrides": train_overrides(args, work, run_dir, drafter, strategy, online)}
    print(f"{drafter:8s} {strategy:10s} {'online' if online else 'cached'} world={world} ...", end=" ", flush=True)
    r = {"drafter": drafter, "strategy": strategy, "world_size": world,
         **run_worker(spec, work, tag, world, args.timeout)}
    print("ERROR" if "error" in r else f"{r['tokens_per_s']:.0f} tok/s, peak RSS {r['peak_rss_mb']:.0f} MB", flush=True)
    return r


def strategies(args) -> int:
    from deepspec.drafts import available_drafters
    work = Path(args.work)
    prepare_data(args, work, args.online)
    drafters = args.drafters.split(",") if args.drafters else available_drafters()
    results = [train_run(args, work, d, s, args.online) for d in drafters for s in args.strategies.split(",")]
    import torch
    record = header(target=args.target, data="online" if args.online else "cache",
                    device="cuda" if torch.cuda.is_available() else "cpu",
                    settings={k: v for k, v in vars(args).items() if k not in ("out", "work")}, results=results)
    write_record(record, "train_throughput", args.out, "online" if args.online and not args.out else None)
    return 1 if any("error" in r for r in results) else 0


def forward_probe(args) -> dict:
    """The target forward alone: the full capture against stopping after the deepest captured layer."""
    import torch
    from deepspec.config import TargetConfig
    from deepspec.targets import load_target
    torch.set_num_threads(args.threads)
    target = load_target(TargetConfig(path=args.target, dtype=args.dtype, device="cpu"))
    ids = torch.randint(0, min(1000, target.vocab_size), (4, args.max_length),
                        generator=torch.Generator().manual_seed(0))

    class _Stop(Exception):
        pass

    def stop(m, i, o):
        raise _Stop()

    def truncated():
        """The captured layers recorded as in `capture`, then stop after the deepest one."""
        seen = {}
        hooks = [target.layers[i].register_forward_hook(
            lambda m, inp, o, i=i: seen.__setitem__(i, o[0] if isinstance(o, (tuple, list)) else o))
            for i in sorted(set(target.layer_ids))]
        hooks.append(target.layers[max(target.layer_ids)].register_forward_hook(stop))
        try:
            with torch.inference_mode():
                target.decoder(input_ids=ids, use_cache=False)
        except _Stop:
            pass
        finally:
            for h in hooks:
                h.remove()

    out = {"deepest_layer": max(target.layer_ids), "num_layers": target.num_layers, "batch": list(ids.shape)}
    for name, fn in (("full_capture", lambda: target.capture(ids)), ("stop_after_deepest_layer", truncated)):
        fn()
        ts = [timed_s(fn) for _ in range(args.probe_reps)]
        out[name] = {"median_s": statistics.median(ts), "tokens_per_s": ids.numel() / statistics.median(ts)}
    out["saving"] = 1 - out["stop_after_deepest_layer"]["median_s"] / out["full_capture"]["median_s"]
    return out


def timed_s(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def online(args) -> int:
    work = Path(args.work)
    build_s = prepare_data(args, work, False)
    modes = {m: train_run(args, work, "dspark", "single", m == "online") for m in ("cached", "online")}
    if any("error" in r for r in modes.values()):
        raise SystemExit("a training run failed: " + next(r["error"] for r in modes.values() if "error" in r))
    probe = forward_probe(args)
    record = header(target=args.target, dtype=args.dtype, steps=args.steps, regen=args.regen or str(work / "regen.jsonl"),
                    max_length=args.max_length, threads=args.threads, cache_build_s=build_s, modes=modes,
                    online_over_cached_tokens_per_s=modes["online"]["tokens_per_s"] / modes["cached"]["tokens_per_s"],
                    target_forward_probe=probe)
    print(json.dumps({k: v for k, v in record.items() if k not in ("modes", "machine")}, indent=1))
    write_record(record, "online_vs_cached", args.out)
    return 0


# -- memory: one draft training step, chunked and unchunked loss ----------------------------------------

def memory(args) -> int:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    keep = {k: v for k, v in vars(args).items() if k not in ("out", "work", "mode", "chunks")}
    rows = []
    for c in [int(x) for x in args.chunks.split(",")]:
        r = run_worker({"kind": "memory", "threads": args.threads, "chunk": c, "args": keep}, work, f"memory_{c}")
        if "error" in r:
            raise SystemExit(f"chunk {c}: {r['error']}")
        rows.append({k: r[k] for k in ("chunk", "peak_mb", "seconds", "loss")})
    unit = "CUDA max allocated" if args.device.startswith("cuda") else "CPU RSS high-water growth"
    print(f"{args.algorithm} (head={args.head}) V={args.vocab} B={args.batch} T={args.seq} anchors={args.anchors} "
          f"gamma={args.gamma} — peak = {unit}\n{'chunk_size':>10} {'peak MiB':>10} {'seconds':>8} {'loss':>12}")
    for r in rows:
        print(f"{r['chunk'] or 'none':>10} {r['peak_mb']:>10} {r['seconds']:>8} {r['loss']:>12}")
    write_record(header(args=keep, peak=unit, results=rows), "draft_memory", args.out)
    return 0


# -- vocab: the draft vocabulary size ---------------------------------------------------------------------

def vocab(args) -> int:
    from bench.draft_costs import heldout_by_size, markdown
    work = Path(args.work)
    keep = {k: v for k, v in vars(args).items() if k not in ("out", "mode")}
    record = header(args=keep, sizes={})
    for n in args.sizes:
        r = run_worker({"kind": "vocab", "threads": args.threads, "size": n, "args": keep}, work, f"draft_vocab_{n}")
        if "error" in r:
            raise SystemExit(f"draft vocabulary N={n}: {r['error']}")
        record.update(bf16_autocast=r["bf16_autocast"], target_lse=r["target_lse"])
        record["sizes"][r["label"]] = r["size"]
    if args.curve:
        record["heldout"] = heldout_by_size(json.loads(Path(args.curve).read_text()))
    md = markdown(record)
    print(md)
    write_record(record, "draft_vocab", args.out, markdown=md)
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = ap.add_subparsers(dest="mode", required=True)
    for name, helptext, work in (("strategies", "tokens/s and RSS per drafter × strategy", "train_throughput"),
                                 ("online", "cached vs online training, the target forward alone", "online_vs_cached")):
        m = modes.add_parser(name, help=helptext)
        m.add_argument("--target", default="reference:smollm2-135m")
        m.add_argument("--dtype", default="float32" if name == "online" else "auto")
        m.add_argument("--regen", default=None, help="regen JSONL (default: --samples synthetic conversations)")
        m.add_argument("--steps", type=int, default=10 if name == "online" else 3)
        m.add_argument("--samples", type=int, default=32)
        m.add_argument("--max-words", type=int, default=80)
        m.add_argument("--max-length", type=int, default=192 if name == "online" else 256)
        m.add_argument("--global-batch", type=int, default=4)
        m.add_argument("--micro-batch", type=int, default=4 if name == "online" else 2)
        m.add_argument("--anchors", type=int, default=16)
        m.add_argument("--draft-layers", type=int, default=1)
        m.add_argument("--deepspeed-stage", type=int, default=2)
        m.add_argument("--bf16", action="store_true", help="bf16 autocast (default off: CPU)")
        m.add_argument("--set", nargs="*", help="extra config overrides, e.g. train.compile=true")
        m.add_argument("--threads", type=int, default=2 if name == "online" else None,
                       help="torch threads per process (default: torch's)")
        m.add_argument("--timeout", type=int, default=1800)
        m.add_argument("--work", default=str(REPO / "bench" / "work" / work))
        m.add_argument("--out", default=None, help="record path")
    s = modes.choices["strategies"]
    s.add_argument("--drafters", default=None, help="comma list (default: every registered drafter)")
    s.add_argument("--strategies", default="single,ddp,fsdp,deepspeed")
    s.add_argument("--nproc", type=int, default=2, help="processes for ddp / fsdp / deepspeed")
    s.add_argument("--online", action="store_true", help="features from the target inside training")
    modes.choices["online"].add_argument("--probe-reps", type=int, default=3)
    m = modes.add_parser("memory", help="peak memory of one draft step, chunked vs unchunked loss")
    m.add_argument("--algorithm", default="dspark", choices=["dspark", "dflash", "eagle3"])
    m.add_argument("--head", default="markov", choices=["none", "markov", "rnn"])
    for flag, default in (("rank", 64), ("vocab", 32768), ("hidden", 64), ("layers", 1), ("gamma", 7), ("batch", 1),
                          ("seq", 256), ("anchors", 64), ("threads", 1)):
        m.add_argument(f"--{flag}", type=int, default=default)
    m.add_argument("--chunks", default="0,16,4", help="comma list of loss.chunk_size (0 = unchunked)")
    m.add_argument("--device", default="cpu")
    m.add_argument("--work", default=str(REPO / "bench" / "work" / "draft_memory"))
    m.add_argument("--out", default=None, help="record path")
    v = modes.add_parser("vocab", help="the draft vocabulary size: coverage, step time, RSS, draft pass")
    v.add_argument("--work", default=str(REPO / "bench" / "work" / "conv"), help="a work directory with a cache/")
    v.add_argument("--sizes", nargs="*", type=int, default=[0, 32768, 16384, 8192], help="0 = full vocabulary")
    for flag, default, helptext in (("layers", 1, None), ("rank", 256, None), ("anchors", 32, None),
                                    ("seqs", 8, None), ("steps", 6, None), ("warmup", 2, None),
                                    ("rounds", 5, "timed draft passes per prompt"), ("threads", 2, None)):
        v.add_argument(f"--{flag}", type=int, default=default, help=helptext)
    v.add_argument("--without-lse", action="store_true",
                   help="no stored target log-normaliser: the loss takes the full-V softmax of the target")
    v.add_argument("--curve", default=None, help="learning_curve record with draft.vocab_size variants")
    v.add_argument("--out", default=None, help="record path")
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return worker(argv[1])
    args = parser().parse_args(argv)
    return {"strategies": strategies, "online": online, "memory": memory, "vocab": vocab}[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
