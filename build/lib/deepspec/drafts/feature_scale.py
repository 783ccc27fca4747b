"""Per-channel scaling of the target features (`draft.feature_norm=channel`), an ablation.

Decoder LLMs carry a few "massive activation" channels in their middle and late layers: on
SmolLM2-135M two or three channels of the residual stream have 10–30× the RMS of the median channel
(layer 27: 437 against 16), and one reaches 24,832 at the first position.  The drafters' feature
projection (``fc`` over the concatenated layers, as in DFlash, DSpark and EAGLE-3) then sees inputs
whose scale differs by one to three orders of magnitude between channels.  With ``channel`` each
feature channel is divided by its RMS over a fixed probe text run through the target once when
the draft is built (no training data needed, identical on every rank), so every channel enters
``fc`` at unit scale.  The divisor is a buffer saved with the draft; a loaded draft uses its own.
"""
from __future__ import annotations

from typing import Optional

import torch

FEATURE_NORMS = ("none", "channel")

# Prose, a list, code, arithmetic and chat: enough positions (~200 tokens) for stable per-channel RMS.
PROBE_TEXT = (
    "Speculative decoding lets a small draft model propose several tokens that the large target model "
    "then checks in a single forward pass. If the draft is right, many tokens are produced for the cost "
    "of one step; if it is wrong, the target's own token is kept, so the output does not change.\n\n"
    "Steps to bake bread:\n1. Mix 500 g of flour, 10 g of salt and 7 g of yeast.\n2. Add 350 ml of warm "
    "water and knead for ten minutes.\n3. Let it rise for an hour, shape it, and bake at 230 °C.\n\n"
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "Question: A train travels 120 km in 1.5 hours. What is its average speed?\n"
    "Answer: 120 / 1.5 = 80, so the average speed is 80 km/h.\n"
    "User: Can you recommend a good book about the history of science?\n"
    "Assistant: Sure! \"A Short History of Nearly Everything\" by Bill Bryson is a friendly overview."
)


def probe_feature_rms(target, text: str = PROBE_TEXT) -> torch.Tensor:
    """Per-channel RMS [feature_dim] (float32, CPU) of the target's features over ``text``, leaving out
    the first position (whose attention-sink activations are far larger than any later position's)."""
    ids = target.tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < 2:
        raise ValueError("draft.feature_norm=channel: the probe text tokenises to fewer than 2 tokens")
    with torch.inference_mode():
        feats = target.capture(torch.tensor([ids], dtype=torch.long)).features[0, 1:]
    rms = feats.float().pow(2).mean(0).sqrt().cpu()
    if not torch.isfinite(rms).all():
        raise ValueError("draft.feature_norm=channel: the target's features over the probe text are not finite")
    return rms.clamp_min(1e-6)


def inverse_feature_rms(target, feature_norm: str) -> Optional[torch.Tensor]:
    """1 / per-channel RMS for ``draft.feature_norm=channel``; None for ``none``."""
    if feature_norm not in FEATURE_NORMS:
        raise ValueError(f"draft.feature_norm={feature_norm!r}: choose from {', '.join(FEATURE_NORMS)}")
    if feature_norm == "none":
        return None
    return probe_feature_rms(target).reciprocal()


def set_inv_rms(module, inv_rms: Optional[torch.Tensor]) -> None:
    """``module.inv_rms``: a saved float32 buffer when set, else None (no entry in the state dict)."""
    if inv_rms is not None:
        module.register_buffer("inv_rms", inv_rms.detach().clone().float())
    else:
        module.inv_rms = None


def scale_features(features: torch.Tensor, inv_rms: Optional[torch.Tensor], dtype: torch.dtype,
                   device) -> torch.Tensor:
    """``features`` on ``device`` in ``dtype``, divided channel-wise by the RMS first when set (in float32)."""
    if features.is_inference():  # e.g. straight from `target.capture` (inference mode)
        features = features.clone()
    features = features.to(device)
    if inv_rms is not None:
        features = features.float() * inv_rms.float()
    return features.to(dtype)
