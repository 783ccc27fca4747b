"""Peak memory of one draft training step (forward + backward): chunked vs unchunked loss.

Not a test.  Each configuration runs in a fresh subprocess so the numbers do not
leak into each other.  On CUDA the peak is ``torch.cuda.max_memory_allocated``;
on CPU it is the growth of the process's resident-set high-water mark during the
step (coarser, but it shows the same trend).

    python bench/draft_memory.py                       # dspark, vocab 32768, 64 anchors x γ=7
    python bench/draft_memory.py --algorithm eagle3 --chunks 0,4,16
    python bench/draft_memory.py --device cuda --vocab 151936 --seq 2048 --anchors 512

The target is a tiny random Llama (4 layers, H=64) with an enlarged vocabulary, so
the vocabulary-sized tensors (anchors × γ × V) dominate, which is exactly what
chunking bounds (chunk_size anchors × γ × V at a time, recomputed in backward).
Prints a table and writes bench/results/draft_memory.json.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.records import record_path  # noqa: E402


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0   # Linux: KiB


def run_one(args) -> dict:
    import torch
    from deepspec.config.draft import DraftConfig, LossConfig
    from deepspec.drafts import build_drafter
    from deepspec.targets import TargetAdapter
    from deepspec.targets.tiny import tiny_model, tiny_tokenizer

    torch.set_num_threads(max(1, args.threads))
    dev = torch.device(args.device)
    model = tiny_model("llama", args.vocab, num_layers=4, hidden_size=args.hidden).to(dev)
    target = TargetAdapter(model, tiny_tokenizer("llama"), num_feature_layers=2, name="bench")
    cfg = DraftConfig(algorithm=args.algorithm, gamma=args.gamma, num_layers=args.layers,
                      sequential_head=args.head, head_rank=args.rank, ttt_steps=args.gamma,
                      loss=LossConfig(chunk_size=args.chunk))
    torch.manual_seed(0)
    draft = build_drafter(target, cfg)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(dev)
    cap = target.capture(ids)
    ones = torch.ones_like(ids, dtype=torch.bool)
    anchors = torch.stack([torch.randperm(args.seq - args.gamma - 1, generator=g)[:args.anchors].sort().values
                           for _ in range(args.batch)]).to(dev)
    batch = {"input_ids": ids, "loss_mask": ones, "attention_mask": ones, "features": cap.features.clone(),
             "last_hidden": cap.last_hidden.clone(), "anchors": anchors}
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_mb()
    t0 = time.perf_counter()
    out = draft(batch)
    out["loss"].backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    else:
        peak = _rss_mb() - base
    return {"chunk": args.chunk, "peak_mb": round(peak, 1), "seconds": round(time.perf_counter() - t0, 2),
            "loss": round(float(out["loss"]), 6)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algorithm", default="dspark", choices=["dspark", "dflash", "eagle3"])
    p.add_argument("--head", default="markov", choices=["none", "markov", "rnn"])
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--gamma", type=int, default=7)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--anchors", type=int, default=64)
    p.add_argument("--chunks", default="0,16,4", help="comma list of loss.chunk_size (0 = unchunked)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(record_path("draft_memory")), help="record path")
    p.add_argument("--chunk", type=int, default=None, help=argparse.SUPPRESS)   # child mode
    args = p.parse_args(argv)
    if args.chunk is not None:
        print(json.dumps(run_one(args)))
        return
    rows = []
    for c in [int(x) for x in args.chunks.split(",")]:
        child = [a for a in (argv if argv is not None else sys.argv[1:])] + ["--chunk", str(c)]
        res = subprocess.run([sys.executable, __file__, *child], capture_output=True, text=True, check=True)
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    unit = "CUDA max allocated" if args.device.startswith("cuda") else "CPU RSS high-water growth"
    print(f"{args.algorithm} (head={args.head}) V={args.vocab} B={args.batch} T={args.seq} "
          f"anchors={args.anchors} gamma={args.gamma} — peak = {unit}")
    print(f"{'chunk_size':>10} {'peak MiB':>10} {'seconds':>8} {'loss':>12}")
    for r in rows:
        print(f"{r['chunk'] or 'none':>10} {r['peak_mb']:>10} {r['seconds']:>8} {r['loss']:>12}")
    record = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join([sys.executable, *sys.argv]), "machine": platform.platform(),
              "args": {k: v for k, v in vars(args).items() if k not in ("chunk", "out")}, "peak": unit,
              "results": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
