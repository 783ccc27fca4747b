"""Target model section (`target=...`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional


@dataclass
class TargetConfig:
    # Short name used in manifests, reports and checkpoint cards.
    name: str = "smollm2_135m"
    # Hugging Face id, local directory, a ``.gguf`` file, or ``reference:<name>``
    # for a reference target converted by ``deepspec target fetch``.
    path: str = "reference:smollm2-135m"
    # GGUF file inside ``path`` (a directory or hub id) when loading GGUF weights.
    gguf_file: Optional[str] = None
    # Decoder layer ids whose outputs feed the draft (index i = output of decoder
    # layer i = HF ``hidden_states[i + 1]``). ``None`` picks evenly spaced layers.
    layer_ids: Optional[List[int]] = None
    num_feature_layers: int = 5
    # auto = bf16 on GPUs, fp32 on CPUs; or bfloat16 | float16 | float32 (bf16 | fp16 | fp32 alike).
    dtype: Literal["auto", "bfloat16", "float16", "float32", "bf16", "fp16", "fp32"] = "auto"
    device: str = "auto"
    # Place the target's layers over several devices with accelerate (transformers' ``device_map``):
    # "auto" | "balanced" | "balanced_low_0" | "sequential", for a target too large for one device in
    # regeneration, cache capture and online training (inputs go to its embedding's device, features are
    # gathered there).  null = the whole model on target.device.
    device_map: Optional[str] = None
    trust_remote_code: bool = False
    # Chat template switches (e.g. Qwen3 ``enable_thinking``); None = template default.
    enable_thinking: Optional[bool] = None
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)
    # None = the tokenizer's own chat template; ``plain`` = a plain-text transcript for base models
    # without one (`deepspec.targets.chat.PLAIN_TEMPLATE`); or the path of a Jinja file.
    chat_template: Optional[str] = None
    attn_implementation: Optional[str] = "sdpa"
