"""Reference benchmark: DSpark (Markov), DSpark (RNN), DFlash and Eagle3 side by side on a real model.

One command, one shared regenerated dataset and cache, the same steps and depth for every
drafter, eval on the same prompts. Writes `bench/results/reference.json` (`--label L`:
`reference-L.json`) and regenerates `docs/benchmarks.md`.

    .venv/bin/python bench/reference.py                      # defaults sized for a 2-core CPU
    .venv/bin/python bench/reference.py --samples 4000 --steps 3000 --eval-samples 20   # larger

Every number it prints was measured in this run; nothing is estimated or copied.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.records import record_path  # noqa: E402  (needs REPO on sys.path)
from bench.render_benchmarks import train_rate  # noqa: E402

DRAFTERS = {
    "dspark_markov": ["draft=dspark", "draft.sequential_head=markov"],
    "dspark_rnn": ["draft=dspark_rnn"],
    "dflash": ["draft=dflash"],
    # Loss on the chains rooted at the sampled anchors: the same LM-head rows per step as the
    # others (dense TTT would do ~T/anchors times the vocabulary work of DFlash per step).
    "eagle3": ["draft=eagle3", "draft.ttt_dense=false"],
}
# Arguments that must match for a later `--only` run to join an earlier result file.
SHARED_ARGS = ("work", "samples", "max_new_tokens", "max_turns", "steps", "anchors", "layers", "eval_samples",
               "eval_new_tokens", "extra", "sampled_temperatures")
DOMAIN_BENCHES = ["gsm8k", "math500", "humaneval", "mbpp", "mt-bench", "arena-hard-v2"]


def shared_overrides(args) -> list:
    """The Hydra overrides every stage and drafter of a run shares (data, cache, target, budget)."""
    work = Path(args.work)
    return [f"data.regen_path={work / 'regen' / 'regen.jsonl'}", f"cache.dir={work / 'cache'}",
            "target=smollm2_135m", "data=sharegpt", f"data.max_samples={args.samples}",
            f"engine.max_new_tokens={args.max_new_tokens}", f"engine.max_turns={getattr(args, 'max_turns', 1)}",
            "engine.temperature=0.7",
            "data.max_length=512", "train=cpu", f"train.max_steps={args.steps}",
            f"train.anchors_per_sequence={args.anchors}", "eval.temperature=0",
            f"eval.max_samples={args.eval_samples}", f"eval.max_new_tokens={args.eval_new_tokens}",
            f"eval.benchmarks=[{','.join(DOMAIN_BENCHES)}]",
            "eval.data_dir=" + str(REPO.parent / "shared" / "eval_datasets"), *args.extra]


def prepare(args, work: Path):
    """Regenerate and cache the work directory's data (each stage resumes what is already there):
    ({regenerate_s, cache_s}, cache path)."""
    from deepspec.cache.writer import build_cache
    from deepspec.prepare import regenerate
    base = _cfg(shared_overrides(args) + [f"run_dir={work / 'prepare'}"])
    t = time.perf_counter()
    regen = regenerate(base)
    t1 = time.perf_counter()
    cache = build_cache(base, regen_path=regen)
    return {"regenerate_s": t1 - t, "cache_s": time.perf_counter() - t1}, cache


def _cfg(overrides):
    from deepspec.config import load_config
    return load_config(overrides)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default=str(REPO / "bench" / "work" / "reference"))
    p.add_argument("--samples", type=int, default=600, help="ShareGPT conversations to regenerate")
    p.add_argument("--max-new-tokens", type=int, default=160, help="regeneration length per turn")
    p.add_argument("--max-turns", type=int, default=1, help="assistant turns regenerated per conversation")
    p.add_argument("--steps", type=int, default=400, help="training steps per drafter")
    p.add_argument("--anchors", type=int, default=32, help="anchors per training sequence")
    p.add_argument("--layers", type=int, default=2, help="draft depth for DSpark/DFlash (Eagle3 uses 1)")
    p.add_argument("--eval-samples", type=int, default=4, help="prompts per benchmark")
    p.add_argument("--eval-new-tokens", type=int, default=128)
    p.add_argument("--only", nargs="*", default=list(DRAFTERS), help="subset of drafters")
    p.add_argument("--sampled-temperatures", nargs="*", type=float, default=[1.0],
                   help="eval again at these temperatures (the paper and DeepSpec report τ at T = 1.0; "
                        "the greedy eval stays the losslessness check)")
    p.add_argument("--extra", nargs="*", default=[], help="extra Hydra overrides for every stage")
    p.add_argument("--label", default=None, help="record a separate experiment as bench/results/reference-LABEL.json")
    args = p.parse_args(argv)

    from deepspec.eval.runner import run as run_eval
    from deepspec.train.loop import run as run_train

    work = Path(args.work)
    shared = shared_overrides(args)
    record = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "machine": {"platform": platform.platform(), "processor": platform.processor(),
                          "python": platform.python_version()},
              "command": " ".join([sys.executable, *sys.argv]), "args": vars(args), "stages": {}, "drafters": {}}
    out = record_path("reference", args.label)
    if out.is_file():   # a later `--only` run joins the record if its settings match
        old = json.loads(out.read_text())
        if all(old["args"].get(k) == record["args"][k] for k in SHARED_ARGS):
            record["drafters"] = {k: v for k, v in old["drafters"].items() if k not in args.only}
            record["commands"] = old.get("commands", [old["command"]])
            record["joined_stages"] = old["stages"]   # regeneration and cache ran in the first run
            print(f"joining {out} (drafters kept: {sorted(record['drafters'])})")
        elif set(old["drafters"]) >= set(DRAFTERS) and set(args.only) < set(DRAFTERS):
            raise SystemExit(f"{out} holds a run of all drafters with other settings; a partial --only run "
                             "would replace it: run every drafter, or pass --label to record this run beside it")
        else:
            print(f"replacing {out} (other settings; the previous record stays in git history)")
    record.setdefault("commands", [])
    record["commands"].append(record["command"])
    import torch
    record["machine"]["torch"] = torch.__version__
    record["machine"]["threads"] = torch.get_num_threads()

    record["stages"], cache = prepare(args, work)
    from deepspec.cache.reader import CacheReader
    reader = CacheReader(cache)
    m = reader.manifest
    record["cache"] = {k: m.get(k) for k in ("num_samples", "num_tokens", "stored_bytes", "raw_float_bytes",
                                             "codec", "layer_ids", "hidden_size")}
    record["cache"]["bytes_per_token"] = m["stored_bytes"] / max(m["num_tokens"], 1)
    record["cache"]["float_compression_ratio"] = m["raw_float_bytes"] / max(m["stored_float_bytes"], 1)

    for name in args.only:
        ov = shared + DRAFTERS[name] + [f"run_dir={work / name}"]
        if name != "eagle3":
            ov.append(f"draft.num_layers={args.layers}")
        cfg = _cfg(ov)
        t = time.perf_counter()
        ckpt = run_train(cfg)
        train_s = time.perf_counter() - t
        load_after_train = os.getloadavg()
        cfg.eval.checkpoint = str(ckpt)
        t = time.perf_counter()
        run_eval(cfg)
        eval_s = time.perf_counter() - t
        from deepspec.paths import eval_dir
        results = json.loads((eval_dir(cfg) / "results.json").read_text())
        sampled = {}
        for temp in args.sampled_temperatures:
            cfg.eval.temperature, cfg.eval.out_dir = float(temp), str(work / name / f"eval_T{temp:g}")
            t = time.perf_counter()
            run_eval(cfg)
            eval_s += time.perf_counter() - t
            sampled[f"{temp:g}"] = json.loads((eval_dir(cfg) / "results.json").read_text())
        metrics = [json.loads(l) for l in (work / name / "metrics.jsonl").read_text().splitlines() if l.strip()] \
            if (work / name / "metrics.jsonl").is_file() else []
        record["drafters"][name] = {"checkpoint": str(ckpt), "train_s": train_s, "eval_s": eval_s,
                                    # 1/5/15-minute load averages: wall-clock figures on 2 cores move 2-3x with load
                                    "load_avg": {"after_train": load_after_train, "after_eval": os.getloadavg()},
                                    "train_last_metrics": metrics[-1] if metrics else None,
                                    "train_summary": train_rate(metrics),
                                    "eval": results, "eval_sampled": sampled}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2, default=str))
    if "joined_stages" in record:
        record["stages_reuse"], record["stages"] = record["stages"], record.pop("joined_stages")
    record["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out.write_text(json.dumps(record, indent=2, default=str))
    print(f"wrote {out}")
    from bench.render_benchmarks import render
    render()
    return 0


if __name__ == "__main__":
    sys.exit(main())
