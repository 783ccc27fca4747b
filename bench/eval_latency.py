"""Eval-loop latency: per-round draft / verify / overhead time next to plain decoding, same run.

Each drafter (random init: timings do not depend on what it learned, except through τ) decodes
the same prompts with the lossless loop of `deepspec.decoding.chain` and the target decodes them
alone; both go through `TargetAdapter.decode`.  Reports per round: draft ms, verify ms, overhead ms,
and the plain-decode ms per token of the same run, and the ratios the issue sets goals for
(verify ÷ plain step, overhead ÷ round).  Writes `bench/results/eval_latency.json`.

    .venv/bin/python bench/eval_latency.py                       # SmolLM2-135M, CPU, 1 thread
    .venv/bin/python bench/eval_latency.py --device cuda --threads 0 --new-tokens 96
"""
from __future__ import annotations

import argparse
import datetime as dt
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.records import write_record  # noqa: E402

PROMPTS = ["Explain how a hash table works, with an example in Python.",
           "What is 17 times 23? Show your steps.",
           "Write a short poem about the sea."]


def split(specs, bases) -> dict:
    rounds = [r for s in specs for r in s.rounds]
    n = max(len(rounds), 1)
    d = 1e3 * sum(r.t_draft for r in rounds) / n
    v = 1e3 * sum(r.t_verify for r in rounds) / n
    o = 1e3 * sum(r.t_overhead for r in rounds) / n
    steps = sum(b.num_tokens - 1 for b in bases)
    plain = 1e3 * sum(b.t_total - b.t_prefill for b in bases) / max(steps, 1)
    return {"rounds": len(rounds), "tau": sum(r.accepted + 1 for r in rounds) / n, "draft_ms": d, "verify_ms": v,
            "overhead_ms": o, "round_ms": d + v + o, "overhead_fraction": o / (d + v + o),
            "plain_decode_ms_per_token": plain, "verify_over_plain_decode": v / plain,
            "draft_over_plain_decode": d / plain,
            "greedy_equal": all(s.tokens == b.tokens for s, b in zip(specs, bases))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="reference:smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = leave as is)")
    ap.add_argument("--drafters", nargs="*", default=["dspark", "eagle3"])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--gamma", type=int, default=7)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    from deepspec.config import load_config
    from deepspec.drafts.registry import build_drafter
    from deepspec.decoding.warp import make_warp
    from deepspec.decoding.chain import speculative_generate
    from deepspec.decoding.loop import target_generate
    from deepspec.targets import load_target
    from deepspec.targets.chat import encode_prompt

    rec = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "machine": {"platform": platform.platform(), "python": platform.python_version(),
                       "torch": torch.__version__, "threads": torch.get_num_threads()},
           "command": " ".join([Path(sys.executable).name, *sys.argv]), "args": vars(args), "drafters": {}}
    greedy = make_warp(0.0)
    target = None
    for algo in args.drafters:
        cfg = load_config([f"target.path={args.target}", f"target.device={args.device}",
                           f"target.dtype={args.dtype}", f"draft={algo}"]
                          + ([f"draft.num_layers={args.layers}"] if algo != "eagle3" else []))
        if target is None:
            target = load_target(cfg.target)
            rec["target"] = {"path": args.target, "device": str(target.device), "dtype": str(target.dtype)}
        torch.manual_seed(0)
        drafter = build_drafter(target, cfg.draft).eval()
        ids = [encode_prompt(target.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS[: args.prompts]]
        speculative_generate(target, drafter, ids[0], gamma=args.gamma, max_new_tokens=8, warp=greedy, eos_token_ids=[])
        target_generate(target, ids[0], max_new_tokens=8, warp=greedy, eos_token_ids=[])
        specs, bases = [], []
        t0 = time.perf_counter()
        for p in ids:   # interleaved: the same machine load for both
            specs.append(speculative_generate(target, drafter, p, gamma=args.gamma, max_new_tokens=args.new_tokens,
                                              warp=greedy, eos_token_ids=[]))
            bases.append(target_generate(target, p, max_new_tokens=args.new_tokens, warp=greedy, eos_token_ids=[]))
        rec["drafters"][algo] = {**split(specs, bases), "seconds": time.perf_counter() - t0}
        r = rec["drafters"][algo]
        print(f"{algo}: draft {r['draft_ms']:.1f} ms, verify {r['verify_ms']:.1f} ms, overhead "
              f"{r['overhead_ms']:.1f} ms ({100 * r['overhead_fraction']:.1f}%) per round; plain decode "
              f"{r['plain_decode_ms_per_token']:.1f} ms/token; verify/plain {r['verify_over_plain_decode']:.2f}, "
              f"draft/plain {r['draft_over_plain_decode']:.2f}; greedy equal {r['greedy_equal']}", flush=True)
    write_record(rec, "eval_latency", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
