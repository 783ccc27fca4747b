"""Prompt data section (`data=...`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Literal, Optional


@dataclass
class DataConfig:
    # Source kind: sharegpt_package | jsonl | parquet | hf
    source: Literal["sharegpt_package", "jsonl", "parquet", "hf"] = "sharegpt_package"
    path: Optional[str] = None
    # Hugging Face datasets source.
    hf_name: Optional[str] = None
    hf_config: Optional[str] = None
    hf_split: str = "train"
    # Column mapping for HF/parquet sources, e.g. {"conversations": "messages"}.
    columns: Dict[str, str] = field(default_factory=dict)
    trust_remote_code: bool = False
    # Stream the HF dataset instead of downloading it whole (useful with max_samples).
    hf_streaming: bool = False
    max_samples: Optional[int] = None
    # Pass over this many good conversations first (counted, not kept): a later prepare extends an
    # earlier one without redoing it, e.g. start_sample=1000 max_samples=2000 keeps conversations 1000..2999.
    start_sample: int = 0
    # The one held-out split: the fraction of conversations, chosen by a seeded hash of their id, that
    # training never fits.  They are regenerated and cached like the rest; training scores them
    # teacher-forced (eval/expected_tau) and decodes their prompts (heldout.jsonl, train.decode_eval_*).
    heldout_fraction: float = 0.02
    split_seed: int = 0
    # error | skip (skip writes the bad record to an error file and counts it).
    on_error: Literal["error", "skip"] = "error"
    # Where skipped records go (JSONL); None = {regen dir}/errors.jsonl.
    errors_path: Optional[str] = None
    # Regenerated conversations (output of the regeneration step).
    regen_path: Optional[str] = None
    # Train without a cache: the frozen target runs inside training.
    online: bool = False
    # Tokens per conversation (prompt turns and answers): the regeneration's prompt budget (unless
    # engine.max_prompt_tokens), what the cache stores and what training reads (a cache built longer
    # is cut to it).
    max_length: int = 2048
