"""Draft models: DSpark / DFlash (one parallel backbone) and Eagle3, behind one registry.

Public API: `build_drafter(target, draft_cfg)`, `load_drafter(dir, target)`,
`available_drafters()`, `register_drafter`, the `Drafter` base class and the
`Proposal` / `DraftState` decoding records.  The algorithms: `parallel` (DSpark, and DFlash
= the same drafter without heads) and `eagle3`.  See docs/CONTRACTS.md.
"""
from . import eagle3, model_free, parallel  # noqa: F401  (the built-in drafters register themselves)
from .base import DraftState, Drafter, Proposal
from .checkpoint import DraftCheckpointError, DraftTargetMismatchError
from .registry import available_drafters, build_drafter, load_drafter, register_drafter

__all__ = ["Drafter", "DraftState", "Proposal", "DraftTargetMismatchError", "DraftCheckpointError",
           "available_drafters",
           "build_drafter", "load_drafter", "register_drafter"]
