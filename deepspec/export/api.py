"""`export_draft` / `import_draft` / `verify_export`: the functions behind `deepspec export`."""
from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..config import TargetConfig
from ..data.vocab import VocabError, load_vocab, save_vocab
from ..drafts import DraftTargetMismatchError, load_drafter
from ..utils.fs import atomic_dir
from . import schemas
from .card import model_card
from .common import (CONFIG_NAME, PROVENANCE_NAME, WEIGHTS_NAME, ExportResult, check_output_dir, find_results,
                     has_target_source, load_target_for, read_checkpoint, read_results, write_json)
from .vocab_map import VOCAB_FILE, find_vocab_file, read_tensors
from .engine_formats import ENGINE_FORMATS, ENGINE_NAMES, Plan, target_blockers, verifier_name
from .errors import ExportError, ExportUnsupported, refusal
from .importers import detect_format, import_engine
from .registry import exporter_for

log = logging.getLogger(__name__)

FORMATS = ("hf", "vllm", "sglang")


def import_draft(path, target, fmt: Optional[str] = None):
    """Read a draft written by `export_draft` (any format) back into a deepspec drafter for ``target``."""
    fmt = fmt or detect_format(path)
    if fmt == "hf":
        return load_drafter(path, target)
    if fmt in ENGINE_FORMATS:
        return import_engine(fmt, path, target)
    raise ValueError(f"unknown format {fmt!r}; choose from {FORMATS}")


# aliases named after the brief's `import_` readers
import_ = import_draft


def probe_batch(target, gamma: int, seed: int = 0, dtype=torch.float32) -> Dict[str, torch.Tensor]:
    """A random teacher-forced batch: features of every position, blocks at three anchors (one with no context)."""
    g = torch.Generator().manual_seed(seed)
    T = gamma + 8
    ids = torch.randint(0, int(target.vocab_size), (1, T), generator=g)
    feats = torch.randn(1, T, int(target.feature_dim), generator=g).to(dtype)
    anchors = torch.tensor([[0, 3, T - gamma - 1]])
    ones = torch.ones(1, T, dtype=torch.bool)
    return {"input_ids": ids, "attention_mask": ones, "loss_mask": ones, "features": feats,
            "last_hidden": torch.zeros(1, T, int(target.hidden_size), dtype=dtype), "anchors": anchors}


def verify_export(out: Path, fmt: str, original, target, nothing_dropped: bool, seed: int = 0,
                  written_dtype: Optional[torch.dtype] = None) -> Dict[str, float]:
    """Re-read the export and compare logits; raise `ExportError` on a mismatch.

    The algorithm's exporter (`Exporter.compare`) measures, on a random probe batch:

    * ``reimport*``: our drafter rebuilt from the written files vs the trained drafter (must be exact);
      skipped when heads were dropped (the export intentionally differs then).
    * ``engine*`` (engine formats): an independent implementation of the engine's forward
      (`deepspec.export.engine_parallel`, `deepspec.export.engine_eagle3`) on the written files vs the
      re-imported drafter; ``*mass_outside_vocab``: the softmax probability the engine forward leaves
      outside a draft vocabulary it scores as one more Markov rank dimension (at most 1e-30)."""
    out = Path(out)
    original = original.eval()
    re_drafter = import_draft(out, target, fmt).eval()
    batch = probe_batch(target, int(original.cfg.gamma), seed, dtype=original.param_dtype)
    got, ref = exporter_for(original.algorithm).compare(out, fmt, original, re_drafter, batch, target,
                                                         nothing_dropped)
    # fp32 end to end: the re-import must be bit-exact and the engine forward agree to rounding;
    # low-precision targets/drafts round the LM-head input, and tensors computed at export (a factored W1's
    # table) round when written in a low precision, so the bounds scale with the logits
    exact = (target.dtype == torch.float32 and original.param_dtype == torch.float32
             and written_dtype in (None, torch.float32))
    scale = max(1.0, float(ref.float().abs().max()))
    for k, v in got.items():
        if k.startswith("reimport"):
            tol = (1e-6 if exact else 1e-2) * scale
        elif k.endswith("mass_outside_vocab"):     # a probability, whatever the dtype: 0 up to fp32 underflow
            tol = 1e-30
        else:
            tol = (1e-4 if exact else 3e-2) * scale
        if not v <= tol:
            raise ExportError(f"export self-check failed: {k} = {v:.3g} > {tol:.1g} — the {fmt} files do not "
                              "compute what the trained draft computes; nothing was written")
    return got


_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def _stored_dtype(ckpt) -> Optional[torch.dtype]:
    """The floating-point dtype the checkpoint stores its weights in (exports keep it)."""
    with safe_open(str(ckpt.weights_path()), framework="pt") as f:
        kinds = {f.get_slice(k).get_dtype() for k in f.keys()}
    floats = [_ST_DTYPES[k] for k in kinds if k in _ST_DTYPES]
    return floats[0] if len(floats) == 1 else None


def export_draft(ckpt_path, out, fmt: str, *, target_path: Optional[str] = None, overrides: Sequence[str] = (),
                 results: Optional[str] = None, allow_drop_heads: bool = False, force: bool = False,
                 verify: bool = True, target=None) -> ExportResult:
    """Export the draft checkpoint at ``ckpt_path`` to ``out`` in ``fmt`` (hf | vllm | sglang).

    The target (``target`` object, ``target_path``, ``target.*`` overrides, or the run.yaml next to
    the checkpoint) is required for vllm/sglang: the engine config names it, its fingerprint must
    match, and the export is verified against it.  Nothing is left at ``out`` on failure."""
    if fmt not in FORMATS:
        raise ValueError(f"--to {fmt!r}: choose from {', '.join(FORMATS)}")
    ckpt = read_checkpoint(ckpt_path)
    out = Path(out)
    res_path = find_results(ckpt.path, results)
    res = read_results(res_path)
    tcfg = None
    exporter = exporter_for(ckpt.algorithm)
    refused = analysis(fmt, exporter, ckpt, allow_drop_heads) if fmt != "hf" else None
    if target is None and (fmt != "hf" or has_target_source(ckpt, target_path, overrides)):
        try:
            target, tcfg = load_target_for(ckpt, target_path, overrides)
        except (OSError, ValueError) as e:
            if refused is not None:
                raise refused from None
            if fmt != "hf":
                raise ExportError(f"cannot load the target for a {fmt} export ({e}); give --target-path or "
                                  "target.* overrides") from e
            log.warning("exporting without a target (%s): no fingerprint check, no self-check", e)
            target = None
    if fmt != "hf":
        refuse(fmt, exporter, ckpt.meta.get("mask_token_id"), target, refused)
    if target is not None and tcfg is None:    # a loaded target was handed in: name it as best we can
        run_path = ((ckpt.run or {}).get("target") or {}).get("path")
        tcfg = TargetConfig(path=target_path or run_path or getattr(target, "name", "target"))
    drafter = None
    if target is not None:
        try:
            drafter = load_drafter(ckpt.path, target)
        except DraftTargetMismatchError as e:
            raise ExportError(f"{e}. Export with the target the draft was trained on (see `deepspec check`).") from e
        drafter.eval()
    result = ExportResult(fmt=fmt, out=out)
    verifier = verifier_name(tcfg) if tcfg is not None else None
    check_output_dir(out, force)
    with atomic_dir(out) as tmp:
        engine_cfg = None
        nothing_dropped = True
        written = _stored_dtype(ckpt) if fmt != "hf" else None     # engine files keep the stored dtype
        if fmt == "hf":
            shutil.copy2(ckpt.path / CONFIG_NAME, tmp / CONFIG_NAME)
            shutil.copy2(ckpt.path / WEIGHTS_NAME, tmp / WEIGHTS_NAME)
        else:
            plan, engine_cfg = export_engine(fmt, drafter, target, tcfg, tmp, allow_drop_heads,
                                             draft_meta=ckpt.draft, dtype=written)
            result.dropped, result.warnings = list(plan.dropped), list(plan.warnings)
            nothing_dropped = not plan.dropped
            for w in plan.warnings:
                log.warning("%s export: %s", fmt, w)
            for d in plan.dropped:
                log.warning("%s export: DROPPED %s", fmt, d)
        vocab_n = write_vocab_file(tmp, ckpt, result.warnings)
        if verify and drafter is not None:
            result.verified = verify_export(tmp, fmt, drafter, target, nothing_dropped, written_dtype=written)
            log.info("%s export verified: %s", fmt, ", ".join(f"{k}={v:.2e}" for k, v in result.verified.items()))
        card = model_card(ckpt, fmt, out=str(out), results=res, dropped=result.dropped, warnings=result.warnings,
                          target_path=tcfg.path if tcfg is not None else None, verifier=verifier,
                          engine_config=engine_cfg, verified=result.verified)
        (tmp / "README.md").write_text(card)
        provenance = {"format": fmt, "source_checkpoint": str(ckpt.path.resolve()), "algorithm": ckpt.algorithm,
                      "gamma": ckpt.draft.get("gamma"), "layer_ids": ckpt.layer_ids,
                      "draft_vocab_size": vocab_n or ckpt.target.get("vocab_size"),
                      "index_convention": "deepspec: layer id i = output of decoder layer i = hidden_states[i+1]",
                      "target": {k: v for k, v in ckpt.target.items()},
                      "target_path": tcfg.path if tcfg is not None else None,
                      "dropped": result.dropped, "warnings": result.warnings, "verified": result.verified,
                      "results": res}
        write_json(tmp / PROVENANCE_NAME, provenance)
        result.files = sorted(p.name for p in tmp.iterdir())
    return result


def analysis(fmt: str, exporter, ckpt, allow_drop_heads: bool) -> Optional[ExportUnsupported]:
    """The exporter's refusal of the checkpoint in ``fmt`` (None if `Exporter.analyze` accepts it), read
    from its config and weight names before anything is loaded or written."""
    with safe_open(str(ckpt.weights_path()), framework="pt") as f:
        keys = list(f.keys())
    try:
        exporter.analyze(fmt, ckpt.algorithm, {**ckpt.draft, "_n_feature_layers": len(ckpt.layer_ids)}, keys,
                         allow_drop_heads=allow_drop_heads)
    except ExportUnsupported as e:
        return e
    return None


def refuse(fmt: str, exporter, mask_token_id, target, refused: Optional[ExportUnsupported] = None) -> None:
    """Raise one `ExportUnsupported` for everything ``fmt`` cannot serve: ``refused`` (the exporter's
    `analyze`) together with what the target shows (`Exporter.target_problems`: the mask token)."""
    extra = exporter.target_problems(fmt, mask_token_id, target) if target is not None else []
    if not extra:
        if refused is not None:
            raise refused
        return
    if refused is not None and not refused.problems:
        raise ExportUnsupported(f"{refused} Also: " + "; ".join(f"{c} — {why}; retrain with {fix}"
                                                                for c, fix, why in extra))
    problems = (list(refused.problems) if refused is not None else []) + extra
    raise refusal(f"{ENGINE_NAMES[fmt]} cannot serve this draft", problems)


def write_vocab_file(out: Path, ckpt, warnings: List[str]) -> Optional[int]:
    """A pruned draft's ``draft_vocab.json`` (`deepspec.data.vocab`) in ``out``, so that the export says which
    tokenizer its ids belong to (`deepspec check` verifies it): the run's file when it lists the checkpoint's
    ``draft_vocab``, else one written from the checkpoint.  Returns N (None for a full-vocabulary draft)."""
    ids = read_tensors(ckpt.weights_path(), ("draft_vocab",)).get("draft_vocab")
    if ids is None:
        return None
    ids = ids.long().numpy()
    V = int(ckpt.target.get("vocab_size") or 0)
    tok = (ckpt.target.get("fingerprint") or {}).get("tokenizer_sha256")
    cov, source = None, f"draft_vocab of the checkpoint {ckpt.path}"
    run_file = find_vocab_file(ckpt.path)
    if run_file is not None:
        try:
            listed = load_vocab(run_file, vocab_size=V, tokenizer_fingerprint=tok)
        except VocabError as e:
            warnings.append(f"ignored {e}")
        else:
            if np.array_equal(listed, ids):
                rec = json.loads(run_file.read_text())
                cov, source = rec.get("coverage"), rec.get("source") or source
            else:
                warnings.append(f"{run_file} lists other tokens than the checkpoint's draft_vocab (the run selected "
                                f"again after this checkpoint?); {VOCAB_FILE} is written from the checkpoint")
    save_vocab(out / VOCAB_FILE, ids, vocab_size=V, tokenizer_fingerprint=tok, coverage_value=cov, source=source)
    return int(ids.size)


def export_engine(fmt: str, drafter, target, target_cfg, out: Path, allow_drop_heads: bool = False,
                  draft_meta: Optional[Dict[str, Any]] = None,
                  dtype: Optional[torch.dtype] = None) -> Tuple[Plan, Dict[str, Any]]:
    """Write ``config.json`` + ``model.safetensors`` of ``drafter`` in ``fmt`` (vllm | sglang) into ``out``.

    ``dtype``: the dtype to store floating-point weights in (default: the drafter's)."""
    exporter = exporter_for(drafter.algorithm)
    meta = dict(draft_meta or dataclasses.asdict(drafter.cfg))
    meta["_n_feature_layers"] = len(target.layer_ids)
    state = drafter.state_dict()
    plan = exporter.analyze(fmt, drafter.algorithm, meta, state.keys(), allow_drop_heads=allow_drop_heads)
    blockers = target_blockers(target)
    if blockers:
        raise ExportUnsupported(f"{fmt}: " + "; ".join(blockers) + ". Nothing was written.")
    refuse(fmt, exporter, drafter.mask_token_id, target)
    if max(target.layer_ids) == target.num_layers - 1 and fmt == "vllm":
        plan.warnings.append(f"layer id {target.num_layers - 1} is the target's last decoder layer: vLLM captures "
                             "the input of layer k, so it needs aux id = num_layers, which not every vLLM model "
                             "captures")
    dtype = dtype or next(iter(state.values())).dtype
    raw = exporter.engine_weights(fmt, drafter, target, plan)
    cfg = exporter.engine_config(fmt, drafter, target, target_cfg, plan, dtype)
    weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in raw.items()}
    schemas.check(cfg, exporter.schemas[fmt][0])
    write_json(out / CONFIG_NAME, cfg)
    save_file(weights, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    return plan, cfg
