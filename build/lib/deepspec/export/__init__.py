"""Export drafts for serving engines, read them back, and check train↔serve consistency.

* `export_draft(ckpt, out, fmt)` — ``hf`` (our ``from_pretrained`` directory + model card),
  ``vllm`` (speculators format) or ``sglang``, as the draft algorithm's exporter lays it out
  (`deepspec.export.registry`: `parallel` for DSpark / DFlash, `eagle3` for EAGLE-3 with
  ``draft.eagle3_layout=engine``); refuses with `ExportUnsupported` whatever an engine cannot
  run exactly.
* `import_draft(dir, target)` — any of those back into a deepspec drafter.
* `deepspec.export.check` — ``deepspec check``: draft ↔ target consistency.
* `deepspec.export.schemas` — the config schemas and a small validator.

See docs/export.md.
"""
from . import eagle3, parallel  # noqa: F401  (the built-in exporters register themselves)
from .api import FORMATS, export_draft, import_, import_draft, verify_export
from .errors import ExportError, ExportUnsupported, ImportUnsupported, SchemaError

__all__ = ["FORMATS", "export_draft", "import_draft", "import_", "verify_export", "ExportError",
           "ExportUnsupported", "ImportUnsupported", "SchemaError"]
