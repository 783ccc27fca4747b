"""Generation engine section (`engine=...`): how `prepare` regenerates answers.

`kind=hf` runs the target in-process with transformers (batched, KV-cached,
data-parallel under torchrun); `kind=openai` sends `/v1/chat/completions`
requests to one or more SGLang / vLLM / TGI / `deepspec serve` servers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Literal, Optional


@dataclass
class EngineConfig:
    # hf (embedded transformers engine) | openai (OpenAI-compatible servers)
    kind: Literal["hf", "openai"] = "hf"
    # Sampling (temperature 0 = greedy).  seed None = the root `seed`.
    max_new_tokens: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    # Prompt budget in tokens (history included); None = data.max_length.  A first
    # turn over budget is a failed sample; a later turn ends the conversation there.
    max_prompt_tokens: Optional[int] = None
    # Regenerate at most this many assistant turns per conversation (None = all).
    max_turns: Optional[int] = None
    # hf engine: sequences per generate call (halved automatically on CUDA OOM).
    batch_size: int = 16
    # hf engine decode loop: auto (static on CUDA, else deepspec) | deepspec (own loop, finished rows
    # leave the batch) | static (static KV cache, one CUDA graph replay per step on a GPU) | generate
    # (transformers' model.generate).  The same tokens under greedy decoding in fp32.
    hf_loop: Literal["auto", "deepspec", "static", "generate"] = "auto"
    # Samples scheduled together (turn by turn); None = 4 x batch_size (hf) or
    # 4 x total concurrency (openai).
    chunk_size: Optional[int] = None
    # openai engine: server base URLs (with or without the /v1 suffix).
    servers: List[str] = field(default_factory=list)
    # Served model name; None = the first id listed by GET /v1/models.
    model: Optional[str] = None
    # In-flight requests per server.
    concurrency: int = 8
    connect_timeout_s: float = 10.0
    timeout_s: float = 600.0
    # Retries after the first attempt (5xx, 429, timeouts, connection errors).
    max_retries: int = 4
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    # Probe each server (/v1/models, then /health) and drop the dead ones.
    health_check: bool = True
    # API key: read from this environment variable, or from api_key_file.  The key
    # itself never goes into a config, log or output file.
    api_key_env: str = "DEEPSPEC_API_KEY"
    api_key_file: Optional[str] = None
    # Job control: continue an interrupted run; retry failed samples on a re-run.
    resume: bool = True
    retry_failed: bool = True
    fsync: bool = True
    progress: bool = True
