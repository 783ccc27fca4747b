"""What the engine formats share: vLLM (speculators format) and SGLang drafts of any algorithm.

The format names, the `Plan` of an export (what is written, dropped, warned about), the
Qwen3-style decoder-layer config both engines build draft layers from, speculators'
``speculators_config`` block, the verifier's name, and the target properties no engine's
draft path reproduces.  How each draft algorithm is laid out in these formats is its
exporter's business (`deepspec.export.registry`; `deepspec.export.parallel`,
`deepspec.export.eagle3`); sources in docs/export.md.

Layer ids: ours are decoder-layer *outputs* (``hidden_states[i+1]``).  vLLM captures the
residual stream *entering* layer k, so its ``eagle_aux_hidden_state_layer_ids`` — and the
speculators ``aux_hidden_state_layer_ids`` passed straight into them — are ours + 1
(vLLM derives the DFlash ``target_layer_ids`` as aux − 1).  SGLang's
``dflash_config.target_layer_ids`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``
name layer outputs (it adds 1 itself), i.e. ours.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

import torch

from ..targets.reference import reference_dir

ENGINE_FORMATS = ("vllm", "sglang")
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}


@dataclass
class Plan:
    """What goes into an engine export: the parts left out (and why), and notes for the model card."""
    fmt: str
    algorithm: str
    drop_parts: Tuple[str, ...] = ()
    dropped: List[str] = field(default_factory=list)     # human descriptions of what was left out
    warnings: List[str] = field(default_factory=list)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def layer_config(drafter, target) -> Dict[str, Any]:
    """The Qwen3-style decoder-layer config of our draft layers (what the engines build)."""
    d = drafter.dims
    tc = target.config
    n = int(drafter.cfg.num_layers)
    return {
        "model_type": "qwen3",
        "hidden_size": int(d.hidden_size),
        "intermediate_size": int(d.intermediate_size),
        "num_hidden_layers": n,
        "num_attention_heads": int(d.num_heads),
        "num_key_value_heads": int(d.num_kv_heads),
        "head_dim": int(d.head_dim),
        "rms_norm_eps": float(d.rms_eps),
        # transformers 4 reads rope_theta/rope_scaling, transformers 5 rope_parameters; our RoPE is the
        # default (unscaled) rotation at the target's base frequency
        "rope_theta": float(d.rope_theta),
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(d.rope_theta)},
        "vocab_size": int(target.vocab_size),
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": int(getattr(tc, "max_position_embeddings", None) or 32768),
        "layer_types": ["full_attention"] * n,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": False,
    }


def verifier_name(target_cfg) -> str:
    path = str(target_cfg.path)
    if path.startswith("reference:"):
        return str(reference_dir(path.split(":", 1)[1]))
    return path


def speculators_block(algorithm: str, tokens: int, target, target_cfg) -> Dict[str, Any]:
    """``speculators_config``: one greedy proposal method of ``tokens`` drafts, and the verifier."""
    archs = list(getattr(target.model.config, "architectures", None) or [type(target.model).__name__])
    return {"algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name(target_cfg), "architectures": archs}}


def target_blockers(target) -> List[str]:
    """Target properties the engines' draft path does not reproduce (each a reason to refuse)."""
    out = []
    if getattr(target, "softcap", None):
        out.append(f"the target soft-caps its final logits (final_logit_softcapping={target.softcap}); our draft "
                   "was trained on soft-capped draft logits but the engines' draft logits are plain LM-head outputs")
    ids = torch.arange(min(int(target.vocab_size), 64), device=target.device)
    with torch.no_grad():
        scaled = target.embed(ids).float()
        raw = torch.nn.functional.embedding(ids, target.embed_tokens.weight).float()
    if not torch.allclose(scaled, raw, rtol=1e-3, atol=1e-6):
        out.append("the target scales its input embeddings (e.g. Gemma's sqrt(hidden_size)); our draft embeds block "
                   "tokens through that scaled module, the engines embed draft tokens with the raw embedding table")
    return out
