"""Evaluation: the lossless speculative-decoding loop, acceptance rule, metrics, benchmarks, report.

The loop never names an algorithm: it drives any drafter through the decoding API
(``init_state / propose / advance``) of `deepspec.drafts`.  See docs/metrics.md.
"""
from .acceptance import Verification, residual_distribution, verify, verify_greedy, verify_sampling
from .sampling import Warp, make_warp, sample_token
from .speculative import GenerationResult, RoundStats, speculative_generate, target_generate

__all__ = ["Verification", "residual_distribution", "verify", "verify_greedy", "verify_sampling", "Warp",
           "make_warp", "sample_token", "GenerationResult", "RoundStats", "speculative_generate",
           "target_generate"]
