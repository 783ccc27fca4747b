"""Reading engine-format drafts (vLLM speculators, SGLang) back into deepspec drafters.

`import_vllm` / `import_sglang` read the directory (``config.json`` + safetensors weights,
nothing unpickled) and hand it to the exporter that reads that config
(`deepspec.export.registry.reader_of`), which rebuilds the drafter the export came from and
refuses, with the reason, whatever has no exact deepspec equivalent.  `check_sizes` and
`build_and_load` are the checks and the rebuild every exporter's reader shares.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Tuple

import torch
from safetensors.torch import load_file

from ..drafts import build_drafter
from ..drafts.layers import DraftDims
from .common import CONFIG_NAME, WEIGHTS_NAME
from .engine_formats import ENGINE_NAMES
from .errors import ExportError, ImportUnsupported
from .registry import reader_of


def detect_format(path) -> str:
    """hf (a deepspec checkpoint), vllm (a speculators config) or sglang (an SGLang draft an exporter reads)."""
    p = Path(path)
    cfg = json.loads((p / CONFIG_NAME).read_text())
    if "speculators_model_type" in cfg:
        return "vllm"
    if reader_of("sglang", cfg) is not None:
        return "sglang"
    if "architecture" in cfg and "draft" in cfg:
        return "hf"
    raise ImportUnsupported(f"{p}: unknown draft format (config.json is neither a deepspec checkpoint, a "
                            "speculators config nor an SGLang draft config that a deepspec exporter reads)")


def rope_theta(layer: Dict[str, Any]) -> float:
    t = layer.get("rope_theta")
    if t is None:
        t = (layer.get("rope_parameters") or {}).get("rope_theta")
    return float(t if t is not None else 10000.0)


def check_sizes(where: str, layer: Dict[str, Any], target, our_layer_ids) -> None:
    """Layer ids, vocabulary and width of an engine draft against ``target`` (ImportUnsupported if off).
    A reduced draft vocabulary (``draft_vocab_size`` / ``d2t``) is `deepspec.export.vocab_map.ids_from_engine`'s."""
    if list(our_layer_ids) != list(target.layer_ids):
        raise ImportUnsupported(f"{where}: the draft reads target layers {list(our_layer_ids)} (deepspec convention: "
                                f"decoder-layer outputs) but the target is configured with {list(target.layer_ids)}; "
                                f"load the target with target.layer_ids={list(our_layer_ids)}")
    if int(layer["vocab_size"]) != int(target.vocab_size):
        raise ImportUnsupported(f"{where}: vocab_size {layer['vocab_size']} != target vocabulary {target.vocab_size} "
                                "(the draft embeds target tokens)")
    if int(layer["hidden_size"]) != int(target.hidden_size):
        raise ImportUnsupported(f"{where}: draft hidden_size {layer['hidden_size']} != target hidden_size "
                                f"{target.hidden_size}")


def build_and_load(where: str, layer: Dict[str, Any], target, cfg, ours: Dict[str, torch.Tensor]):
    """A drafter of ``cfg`` for ``target`` holding ``ours``, after checking the layer's RoPE and epsilon."""
    dims = DraftDims.from_target(target.config, cfg)
    theta = rope_theta(layer)
    if abs(dims.rope_theta - theta) > 1e-6 * max(1.0, dims.rope_theta):
        raise ImportUnsupported(f"{where}: rope_theta {theta} differs from the target's {dims.rope_theta}; "
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


def read_engine_dir(path) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    """``config.json`` and the safetensors weights of an engine draft (anything else is refused)."""
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


def import_engine(fmt: str, path, target):
    """An engine draft in ``fmt`` (vllm | sglang) → the deepspec drafter it maps onto, for ``target``."""
    cfg, weights = read_engine_dir(path)
    exporter = reader_of(fmt, cfg)
    if exporter is None:
        kind = (f"speculators_model_type={cfg.get('speculators_model_type')!r}" if fmt == "vllm"
                else f"architectures={cfg.get('architectures')!r}")
        raise ImportUnsupported(f"{path}: {kind}: no deepspec drafter reads this {ENGINE_NAMES[fmt]} draft")
    return exporter.import_draft(fmt, Path(path), cfg, weights, target)


def import_vllm(path, target):
    """A speculators-format (vLLM) draft → our drafter, for ``target``."""
    return import_engine("vllm", path, target)


def import_sglang(path, target):
    """An SGLang draft → our drafter, for ``target``."""
    return import_engine("sglang", path, target)

