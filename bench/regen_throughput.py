"""Benchmark (not a test): embedded regeneration throughput, the engine's decode loops against transformers'
`generate`.

The same prompts (first user turns), the same batch size and sampling, through `HFEngine` with each of
``--loops``: ``generate`` (transformers' own loop), ``deepspec`` (finished rows leave the batch) and
``static`` (a static KV cache, CUDA-graph replay on a GPU): new tokens/s of each and, under greedy
decoding, how many answers are identical to the first loop's.  Writes `bench/results/regen_throughput.json`.

    .venv/bin/python bench/regen_throughput.py                                  # SmolLM2, CPU, 32 prompts
    python3 bench/regen_throughput.py --device cuda --prompts 512 --batch 256 --max-new-tokens 192 \\
        --data data.source=jsonl data.path=$DEVICE_PROMPTS                       # the GPU machine
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.records import header, write_record  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="reference:smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = leave as is)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--loops", nargs="*", default=["generate", "deepspec"])
    ap.add_argument("--data", nargs="*", default=["data=sharegpt"], help="Hydra overrides choosing the prompts")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    from deepspec.config import load_config
    from deepspec.data import load_conversations
    from deepspec.engines.base import Completion, SamplingParams
    from deepspec.engines.hf import HFEngine
    from deepspec.targets import load_target

    cfg = load_config([f"target.path={args.target}", f"target.device={args.device}", *args.data,
                       f"data.max_samples={args.prompts * 2}", "data.on_error=skip"])
    convs, _ = load_conversations(cfg.data)
    prompts = []
    for c in convs:
        first = next((m for m in c.messages if m["role"] == "user"), None)
        if first:
            prompts.append([{"role": "user", "content": first["content"]}])
        if len(prompts) == args.prompts:
            break
    target = load_target(cfg.target)
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=0)
    keys = [str(i) for i in range(len(prompts))]
    rec = header(args=vars(args), target={"path": args.target, "device": str(target.device),
                                          "dtype": str(target.dtype)}, prompts=len(prompts), loops={})
    rec["machine"]["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    outputs = {}
    for loop in args.loops:
        eng = HFEngine.from_target(target, batch_size=args.batch, max_prompt_tokens=args.max_prompt_tokens, loop=loop)
        eng.generate(prompts[: min(2, len(prompts))], SamplingParams(max_new_tokens=4, temperature=0.0))  # warm-up
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        res = eng.generate(prompts, sp, keys=keys)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        sec = time.perf_counter() - t
        ok = [r for r in res if isinstance(r, Completion)]
        tok = sum(r.num_tokens for r in ok)
        outputs[loop] = [str(r) if isinstance(r, Completion) else None for r in res]
        rec["loops"][loop] = {"seconds": sec, "new_tokens": tok, "tokens_per_s": tok / sec, "ok": len(ok),
                              "mean_new_tokens": tok / max(len(ok), 1)}
        print(f"{loop}: {tok} new tokens in {sec:.1f} s = {tok / sec:.1f} tok/s ({len(ok)} answers)", flush=True)
    first, loops = args.loops[0], rec["loops"]
    for loop in args.loops[1:]:   # each loop against the first (the reference), the last one also at top level
        same = sum(x == y for x, y in zip(outputs[first], outputs[loop]))
        loops[loop]["identical_to_" + first] = same
        loops[loop]["speedup_over_" + first] = loops[loop]["tokens_per_s"] / loops[first]["tokens_per_s"]
        rec["identical"], rec["speedup"] = same, loops[loop]["speedup_over_" + first]
        print(f"{loop} vs {first}: identical answers {same}/{len(prompts)}; speedup {rec['speedup']:.2f}x", flush=True)
    write_record(rec, "regen_throughput", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
