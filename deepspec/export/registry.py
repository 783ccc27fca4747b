"""Algorithm -> exporter registry: how each draft algorithm is written to the engines and read back.

``@register_exporter("dspark", "dflash")`` on an `Exporter` subclass registers one instance
under the algorithm names its drafter is registered under in `deepspec.drafts`.  Export,
import, the self-check, the model card and ``deepspec check`` look the exporter up here and
never name an algorithm themselves.  An algorithm's exporter is the module
``deepspec.export.<algorithm>``, imported by ``deepspec/export/__init__.py``; an algorithm
without one exports to ``hf`` only.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import schemas
from .engine_formats import ENGINE_NAMES, Plan
from .errors import ExportUnsupported, ImportUnsupported

log = logging.getLogger(__name__)
_EXPORTERS: Dict[str, "Exporter"] = {}


class Exporter:
    """One draft algorithm in the engine formats.  Subclasses override what their engines support."""

    #: engine format -> (schema name, schema) of the ``config.json`` written in it (see `deepspec.export.schemas`)
    schemas: Dict[str, Tuple[str, Dict[str, Any]]] = {}

    # -- export ------------------------------------------------------------------------------------------
    def analyze(self, fmt: str, algorithm: str, draft: Dict[str, Any], state_keys,
                allow_drop_heads: bool = False) -> Plan:
        """Decide what an ``fmt`` export writes, or raise `ExportUnsupported` saying what would be lost.
        ``draft``: the checkpoint's draft config, plus ``_n_feature_layers`` (the target layers it reads)."""
        raise ExportUnsupported(f"no {ENGINE_NAMES[fmt]} layout is known for draft algorithm {algorithm!r}")

    def target_problems(self, fmt: str, mask_token_id: Optional[int], target) -> List[Tuple[str, str, str]]:
        """(setting, fix, why) of what the draft's target-side choices (its mask token) break in ``fmt``."""
        return []

    def engine_config(self, fmt: str, drafter, target, target_cfg, plan: Plan, dtype: torch.dtype) -> Dict[str, Any]:
        raise NotImplementedError

    def engine_weights(self, fmt: str, drafter, target, plan: Plan) -> Dict[str, torch.Tensor]:
        """The drafter's weights under ``fmt``'s names (the parts ``plan`` drops left out)."""
        raise NotImplementedError

    # -- import ------------------------------------------------------------------------------------------
    def reads(self, fmt: str, cfg: Dict[str, Any]) -> bool:
        """Whether ``cfg`` (an engine ``config.json`` in ``fmt``) is a draft of this algorithm."""
        return False

    def import_draft(self, fmt: str, path: Path, cfg: Dict[str, Any], weights: Dict[str, torch.Tensor], target):
        """The deepspec drafter an engine draft came from; `ImportUnsupported` for what has no equivalent."""
        raise ImportUnsupported(f"{path}: no deepspec drafter reads this {ENGINE_NAMES[fmt]} draft")

    def recorded_layer_ids(self, fmt: str, cfg: Dict[str, Any]) -> Tuple[Optional[List[int]], Optional[int]]:
        """(target layer ids in deepspec's convention, mask token id) that an exported ``cfg`` records."""
        return None, None

    def held_vocabulary(self, fmt: str, path: Path, cfg: Dict[str, Any], vocab_size: int
                        ) -> Optional[Tuple[Optional[torch.Tensor], List[str]]]:
        """(draft vocabulary or None, problems naming file and key) an ``fmt`` export of this algorithm holds
        in a layout of its own; None where ``draft_vocab_size`` / ``d2t`` / ``t2d`` say it
        (`deepspec.export.vocab_map`)."""
        return None

    # -- self-check ----------------------------------------------------------------------------------------
    def compare(self, out: Path, fmt: str, original, reimported, batch: Dict[str, torch.Tensor], target,
                nothing_dropped: bool) -> Tuple[Dict[str, float], torch.Tensor]:
        """Max |difference| of logits on the probe ``batch``: ``reimport*`` keys (``reimported`` vs
        ``original``), ``engine*`` keys (an independent engine forward on the files in ``out`` vs
        ``reimported``); and the logits whose scale sets the tolerances.  Without an exporter an
        ``hf`` export (a copy of the checkpoint's files) is not compared."""
        log.warning("draft algorithm %r has no exporter: the %s export is not self-checked",
                    getattr(original, "algorithm", None), fmt)
        return {}, torch.zeros(())

    # -- model card ----------------------------------------------------------------------------------------
    def title(self, fmt: str) -> str:
        return f"{ENGINE_NAMES[fmt]} draft"

    def serve_command(self, fmt: str, out: str, verifier: str, gamma: int) -> Optional[str]:
        return None

    def draft_rows(self, algorithm: str, draft: Dict[str, Any]) -> List[Tuple[str, str]]:
        """(field, value) rows of the card's draft table besides algorithm, γ, layers and mask token."""
        return [("heads", "none"), ("confidence head", "False")]

    def vocab_layout(self, fmt: str) -> str:
        """How an ``fmt`` export carries a reduced draft vocabulary, in the model card's words."""
        return "`d2t` / `t2d`"

    def layer_ids_note(self, fmt: str, engine_config: Dict[str, Any]) -> Optional[str]:
        """The card's sentence on how ``engine_config`` names the target layers."""
        return None


def register_exporter(*algorithms: str):
    """Class decorator: register one instance of an `Exporter` subclass for ``algorithms``."""
    def deco(cls):
        if not (isinstance(cls, type) and issubclass(cls, Exporter)):
            raise TypeError(f"@register_exporter{algorithms!r} needs an Exporter subclass, got {cls!r}")
        exporter = cls()
        for name in algorithms:
            prev = _EXPORTERS.get(name)
            if prev is not None and type(prev).__qualname__ != cls.__qualname__:
                raise ValueError(f"algorithm {name!r} already has the exporter {type(prev).__name__}")
            _EXPORTERS[name] = exporter
        for schema_name, schema in cls.schemas.values():
            schemas.SCHEMAS[schema_name] = schema
        return cls
    return deco


_FALLBACK = Exporter()


def exporter_for(algorithm: str) -> Exporter:
    """The exporter of ``algorithm`` (one that refuses every engine format if none is registered)."""
    return _EXPORTERS.get(algorithm, _FALLBACK)


def exporters() -> Sequence[Exporter]:
    """Every registered exporter, once each, in registration order."""
    return list(dict.fromkeys(_EXPORTERS.values()))


def reader_of(fmt: str, cfg: Dict[str, Any]) -> Optional[Exporter]:
    """The exporter that reads an engine ``config.json`` in ``fmt`` back, if any does."""
    return next((e for e in exporters() if e.reads(fmt, cfg)), None)
