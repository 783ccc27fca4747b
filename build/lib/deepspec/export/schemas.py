"""Schemas of the ``config.json`` files we read and write, and a small validator.

Each schema is a JSON-schema-like dict written from the code that reads the config: the
engines' own loaders for the engine formats (see docs/export.md for the sources), our
`deepspec.drafts.checkpoint` for ``DEEPSPEC_CHECKPOINT``.  This module holds the validator,
the pieces the engine schemas share (``QWEN3_LAYER``, `speculators_config`,
`speculators_common`) and our checkpoint's schema; each algorithm's engine schemas live
with its exporter (`deepspec.export.parallel`, `deepspec.export.eagle3`), which
`deepspec.export.registry` adds to ``SCHEMAS`` under their names.

The dialect: ``type`` (a name or list of names among object/array/string/integer/
number/boolean/null), ``required``, ``properties``, ``forbidden`` (keys that must be
absent), ``enum``, ``const``, ``minimum``, ``items``, ``minItems``, ``maxItems``.
"""
from __future__ import annotations

from typing import Any, Dict, List

from .errors import SchemaError

POS_INT = {"type": "integer", "minimum": 1}
NONNEG_INT = {"type": "integer", "minimum": 0}
NUM = {"type": "number"}
BOOL = {"type": "boolean"}
STR = {"type": "string"}
INT_LIST = {"type": "array", "items": NONNEG_INT, "minItems": 1}
STR_LIST = {"type": "array", "items": STR}

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
        "hidden_size": POS_INT,
        "intermediate_size": POS_INT,
        "num_hidden_layers": POS_INT,
        "num_attention_heads": POS_INT,
        "num_key_value_heads": POS_INT,
        "head_dim": POS_INT,
        "rms_norm_eps": NUM,
        "rope_theta": NUM,
        "rope_scaling": {"type": "null"},
        "vocab_size": POS_INT,
        "hidden_act": {"const": "silu"},
        "attention_bias": {"const": False},
        "max_position_embeddings": POS_INT,
        "layer_types": {"type": "array", "items": {"enum": ["full_attention"]}},
    },
}



def speculators_config(algorithm: str) -> Dict[str, Any]:
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
                                         "speculative_tokens": POS_INT,
                                         "verifier_accept_k": POS_INT,
                                         "accept_tolerance": NUM}},
            },
            "default_proposal_method": {"const": "greedy"},
            "verifier": {"type": "object", "required": ["name_or_path", "architectures"],
                         "properties": {"name_or_path": STR, "architectures": STR_LIST}},
        },
    }


def speculators_common(model_type: str, architecture: str, layer: Dict[str, Any]) -> Dict[str, Any]:
    """The properties every speculators config we write shares."""
    return {"speculators_model_type": {"const": model_type},
            "architectures": {"type": "array", "items": {"const": architecture}, "minItems": 1},
            "speculators_config": speculators_config(model_type),
            "transformer_layer_config": layer,
            "draft_vocab_size": POS_INT,
            "target_hidden_size": {"type": ["integer", "null"]}}


DEEPSPEC_CHECKPOINT: Dict[str, Any] = {
    "type": "object",
    "required": ["architecture", "format_version", "draft", "mask_token_id", "target"],
    "properties": {
        "architecture": STR,                  # a registered drafter name (checked by the reader)
        "format_version": POS_INT,
        "draft": {"type": "object", "required": ["algorithm", "gamma", "num_layers"],
                  "properties": {"algorithm": STR, "gamma": POS_INT, "num_layers": POS_INT}},
        "mask_token_id": NONNEG_INT,
        "target": {"type": "object", "required": ["fingerprint", "layer_ids", "hidden_size", "vocab_size"],
                   "properties": {"fingerprint": {"type": "object",
                                                  "required": ["weights_sha256", "tokenizer_sha256",
                                                               "chat_template_sha256"]},
                                  "layer_ids": INT_LIST, "hidden_size": POS_INT, "vocab_size": POS_INT}},
    },
}

# schema name -> schema; the exporters' engine schemas are added as they register
SCHEMAS: Dict[str, Dict[str, Any]] = {"deepspec_checkpoint": DEEPSPEC_CHECKPOINT}

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
    problems = validate(instance, SCHEMAS[name])
    if problems:
        raise SchemaError(name, problems)
