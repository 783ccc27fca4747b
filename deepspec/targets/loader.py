"""Build a `TargetAdapter` from a `TargetConfig` (HF id, directory, GGUF, reference, tiny)."""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ..config import TargetConfig
from .adapter import TargetAdapter
from .chat import resolve_template
from .load_errors import explain
from .reference import fetch_reference
from .tiny import build_tiny, parse_tiny_spec

log = logging.getLogger(__name__)
_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
           "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device | None = None) -> torch.dtype:
    """``auto``: bf16 on accelerators, fp32 on CPUs (CPUs without native bf16 run it ~3x slower)."""
    if name == "auto":
        return torch.bfloat16 if device is not None and device.type != "cpu" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"target.dtype={name!r}: choose from auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[name]


def _template_kwargs(cfg: TargetConfig) -> dict:
    kw = dict(cfg.chat_template_kwargs)
    if cfg.enable_thinking is not None:
        kw["enable_thinking"] = cfg.enable_thinking
    return kw


def check_target_source(cfg: TargetConfig) -> None:
    """Fail early, in one line (`TargetLoadError`), when ``target.path`` cannot be found: its config is read
    (a few KB, from the local directory or the hub cache) before any stage writes or loads anything."""
    if parse_tiny_spec(cfg.path) is not None or cfg.path.startswith("reference:"):
        return
    path, kw = cfg.path, dict(trust_remote_code=cfg.trust_remote_code)
    if path.endswith(".gguf"):
        if not Path(path).expanduser().is_file():
            raise explain(FileNotFoundError(path), cfg.path, "GGUF file")
        return
    if cfg.gguf_file:
        kw["gguf_file"] = cfg.gguf_file
    try:
        AutoConfig.from_pretrained(path, **kw)
    except (OSError, ValueError) as e:
        raise explain(e, cfg.path, "model") from e


def _attention_choice(name, path: str, kw: dict):
    """``target.attn_implementation``, except that ``sdpa`` (the default) falls back to the model's own
    choice for architectures transformers runs without sdpa (gpt-oss: attention sinks)."""
    if name != "sdpa":
        return name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(path, **kw))]
    except (KeyError, OSError, ValueError):
        return name          # let from_pretrained report what is wrong with the model
    if getattr(cls, "_supports_sdpa", True):
        return name
    log.info("target %s: %s has no sdpa attention; using its default", path, cls.__name__)
    return None


def load_target(cfg: TargetConfig, device: str | None = None) -> TargetAdapter:
    dev = resolve_device(device or cfg.device)
    dtype = resolve_dtype(cfg.dtype, dev)
    if cfg.trust_remote_code:
        log.warning("target.trust_remote_code=true: code shipped with %s will be executed", cfg.path)
    tiny = parse_tiny_spec(cfg.path)
    if tiny is not None:
        if cfg.device_map:
            raise ValueError(f"target.device_map={cfg.device_map!r}: a tiny target is built in memory; leave it null")
        model, tok = build_tiny(**tiny)
        model = model.to(dtype)
    else:
        path = cfg.path
        gguf = cfg.gguf_file
        if path.startswith("reference:"):
            path = str(fetch_reference(path.split(":", 1)[1]))
        elif path.endswith(".gguf"):
            p = Path(path)
            path, gguf = str(p.parent), p.name
        kw = dict(trust_remote_code=cfg.trust_remote_code)
        if gguf:
            kw["gguf_file"] = gguf
        try:
            tok = AutoTokenizer.from_pretrained(path, **kw)
        except (OSError, ValueError) as e:
            raise explain(e, cfg.path, "tokenizer") from e
        mkw = dict(kw, dtype=dtype)
        attn = _attention_choice(cfg.attn_implementation, path, kw)
        if attn:
            mkw["attn_implementation"] = attn
        if cfg.device_map:
            mkw["device_map"] = cfg.device_map     # accelerate places the layers (and the tied head)
        try:
            model = AutoModelForCausalLM.from_pretrained(path, **mkw)
        except (OSError, ValueError) as e:
            raise explain(e, cfg.path, "model") from e
    template = resolve_template(cfg.chat_template)
    if template is not None:
        tok.chat_template = template
    if not cfg.device_map:
        model = model.to(dev)
    return TargetAdapter(model, tok, layer_ids=cfg.layer_ids, num_feature_layers=cfg.num_feature_layers,
                         name=cfg.name, chat_template_kwargs=_template_kwargs(cfg))
