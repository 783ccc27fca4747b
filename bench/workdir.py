"""The work directory the drafter benchmarks share (`bench/learning_curve.py`, `bench/eval_drafters.py`,
`bench/decoding_table.py`): the drafters as config overrides, the domain benchmarks, and one work directory's
regenerated ShareGPT data and hidden-state cache of the reference target (SmolLM2-135M-Instruct).

A work directory holds `regen/regen.jsonl` and `cache/`; every drafter trained from it reads the same
cache, so their curves and evals are paired.
"""
from __future__ import annotations

import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

DRAFTERS = {
    "dspark_markov": ["draft=dspark", "draft.sequential_head=markov"],
    "dspark_rnn": ["draft=dspark_rnn"],
    "dflash": ["draft=dflash"],
    # Loss on the chains rooted at the sampled anchors: the same LM-head rows per step as the
    # others (dense TTT would do ~T/anchors times the vocabulary work of DFlash per step).
    "eagle3": ["draft=eagle3", "draft.ttt_dense=false"],
}
DOMAIN_BENCHES = ["gsm8k", "math500", "humaneval", "mbpp", "mt-bench", "arena-hard-v2"]


def shared_overrides(args) -> list:
    """The Hydra overrides every stage and drafter of a work directory shares (data, cache, target, budget):
    ``args`` carries work, samples, max_new_tokens, max_turns, steps, anchors, eval_samples,
    eval_new_tokens and extra."""
    work = Path(args.work)
    return [f"data.regen_path={work / 'regen' / 'regen.jsonl'}", f"cache.dir={work / 'cache'}",
            "target=smollm2_135m", "data=sharegpt", f"data.max_samples={args.samples}",
            f"engine.max_new_tokens={args.max_new_tokens}", f"engine.max_turns={getattr(args, 'max_turns', 1)}",
            "engine.temperature=0.7",
            "data.max_length=512", "train=cpu", f"train.max_steps={args.steps}",
            f"train.anchors_per_sequence={args.anchors}", "eval.temperature=0", "eval.decoding=chain",
            f"eval.max_samples={args.eval_samples}", f"eval.max_new_tokens={args.eval_new_tokens}",
            f"eval.benchmarks=[{','.join(DOMAIN_BENCHES)}]",
            "eval.data_dir=" + str(REPO.parent / "shared" / "eval_datasets"), *args.extra]


def prepare(args, work: Path):
    """Regenerate and cache the work directory's data (each stage resumes what is already there):
    ({regenerate_s, cache_s}, cache path)."""
    from deepspec.cache.writer import build_cache
    from deepspec.config import load_config
    from deepspec.prepare import regenerate
    base = load_config(shared_overrides(args) + [f"run_dir={work / 'prepare'}"])
    t = time.perf_counter()
    regen = regenerate(base)
    t1 = time.perf_counter()
    cache = build_cache(base, regen_path=regen)
    return {"regenerate_s": t1 - t, "cache_s": time.perf_counter() - t1}, cache
