"""Generation engines (embedded transformers, OpenAI-compatible client), chosen by `build_engine`,
and a small OpenAI-compatible server (`deepspec serve`: `server` starts it, `handler` answers HTTP,
`chat_request` validates, `batcher` batches generation).  The regeneration job that drives them is
`deepspec.prepare.regen`."""
from .base import (Completion, Engine, EngineError, GenerationError, Messages, SamplingParams, sample_seed)
from .factory import build_engine

__all__ = ["Completion", "Engine", "EngineError", "GenerationError", "Messages", "SamplingParams",
           "sample_seed", "HFEngine", "OpenAIEngine", "build_engine"]


def __getattr__(name):  # heavy imports (torch, transformers, requests) only when used
    if name == "HFEngine":
        from .hf import HFEngine
        return HFEngine
    if name == "OpenAIEngine":
        from .openai_client import OpenAIEngine
        return OpenAIEngine
    raise AttributeError(name)
