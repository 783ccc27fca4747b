"""Export drafts for serving engines, read them back, and check train↔serve consistency.

* `export_draft(ckpt, out, fmt)` — ``hf`` (our ``from_pretrained`` directory + model card),
  ``vllm`` (speculators DSpark / EAGLE-3 format) or ``sglang`` (``Qwen3DSparkModel`` /
  ``LlamaForCausalLMEagle3``; EAGLE-3 for ``draft.eagle3_layout=engine`` drafts); refuses with
  `ExportUnsupported` whatever an engine cannot run exactly (see `deepspec.export.engines`).
* `import_draft(dir, target)` — any of those back into a deepspec drafter.
* `deepspec.export.check` — ``deepspec check``: draft ↔ target consistency.
* `deepspec.export.schemas` — the engines' config schemas and a small validator.

See docs/export.md.
"""
from .api import FORMATS, export_draft, import_, import_draft, verify_export
from .errors import ExportError, ExportUnsupported, ImportUnsupported, SchemaError

__all__ = ["FORMATS", "export_draft", "import_draft", "import_", "verify_export", "ExportError",
           "ExportUnsupported", "ImportUnsupported", "SchemaError"]
