"""Schemas of the engine ``config.json`` files we write, and a small validator.

Each schema is a JSON-schema-like dict written from the engines' own loaders (the
code that reads the config at serving time) — see docs/export.md for the sources:

* ``SPECULATORS_DSPARK`` — the speculators format read by vLLM
  (`vllm/transformers_utils/configs/speculators/base.py`: ``validate_speculators_config``
  requires ``speculators_config.proposal_methods[0].speculative_tokens``,
  ``speculators_config.verifier.name_or_path``, ``speculators_model_type`` and a dict
  ``transformer_layer_config``; ``algos.py`` ``update_dflash`` / ``update_dspark`` require
  ``aux_hidden_state_layer_ids`` and ``mask_token_id`` and read ``draft_vocab_size``,
  ``target_hidden_size``, ``markov_rank``, ``markov_head_type``, ``sample_from_anchor``);
  field names and types as declared by speculators
  (`src/speculators/models/dflash/config.py`, `src/speculators/models/dspark/config.py`).
* ``SGLANG_DSPARK`` — SGLang's DSpark draft (`python/sglang/srt/models/dspark.py`,
  `speculative/dspark_components/dspark_config.py`, `speculative/dflash_utils.py`
  ``parse_dflash_draft_config``): a flat Qwen3-style HF config with ``dflash_config``
  {``block_size``, ``mask_token_id``, ``target_layer_ids``}, ``num_target_layers``,
  ``markov_rank`` (> 0), ``markov_head_type``, ``enable_confidence_head``,
  ``confidence_head_with_markov``; ``speculators_model_type`` must be absent (SGLang
  refuses speculators-convention DSpark checkpoints).
* ``SPECULATORS_EAGLE3`` — speculators ``eagle3`` read by vLLM: the same
  ``speculators_config`` checks, ``algos.py`` ``update_eagle3`` (``draft_vocab_size``,
  ``target_hidden_size``, ``norm_before_residual`` — default **true** when absent —
  ``eagle_aux_hidden_state_layer_ids``); fields as declared by speculators
  `src/speculators/models/eagle3/config.py` ``Eagle3SpeculatorConfig`` (LlamaConfig layer).
* ``SGLANG_EAGLE3`` — SGLang's ``LlamaForCausalLMEagle3`` (`python/sglang/srt/models/llama_eagle3.py`):
  a flat LlamaConfig plus ``draft_vocab_size`` and ``eagle_config``
  {``eagle_aux_hidden_state_layer_ids``, ``use_aux_hidden_state``} (read in
  `model_executor/model_runner.py`).
* ``DEEPSPEC_CHECKPOINT`` — our own ``from_pretrained`` config (`deepspec.drafts.checkpoint`).

The dialect: ``type`` (a name or list of names among object/array/string/integer/
number/boolean/null), ``required``, ``properties``, ``forbidden`` (keys that must be
absent), ``enum``, ``const``, ``minimum``, ``items``, ``minItems``, ``maxItems``.
"""
from __future__ import annotations

from typing import Any, Dict, List

_INT = {"type": "integer"}
_POS_INT = {"type": "integer", "minimum": 1}
_NONNEG_INT = {"type": "integer", "minimum": 0}
_NUM = {"type": "number"}
_BOOL = {"type": "boolean"}
_STR = {"type": "string"}
_INT_LIST = {"type": "array", "items": _NONNEG_INT, "minItems": 1}
_STR_LIST = {"type": "array", "items": _STR}

# The decoder-layer fields both engines read to build Qwen3-style draft layers
# (q/k RMSNorm, SwiGLU, RoPE): speculators' ``transformer_layer_config`` (a Qwen3Config
# by default for DFlash/DSpark) and SGLang's flat DFlash config.
QWEN3_LAYER = {
    "type": "object",
    "required": ["model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                 "rope_theta", "vocab_size", "hidden_act", "attention_bias", "max_position_embeddings"],
    "properties": {
        "model_type": {"const": "qwen3"},
        "hidden_size": _POS_INT,
        "intermediate_size": _POS_INT,
        "num_hidden_layers": _POS_INT,
        "num_attention_heads": _POS_INT,
        "num_key_value_heads": _POS_INT,
        "head_dim": _POS_INT,
        "rms_norm_eps": _NUM,
        "rope_theta": _NUM,
        "rope_scaling": {"type": "null"},
        "vocab_size": _POS_INT,
        "hidden_act": {"const": "silu"},
        "attention_bias": {"const": False},
        "max_position_embeddings": _POS_INT,
        "layer_types": {"type": "array", "items": {"enum": ["full_attention"]}},
    },
}

# EAGLE-3's layer is a Llama decoder layer (no q/k norm): speculators' ``transformer_layer_config``
# is a LlamaConfig (`models/eagle3/config.py`), SGLang's draft config a flat LlamaConfig.
LLAMA_LAYER = {
    "type": "object",
    "required": QWEN3_LAYER["required"] + ["mlp_bias", "tie_word_embeddings"],
    "properties": {
        **{k: v for k, v in QWEN3_LAYER["properties"].items() if k != "layer_types"},
        "model_type": {"const": "llama"},
        "num_hidden_layers": {"const": 1},
        "mlp_bias": {"const": False},
        "tie_word_embeddings": {"const": False},
    },
}
_EAGLE3_IDS = {"type": "array", "items": _NONNEG_INT, "minItems": 3, "maxItems": 3}


def _speculators_config(algorithm: str) -> Dict[str, Any]:
    """``speculators_config``: what vLLM's ``validate_speculators_config`` reads, as speculators writes it."""
    return {
        "type": "object",
        "required": ["algorithm", "proposal_methods", "default_proposal_method", "verifier"],
        "properties": {
            "algorithm": {"const": algorithm},
            "proposal_methods": {
                "type": "array", "minItems": 1,
                "items": {"type": "object", "required": ["proposal_type", "speculative_tokens"],
                          "properties": {"proposal_type": {"const": "greedy"},
                                         "speculative_tokens": _POS_INT,
                                         "verifier_accept_k": _POS_INT,
                                         "accept_tolerance": _NUM}},
            },
            "default_proposal_method": {"const": "greedy"},
            "verifier": {"type": "object", "required": ["name_or_path", "architectures"],
                         "properties": {"name_or_path": _STR, "architectures": _STR_LIST}},
        },
    }


def _speculators_common(model_type: str, architecture: str, layer: Dict[str, Any]) -> Dict[str, Any]:
    """The properties every speculators config we write shares."""
    return {"speculators_model_type": {"const": model_type},
            "architectures": {"type": "array", "items": {"const": architecture}, "minItems": 1},
            "speculators_config": _speculators_config(model_type),
            "transformer_layer_config": layer,
            "draft_vocab_size": _POS_INT,
            "target_hidden_size": {"type": ["integer", "null"]}}


SPECULATORS_DSPARK: Dict[str, Any] = {
    "type": "object",
    "required": ["speculators_model_type", "architectures", "speculators_config", "transformer_layer_config",
                 "draft_vocab_size", "block_size", "aux_hidden_state_layer_ids", "mask_token_id",
                 "markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
                 "sample_from_anchor"],
    "properties": {
        **_speculators_common("dspark", "DSparkDraftModel", QWEN3_LAYER),
        "block_size": _POS_INT,
        "aux_hidden_state_layer_ids": _INT_LIST,
        "mask_token_id": _NONNEG_INT,
        "markov_rank": _NONNEG_INT,
        "markov_head_type": {"enum": ["vanilla", "gated", "rnn"]},
        "enable_confidence_head": _BOOL,
        "confidence_head_with_markov": _BOOL,
        "sample_from_anchor": {"const": True},
    },
}

SGLANG_DSPARK: Dict[str, Any] = {
    "type": "object",
    "required": QWEN3_LAYER["required"] + ["architectures", "dflash_config", "num_target_layers", "markov_rank",
                                           "markov_head_type", "enable_confidence_head",
                                           "confidence_head_with_markov"],
    "forbidden": ["speculators_model_type"],
    "properties": {
        **QWEN3_LAYER["properties"],
        "architectures": {"type": "array", "items": {"const": "Qwen3DSparkModel"}, "minItems": 1},
        "dflash_config": {"type": "object", "required": ["block_size", "mask_token_id", "target_layer_ids"],
                          "properties": {"block_size": _POS_INT, "mask_token_id": _NONNEG_INT,
                                         "target_layer_ids": _INT_LIST}},
        "num_target_layers": _POS_INT,
        "markov_rank": _POS_INT,
        "markov_head_type": {"enum": ["vanilla", "gated", "rnn"]},
        "enable_confidence_head": _BOOL,
        "confidence_head_with_markov": _BOOL,
    },
}

# vLLM `update_eagle3` (algos.py): copies draft_vocab_size, target_hidden_size (if not null),
# eagle_aux_hidden_state_layer_ids, and norm_before_residual *defaulting to true* when absent —
# so it must be written (false: our residual is the un-normed hidden stream).
SPECULATORS_EAGLE3: Dict[str, Any] = {
    "type": "object",
    "required": ["speculators_model_type", "architectures", "speculators_config", "transformer_layer_config",
                 "draft_vocab_size", "norm_before_residual", "eagle_aux_hidden_state_layer_ids"],
    "properties": {
        **_speculators_common("eagle3", "Eagle3Speculator", LLAMA_LAYER),
        "norm_before_residual": {"const": False},
        "eagle_aux_hidden_state_layer_ids": _EAGLE3_IDS,
    },
}

# SGLang `models/llama_eagle3.py` + `model_executor/model_runner.py`: a flat LlamaConfig;
# draft_vocab_size set ⇒ lm_head is loaded from the checkpoint (null ⇒ taken from the target);
# eagle_config.eagle_aux_hidden_state_layer_ids are layer outputs (SGLang adds 1 itself).
SGLANG_EAGLE3: Dict[str, Any] = {
    "type": "object",
    "required": LLAMA_LAYER["required"] + ["architectures", "draft_vocab_size", "eagle_config"],
    "forbidden": ["speculators_model_type", "dflash_config"],
    "properties": {
        **LLAMA_LAYER["properties"],
        "architectures": {"type": "array", "items": {"const": "LlamaForCausalLMEagle3"}, "minItems": 1},
        "draft_vocab_size": _POS_INT,
        "norm_before_residual": {"const": False},
        "eagle_config": {"type": "object", "required": ["eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state"],
                         "properties": {"eagle_aux_hidden_state_layer_ids": _EAGLE3_IDS,
                                        "use_aux_hidden_state": {"const": True}}},
    },
}

DEEPSPEC_CHECKPOINT: Dict[str, Any] = {
    "type": "object",
    "required": ["architecture", "format_version", "draft", "mask_token_id", "target"],
    "properties": {
        "architecture": {"enum": ["dspark", "dflash", "eagle3"]},
        "format_version": _POS_INT,
        "draft": {"type": "object", "required": ["algorithm", "gamma", "num_layers"],
                  "properties": {"algorithm": _STR, "gamma": _POS_INT, "num_layers": _POS_INT}},
        "mask_token_id": _NONNEG_INT,
        "target": {"type": "object", "required": ["fingerprint", "layer_ids", "hidden_size", "vocab_size"],
                   "properties": {"fingerprint": {"type": "object",
                                                  "required": ["weights_sha256", "tokenizer_sha256",
                                                               "chat_template_sha256"]},
                                  "layer_ids": _INT_LIST, "hidden_size": _POS_INT, "vocab_size": _POS_INT}},
    },
}

SCHEMAS = {"speculators_dspark": SPECULATORS_DSPARK, "sglang_dspark": SGLANG_DSPARK,
           "speculators_eagle3": SPECULATORS_EAGLE3, "sglang_eagle3": SGLANG_EAGLE3,
           "deepspec_checkpoint": DEEPSPEC_CHECKPOINT}

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def _same(a, b) -> bool:
    # const/enum comparisons must not equate True with 1
    return type(a) is type(b) and a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float))
                                               and not isinstance(a, bool) and not isinstance(b, bool) and a == b)


def validate(instance: Any, schema: Dict[str, Any], path: str = "$") -> List[str]:
    """All the ways ``instance`` violates ``schema`` (empty list = valid)."""
    errors: List[str] = []
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else list(types)
        for n in names:
            if n not in _TYPES:
                raise ValueError(f"schema at {path}: unknown type {n!r}")
        if not any(_TYPES[n](instance) for n in names):
            errors.append(f"{path}: expected {' or '.join(names)}, got {type(instance).__name__} {instance!r:.60}")
            return errors
    if "const" in schema and not _same(instance, schema["const"]):
        errors.append(f"{path}: must be {schema['const']!r}, got {instance!r:.60}")
    if "enum" in schema and not any(_same(instance, e) for e in schema["enum"]):
        errors.append(f"{path}: must be one of {schema['enum']!r}, got {instance!r:.60}")
    if "minimum" in schema and _TYPES["number"](instance) and instance < schema["minimum"]:
        errors.append(f"{path}: must be >= {schema['minimum']}, got {instance}")
    if isinstance(instance, dict):
        for key in schema.get("required", []):
            if key not in instance:
                errors.append(f"{path}: missing required key {key!r}")
        for key in schema.get("forbidden", []):
            if key in instance:
                errors.append(f"{path}: key {key!r} must not be present")
        for key, sub in schema.get("properties", {}).items():
            if key in instance:
                errors.extend(validate(instance[key], sub, f"{path}.{key}"))
    if isinstance(instance, list):
        if len(instance) < schema.get("minItems", 0):
            errors.append(f"{path}: needs at least {schema['minItems']} item(s), got {len(instance)}")
        if "maxItems" in schema and len(instance) > schema["maxItems"]:
            errors.append(f"{path}: takes at most {schema['maxItems']} item(s), got {len(instance)}")
        if "items" in schema:
            for i, item in enumerate(instance):
                errors.extend(validate(item, schema["items"], f"{path}[{i}]"))
    return errors


def check(instance: Any, name: str) -> None:
    """Raise `SchemaError` listing every violation of the named schema."""
    from .errors import SchemaError
    problems = validate(instance, SCHEMAS[name])
    if problems:
        raise SchemaError(name, problems)
