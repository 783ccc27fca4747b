"""Reading engine-format drafts (vLLM speculators, SGLang) back into deepspec drafters.

`import_vllm` / `import_sglang` rebuild the drafter an export came from and refuse, with
the reason, whatever has no exact deepspec equivalent; `deepspec.export.engines` writes
these formats (and re-exports the readers).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

from . import mapping, schemas
from .common import CONFIG_NAME, PROVENANCE_NAME, WEIGHTS_NAME
from .errors import ExportError, ImportUnsupported


# -- import ------------------------------------------------------------------------------------------------
def detect_format(path) -> str:
    p = Path(path)
    cfg = json.loads((p / CONFIG_NAME).read_text())
    if "speculators_model_type" in cfg:
        return "vllm"
    if "dflash_config" in cfg or "eagle_config" in cfg or "LlamaForCausalLMEagle3" in (cfg.get("architectures") or []):
        return "sglang"
    if "architecture" in cfg and "draft" in cfg:
        return "hf"
    raise ImportUnsupported(f"{p}: unknown draft format (no speculators_model_type, dflash_config, eagle_config or "
                            "deepspec architecture in config.json)")


def _theta(layer: Dict[str, Any]) -> float:
    t = layer.get("rope_theta")
    if t is None:
        t = (layer.get("rope_parameters") or {}).get("rope_theta")
    return float(t if t is not None else 10000.0)


def _build_from_engine(where: str, layer: Dict[str, Any], target, *, our_layer_ids, block_size: int, mask: int,
                       markov_rank: int, head_type: str, conf: bool, conf_with_markov: bool, vocab: int,
                       weights: Dict[str, torch.Tensor]):
    from ..config.draft import DraftConfig
    check_sizes(where, layer, target, our_layer_ids, vocab)
    if markov_rank > 0 and head_type not in ("vanilla", "rnn"):
        raise ImportUnsupported(f"{where}: markov_head_type={head_type!r} has no deepspec equivalent "
                                "(deepspec has markov = 'vanilla' and rnn)")
    if conf and not conf_with_markov:
        raise ImportUnsupported(f"{where}: a confidence head on the hidden state alone has no deepspec equivalent "
                                "(deepspec's confidence head always reads a token embedding)")
    seq = "none" if markov_rank == 0 else {"vanilla": "markov", "rnn": "rnn"}[head_type]
    algorithm = "dflash" if (seq == "none" and not conf) else "dspark"
    cfg = DraftConfig(algorithm=algorithm, gamma=int(block_size), num_layers=int(layer["num_hidden_layers"]),
                      hidden_size=None, intermediate_size=int(layer["intermediate_size"]),
                      num_attention_heads=int(layer["num_attention_heads"]),
                      num_key_value_heads=int(layer["num_key_value_heads"]), head_dim=int(layer["head_dim"]),
                      sequential_head=seq, head_rank=int(markov_rank) if markov_rank else 256,
                      confidence_head=bool(conf), mask_token_id=int(mask))
    return build_and_load(where, layer, target, cfg, mapping.from_engine(weights))


def check_sizes(where: str, layer: Dict[str, Any], target, our_layer_ids, vocab: int) -> None:
    """Layer ids, vocabulary and width of an engine draft against ``target`` (ImportUnsupported if off)."""
    if list(our_layer_ids) != list(target.layer_ids):
        raise ImportUnsupported(f"{where}: the draft reads target layers {list(our_layer_ids)} (deepspec convention: "
                                f"decoder-layer outputs) but the target is configured with {list(target.layer_ids)}; "
                                f"load the target with target.layer_ids={list(our_layer_ids)}")
    if vocab != int(target.vocab_size) or int(layer["vocab_size"]) != int(target.vocab_size):
        raise ImportUnsupported(f"{where}: draft vocabulary {vocab} != target vocabulary {target.vocab_size}; "
                                "reduced draft vocabularies (d2t/t2d) have no deepspec equivalent")
    if int(layer["hidden_size"]) != int(target.hidden_size):
        raise ImportUnsupported(f"{where}: draft hidden_size {layer['hidden_size']} != target hidden_size "
                                f"{target.hidden_size}")


def build_and_load(where: str, layer: Dict[str, Any], target, cfg, ours: Dict[str, torch.Tensor]):
    """A drafter of ``cfg`` for ``target`` holding ``ours``, after checking the layer's RoPE and epsilon."""
    from ..drafts import build_drafter
    from ..drafts.layers import DraftDims
    dims = DraftDims.from_target(target.config, cfg)
    if abs(dims.rope_theta - _theta(layer)) > 1e-6 * max(1.0, dims.rope_theta):
        raise ImportUnsupported(f"{where}: rope_theta {_theta(layer)} differs from the target's {dims.rope_theta}; "
                                "deepspec draft layers always use the target's RoPE base")
    if abs(dims.rms_eps - float(layer["rms_norm_eps"])) > 1e-12:
        raise ImportUnsupported(f"{where}: rms_norm_eps {layer['rms_norm_eps']} differs from the target's "
                                f"{dims.rms_eps}; deepspec draft layers always use the target's epsilon")
    if layer.get("rope_scaling") not in (None, {}) or (layer.get("rope_parameters") or {}).get(
            "rope_type", "default") != "default":
        raise ImportUnsupported(f"{where}: scaled RoPE has no deepspec draft-layer equivalent")
    drafter = build_drafter(target, cfg)        # parameters in the default dtype, as `load_drafter` does
    missing, unexpected = drafter.load_state_dict(ours, strict=False)
    if missing or unexpected:
        raise ImportUnsupported(f"{where}: weights do not fit a {cfg.algorithm} drafter: missing {sorted(missing)}, "
                                f"unexpected {sorted(unexpected)}")
    return drafter


def _load(path) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    from safetensors.torch import load_file
    p = Path(path)
    if not (p / CONFIG_NAME).is_file() or not (p / WEIGHTS_NAME).is_file():
        raise ImportUnsupported(f"{p}: needs {CONFIG_NAME} and {WEIGHTS_NAME}")
    try:
        cfg = json.loads((p / CONFIG_NAME).read_text(encoding="utf-8"))
    except ValueError as e:
        raise ExportError(f"{p / CONFIG_NAME}: not valid JSON ({type(e).__name__}: {e})") from None
    try:
        weights = load_file(str(p / WEIGHTS_NAME))
    except Exception as e:   # anything but safetensors (a pickle, a torch.save zip) is refused
        raise ExportError(f"{p / WEIGHTS_NAME}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    if not isinstance(cfg, dict):
        raise ExportError(f"{p / CONFIG_NAME}: expected a JSON object")
    return cfg, weights


def import_vllm(path, target):
    """A speculators-format (vLLM) DSpark/DFlash draft → our drafter, for ``target``."""
    cfg, weights = _load(path)
    kind = cfg.get("speculators_model_type")
    if kind == "eagle3":
        from .engines_eagle3 import import_eagle3
        return import_eagle3("vllm", path, cfg, weights, target)
    if kind not in ("dspark", "dflash"):
        raise ImportUnsupported(f"{path}: speculators_model_type={kind!r}; only dspark, dflash and eagle3 map onto "
                                "deepspec drafters")
    if not cfg.get("sample_from_anchor", kind == "dspark"):
        raise ImportUnsupported(f"{path}: sample_from_anchor is false (block slot k predicts anchor+k, slot 0 "
                                "untrained); deepspec drafters predict anchor+k+1 from slot k")
    if kind == "dspark":
        schemas.check(cfg, "speculators_dspark")
    layer = cfg["transformer_layer_config"]
    aux = cfg.get("aux_hidden_state_layer_ids")
    if not aux:
        raise ImportUnsupported(f"{path}: no aux_hidden_state_layer_ids")
    if cfg.get("mask_token_id") is None:
        raise ImportUnsupported(f"{path}: no mask_token_id")
    return _build_from_engine(str(path), layer, target, our_layer_ids=[int(i) - 1 for i in aux],
                              block_size=cfg["block_size"], mask=cfg["mask_token_id"],
                              markov_rank=int(cfg.get("markov_rank") or 0),
                              head_type=str(cfg.get("markov_head_type") or "vanilla"),
                              conf=bool(cfg.get("enable_confidence_head")),
                              conf_with_markov=bool(cfg.get("confidence_head_with_markov")),
                              vocab=int(cfg.get("draft_vocab_size") or layer["vocab_size"]), weights=weights)


def import_sglang(path, target):
    """An SGLang DSpark (``Qwen3DSparkModel``) or EAGLE-3 (``LlamaForCausalLMEagle3``) draft → our drafter."""
    cfg, weights = _load(path)
    if "dflash_config" not in cfg and ("eagle_config" in cfg or "LlamaForCausalLMEagle3" in
                                       (cfg.get("architectures") or [])):
        from .engines_eagle3 import import_eagle3
        return import_eagle3("sglang", path, cfg, weights, target)
    schemas.check(cfg, "sglang_dspark")
    dc = cfg["dflash_config"]
    return _build_from_engine(str(path), cfg, target, our_layer_ids=[int(i) for i in dc["target_layer_ids"]],
                              block_size=dc["block_size"], mask=dc["mask_token_id"],
                              markov_rank=int(cfg["markov_rank"]), head_type=str(cfg["markov_head_type"]),
                              conf=bool(cfg.get("enable_confidence_head")),
                              conf_with_markov=bool(cfg.get("confidence_head_with_markov")),
                              vocab=int(cfg["vocab_size"]), weights=weights)


def read_provenance(path) -> Optional[Dict[str, Any]]:
    p = Path(path) / PROVENANCE_NAME
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError:
        raise ExportError(f"{p}: not valid JSON")
