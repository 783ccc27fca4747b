"""Errors of the export / import / check tools."""
from __future__ import annotations

from typing import List, Sequence, Tuple

from ..errors import DeepSpecError


class ExportError(DeepSpecError, RuntimeError):
    """An export that failed (bad checkpoint, failed self-verification, output exists...)."""


class ExportUnsupported(ExportError):
    """The engine format cannot represent this draft without losing part of it.

    The message says what is missing in the engine and what would be lost; nothing
    is written when this is raised.  ``problems``: the (setting, fix, why) triples of a `refusal`."""
    problems: List["Problem"] = []


class ImportUnsupported(ExportError):
    """An engine checkpoint that has no exact equivalent among deepspec's drafters."""


class SchemaError(ExportError):
    """A config that does not satisfy the engine's schema (see `deepspec.export.schemas`)."""

    def __init__(self, name: str, problems):
        self.problems = list(problems)
        super().__init__(f"{name}: " + "; ".join(self.problems))


Problem = Tuple[str, str, str]     # (the draft setting at fault, the setting to retrain with, why)


def refusal(what: str, problems: Sequence[Problem]) -> ExportUnsupported:
    """One `ExportUnsupported` naming every setting at fault and the settings to retrain with."""
    causes = "; ".join(f"{cause} — {why}" for cause, _, why in problems)
    fixes = list(dict.fromkeys(fix for _, fix, _ in problems))
    err = ExportUnsupported(f"{what}: {causes}. Nothing was written. Retrain with {' '.join(fixes)} to export it.")
    err.problems = list(problems)
    return err
