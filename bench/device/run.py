"""The prepared device run: one command on a machine with one GPU, ≤ 9 minutes.

    bash bench/device/run.sh                 # the GPU run (reference target SmolLM2-135M-Instruct)
    TINY=1 bash bench/device/run.sh          # the same stages at a tiny scale on a CPU (tests/integration)

Stages, each a subprocess with its own time limit (SIGTERM, then SIGKILL 20 s later; a training run
saves a checkpoint on SIGTERM and the eval uses it) inside an overall budget (``--budget-s``):

    env        GPU name, versions
    convert    `deepspec target fetch smollm2-135m` (GGUF → bf16 HF directory; skipped when cached)
    regen      `python -m deepspec.prepare.regen`: regenerate answers (embedded engine, ``engine.hf_loop=auto``)
    regen_ab   bench/regen_throughput.py: the same batch through transformers' generate and the engine's
               loop — tok/s of each and identical greedy answers
    cache      `deepspec prepare` (regeneration reused): hidden-state cache
    train_*    `deepspec train` per drafter (dspark, dflash, eagle3) with the same step budget
    eval_*     `deepspec eval` per drafter: τ, speedup, the per-round split and plain-decode ms/token
    cuda_tests `pytest -m cuda tests/integration/test_cuda.py` (GPU scale only, when time is left)
    profile    torch.profiler tables of a few training steps and eval rounds (when time is left)

Outputs: ``$OUT`` when set (a folder the machine's caller collects), else ``bench/results/``:
``device_run.json`` (the record), ``device_run.md`` (the summary) and ``device_run.logs.tar.gz`` (stage logs,
eval reports, training metrics, profiler tables — never the cache or the regenerated data).  Scratch
(models, data, cache, checkpoints) goes to ``--work`` (default ``bench/work/device_run``).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import tarfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from report import (BEFORE, cache_metrics, eval_metrics, goals, pytest_summary, read_json, regen_metrics,
                    summary_md, train_metrics)
from stage_runner import Runner

REPO = Path(__file__).resolve().parents[2]
DRAFTERS = {
    "dspark": ["draft=dspark"],
    "dflash": ["draft=dflash"],
    "eagle3": ["draft=eagle3", "draft.ttt_dense=false"],
}
EVAL_BENCHES = ["gsm8k", "humaneval", "mt-bench"]

# -- scales ------------------------------------------------------------------------------------------
def scale(tiny: bool) -> Dict[str, Any]:
    if tiny:
        return dict(target="target.path=tiny:llama",
                    target_extra=["target.num_feature_layers=2", "target.device=cpu", "data.heldout_fraction=0.15"],
                    prompts=32, new_tokens=16, batch=8, steps=3, global_batch=4, micro_batch=4, anchors=8,
                    max_length=256, layers=1, eval_samples=1, eval_new_tokens=12, ab_prompts=8, ab_new_tokens=12,
                    timeouts=dict(env=60, convert=60, regen=120, regen_ab=120, cache=120, train=150, eval=150,
                                  profile=120))
    # sized for ≤ 9 minutes on one H200 with the baseline rates (report.BEFORE) as the worst case
    return dict(target="target=smollm2_135m", target_extra=[], prompts=1024, new_tokens=192, batch=256, steps=300,
                global_batch=32, micro_batch=32, anchors=64, max_length=1024, layers=2, eval_samples=2,
                eval_new_tokens=96, ab_prompts=256, ab_new_tokens=192,
                timeouts=dict(env=60, convert=120, regen=120, regen_ab=75, cache=75, train=75, eval=60, cuda_tests=90,
                              profile=40))


def common(args, sc, work: Path) -> List[str]:
    return [sc["target"], *sc["target_extra"], "data.source=jsonl", f"data.path={args.prompts_path}",
            f"data.max_samples={sc['prompts']}", "data.on_error=skip", f"data.max_length={sc['max_length']}",
            f"data.regen_path={work / 'regen' / 'regen.jsonl'}", f"cache.dir={work / 'cache'}",
            f"engine.max_new_tokens={sc['new_tokens']}", f"engine.batch_size={sc['batch']}", "engine.max_turns=1",
            "engine.temperature=0.7", "engine.progress=false"]


def train_overrides(sc, work: Path, name: str) -> List[str]:
    layers = [] if name == "eagle3" else [f"draft.num_layers={sc['layers']}", "draft.loss.chunk_size=1024"]
    return [*DRAFTERS[name], *layers, f"run_dir={work / 'runs' / name}", "train.strategy=single",
            f"train.max_steps={sc['steps']}", f"train.global_batch_sequences={sc['global_batch']}",
            f"train.micro_batch_sequences={sc['micro_batch']}", f"train.anchors_per_sequence={sc['anchors']}",
            "train.save_every=0", "train.eval_every=0",
            "train.tensorboard=false", "train.bf16=null", "train.resume=false"]


def eval_overrides(sc, work: Path, name: str, ckpt: Optional[str], eval_dir: Path, benches: List[str]) -> List[str]:
    out = [*DRAFTERS[name], f"run_dir={work / 'runs' / name}", f"eval.out_dir={work / 'eval' / name}",
           f"eval.data_dir={eval_dir}", f"eval.benchmarks=[{','.join(benches)}]",
           f"eval.max_samples={sc['eval_samples']}", f"eval.max_new_tokens={sc['eval_new_tokens']}",
           "eval.temperature=0", "eval.decoding=chain", "eval.progress=false", "eval.rerun=true"]
    if name != "eagle3":
        out.append(f"draft.num_layers={sc['layers']}")
    return out + ([f"eval.checkpoint={ckpt}"] if ckpt else [])


def _py(*args: str) -> List[str]:
    return [sys.executable, *args]


def _cli(*args: str) -> List[str]:
    return _py("-m", "deepspec.cli", *args)


# -- the machine ---------------------------------------------------------------------------------------
def env_info() -> Dict[str, Any]:
    import torch
    import transformers
    info = {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
            "transformers": transformers.__version__, "cuda": torch.version.cuda,
            "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "gpu": None}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=torch.cuda.get_device_name(0), gpu_memory_gib=round(p.total_memory / 2 ** 30, 1),
                    bf16=torch.cuda.is_bf16_supported())
    return info


# -- the stages that run inside this file ---------------------------------------------------------
def stage_profile(args) -> int:
    """torch.profiler tables: 3 training steps of DSpark (from its checkpoint) and 4 eval rounds."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from deepspec.config import load_config
    from deepspec.drafts.registry import load_drafter
    from deepspec.decoding.warp import make_warp
    from deepspec.decoding.chain import speculative_generate
    from deepspec.targets import load_target
    from deepspec.targets.chat import encode_prompt
    from deepspec.train.data import CachedSequences, build_micro_batch
    from deepspec.cache import CacheReader
    work = Path(args.work)
    sc = scale(args.tiny)
    cfg = load_config(common(args, sc, work) + train_overrides(sc, work, "dspark"))
    target = load_target(cfg.target)
    ck = train_metrics(work, "dspark").get("checkpoint")
    if not ck:
        print("no dspark checkpoint to profile")
        return 1
    drafter = load_drafter(ck, target)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    out = Path(args.work) / "logs"
    src = CachedSequences(CacheReader(work / "cache"), sc["max_length"])
    items = [(0, i) for i in range(min(len(src), sc["micro_batch"]))]
    batch = build_micro_batch(src, items, sc["anchors"], 0)
    batch = {k: v.to(target.device, non_blocking=True) for k, v in batch.items()}
    drafter.train()
    ac = torch.autocast(target.device.type, dtype=torch.bfloat16, enabled=target.device.type == "cuda")
    for _ in range(2):
        with ac:
            drafter(batch)["loss"].backward()
    with profile(activities=acts) as prof:
        for _ in range(3):
            with ac:
                drafter(batch)["loss"].backward()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    (out / "profile_train.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=40))
    drafter.eval()
    ids = encode_prompt(target.tokenizer, [{"role": "user", "content": "Explain how a hash table works."}])
    g = make_warp(0.0)
    speculative_generate(target, drafter, ids, gamma=7, max_new_tokens=8, warp=g)
    with profile(activities=acts) as prof:
        speculative_generate(target, drafter, ids, gamma=7, max_new_tokens=32, warp=g)
    (out / "profile_eval.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=40))
    print("profiles written")
    return 0


def stage_env(args) -> int:
    info = env_info()
    Path(args.work, "env.json").write_text(json.dumps(info, indent=2))
    print(json.dumps(info))
    return 0


def stage_regen(args) -> int:
    """Regeneration through `deepspec.prepare.regen`, noting which decode loop the engine used."""
    from deepspec.config import load_config
    from deepspec.engines.factory import build_engine
    from deepspec.engines import static_decode
    from deepspec.prepare import regenerate
    sc = scale(args.tiny)
    cfg = load_config(common(args, sc, Path(args.work)) + [f"run_dir={Path(args.work) / 'prepare'}"])
    engine = build_engine(cfg)
    try:
        print(f"[engine] loop={engine.loop} device={engine.device}", flush=True)
        regenerate(cfg, engine=engine)
        print(f"[engine] loop={engine.loop} graph={static_decode.LAST['graph']} replays_last_batch="
              f"{static_decode.LAST['replays']} capture_error={static_decode.LAST['capture_error']}", flush=True)
    finally:
        engine.close()
    return 0


def write_eval_prompts(work: Path, n: int) -> Path:
    """Held-out prompts of the regeneration split as one benchmark file (``sharegpt.jsonl``)."""
    d = work / "evaldata"
    d.mkdir(parents=True, exist_ok=True)
    lines = [x for x in (work / "regen" / "heldout.jsonl").read_text().splitlines() if x.strip()][:n]
    (d / "sharegpt.jsonl").write_text("\n".join(lines) + "\n")
    return d


def write_tiny_prompts(work: Path, n: int) -> Path:
    from tests.support.synthetic import write_regen_jsonl
    return write_regen_jsonl(work / "prompts.jsonl", n, seed=0, max_words=40)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", default=os.environ.get("TINY", "") not in ("", "0"),
                    help="tiny target and sizes, on the CPU (also TINY=1)")
    ap.add_argument("--work", default=os.environ.get("DEVICE_WORK", str(REPO / "bench" / "work" / "device_run")))
    ap.add_argument("--out", default=os.environ.get("OUT") or None,
                    help="output folder (default $OUT, else bench/results)")
    ap.add_argument("--prompts-path", default=os.environ.get("DEVICE_PROMPTS"),
                    help="prompt JSONL (default $DEVICE_PROMPTS; --tiny writes synthetic ones)")
    ap.add_argument("--eval-data", default=os.environ.get("EVAL_DATA"),
                    help="benchmark prompt folder (gsm8k, humaneval, mt-bench); default: held-out regeneration prompts")
    ap.add_argument("--budget-s", type=float, default=float(os.environ.get("DEVICE_BUDGET_S", 520)),
                    help="overall seconds; a stage gets min(its limit, what is left) and is skipped under its need")
    ap.add_argument("--drafters", nargs="*", default=list(DRAFTERS))
    ap.add_argument("--stage", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _self_stage(args, stage: str) -> List[str]:
    """This file run as one of the stages it holds (``--stage``), with the run's work folder and prompts."""
    base = ["--work", str(Path(args.work)), "--prompts-path", args.prompts_path] + (["--tiny"] if args.tiny else [])
    return _py(str(Path(__file__).resolve()), "--stage", stage, *base)


def run_data_stages(R: Runner, args, sc) -> None:
    """env, convert (GPU scale), regen, regen_ab and cache, each recorded as it ends."""
    work, rec, T = R.work, R.record, sc["timeouts"]
    R.run("env", _self_stage(args, "env"), T["env"])
    rec["env"] = read_json(work / "env.json")
    if not args.tiny:
        R.run("convert", _cli("target", "fetch", "smollm2-135m"), T["convert"])
    R.run("regen", _self_stage(args, "regen"), T["regen"], need=20)
    rec["regen"] = regen_metrics(work)
    R.save()
    ab_out = work / "regen_ab.json"
    R.run("regen_ab", _py(str(REPO / "bench" / "regen_throughput.py"), "--target",
                          "tiny:llama" if args.tiny else "reference:smollm2-135m",
                          "--device", "cpu" if args.tiny else "cuda", "--threads", "1" if args.tiny else "0",
                          "--prompts", str(sc["ab_prompts"]), "--batch", str(sc["batch"]),
                          "--max-new-tokens", str(sc["ab_new_tokens"]), "--loops", "generate", "auto",
                          "--data", "data.source=jsonl", f"data.path={args.prompts_path}", "--out", str(ab_out)),
          T["regen_ab"], need=20)
    rec["regen_ab"] = read_json(ab_out)
    st = R.run("cache", _cli("prepare", *common(args, sc, work), f"run_dir={work / 'prepare'}"), T["cache"], need=15)
    rec["cache"] = cache_metrics(work, st.get("seconds"))
    R.save()


def run_train_stages(R: Runner, args, sc) -> None:
    R.record["train"] = {}
    for name in args.drafters:
        R.run(f"train_{name}", _cli("train", *common(args, sc, R.work), *train_overrides(sc, R.work, name)),
              sc["timeouts"]["train"], need=30)
        R.record["train"][name] = train_metrics(R.work, name)
        R.save()


def run_eval_stages(R: Runner, args, sc) -> None:
    """One eval per trained drafter, on the benchmark files when all are there, else on held-out prompts."""
    work, rec = R.work, R.record
    if args.eval_data and all((Path(args.eval_data) / f"{b}.jsonl").is_file() for b in EVAL_BENCHES):
        eval_dir, benches = Path(args.eval_data), EVAL_BENCHES
    else:
        eval_dir, benches = write_eval_prompts(work, 2 * sc["eval_samples"] + 2), ["sharegpt"]
        sc = {**sc, "eval_samples": 2 * sc["eval_samples"] + 2}
    rec["eval_prompts"] = {"benchmarks": benches, "max_samples": sc["eval_samples"],
                           "source": "benchmark files" if benches == EVAL_BENCHES else "held-out regeneration prompts"}
    rec["eval"] = {}
    for name in args.drafters:
        ck = rec["train"].get(name, {}).get("checkpoint")
        if not ck:
            rec["stages"][f"eval_{name}"] = {"status": "skipped", "reason": "no checkpoint"}
            continue
        overrides = eval_overrides(sc, work, name, ck, eval_dir, benches)
        R.run(f"eval_{name}", _cli("eval", *common(args, sc, work), *overrides), sc["timeouts"]["eval"], need=20)
        rec["eval"][name] = eval_metrics(work, name)
        R.save()


def run_extra_stages(R: Runner, args, sc) -> None:
    """cuda_tests (GPU scale) and profile (with dspark), when time is left."""
    T = sc["timeouts"]
    if not args.tiny:   # the CUDA-marked tests, when time is left (they skip without a GPU)
        st = R.run("cuda_tests", _py("-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda",
                                     "tests/integration/test_cuda.py"), T["cuda_tests"], need=40)
        R.record["cuda_tests"] = (pytest_summary(R.work / "logs" / "cuda_tests.log")
                                  if st.get("status") != "skipped" else None)
    if "dspark" in args.drafters:
        R.run("profile", _self_stage(args, "profile"), T["profile"], need=25)


def write_logs_tar(path: Path, work: Path, drafters: List[str]) -> None:
    """Stage logs, eval reports, training metrics and small records; never the cache or the regenerated data."""
    with tarfile.open(path, "w:gz") as tar:
        for p in sorted((work / "logs").glob("*")):
            tar.add(p, arcname=f"logs/{p.name}")
        for name in drafters:
            for rel in (f"eval/{name}/report.md", f"eval/{name}/results.json", f"runs/{name}/metrics.jsonl",
                        f"runs/{name}/train.log"):
                p = work / rel
                if p.is_file():
                    tar.add(p, arcname=rel)
        for rel in ("regen/regen.jsonl.job.json", "regen_ab.json", "cache/manifest.json", "env.json"):
            if (work / rel).is_file():
                tar.add(work / rel, arcname=rel)


def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.stage:
        return {"env": stage_env, "regen": stage_regen, "profile": stage_profile}[args.stage](args)

    sc = scale(args.tiny)
    if args.tiny and not args.prompts_path:
        args.prompts_path = str(write_tiny_prompts(work, sc["prompts"]))
    if not args.prompts_path or not Path(args.prompts_path).is_file():
        print("device run: no prompts (set DEVICE_PROMPTS or --prompts-path, or run with TINY=1)", file=sys.stderr)
        return 2
    out_dir = Path(args.out) if args.out else REPO / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    rec: Dict[str, Any] = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "tiny": args.tiny,
                           "command": " ".join(["bench/device/run.py", *(argv if argv is not None else sys.argv[1:])]),
                           "scale": {k: v for k, v in sc.items() if k != "timeouts"}, "timeouts": sc["timeouts"],
                           "budget_s": args.budget_s, "baseline_h200": BEFORE, "stages": {}}
    rec_path, md_path = out_dir / "device_run.json", out_dir / "device_run.md"

    def save():
        rec["goals"] = goals(rec)
        rec_path.write_text(json.dumps(rec, indent=2) + "\n")
        md_path.write_text(summary_md(rec))

    # tiny tensors on a CPU: one thread each (more only spin against each other on a shared machine)
    R = Runner(work, args.budget_s, rec, save,
               {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")} if args.tiny else None)
    run_data_stages(R, args, sc)
    run_train_stages(R, args, sc)
    run_eval_stages(R, args, sc)
    run_extra_stages(R, args, sc)
    rec["total_s"] = round(time.monotonic() - R.t0, 1)
    save()
    write_logs_tar(out_dir / "device_run.logs.tar.gz", work, args.drafters)
    print(f"[device] done in {rec['total_s']} s → {rec_path}, {md_path}, {out_dir / 'device_run.logs.tar.gz'}",
          flush=True)
    print(summary_md(rec), flush=True)
    failed = [k for k, s in rec["stages"].items() if s.get("status") == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
