"""The engine a config asks for: ``engine.kind`` = ``hf`` (embedded transformers) or ``openai`` (servers)."""
from __future__ import annotations

from typing import Optional

from .base import Engine, EngineError


def build_engine(cfg, device: Optional[str] = None) -> Engine:
    """Each backend's own dependencies (torch + transformers, or an HTTP client) load only when chosen."""
    kind = cfg.engine.kind
    if kind == "hf":
        from .hf import HFEngine
        return HFEngine.from_config(cfg, device=device)
    if kind == "openai":
        from .openai_client import OpenAIEngine
        return OpenAIEngine.from_config(cfg)
    raise EngineError(f"unknown engine.kind={kind!r}; choose hf or openai")
