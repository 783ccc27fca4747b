"""`deepspec eval`: speculative decoding on benchmarks → report.md, results.json, rollouts, plots.

    deepspec eval target.path=... eval.checkpoint=runs/x/checkpoints/step_1000 eval.max_samples=20

For every benchmark prompt (every turn of mt-bench, with the generated history) the
drafter and the target run the lossless loops of `deepspec.decoding`, and the
target alone decodes the same prompt for the tokens/s baseline.  Outputs go to
`deepspec.paths.eval_dir(cfg)`:

- ``report.md``          tables: τ per benchmark and domain, acceptance by position, speed, time split
- ``results.json``       every number of the report + the resolved config, target and drafter
- ``rollouts.jsonl``     one line per verification round (confidence, accepted, proposed, draft tokens)
- ``samples.jsonl``      one line per request (prompt length, generated text, τ, stop reason, timings)
- ``plots/*.png``        conditional acceptance per domain, τ per benchmark, reliability, threshold sweep
- ``resolved_config.yaml``
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import statistics
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from ..config import ConfigError, as_node, save_config
from ..decoding.chain import speculative_generate
from ..decoding.loop import GenerationResult, RoundStats, target_generate
from ..decoding.policy import build_policy
from ..decoding.row_invariant import check_row_invariant_target
from ..decoding.settings import TreeSetting, tree_setting
from ..decoding.tree_loop import tree_generate
from ..decoding.warp import Warp, make_warp
from ..paths import eval_dir
from ..drafts.checkpoint import read_checkpoint_config
from ..targets import load_target
from ..targets.loader import check_target_source
from ..targets.chat import encode_prompt
from ..utils.fs import atomic_write, jsonl_line
from .benchmarks import Sample, domain_of, load_benchmarks
from .bootstrap import LEVEL, benchmark_interval, bootstrap_intervals, request_totals
from .latency import format_round_split, round_split
from .metrics import (acceptance_metrics, cumulative_confidence_points, macro_average, nanmean, reliability,
                      speed_metrics, threshold_sweep)
from .report import make_plots, write_report
from .setup import adopt_checkpoint_layers, load_eval_drafter

log = logging.getLogger(__name__)

__all__ = ["run", "evaluate", "RequestRecord", "ROLLOUTS_FILENAME"]

ROLLOUTS_FILENAME = "rollouts.jsonl"


@dataclass
class RequestRecord:
    request_id: str
    benchmark: str
    sample: int
    turn: int
    prompt_tokens: int
    spec: GenerationResult
    baseline: Optional[GenerationResult] = None
    text: str = ""

    @property
    def domain(self) -> str:
        return domain_of(self.benchmark)

    def to_json(self) -> Dict[str, Any]:
        s = self.spec
        d = {"request_id": self.request_id, "benchmark": self.benchmark, "domain": self.domain,
             "sample": self.sample, "turn": self.turn, "prompt_tokens": self.prompt_tokens,
             "generated_tokens": s.num_tokens, "rounds": len(s.rounds), "tau": s.tau,
             "stop_reason": s.stop_reason, "time_s": s.t_total, "prefill_s": s.t_prefill,
             "draft_s": s.t_draft, "verify_s": s.t_verify, "overhead_s": s.t_overhead,
             "accepted": [r.accepted for r in s.rounds], "text": self.text}
        if self.baseline is not None:
            b = self.baseline
            d["baseline"] = {"generated_tokens": b.num_tokens, "time_s": b.t_total, "stop_reason": b.stop_reason}
        return d


# -- pieces ---------------------------------------------------------------------------------------


def request_generator(device, seed: int, request_id: str) -> torch.Generator:
    """A generator seeded from (eval.seed, request id): results do not depend on request order."""
    g = torch.Generator(device=device)
    g.manual_seed((int(seed) * 1_000_003 + zlib.crc32(request_id.encode())) % (2 ** 63))
    return g


def _rollout_line(request_id: str, rnd: int, rs: RoundStats, meta: Dict[str, Any]) -> str:
    return json.dumps({"request_id": request_id, "round": rnd, "confidence": rs.confidence,
                       "accepted": rs.accepted, "proposed": rs.proposed, "verified": rs.proposed,
                       "draft_tokens": rs.draft_tokens, "meta": meta,
                       **({"lookup_accepted": rs.lookup_accepted} if "lookup" in meta else {})}, separators=(",", ":"))


# -- the evaluation ---------------------------------------------------------------------------------


def _position_mean(vectors: Sequence[Sequence[float]]) -> List[float]:
    n = max((len(v) for v in vectors), default=0)
    return [nanmean(v[k] for v in vectors if k < len(v)) for k in range(n)]


def _summarize(reqs: Sequence[RequestRecord], gamma: int) -> Dict[str, Any]:
    rounds = [r for q in reqs for r in q.spec.rounds]
    m = acceptance_metrics(rounds, gamma)
    m["requests"] = len(reqs)
    m["spec"] = speed_metrics([q.spec for q in reqs])
    base = [q.baseline for q in reqs if q.baseline is not None]
    m["baseline"] = speed_metrics(base) if base else None
    m["generated_tokens"] = m["spec"]["generated_tokens"]
    bt, st = (m["baseline"] or {}).get("tokens_per_s"), m["spec"]["tokens_per_s"]
    m["speedup"] = st / bt if bt and not math.isnan(bt) and bt > 0 else float("nan")
    m["stop_reasons"] = {k: sum(1 for q in reqs if q.spec.stop_reason == k) for k in ("eos", "max_new_tokens")}
    return m


def summarize(records: Sequence[RequestRecord], gamma: int, temperatures: Optional[Sequence[float]] = None,
              greedy: bool = False, bootstrap_resamples: int = 0, bootstrap_seed: int = 0) -> Dict[str, Any]:
    """All numbers of the report from the per-request records; with ``bootstrap_resamples`` > 0 also
    ``tau_ci95`` (and ``speedup_ci95``) per benchmark, domain and overall (`deepspec.eval.bootstrap`)."""
    by_bench: Dict[str, List[RequestRecord]] = {}
    for r in records:
        by_bench.setdefault(r.benchmark, []).append(r)
    benchmarks: Dict[str, Any] = {}
    for name, reqs in by_bench.items():
        first = [q for q in reqs if q.turn == 0] if any(q.turn > 0 for q in reqs) else None
        benchmarks[name] = {"domain": domain_of(name), "all_turns": _summarize(reqs, gamma),
                            "first_turn": _summarize(first, gamma) if first is not None else None}
        if first is not None:
            benchmarks[name]["first_turn"].update(benchmark_interval(
                request_totals(first), bootstrap_resamples, bootstrap_seed, f"{name}/turn1"))
    flat = {n: b["all_turns"] for n, b in benchmarks.items()}
    macro = macro_average(flat, keys=("tau", "acceptance_rate", "speedup", "verified_per_round"))
    ci = bootstrap_intervals({n: request_totals(r) for n, r in by_bench.items()}, bootstrap_resamples, bootstrap_seed)
    for n, e in ci.get("benchmarks", {}).items():
        flat[n].update(e)
    for part in (*macro["domains"].values(), macro["overall"]):
        part["requests"] = sum(flat[b]["requests"] for b in part["benchmarks"])
    macro["overall"].update(ci.get("overall", {}))
    for d, dm in macro["domains"].items():
        dm.update(ci.get("domains", {}).get(d, {}))
        dm["conditional_acceptance"] = _position_mean([flat[b]["conditional_acceptance"] for b in dm["benchmarks"]])
        dm["prefix_survival"] = _position_mean([flat[b]["prefix_survival"] for b in dm["benchmarks"]])
    macro["overall"]["conditional_acceptance"] = _position_mean([m["conditional_acceptance"] for m in flat.values()])
    macro["overall"]["prefix_survival"] = _position_mean([m["prefix_survival"] for m in flat.values()])
    spec = speed_metrics([r.spec for r in records])
    base_res = [r.baseline for r in records if r.baseline is not None]
    base = speed_metrics(base_res) if base_res else None
    speed = {"spec": spec, "baseline": base,
             "speedup": spec["tokens_per_s"] / base["tokens_per_s"] if base and base["tokens_per_s"] > 0
             else float("nan"),
             "round_split": round_split([r.spec for r in records], base_res)}
    out: Dict[str, Any] = {"gamma": gamma, "benchmarks": benchmarks, "domains": macro["domains"],
                           "overall": macro["overall"], "speed": speed,
                           "bootstrap": {"resamples": int(bootstrap_resamples), "seed": int(bootstrap_seed),
                                         "level": LEVEL, "unit": "request", "macro": "stratified by benchmark"}
                           if bootstrap_resamples > 0 else None,
                           "pooled": acceptance_metrics([x for r in records for x in r.spec.rounds], gamma)}
    if greedy and base_res:
        pairs = [(r.spec.tokens, r.baseline.tokens) for r in records if r.baseline is not None]
        out["greedy_check"] = {"compared": len(pairs), "matched": sum(1 for a, b in pairs if a == b),
                               "mismatched_requests": [r.request_id for r in records
                                                       if r.baseline is not None and r.spec.tokens != r.baseline.tokens]}
    else:
        out["greedy_check"] = None
    rounds = [x for r in records for x in r.spec.rounds]
    if any(x.confidence for x in rounds):
        c, y, _ = cumulative_confidence_points(rounds)
        conf: Dict[str, Any] = {"reliability_raw": reliability(c, y),
                                "threshold_sweep": threshold_sweep(rounds, temperatures=temperatures),
                                "temperatures": list(temperatures) if temperatures else None}
        if temperatures:
            c2, y2, _ = cumulative_confidence_points(rounds, temperatures)
            conf["reliability_calibrated"] = reliability(c2, y2)
        out["confidence"] = conf
    else:
        out["confidence"] = None
    return out


def evaluate(target, drafter, benchmarks: Mapping[str, Sequence[Sample]], *, gamma: int, warp: Warp,
             max_new_tokens: int, seed: int = 0, multi_turn: bool = True, measure_baseline: bool = True,
             policy: Any = None, eos_token_ids: Optional[Sequence[int]] = None,
             rollout_sink: Optional[Callable[[str], None]] = None, warmup: bool = True,
             progress: bool = True, tree: Optional[TreeSetting] = None,
             row_invariant: bool = False) -> List[RequestRecord]:
    """Run speculative (+ baseline) decoding on every turn of every sample; returns the records.
    ``tree``: verify draft trees (`tree_generate`, with prompt lookup when it says so) instead of chains;
    ``row_invariant``: verification rows round like one-token steps (`deepspec.decoding.row_invariant`)."""
    def generate(target, drafter, ids, *, gamma, policy=None, **kw):
        if tree is None:
            return speculative_generate(target, drafter, ids, gamma=gamma, policy=policy,
                                        row_invariant=row_invariant, **kw)
        return tree_generate(target, drafter, ids, gamma=gamma, nodes=tree.nodes, width=tree.width,
                             lookup=tree.lookup, row_invariant=row_invariant, draft_depth=tree.depth, **kw)
    tok = target.tokenizer
    eos = list(target.eos_token_ids if eos_token_ids is None else eos_token_ids)
    eos_set = set(eos)
    kw = dict(getattr(target, "chat_template_kwargs", {}) or {})
    total = sum(len(s.turns) if multi_turn else 1 for ss in benchmarks.values() for s in ss)
    if warmup and total:
        first = next(s for ss in benchmarks.values() for s in ss)
        ids = encode_prompt(tok, [{"role": "user", "content": first.turns[0]}], **kw)
        n = min(8, max_new_tokens)
        warm = generate(target, drafter, ids, gamma=gamma, max_new_tokens=n, warp=warp,
                        generator=request_generator(target.device, seed, "warmup"), eos_token_ids=eos, policy=policy)
        if getattr(policy, "overhead_s", 0.0) is None and warm.rounds:   # a scheduler whose draft cost is unset
            policy.overhead_s = statistics.median(r.t_draft for r in warm.rounds)
            log.info("eval: scheduler draft overhead %.1f ms per round (median of %d warm-up rounds)",
                     1e3 * policy.overhead_s, len(warm.rounds))
        if measure_baseline:
            target_generate(target, ids, max_new_tokens=n, warp=warp,
                            generator=request_generator(target.device, seed, "warmup"), eos_token_ids=eos)
    records: List[RequestRecord] = []
    bar = tqdm(total=total, desc="eval", unit="req", disable=not progress, dynamic_ncols=True)
    try:
        for name, samples in benchmarks.items():
            for sample in samples:
                turns = sample.turns if multi_turn else sample.turns[:1]
                history: List[Dict[str, str]] = []
                for ti, user in enumerate(turns):
                    rid = sample.id if len(turns) == 1 else f"{sample.id}/t{ti}"
                    messages = history + [{"role": "user", "content": user}]
                    ids = encode_prompt(tok, messages, **kw)
                    meta = {"benchmark": name, "turn": ti, **({"tree": [tree.nodes, tree.width]} if tree else {}),
                            **({"lookup": list(tree.lookup)} if tree and tree.lookup else {})}
                    sink = None
                    if rollout_sink is not None:
                        def sink(rnd, rs, _rid=rid, _meta=meta):
                            rollout_sink(_rollout_line(_rid, rnd, rs, _meta))
                    spec = generate(target, drafter, ids, gamma=gamma, max_new_tokens=max_new_tokens, warp=warp,
                                    generator=request_generator(target.device, seed, rid), eos_token_ids=eos,
                                    policy=policy, on_round=sink)
                    base = None
                    if measure_baseline:
                        base = target_generate(target, ids, max_new_tokens=max_new_tokens, warp=warp,
                                               generator=request_generator(target.device, seed, rid),
                                               eos_token_ids=eos)
                    text = tok.decode([t for t in spec.tokens if t not in eos_set], skip_special_tokens=True)
                    records.append(RequestRecord(rid, name, sample.index, ti, len(ids), spec, base, text))
                    history = messages + [{"role": "assistant", "content": text}]
                    bar.update(1)
                    bar.set_postfix(bench=name, tau=f"{spec.tau:.2f}")
    finally:
        bar.close()
    return records


# -- files ----------------------------------------------------------------------------------------


def _clean(x):
    """JSON-safe: NaN/inf → null, tuples → lists, numpy scalars → Python."""
    if isinstance(x, float):
        return None if math.isnan(x) or math.isinf(x) else x
    if isinstance(x, Mapping):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):
        try:
            return _clean(x.item())
        except (ValueError, TypeError):
            return str(x)
    return x


def _config_dict(cfg) -> Dict[str, Any]:
    return OmegaConf.to_container(as_node(cfg), resolve=True)


def fingerprint(cfg, benches: Mapping[str, Sequence[Sample]]) -> str:
    """What an eval's numbers depend on: the resolved config (less `eval.rerun`/`eval.progress`),
    the checkpoint's files (name, size, mtime) and the prompts themselves."""
    conf = _config_dict(cfg)
    conf.get("eval", {}).pop("rerun", None)
    conf.get("eval", {}).pop("progress", None)
    files = []
    ck = Path(cfg.eval.checkpoint) if cfg.eval.checkpoint else None
    if ck is not None and ck.exists():
        for f in sorted([ck] if ck.is_file() else (q for q in ck.rglob("*") if q.is_file())):
            st = os.stat(f)
            files.append([str(f.relative_to(ck)) if f != ck else f.name, st.st_size, st.st_mtime_ns])
    prompts = {n: [[s.id, list(s.turns)] for s in ss] for n, ss in benches.items()}
    blob = json.dumps({"config": conf, "checkpoint": files, "prompts": prompts}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _reusable(out, fp: str) -> Optional[Dict[str, Any]]:
    """The earlier results.json in ``out`` when it was written for the same fingerprint."""
    res = out / "results.json"
    if not res.is_file():
        return None
    try:
        old = json.loads(res.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return old if old.get("fingerprint") == fp and (out / "report.md").is_file() else None


def run(cfg) -> Dict[str, Any]:
    """`deepspec eval` entry point: returns the summary written to results.json.

    An output directory whose results.json was written for the same config, checkpoint files and
    prompts is reused as it is (``eval.rerun=true`` decodes again)."""
    ec = cfg.eval
    benches = load_benchmarks(ec.data_dir, ec.benchmarks, ec.max_samples)   # fail before loading models
    if ec.checkpoint:                              # a missing or damaged checkpoint, before the target loads
        try:
            read_checkpoint_config(ec.checkpoint)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"eval.checkpoint={ec.checkpoint}: {e}") from None
        adopt_checkpoint_layers(cfg)
    check_target_source(cfg.target)
    out = eval_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out)
    fp = fingerprint(cfg, benches)
    old = None if getattr(ec, "rerun", False) else _reusable(out, fp)
    if old is not None:
        log.info("eval: already complete in %s (same config, checkpoint and prompts); eval.rerun=true decodes "
                 "again", out)
        return old
    torch.manual_seed(ec.seed)
    target = load_target(cfg.target)
    drafter, dinfo = load_eval_drafter(cfg, target)
    gamma = int(ec.gamma or dinfo["gamma"])
    policy, temps = build_policy(cfg, target)
    warp = make_warp(ec.temperature, ec.top_k, ec.top_p, ec.min_p)
    tree = tree_setting(cfg, target, drafter, policy, warp)
    if ec.row_invariant:
        try:
            check_row_invariant_target(target)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    policy_name = tree.describe() if tree else getattr(policy, "name", type(policy).__name__)
    if tree is not None and tree.source != "eval config":
        log.info("eval: %s is the %s drafter's default for %s decoding (eval.decoding=chain verifies chains)",
                 policy_name, dinfo["algorithm"], "greedy" if warp.greedy else "sampled")
    log.info("eval: %d benchmarks, γ=%d, %s, policy=%s → %s", len(benches), gamma, warp.describe(), policy_name, out)
    rollout_path = out / ROLLOUTS_FILENAME
    with open(rollout_path, "w", encoding="utf-8") as rf:
        def sink(line: str) -> None:
            rf.write(line + "\n")
        records = evaluate(target, drafter, benches, gamma=gamma, warp=warp, max_new_tokens=ec.max_new_tokens,
                           seed=ec.seed, multi_turn=ec.multi_turn, measure_baseline=ec.measure_baseline,
                           policy=policy, rollout_sink=sink, warmup=getattr(ec, "warmup", True),
                           progress=getattr(ec, "progress", True), tree=tree, row_invariant=ec.row_invariant)
    with open(out / "samples.jsonl", "w", encoding="utf-8") as f:
        for r in records:
            f.write(jsonl_line(_clean(r.to_json())) + "\n")
    summary = summarize(records, gamma, temps, greedy=warp.greedy,
                        bootstrap_resamples=ec.bootstrap_resamples, bootstrap_seed=ec.seed)
    summary["setup"] = {"target": f"{target.name} ({cfg.target.path})", "drafter": f"{dinfo['algorithm']} ({dinfo['source']})",
                        "policy": policy_name, "decoding_source": tree.source if tree else None,
                        "row_invariant": bool(ec.row_invariant),
                        "warp": warp.describe(),
                        "max_new_tokens": ec.max_new_tokens, "max_samples": ec.max_samples,
                        "multi_turn": ec.multi_turn, "device": str(target.device), "dtype": str(target.dtype)}
    if hasattr(policy, "overhead_s"):
        summary["setup"]["draft_overhead_s"] = policy.overhead_s
    summary["files"] = {"report": "report.md", "results": "results.json", "rollouts": ROLLOUTS_FILENAME,
                        "samples": "samples.jsonl", "config": "resolved_config.yaml"}
    plots = make_plots(out, summary)
    summary["plots"] = plots
    results = {**summary, "target": target.describe(), "drafter": dinfo, "config": _config_dict(cfg),
               "fingerprint": fp}
    res = out / "results.json"   # atomic, not fsynced
    atomic_write(res, json.dumps(_clean(results), indent=2, ensure_ascii=False),
                 tmp=res.with_suffix(res.suffix + ".tmp"), fsync=False)
    write_report(out, summary, plots)
    ov = summary["overall"]
    log.info("eval done: macro τ=%.3f, speedup=%.2fx → %s", ov.get("tau", float("nan")),
             summary["speed"]["speedup"], out / "report.md")
    log.info("eval %s", format_round_split(summary["speed"]["round_split"]))
    return summary
