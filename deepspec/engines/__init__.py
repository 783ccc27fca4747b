"""Generation engines (embedded transformers, OpenAI-compatible client), the regeneration
job behind `prepare` and a small OpenAI-compatible server (`deepspec serve`: `server` starts it,
`handler` answers HTTP, `chat_request` validates, `batcher` batches generation)."""
from .base import (Completion, Engine, EngineError, GenerationError, Messages, SamplingParams, sample_seed)

__all__ = ["Completion", "Engine", "EngineError", "GenerationError", "Messages", "SamplingParams",
           "sample_seed", "HFEngine", "OpenAIEngine", "build_engine", "regenerate", "RegenError"]


def __getattr__(name):  # heavy imports (torch, transformers, requests) only when used
    if name == "HFEngine":
        from .hf import HFEngine
        return HFEngine
    if name == "OpenAIEngine":
        from .openai_client import OpenAIEngine
        return OpenAIEngine
    if name in ("regenerate", "build_engine", "RegenError"):
        from . import regen
        return getattr(regen, name)
    raise AttributeError(name)
