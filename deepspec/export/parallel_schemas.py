"""The config schemas of the parallel drafter's engine formats, written from the readers' code.

* ``SPECULATORS_DSPARK`` — the speculators format read by vLLM
  (`vllm/transformers_utils/configs/speculators/base.py`: ``validate_speculators_config``
  requires ``speculators_config.proposal_methods[0].speculative_tokens``,
  ``speculators_config.verifier.name_or_path``, ``speculators_model_type`` and a dict
  ``transformer_layer_config``; ``algos.py`` ``update_dspark`` requires
  ``aux_hidden_state_layer_ids`` and ``mask_token_id`` and reads ``draft_vocab_size``,
  ``target_hidden_size``, ``markov_rank``, ``markov_head_type``, ``block_size``,
  ``enable_confidence_head``, ``confidence_head_with_markov``, ``sample_from_anchor``);
  field names and types as declared by speculators 0.9.0 (`models/dflash/config.py`,
  `models/dspark/config.py`).
* ``SGLANG_DSPARK`` — the DSpark draft read by SGLang 0.5.23 and by SpecForge 0.2.0.
  SGLang (`srt/models/dspark.py`, `speculative/dspark_components/dspark_config.py`
  ``parse_dspark_draft_config``, `speculative/dflash_utils.py` ``parse_dflash_draft_config``)
  reads ``markov_rank`` / ``markov_head_type`` / ``mask_token_id`` / ``block_size`` from
  ``dflash_config`` first, then the top level, but builds the Markov and confidence heads
  from the top-level ``markov_rank``, ``markov_head_type`` and ``confidence_head_with_markov``;
  its model registry holds ``DSparkDraftModel``.  SpecForge (`modeling/draft/registry.py`,
  `dflash.py`, `dspark.py`) knows only ``DSparkDraftModel``, needs a top-level
  ``block_size`` and reads every head field inside ``dflash_config`` (plus
  ``attention_mode``: ``gqa`` needs fewer KV heads than query heads, ``mha`` equal counts).
  So the heads are written in both places, with equal values.
"""
from __future__ import annotations

from typing import Any, Dict

from .schemas import BOOL, INT_LIST, NONNEG_INT, POS_INT, QWEN3_LAYER, speculators_common

_HEAD_TYPES = {"enum": ["vanilla", "gated", "rnn"]}

SPECULATORS_DSPARK: Dict[str, Any] = {
    "type": "object",
    "required": ["speculators_model_type", "architectures", "speculators_config", "transformer_layer_config",
                 "draft_vocab_size", "block_size", "aux_hidden_state_layer_ids", "mask_token_id",
                 "markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
                 "sample_from_anchor"],
    "properties": {
        **speculators_common("dspark", "DSparkDraftModel", QWEN3_LAYER),
        "block_size": POS_INT,
        "aux_hidden_state_layer_ids": INT_LIST,
        "mask_token_id": NONNEG_INT,
        "markov_rank": NONNEG_INT,
        "markov_head_type": _HEAD_TYPES,
        "enable_confidence_head": BOOL,
        "confidence_head_with_markov": BOOL,
        "sample_from_anchor": {"const": True},
    },
}

_HEADS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
_HEAD_SCHEMA = {"markov_rank": POS_INT, "markov_head_type": _HEAD_TYPES, "enable_confidence_head": BOOL,
                "confidence_head_with_markov": BOOL}

SGLANG_DSPARK: Dict[str, Any] = {
    "type": "object",
    "required": QWEN3_LAYER["required"] + ["architectures", "block_size", "dflash_config", "num_target_layers",
                                           *_HEADS],
    "forbidden": ["speculators_model_type"],
    "properties": {
        **QWEN3_LAYER["properties"],
        "architectures": {"type": "array", "items": {"const": "DSparkDraftModel"}, "minItems": 1},
        "block_size": POS_INT,
        "dflash_config": {"type": "object",
                          "required": ["block_size", "mask_token_id", "target_layer_ids", "attention_mode", *_HEADS],
                          "properties": {"block_size": POS_INT, "mask_token_id": NONNEG_INT,
                                         "target_layer_ids": INT_LIST, "attention_mode": {"enum": ["gqa", "mha"]},
                                         **_HEAD_SCHEMA}},
        "num_target_layers": POS_INT,
        "sample_from_anchor": {"const": True},
        **_HEAD_SCHEMA,
    },
}


def sglang_problems(cfg: Dict[str, Any]) -> list:
    """Where a SGLang DSpark config's nested and top-level head fields disagree (SGLang reads both)."""
    dc = cfg.get("dflash_config") or {}
    out = [f"dflash_config.{k}={dc[k]!r} but {k}={cfg[k]!r}" for k in (*_HEADS, "block_size")
           if k in dc and k in cfg and dc[k] != cfg[k]]
    return out
