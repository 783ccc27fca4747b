"""`deepspec plan`: tokens, cache bytes and hours before spending GPU time.

From the config and a sample of the data (the regen JSONL when it exists, else the
raw prompt source through ``deepspec.data``, or an explicit JSONL path), estimate

- samples and tokens (chat template applied, truncated to ``data.max_length``);
- cache bytes: this codec measured on a probe of real captured hidden states, side
  by side with DeepSpec's raw layout ``6 + 2·H·(L+1)`` bytes/token;
- regeneration, capture and training time from short measured probes on the
  current device (greedy KV-cached decode, the builder's own capture batching, and a
  forward+backward of the configured drafter);
- with ``draft.vocab_size = N``: the share of the sampled answer tokens the N most frequent
  of them (+ the target's EOS tokens, as the trainer selects) cover, and what the draft head
  shrinks to (target LM-head rows N of V; trainable parameters, e.g. the Markov ``W2`` r×N);

print a table, and return 2 (``deepspec plan`` exits non-zero) when the estimated
cache does not fit the free disk at the cache path.

The probes themselves live in `probes`; this module samples the data, extrapolates and
prints the table.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, TextIO

import numpy as np

from .. import paths
from ..cache.codecs import codec_from_config
from ..cache.format import raw_bytes_per_token
from ..data import DataError, fallback_id, iter_jsonl, iter_source, record_to_conversation
from ..data.sources import column_mapping
from ..data.vocab import REPORT_SIZES, count_answer_tokens, coverage, select_top, top_coverage
from ..drafts.registry import count_trainable_parameters
from ..cache.writer import encode_threads
from ..targets import load_target
from ..targets.loader import check_target_source
from .probes import encode_conversations, probe_capture, probe_decode, probe_train

log = logging.getLogger(__name__)


@dataclass
class Plan:
    source: str
    records: int                      # records counted (train share for raw prompts)
    records_exact: bool
    sampled: int                      # records tokenized for the statistics
    mean_tokens: float
    mean_loss_tokens: float
    skipped_fraction: float
    total_tokens: float
    assumed_response_tokens: Optional[int]
    hidden_size: int
    num_feature_layers: int
    codec: Dict[str, Any]
    probe_tokens: int = 0
    codec_bytes_per_token: float = float("nan")
    raw_bytes_per_token: int = 0
    cache_bytes: float = float("nan")
    raw_cache_bytes: float = float("nan")
    free_bytes: int = 0
    cache_path: str = ""
    device: str = ""
    capture_tok_s: float = float("nan")
    encode_mb_s: float = float("nan")
    decode_tok_s: float = float("nan")
    decode_batch: int = 0
    mean_anchors: float = float("nan")
    train_anchor_s: float = float("nan")
    regen_s: float = float("nan")
    capture_s: float = float("nan")
    train_s: float = float("nan")
    vocab_size: int = 0                       # the target's
    draft_vocab_size: Optional[int] = None    # draft.vocab_size (None: the full vocabulary)
    vocab_coverage: float = float("nan")      # of the sampled answer tokens by the draft vocabulary
    vocab_answer_tokens: int = 0              # sampled answer tokens the coverage was measured on
    draft_params: int = 0                     # trainable draft parameters with draft.vocab_size
    draft_params_full: int = 0                # ... and with the full vocabulary
    notes: List[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not (self.cache_bytes > self.free_bytes)


# -- data sample ---------------------------------------------------------------------------------------
def _count_lines(path: Path) -> int:
    n = 0
    with open(path, "rb") as f:
        for line in f:
            n += bool(line.strip())
    return n


def _regen_sample(path: Path, limit: int) -> List[List[Dict[str, str]]]:
    out = []
    with open(path, "rb") as f:
        for line in f:
            if len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                conv = rec["conversations"]
            except (ValueError, KeyError, TypeError):
                continue
            if isinstance(conv, list) and conv:
                out.append(conv)
    return out


def _source_sample(cfg, prompts_path: Optional[Path], limit: int, count_s: float):
    """(sample of message lists, counted records, exact?) from the raw prompt source."""
    it = iter_jsonl(prompts_path) if prompts_path is not None else iter_source(cfg.data)
    columns = {} if prompts_path is not None else column_mapping(cfg.data)
    sample, n, exact = [], 0, True
    cap = cfg.data.max_samples
    t0 = time.monotonic()
    for rec in it:
        if rec.error is not None:
            continue
        if cap is not None and n >= cap:
            break
        if len(sample) < limit:
            try:
                conv = record_to_conversation(rec.value, origin=rec.origin,
                                              default_id=fallback_id(rec.source_key, rec.line), columns=columns)
            except DataError:
                continue
            sample.append(conv.messages)
        n += 1
        if time.monotonic() - t0 > count_s:
            exact = False
            break
    return sample, n, exact


# -- estimate helpers ---------------------------------------------------------------------------------
def _valid_anchors(mask, gamma: int, cap: int) -> int:
    """Anchors training draws from one sample (valid positions, capped by anchors_per_sequence)."""
    m = np.asarray(mask, dtype=bool)
    if m.size <= gamma:
        return 0
    win = np.lib.stride_tricks.sliding_window_view(m, gamma + 1).all(axis=-1)
    n = int(win.sum())
    return n if cap <= 0 else min(n, cap)


def _free_bytes(path: Path) -> int:
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


# -- estimate -------------------------------------------------------------------------------------------
def estimate(cfg, target=None, prompts_path=None, sample_records: int = 256, probe_tokens: Optional[int] = None,
             decode_steps: Optional[int] = None, decode_batch: Optional[int] = None,
             assumed_response_tokens: int = 512, count_seconds: float = 120.0, train_probe: bool = True) -> Plan:
    """Measure and extrapolate (see the module doc).  Probe sizes default to 2048 captured
    tokens, 16 decode steps at batch 8 on an accelerator and 384 / 4 / 2 on a CPU."""
    notes: List[str] = []
    source, convs, n, exact = _sample(cfg, prompts_path, sample_records, count_seconds, notes)
    if not convs:
        raise SystemExit(f"deepspec plan: no readable conversations in {source}")
    if target is None:
        log.info("plan: loading the target %s", cfg.target.path)
        target = load_target(cfg.target)
    accel = target.device.type != "cpu"
    probe_tokens = probe_tokens or (2048 if accel else 384)
    decode_steps = decode_steps or (16 if accel else 4)
    decode_batch = decode_batch or (8 if accel else 2)
    codec = codec_from_config(cfg.cache)
    log.info("plan: tokenizing %d sampled conversations", len(convs))
    items, assumed = encode_conversations(target, convs, int(cfg.data.max_length), assumed_response_tokens)
    ok = [it for it in items if it is not None]
    if not ok:
        raise SystemExit("deepspec plan: no sampled conversation has assistant tokens within data.max_length")
    records = float(n)          # every conversation is regenerated and cached (held-out ones too)
    keep = len(ok) / len(items)
    mean_t = float(np.mean([len(i) for i, _ in ok]))
    mean_l = float(np.mean([sum(m) for _, m in ok]))
    total_tokens = records * keep * mean_t
    L, H = len(target.layer_ids), int(target.hidden_size)
    plan = Plan(source=source, records=int(round(records)), records_exact=exact, sampled=len(items),
                mean_tokens=mean_t, mean_loss_tokens=mean_l, skipped_fraction=1 - keep, total_tokens=total_tokens,
                assumed_response_tokens=assumed_response_tokens if assumed else None, hidden_size=H,
                num_feature_layers=L, codec=codec.spec(), raw_bytes_per_token=raw_bytes_per_token(H, L),
                cache_path=str(paths.cache_dir(cfg)), device=str(target.device), notes=notes)
    if assumed:
        notes.append(f"{assumed} of {len(items)} sampled records have no answers: "
                     f"assumed {assumed_response_tokens} response tokens per user turn")
    plan.free_bytes = _free_bytes(paths.cache_dir(cfg))
    _draft_vocab(plan, cfg, target, [it for conv, it in zip(convs, items) if it is not None
                                     and any(m.get("role") == "assistant" and m.get("content") for m in conv)])
    plan.raw_cache_bytes = total_tokens * plan.raw_bytes_per_token
    # capture + codec probe
    log.info("plan: capture + %s probe on %d tokens (%s)", codec.name, probe_tokens, target.device)
    tot, bpt, cap_tps, enc_mbs, captured = probe_capture(target, codec, ok, probe_tokens,
                                                         max(1, min(int(cfg.cache.batch_tokens), probe_tokens)))
    plan.probe_tokens, plan.codec_bytes_per_token = tot, bpt
    plan.capture_tok_s, plan.encode_mb_s = cap_tps, enc_mbs
    plan.cache_bytes = total_tokens * bpt
    enc_tps = enc_mbs * 1e6 / (2 * H * (L + 1))
    plan.capture_s = total_tokens / min(cap_tps, enc_tps * encode_threads(cfg, 1))
    _probe_regeneration(plan, target, ok, records * keep * mean_l, decode_steps, decode_batch)
    if train_probe:
        _probe_training(plan, cfg, target, ok, captured, records * keep)
    return plan


def _sample(cfg, prompts_path, sample_records: int, count_seconds: float, notes: List[str]):
    """(source label, sampled conversations, record count, whether exact): the regenerated conversations
    when they exist, else the raw prompts (their original answers standing in)."""
    regen = paths.regen_path(cfg)
    if prompts_path is None and regen.is_file():
        return f"regen {regen}", _regen_sample(regen, sample_records), _count_lines(regen), True
    pp = Path(prompts_path) if prompts_path is not None else None
    source = f"prompts {pp}" if pp else f"data.source={cfg.data.source}"
    convs, n, exact = _source_sample(cfg, pp, sample_records, count_seconds)
    if not exact:
        notes.append(f"record count stopped after {count_seconds:.0f} s: {n:,} is a lower bound")
    notes.append("raw prompts: original answers stand in for regenerated ones")
    return source, convs, n, exact


def _probe_regeneration(plan: Plan, target, ok, answer_tokens: float, decode_steps: int, decode_batch: int) -> None:
    log.info("plan: decode probe (%d steps at batch %d)", decode_steps, decode_batch)
    try:
        prompts = [i[: max(8, min(64, len(i)))] for i, _ in ok[:decode_batch]]
        plan.decode_batch = len(prompts)
        plan.decode_tok_s = probe_decode(target, prompts, decode_steps)
        plan.regen_s = answer_tokens / plan.decode_tok_s
        plan.notes.append(f"regeneration: HF greedy decode at batch {len(prompts)}; a serving engine with larger "
                          "batches is usually much faster")
    except Exception as e:  # pragma: no cover - depends on the target family
        plan.notes.append(f"regeneration probe failed: {type(e).__name__}: {e}")


def _probe_training(plan: Plan, cfg, target, ok, captured, sequences: float) -> None:
    log.info("plan: %s forward+backward probe", cfg.draft.algorithm)
    try:
        gamma, cap = int(cfg.draft.gamma), int(cfg.train.anchors_per_sequence)
        plan.mean_anchors = float(np.mean([_valid_anchors(m, gamma, cap) for _, m in ok]))
        plan.train_anchor_s = probe_train(target, cfg, captured)
        epochs = int(cfg.train.epochs)
        seqs = sequences * epochs
        if cfg.train.max_steps:
            seqs = min(seqs, int(cfg.train.max_steps) * int(cfg.train.global_batch_sequences))
        plan.train_s = seqs * plan.mean_anchors / plan.train_anchor_s
        plan.notes.append(f"training: {cfg.draft.algorithm} forward+backward, {plan.mean_anchors:,.0f} anchor blocks "
                          f"per sequence (gamma {gamma}), {epochs} epochs on one device (divide by the GPUs)")
    except Exception as e:
        plan.notes.append(f"training probe unavailable: {type(e).__name__}: {e}")


def _draft_vocab(plan: Plan, cfg, target, answered) -> None:
    """Coverage of the configured draft vocabulary on the sampled answers (not on assumed ones)."""
    V, N = int(target.vocab_size), cfg.draft.vocab_size
    plan.vocab_size, plan.draft_vocab_size = V, (int(N) if N is not None else None)
    if N is not None and not 1 <= int(N) <= V:
        plan.notes.append(f"ERROR: draft.vocab_size={N} must be between 1 and the target vocabulary size {V} "
                          "(null = the full vocabulary); training would refuse it")
        return
    if N is not None:
        try:
            plan.draft_params = count_trainable_parameters(target, cfg.draft)
            plan.draft_params_full = count_trainable_parameters(target, dataclasses.replace(cfg.draft,
                                                                                             vocab_size=None))
        except Exception as e:   # a draft config the drafter refuses: the training probe reports it too
            plan.notes.append(f"draft parameters unavailable: {type(e).__name__}: {e}")
    counts = count_answer_tokens(({"input_ids": i, "loss_mask": m} for i, m in answered), V)
    plan.vocab_answer_tokens = int(counts.sum())
    if not plan.vocab_answer_tokens:
        return
    if N is not None:
        plan.vocab_coverage = coverage(counts, select_top(counts, int(N), always=target.eos_token_ids))
    else:
        sizes = [n for n in REPORT_SIZES if n < V]
        if sizes:
            plan.notes.append("draft.vocab_size=null (all {:,} tokens); the N most frequent sampled answer tokens "
                              "would cover {}".format(V, ", ".join(f"{100 * top_coverage(counts, n):.1f}% at N={n:,}"
                                                                  for n in sizes)))


# -- report ----------------------------------------------------------------------------------------------
def _b(n: float) -> str:
    if not math.isfinite(n):
        return "n/a"
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:,.1f} {unit}"
        n /= 1000
    return str(n)


def _t(s: float) -> str:
    if not math.isfinite(s):
        return "n/a"
    if s < 120:
        return f"{s:,.0f} s"
    if s < 7200:
        return f"{s / 60:,.1f} min"
    if s < 172800:
        return f"{s / 3600:,.1f} h"
    return f"{s / 86400:,.1f} days"


def _r(x: float, unit: str) -> str:
    if not math.isfinite(x):
        return "n/a"
    return f"{x:,.1f} {unit}" if x < 10 else f"{x:,.0f} {unit}"


def format_plan(p: Plan) -> str:
    L, H = p.num_feature_layers, p.hidden_size
    rows = [
        ("source", p.source, ""),
        ("records", f"{p.records:,}{'' if p.records_exact else '+'}",
         f"{p.skipped_fraction:.1%} of {p.sampled} sampled skipped (no answer tokens)"),
        ("tokens / sample", f"{p.mean_tokens:,.0f}", f"{p.mean_loss_tokens:,.0f} answer (loss) tokens"),
        ("total tokens", f"{p.total_tokens:,.0f}", ""),
        ("", "", ""),
        ("cache layout", "bytes/token", "total"),
        (f"raw (6 + 2·{H}·({L}+1))", f"{p.raw_bytes_per_token:,}", _b(p.raw_cache_bytes)),
        (f"codec {p.codec['name']} {json.dumps(p.codec['params'], sort_keys=True)}",
         f"{p.codec_bytes_per_token:,.1f}", _b(p.cache_bytes)),
        ("ratio vs raw", f"{p.raw_bytes_per_token / p.codec_bytes_per_token:.3f}x",
         f"measured on {p.probe_tokens:,} captured tokens"),
        ("free disk", "", f"{_b(p.free_bytes)} at {p.cache_path}"),
        ("", "", ""),
        (f"time on {p.device}", "throughput", "estimate"),
        ("regeneration", _r(p.decode_tok_s, "tok/s"), _t(p.regen_s)),
        ("capture + encode", f"{_r(p.capture_tok_s, 'tok/s')}, {_r(p.encode_mb_s, 'MB/s')} enc", _t(p.capture_s)),
        ("training", _r(p.train_anchor_s, "blocks/s"), _t(p.train_s)),
    ]
    if p.draft_vocab_size is not None and 1 <= p.draft_vocab_size <= p.vocab_size:
        N, V, H = p.draft_vocab_size, p.vocab_size, p.hidden_size
        head = f"target LM-head rows {N:,}×{H} = {N / V:.1%} of {V:,}×{H}"
        if p.draft_params_full:
            head += (f"; trainable {p.draft_params / 1e6:,.2f}M (full vocabulary: "
                     f"{p.draft_params_full / 1e6:,.2f}M)")
        cov = (f"{100 * p.vocab_coverage:.2f}% of {p.vocab_answer_tokens:,} sampled answer tokens"
               if math.isfinite(p.vocab_coverage) else "n/a (no sampled answers)")
        rows += [("", "", ""), ("draft vocabulary", f"{N:,} of {V:,}", f"coverage {cov}"),
                 ("draft head", "", head)]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = ["deepspec plan", "-" * (w0 + w1 + 40)]
    lines += [f"{a:<{w0}}  {b:>{w1}}  {c}".rstrip() for a, b, c in rows]
    lines.append("-" * (w0 + w1 + 40))
    lines += [f"note: {n}" for n in p.notes]
    if not p.fits:
        lines.append(f"ERROR: the estimated cache ({_b(p.cache_bytes)}) exceeds the free disk "
                     f"({_b(p.free_bytes)}) at {p.cache_path}")
    return "\n".join(lines)


def run(cfg, prompts_path=None, target=None, out: Optional[TextIO] = None, **kw) -> int:
    """Print the plan; return 2 when the cache would not fit on disk (else 0)."""
    if target is None:
        check_target_source(cfg.target)          # one line, before the data is sampled
    plan = estimate(cfg, target=target, prompts_path=prompts_path, **kw)
    print(format_plan(plan), file=out or sys.stdout)
    return 0 if plan.fits else 2

