"""Errors of the export / import / check tools."""
from __future__ import annotations

from ..errors import DeepSpecError


class ExportError(DeepSpecError, RuntimeError):
    """An export that failed (bad checkpoint, failed self-verification, output exists...)."""


class ExportUnsupported(ExportError):
    """The engine format cannot represent this draft without losing part of it.

    The message says what is missing in the engine and what would be lost; nothing
    is written when this is raised."""


class ImportUnsupported(ExportError):
    """An engine checkpoint that has no exact equivalent among deepspec's drafters."""


class SchemaError(ExportError):
    """A config that does not satisfy the engine's schema (see `deepspec.export.schemas`)."""

    def __init__(self, name: str, problems):
        self.problems = list(problems)
        super().__init__(f"{name}: " + "; ".join(self.problems))
