"""The verification-length policy hook: how many of a chain's drafts a round verifies.

The chain loop asks `verify_length` once per round.  The policies themselves (fixed γ, a threshold on the
calibrated cumulative confidence, the prefix scheduler of DSpark's Alg. 1) and their cost models are
`deepspec.schedule.prefix_scheduler`; `build_policy` picks one from the config the way ``deepspec eval``
does.  A policy chooses ℓ from draft-side quantities only (the confidences, the cost table), before the
target sees the draft, so verifying the first ℓ drafts with the acceptance rule stays lossless.  Trees
replace the policy (`deepspec.decoding.settings` refuses the combination).
"""
from __future__ import annotations

import logging
from typing import List, Optional

import torch

from ..schedule.calibration import Calibration, find_calibration
from ..schedule.prefix_scheduler import FixedLengthPolicy, policy_from_config

log = logging.getLogger(__name__)

__all__ = ["FixedLengthPolicy", "build_policy", "confidence_list", "needs_confidences", "verify_length"]

_warned_no_conf = False


def needs_confidences(policy) -> bool:
    """Whether the policy reads the drafter's confidences (every policy but the fixed one)."""
    if policy is None or isinstance(policy, FixedLengthPolicy):
        return False
    return getattr(policy, "name", "") != "fixed"


def confidence_list(conf) -> Optional[List[float]]:
    if conf is None:
        return None
    return [float(x) for x in torch.as_tensor(conf).reshape(-1).float().tolist()]


def verify_length(policy, conf: Optional[List[float]], drafted: int) -> int:
    """ℓ ≤ ``drafted``: all of them (or ``length``) for the fixed policy, all of them without confidences
    (with one warning)."""
    global _warned_no_conf
    if isinstance(policy, FixedLengthPolicy) and policy.length is not None:
        return max(0, min(int(policy.length), drafted))
    if drafted == 0 or not needs_confidences(policy):
        return drafted
    if conf is None:
        if not _warned_no_conf:
            log.warning("verification policy %s needs confidences but the drafter gives none: "
                        "verifying the whole draft", getattr(policy, "name", type(policy).__name__))
            _warned_no_conf = True
        return drafted
    ell = policy.lengths(torch.tensor([conf[:drafted]], dtype=torch.float32))
    return max(0, min(int(ell[0]), drafted))


def build_policy(cfg, target=None):
    """(policy, calibration temperatures or None) for eval.

    Uses `deepspec.schedule.prefix_scheduler.policy_from_config`: fixed γ by default,
    a threshold on the (STS-calibrated) cumulative confidence (``schedule.policy=threshold``,
    ``schedule.threshold``), or the prefix scheduler (``schedule.policy=scheduler``)."""
    policy = policy_from_config(cfg, target)
    cal = getattr(policy, "calibration", None)
    if cal is None:
        try:
            sc = getattr(cfg.schedule, "calibration", None)
            cal = Calibration.load(sc) if sc else find_calibration(cfg.eval.checkpoint)
        except FileNotFoundError:
            cal = None
    temps = list(cal.temperatures) if cal is not None else None
    return policy, temps
