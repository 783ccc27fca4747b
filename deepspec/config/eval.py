"""Evaluation section (`eval=...`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Literal, Optional


@dataclass
class EvalConfig:
    checkpoint: Optional[str] = None
    data_dir: str = "../shared/eval_datasets"
    benchmarks: List[str] = field(
        default_factory=lambda: ["gsm8k", "math500", "aime25", "humaneval", "mbpp",
                                 "livecodebench", "mt-bench", "arena-hard-v2"])
    max_samples: Optional[int] = 20
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # Drop tokens below min_p × the most likely token's probability (after top-k/top-p); 0 = off.
    min_p: float = 0.0
    gamma: Optional[int] = None
    # auto | chain | tree.  auto: what is set below, else the loaded drafter's documented best lossless
    # setting for greedy / sampled decoding (`deepspec.decoding.settings`); chain: verify γ drafts per round;
    # tree: draft trees (the drafter's default fills the tree keys left unset).
    decoding: Literal["auto", "chain", "tree"] = "auto"
    # Verify a draft tree of at most this many nodes per round instead of a chain of γ drafts
    # (`deepspec.decoding.tree_loop`, greedy or sampled).  None = the drafter's default (auto) or chains.
    tree_nodes: Optional[int] = None
    # Tree growth: nodes expanded per depth, and children per expanded node.  None = the default (4).
    tree_width: Optional[int] = None
    # The deepest node the drafter's tree grows to (capped at γ; a prompt-lookup chain may still reach γ).
    # A sequential drafter (Eagle3) runs one draft forward per depth, so a shallower tree drafts faster.
    # 0 = γ; None = the drafter's default, else γ.
    tree_depth: Optional[int] = None
    # Prompt lookup (trees only): each round also verifies the tokens that followed the latest earlier
    # occurrence of the context's last n tokens, n from lookup_ngram down to lookup_min_ngram, within the
    # same node budget (`deepspec.decoding.lookup`).  0 = off; None = the drafter's default (else 0 / 1).
    lookup_ngram: Optional[int] = None
    lookup_min_ngram: Optional[int] = None
    # Verify every row through the one-token attention call of plain decoding: bf16 rows then round like
    # one-token steps only where the target's matmuls are batch-invariant too, which the reference target's
    # bf16 GEMMs on CPU are not (71/120 identical outputs, 2026-12-07; `deepspec.decoding.row_invariant`);
    # costs one small attention call per row and layer.  For identical greedy outputs use a float32 target.
    row_invariant: bool = False
    # The drafter's weights while decoding: null = as saved (fp32), float32 | bfloat16 | float16, or
    # "target" = the target's dtype.  The verification stays the target's, so any dtype is lossless.
    draft_dtype: Optional[str] = None
    multi_turn: bool = True
    measure_baseline: bool = True
    seed: int = 0
    # Percentile-bootstrap resamples over requests for the 95% intervals of τ and the speedup
    # (per benchmark; stratified for the domain/overall macro); seeded with `seed`. 0 = off.
    bootstrap_resamples: int = 1000
    out_dir: Optional[str] = None
    # One short untimed generation before measuring (kernels, allocator, caches).
    warmup: bool = True
    # tqdm progress bar over requests.
    progress: bool = True
    # Decode again even when results.json already matches this config, checkpoint and prompts.
    rerun: bool = False
