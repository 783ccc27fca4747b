"""The parallel drafter (DFlash / DSpark, `deepspec.drafts.parallel`) in vLLM's speculators format and SGLang's.

What each engine can run (sources in docs/export.md):

============  =========================================  ==========================================
ours          vLLM (speculators ``dspark``)               SGLang (``Qwen3DSparkModel``)
============  =========================================  ==========================================
dflash        backbone, ``markov_rank=0``                 refused: SGLang's DSpark needs
                                                          ``markov_rank > 0`` and its DFlash reads
                                                          block slots one position later
dspark        backbone + Markov (``vanilla``) +           backbone + Markov (``vanilla`` / ``rnn``)
 markov       confidence head (kept, unused by vLLM)      + confidence head
dspark rnn    refused (vLLM serves ``vanilla`` only);     yes
              ``--allow-drop-heads`` → backbone only
conf head     refused: no way to carry its own W1;        refused (no Markov head)
 w/o seq head ``--allow-drop-heads`` → backbone only
draft.vocab_  ``draft_vocab_size = N``, ``d2t`` / ``t2d``,   refused: SGLang's DSpark scores with the
 size = N     target ``lm_head`` rows, ``markov_w2`` [N, r]  target's full head, reads no ``d2t``
============  =========================================  ==========================================

Block convention: our block anchored at p is ``[x_p, MASK×(γ−1)]`` at positions
p..p+γ−1, sees target features of positions < p, and slot k predicts x_{p+k+1}
(every slot trained).  That is speculators' ``sample_from_anchor=True`` (the DSpark
default) and exactly the convention SGLang's ``models/dspark.py`` is written for
("DeepSpec trains block slot k to predict anchor+k+1"); the DFlash runtimes of both
engines instead read slot k as a prediction of x_{p+k} (slot 0 = bonus token), which is
why even our head-less "dflash" is written as a DSpark config with the Markov head off.

Config schemas, written from the engines' loaders:

* ``SPECULATORS_DSPARK`` — the speculators format read by vLLM
  (`vllm/transformers_utils/configs/speculators/base.py`: ``validate_speculators_config``
  requires ``speculators_config.proposal_methods[0].speculative_tokens``,
  ``speculators_config.verifier.name_or_path``, ``speculators_model_type`` and a dict
  ``transformer_layer_config``; ``algos.py`` ``update_dflash`` / ``update_dspark`` require
  ``aux_hidden_state_layer_ids`` and ``mask_token_id`` and read ``draft_vocab_size``,
  ``target_hidden_size``, ``markov_rank``, ``markov_head_type``, ``sample_from_anchor``);
  field names and types as declared by speculators
  (`src/speculators/models/dflash/config.py`, `src/speculators/models/dspark/config.py`).
* ``SGLANG_DSPARK`` — SGLang's DSpark draft (`python/sglang/srt/models/dspark.py`,
  `speculative/dspark_components/dspark_config.py`, `speculative/dflash_utils.py`
  ``parse_dflash_draft_config``): a flat Qwen3-style HF config with ``dflash_config``
  {``block_size``, ``mask_token_id``, ``target_layer_ids``}, ``num_target_layers``,
  ``markov_rank`` (> 0), ``markov_head_type``, ``enable_confidence_head``,
  ``confidence_head_with_markov``; ``speculators_model_type`` must be absent (SGLang
  refuses speculators-convention DSpark checkpoints).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..config.draft import DraftConfig
from . import mapping, schemas
from .draft_vocab import draft_ids, engine_vocab_tensors, ids_from_engine, lm_head_rows, place, without_vocab_keys
from .engine_formats import ENGINE_FORMATS, ENGINE_NAMES, Plan, dtype_name, layer_config, speculators_block
from .errors import ExportUnsupported, ImportUnsupported
from .importers import build_and_load, check_sizes
from .reference import EngineDraft
from .reference_math import max_abs_diff
from .registry import Exporter, register_exporter
from .schemas import BOOL, INT_LIST, NONNEG_INT, POS_INT, QWEN3_LAYER, speculators_common

SPECULATORS_DSPARK: Dict[str, Any] = {
    "type": "object",
    "required": ["speculators_model_type", "architectures", "speculators_config", "transformer_layer_config",
                 "draft_vocab_size", "block_size", "aux_hidden_state_layer_ids", "mask_token_id",
                 "markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
                 "sample_from_anchor"],
    "properties": {
        **speculators_common("dspark", "DSparkDraftModel", QWEN3_LAYER),
        "block_size": POS_INT,
        "aux_hidden_state_layer_ids": INT_LIST,
        "mask_token_id": NONNEG_INT,
        "markov_rank": NONNEG_INT,
        "markov_head_type": {"enum": ["vanilla", "gated", "rnn"]},
        "enable_confidence_head": BOOL,
        "confidence_head_with_markov": BOOL,
        "sample_from_anchor": {"const": True},
    },
}

SGLANG_DSPARK: Dict[str, Any] = {
    "type": "object",
    "required": QWEN3_LAYER["required"] + ["architectures", "dflash_config", "num_target_layers", "markov_rank",
                                           "markov_head_type", "enable_confidence_head",
                                           "confidence_head_with_markov"],
    "forbidden": ["speculators_model_type"],
    "properties": {
        **QWEN3_LAYER["properties"],
        "architectures": {"type": "array", "items": {"const": "Qwen3DSparkModel"}, "minItems": 1},
        "dflash_config": {"type": "object", "required": ["block_size", "mask_token_id", "target_layer_ids"],
                          "properties": {"block_size": POS_INT, "mask_token_id": NONNEG_INT,
                                         "target_layer_ids": INT_LIST}},
        "num_target_layers": POS_INT,
        "markov_rank": POS_INT,
        "markov_head_type": {"enum": ["vanilla", "gated", "rnn"]},
        "enable_confidence_head": BOOL,
        "confidence_head_with_markov": BOOL,
    },
}


@dataclass
class ParallelPlan(Plan):
    """A parallel drafter's export: which heads are written."""
    seq_head: str = "none"          # none | markov | rnn  (what is written)
    confidence: bool = False        # confidence head written
    head_rank: int = 0

    @property
    def markov_rank(self) -> int:
        return self.head_rank if self.seq_head != "none" else 0

    @property
    def markov_head_type(self) -> str:
        return {"markov": "vanilla", "rnn": "rnn"}.get(self.seq_head, "vanilla")


@register_exporter("dspark", "dflash")
class ParallelExporter(Exporter):
    schemas = {"vllm": ("speculators_dspark", SPECULATORS_DSPARK), "sglang": ("sglang_dspark", SGLANG_DSPARK)}

    # -- export ------------------------------------------------------------------------------------------
    def analyze(self, fmt, algorithm, draft, state_keys, allow_drop_heads=False) -> ParallelPlan:
        engine = ENGINE_NAMES[fmt]
        bad = mapping.unrepresentable(state_keys)
        if bad:
            raise ExportUnsupported(
                f"{engine} cannot hold this draft: it has "
                + "; ".join(f"{k} — {why}" for k, why in sorted(bad.items()))
                + ". Train with draft.hidden_size unset (= the target's) to export it.")
        seq = str(draft.get("sequential_head") or "none")
        conf = bool(draft.get("confidence_head"))
        plan = ParallelPlan(fmt, algorithm, seq_head=seq, confidence=conf, head_rank=int(draft.get("head_rank") or 0))

        def need_drop(parts, what_lost, why):
            msg = f"{engine} cannot serve {what_lost}: {why}"
            if not allow_drop_heads:
                raise ExportUnsupported(
                    msg + f". Exporting would lose {what_lost}; nothing was written. Pass --allow-drop-heads to "
                    "write the parallel backbone alone (lossless decoding still holds, acceptance will be lower "
                    "than measured in deepspec eval), or choose another format.")
            plan.drop_parts = tuple(sorted(set(plan.drop_parts) | set(parts)))
            plan.dropped.append(f"{what_lost} ({why})")

        if fmt == "vllm":
            if seq == "rnn":
                need_drop(("markov", "rnn", "confidence") if conf else ("markov", "rnn"),
                          "the RNN sequential head" + (" and the confidence head that reads its embedding"
                                                       if conf else ""),
                          "vLLM's speculators `dspark` config updater documents only markov_head_type='vanilla' "
                          "at inference (use --to sglang, which runs RNN heads)")
                plan.seq_head, plan.confidence = "none", False
            elif seq == "none" and conf:
                need_drop(("confidence",), "the confidence head",
                          "it owns a token embedding of its own (no sequential head), which the speculators "
                          "ConfidenceHead has no place for")
                plan.confidence = False
            if plan.confidence:
                plan.warnings.append("the confidence head is written (speculators carries it) but vLLM does not use "
                                     "it at inference; confidence-scheduled verification needs deepspec's own engine")
        else:
            if draft.get("vocab_size") is not None:
                raise ExportUnsupported(
                    f"SGLang cannot serve this draft: it scores a reduced draft vocabulary (draft.vocab_size="
                    f"{draft['vocab_size']}), and SGLang's DSpark model (models/dspark.py) has no place for one — it "
                    "computes the base logits with the target's full LM head (the checkpoint's lm_head.* is "
                    "skipped), builds markov_w2 over the full vocab_size and reads no d2t. Nothing was written; use "
                    "--to vllm (the speculators format carries d2t/t2d) or train with draft.vocab_size=null.")
            if seq == "none":
                raise ExportUnsupported(
                    "SGLang cannot serve this draft: it has no sequential head, and SGLang's DSpark model "
                    "(models/dspark.py) requires markov_rank > 0 while SGLang's DFlash runtime reads block slot k "
                    "as a prediction of token anchor+k (slot 0 = bonus token) — our drafter's slot k predicts "
                    "anchor+k+1, so every proposal would be one position off. Nothing was written; use --to vllm "
                    "(speculators dspark with the Markov head off) or --to hf.")
            if not conf:
                plan.warnings.append("this draft has no confidence head; SGLang's DSpark loader builds one unless "
                                     "its ragged-verify mode is static (models/dspark.py build_confidence_head), so "
                                     "serve it in that mode")
        return plan

    def engine_config(self, fmt, drafter, target, target_cfg, plan: ParallelPlan, dtype) -> Dict[str, Any]:
        g = int(drafter.cfg.gamma)
        heads = {"markov_rank": plan.markov_rank, "markov_head_type": plan.markov_head_type,
                 "enable_confidence_head": plan.confidence,
                 "confidence_head_with_markov": plan.confidence and plan.seq_head != "none",
                 "torch_dtype": dtype_name(dtype), "dtype": dtype_name(dtype)}
        layer = layer_config(drafter, target)
        if fmt == "vllm":
            return {
                "architectures": ["DSparkDraftModel"],
                "speculators_model_type": "dspark",
                # sample_from_anchor=True: all block_size slots are proposals
                "speculators_config": speculators_block("dspark", g, target, target_cfg),
                "transformer_layer_config": layer,
                "draft_vocab_size": int(drafter.out_vocab),     # < vocab_size: d2t/t2d + lm_head rows written
                "block_size": g,
                "target_hidden_size": None if int(target.hidden_size) == layer["hidden_size"]
                else int(target.hidden_size),
                "aux_hidden_state_layer_ids": [int(i) + 1 for i in target.layer_ids],
                "mask_token_id": int(drafter.mask_token_id),
                "sample_from_anchor": True,
                "sliding_window_non_causal": False,
                **heads,
            }
        return {
            **layer,
            "architectures": ["Qwen3DSparkModel"],
            "dflash_config": {"block_size": g, "mask_token_id": int(drafter.mask_token_id),
                              "target_layer_ids": [int(i) for i in target.layer_ids]},
            "num_target_layers": int(target.num_layers),
            **heads,
        }

    def engine_weights(self, fmt, drafter, target, plan: ParallelPlan) -> Dict[str, torch.Tensor]:
        """Our weights under the engine names; for a reduced draft vocabulary (vLLM only, `analyze` refuses
        SGLang) also the target's LM-head rows ``lm_head.weight`` [N, H] and ``d2t`` / ``t2d``
        (`deepspec.export.draft_vocab`): vLLM's DSpark/DFlash models load the draft's own head when
        ``draft_vocab_size`` differs from the target's and map draft ids through ``d2t``."""
        state = {k: v for k, v in drafter.state_dict().items() if k != "draft_vocab"}
        out = mapping.to_engine(state, drop_parts=plan.drop_parts)
        ids = draft_ids(drafter)
        if ids is not None:
            out["lm_head.weight"] = lm_head_rows(target, ids)
            out.update(engine_vocab_tensors(ids, int(target.vocab_size)))
        return out

    # -- import ------------------------------------------------------------------------------------------
    def reads(self, fmt, cfg) -> bool:
        if fmt == "vllm":
            return cfg.get("speculators_model_type") in ("dspark", "dflash")
        return "dflash_config" in cfg

    def import_draft(self, fmt, path: Path, cfg, weights, target):
        if fmt == "sglang":
            schemas.check(cfg, "sglang_dspark")
            dc = cfg["dflash_config"]
            return _build(str(path), cfg, target, our_layer_ids=[int(i) for i in dc["target_layer_ids"]],
                          block_size=dc["block_size"], mask=dc["mask_token_id"],
                          markov_rank=int(cfg["markov_rank"]), head_type=str(cfg["markov_head_type"]),
                          conf=bool(cfg.get("enable_confidence_head")),
                          conf_with_markov=bool(cfg.get("confidence_head_with_markov")),
                          vocab=cfg.get("draft_vocab_size"), weights=weights)
        kind = cfg.get("speculators_model_type")
        if not cfg.get("sample_from_anchor", kind == "dspark"):
            raise ImportUnsupported(f"{path}: sample_from_anchor is false (block slot k predicts anchor+k, slot 0 "
                                    "untrained); deepspec drafters predict anchor+k+1 from slot k")
        if kind == "dspark":
            schemas.check(cfg, "speculators_dspark")
        layer = cfg["transformer_layer_config"]
        aux = cfg.get("aux_hidden_state_layer_ids")
        if not aux:
            raise ImportUnsupported(f"{path}: no aux_hidden_state_layer_ids")
        if cfg.get("mask_token_id") is None:
            raise ImportUnsupported(f"{path}: no mask_token_id")
        return _build(str(path), layer, target, our_layer_ids=[int(i) - 1 for i in aux],
                      block_size=cfg["block_size"], mask=cfg["mask_token_id"],
                      markov_rank=int(cfg.get("markov_rank") or 0),
                      head_type=str(cfg.get("markov_head_type") or "vanilla"),
                      conf=bool(cfg.get("enable_confidence_head")),
                      conf_with_markov=bool(cfg.get("confidence_head_with_markov")),
                      vocab=cfg.get("draft_vocab_size"), weights=weights)

    def recorded_layer_ids(self, fmt, cfg) -> Tuple[Optional[List[int]], Optional[int]]:
        if fmt == "vllm":        # vLLM ids = ours + 1
            return [int(i) - 1 for i in cfg.get("aux_hidden_state_layer_ids") or []], cfg.get("mask_token_id")
        dc = cfg.get("dflash_config") or {}
        return [int(i) for i in dc.get("target_layer_ids") or []], dc.get("mask_token_id")

    # -- self-check ----------------------------------------------------------------------------------------
    def compare(self, out, fmt, original, reimported, batch, target, nothing_dropped):
        got: Dict[str, float] = {}
        new = reimported.block_logits(batch)
        if nothing_dropped:
            old = original.block_logits(batch)
            got["reimport_max_abs_diff"] = max_abs_diff(old["logits"], new["logits"])
            if old["confidence"] is not None:
                got["reimport_confidence_max_abs_diff"] = max_abs_diff(old["confidence"], new["confidence"])
        if fmt in ENGINE_FORMATS:
            eng = EngineDraft.from_dir(out)

            def embed(ids):
                with torch.no_grad():
                    return target.embed(ids.to(target.device)).float().cpu()

            def lm_logits(h):
                with torch.no_grad():
                    return target.logits_from_hidden(h.to(target.device, target.dtype)).float().cpu()

            anchors = [int(a) for a in batch["anchors"][0]]
            eng_logits, eng_conf = eng.block_logits(batch["features"][0].float(), batch["input_ids"][0], anchors,
                                                    embed, lm_logits)
            ours = place(new["logits"][0], draft_ids(reimported), int(target.vocab_size))   # the engines' −inf
            got["reference_max_abs_diff"] = max_abs_diff(eng_logits, ours)
            if eng_conf is not None and new["confidence"] is not None:
                got["reference_confidence_max_abs_diff"] = max_abs_diff(eng_conf, new["confidence"][0])
        return got, new["logits"]

    # -- model card ----------------------------------------------------------------------------------------
    def title(self, fmt) -> str:
        return {"vllm": "vLLM — speculators DSpark format", "sglang": "SGLang — DSpark draft (Qwen3DSparkModel)"}[fmt]

    def serve_command(self, fmt, out, verifier, gamma) -> Optional[str]:
        if fmt == "vllm":
            spec = json.dumps({"model": out, "method": "dspark", "num_speculative_tokens": gamma})
            return f"vllm serve {verifier} --speculative-config '{spec}'"
        return (f"python -m sglang.launch_server --model-path {verifier} --speculative-algorithm DSPARK "
                f"--speculative-draft-model-path {out} --speculative-num-draft-tokens {gamma + 1}")

    def draft_rows(self, algorithm, draft) -> List[Tuple[str, str]]:
        seq, conf = draft.get("sequential_head", "none"), bool(draft.get("confidence_head"))
        head = (("heads", "none") if (seq or "none") == "none" and not conf
                else ("sequential head", f"{seq} (rank {draft.get('head_rank')})"))
        return [head, ("confidence head", str(conf))]

    def layer_ids_note(self, fmt, engine_config) -> Optional[str]:
        if fmt == "vllm":
            return (f"Engine layer ids: `aux_hidden_state_layer_ids = {engine_config.get('aux_hidden_state_layer_ids')}`"
                    " (vLLM captures the input of decoder layer k = deepspec id + 1).")
        return (f"Engine layer ids: `dflash_config.target_layer_ids = "
                f"{(engine_config.get('dflash_config') or {}).get('target_layer_ids')}` (layer outputs, as in "
                "deepspec).")


def _build(where: str, layer: Dict[str, Any], target, *, our_layer_ids, block_size: int, mask: int,
           markov_rank: int, head_type: str, conf: bool, conf_with_markov: bool, vocab: Optional[int],
           weights: Dict[str, torch.Tensor]):
    """The parallel drafter an engine DSpark/DFlash config describes, holding its weights (``vocab``: its
    ``draft_vocab_size``, None = the target's)."""
    check_sizes(where, layer, target, our_layer_ids)
    ids = ids_from_engine(where, vocab, weights, target)
    if markov_rank > 0 and head_type not in ("vanilla", "rnn"):
        raise ImportUnsupported(f"{where}: markov_head_type={head_type!r} has no deepspec equivalent "
                                "(deepspec has markov = 'vanilla' and rnn)")
    if conf and not conf_with_markov:
        raise ImportUnsupported(f"{where}: a confidence head on the hidden state alone has no deepspec equivalent "
                                "(deepspec's confidence head always reads a token embedding)")
    seq = "none" if markov_rank == 0 else {"vanilla": "markov", "rnn": "rnn"}[head_type]
    algorithm = "dflash" if (seq == "none" and not conf) else "dspark"
    cfg = DraftConfig(algorithm=algorithm, gamma=int(block_size), num_layers=int(layer["num_hidden_layers"]),
                      hidden_size=None, intermediate_size=int(layer["intermediate_size"]),
                      num_attention_heads=int(layer["num_attention_heads"]),
                      num_key_value_heads=int(layer["num_key_value_heads"]), head_dim=int(layer["head_dim"]),
                      sequential_head=seq, head_rank=int(markov_rank) if markov_rank else 256,
                      confidence_head=bool(conf), mask_token_id=int(mask),
                      vocab_size=None if ids is None else int(ids.numel()))
    ours = mapping.from_engine(without_vocab_keys(weights))
    if ids is not None:
        ours["draft_vocab"] = ids
    return build_and_load(where, layer, target, cfg, ours)
