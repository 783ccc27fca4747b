"""The parallel drafter (DFlash / DSpark, `deepspec.drafts.parallel`) in vLLM's speculators format and SGLang's.

What each format holds (sources in docs/export.md; schemas in `deepspec.export.parallel_schemas`):

============  =========================================  ==========================================
ours          vllm: speculators ``dspark``                sglang: ``DSparkDraftModel`` (SGLang and
                                                          SpecForge read it)
============  =========================================  ==========================================
dflash        backbone, ``markov_rank=0``                 backbone + a rank-1 Markov head of zeros
                                                          (SGLang's DSpark needs ``markov_rank > 0``;
                                                          its bias is exactly 0)
dspark        backbone + Markov (``vanilla``) +           backbone + Markov (``vanilla`` / ``rnn``)
 markov       confidence head (kept, unused by vLLM)      + confidence head
dspark rnn    backbone + ``rnn`` head: speculators         yes (SGLang's ``RNNHead``)
              computes it; vLLM 0.34 serves ``vanilla``
              only (note in the model card)
conf head     refused (``draft.confidence_head=true``     refused (same)
 w/o seq head with ``draft.sequential_head=none`` owns a
              token embedding); ``--allow-drop-heads``
              → backbone only
W1 over the   the table ``W1 = P·E`` (V×r) computed      same
 target emb.  at export (`materialized_w1`)
draft.vocab_  ``draft_vocab_size = N``, ``d2t`` / ``t2d``,   one more Markov rank dimension: 1 in
 size = N     target ``lm_head`` rows, ``markov_w2`` [N, r]  ``markov_w1``, 0 / −2¹⁴ in ``markov_w2``
                                                          on / off the draft vocabulary
                                                          (`deepspec.export.vocab_rank`)
============  =========================================  ==========================================

Refusals name the draft settings at fault and the ones to retrain with
(`deepspec.export.mapping.UNSERVABLE`, and a mask token that is a stop token or an ordinary
token: `deepspec.targets.mask_token`).

Block convention: our block anchored at p is ``[x_p, MASK×(γ−1)]`` at positions
p..p+γ−1, sees target features of positions < p, and slot k predicts x_{p+k+1}
(every slot trained).  That is speculators' ``sample_from_anchor=True`` (the DSpark
default) and the convention of SGLang's DSpark (``sample_from_anchor`` defaults to true);
the DFlash runtimes of the engines instead read slot k as a prediction of x_{p+k} (slot 0 =
bonus token), which is why even our head-less "dflash" is written as a DSpark draft.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..config.draft import DraftConfig
from ..targets.mask_token import mask_token_fault, suggested_mask_token, target_tokens
from . import mapping, schemas
from .common import WEIGHTS_NAME
from .engine_formats import ENGINE_FORMATS, ENGINE_NAMES, Plan, dtype_name, layer_config, speculators_block
from .engine_math import max_abs_diff
from .engine_parallel import EngineDraft
from .errors import ExportUnsupported, ImportUnsupported, Problem, refusal
from .importers import build_and_load, check_sizes
from .parallel_schemas import SGLANG_DSPARK, SPECULATORS_DSPARK, sglang_problems
from .registry import Exporter, register_exporter
from .vocab_map import (draft_ids, engine_vocab_tensors, ids_from_engine, lm_head_rows, place, read_tensors,
                        without_vocab_keys)
from .vocab_rank import KEYS as RANK_KEYS, VOCAB_BIAS, add_vocab_rank, mass_outside, rank_problems, split_vocab_rank

RNN_ON_VLLM = ("the RNN sequential head is written (speculators 0.9.0 computes it) but vLLM 0.34 serves the vanilla "
               "Markov head only (model_executor/models/qwen3_dspark.py); serve this draft with SGLang 0.5.23 "
               "(--to sglang), which runs RNN heads")
_ZERO_MARKOV = ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight")


def materialized_w1(drafter, vocab_size: int, rows: int = 8192) -> torch.Tensor:
    """The sequential head's factored W1 (``draft.head_embedding=target``: ``W1[x] = P·E_target[x]``) as the
    V×r table the engines read, computed by the head itself a block of token ids at a time."""
    with torch.no_grad():
        return torch.cat([drafter.head.embed(torch.arange(i, min(i + rows, vocab_size), device=drafter.device))
                          for i in range(0, vocab_size, rows)])


@dataclass
class ParallelPlan(Plan):
    """A parallel drafter's export: which heads are written."""
    seq_head: str = "none"          # none | markov | rnn  (what is written)
    confidence: bool = False        # confidence head written
    head_rank: int = 0
    zero_markov: bool = False       # sglang: a rank-1 Markov head of zeros stands for "no sequential head"
    vocab_rank: bool = False        # sglang: the draft vocabulary as one more Markov rank dimension

    @property
    def markov_rank(self) -> int:
        rank = self.head_rank if self.seq_head != "none" else 0
        return rank + 1 if self.vocab_rank else 1 if self.zero_markov else rank

    @property
    def markov_head_type(self) -> str:
        return {"markov": "vanilla", "rnn": "rnn"}.get(self.seq_head, "vanilla")


@register_exporter("dspark", "dflash")
class ParallelExporter(Exporter):
    schemas = {"vllm": ("speculators_dspark", SPECULATORS_DSPARK), "sglang": ("sglang_dspark", SGLANG_DSPARK)}

    # -- export ------------------------------------------------------------------------------------------
    def analyze(self, fmt, algorithm, draft, state_keys, allow_drop_heads=False) -> ParallelPlan:
        engine = ENGINE_NAMES[fmt]
        seq = str(draft.get("sequential_head") or "none")
        conf = bool(draft.get("confidence_head"))
        plan = ParallelPlan(fmt, algorithm, seq_head=seq, confidence=conf, head_rank=int(draft.get("head_rank") or 0))
        problems = mapping.unservable(state_keys, draft)
        own_w1 = [p for p in problems if p[0].startswith("draft.confidence_head=true")]
        if own_w1 and allow_drop_heads:      # the confidence head that owns a token embedding can be left out
            problems = [p for p in problems if p not in own_w1]
            plan.drop_parts, plan.confidence = ("confidence",), False
            plan.dropped.append("the confidence head (it owns a token embedding of its own, which the engines' "
                                "confidence heads have no place for)")
        if problems:
            err = refusal(f"{engine} cannot serve this draft", problems)
            if own_w1 and not allow_drop_heads:
                err.args = (err.args[0] + " Or pass --allow-drop-heads to write it without its confidence head "
                            "(lossless decoding still holds, acceptance will be lower than measured).",)
            raise err
        if fmt == "vllm" and plan.seq_head == "rnn":
            plan.warnings.append(RNN_ON_VLLM)
        if fmt == "vllm" and plan.confidence:
            plan.warnings.append("the confidence head is written (speculators carries it) but vLLM does not use it "
                                 "at inference; confidence-scheduled verification needs deepspec's own engine")
        if fmt == "sglang" and draft.get("vocab_size") is not None:
            plan.vocab_rank = True
            plan.warnings.append(f"the draft vocabulary ({draft['vocab_size']} tokens) is written as one more Markov "
                                 f"rank dimension (markov_rank {plan.markov_rank}): SGLang's DSpark scores every "
                                 f"target token and adds {VOCAB_BIAS:g} to the logits of the tokens outside it, whose "
                                 "probability is then exactly 0")
        elif fmt == "sglang" and plan.seq_head == "none":
            plan.zero_markov = True
            plan.warnings.append("no sequential head: written with a rank-1 Markov head of zeros (SGLang's DSpark "
                                 "requires markov_rank > 0; the bias it adds is exactly 0)")
        if fmt == "sglang" and not plan.confidence:
            plan.warnings.append("this draft has no confidence head; SGLang's DSpark loader builds one unless its "
                                 "ragged-verify mode is static (models/dspark.py build_confidence_head), so serve it "
                                 "in that mode")
        return plan

    def target_problems(self, fmt, mask_token_id, target) -> List[Problem]:
        """A mask token the engines cannot serve: a stop token (they stop a block at it) or an ordinary token."""
        inventory, rows, stops = target_tokens(target)
        fault = mask_token_fault(inventory, int(mask_token_id), rows, stops)
        if fault is None:
            return []
        best = suggested_mask_token(inventory, rows, stops)
        fix = f"draft.mask_token_id={best}" if best is not None else "draft.mask_token_id=<an id never in text>"
        return [(f"draft.mask_token_id={int(mask_token_id)}", fix, f"the mask token is {fault}")]

    def engine_config(self, fmt, drafter, target, target_cfg, plan: ParallelPlan, dtype) -> Dict[str, Any]:
        g = int(drafter.cfg.gamma)
        heads = {"markov_rank": plan.markov_rank, "markov_head_type": plan.markov_head_type,
                 "enable_confidence_head": plan.confidence,
                 "confidence_head_with_markov": plan.confidence and plan.seq_head != "none"}
        dt = {"torch_dtype": dtype_name(dtype), "dtype": dtype_name(dtype)}
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
                **heads, **dt,
            }
        mha = layer["num_key_value_heads"] == layer["num_attention_heads"]
        return {
            **layer,
            "architectures": ["DSparkDraftModel"],
            "block_size": g,
            "dflash_config": {"block_size": g, "mask_token_id": int(drafter.mask_token_id),
                              "target_layer_ids": [int(i) for i in target.layer_ids],
                              "attention_mode": "mha" if mha else "gqa", **heads},
            "num_target_layers": int(target.num_layers),
            "sample_from_anchor": True,
            **heads, **dt,
        }

    def engine_weights(self, fmt, drafter, target, plan: ParallelPlan) -> Dict[str, torch.Tensor]:
        """Our weights under the engine names.  A reduced draft vocabulary is, for vLLM, the target's LM-head
        rows ``lm_head.weight`` [N, H] and ``d2t`` / ``t2d`` (`deepspec.export.vocab_map`: vLLM's DSpark/DFlash
        models load the draft's own head when ``draft_vocab_size`` differs from the target's and map draft
        ids through ``d2t``); for SGLang one more Markov rank dimension (`deepspec.export.vocab_rank`)."""
        state = {k: v for k, v in drafter.state_dict().items() if k != "draft_vocab"
                 and not (k.startswith("conf_head.") and "confidence" in plan.drop_parts)}
        if "head.w1_proj.weight" in state:
            state["head.w1.weight"] = materialized_w1(drafter, int(target.vocab_size))
            del state["head.w1_proj.weight"]
        out = mapping.to_engine(state, drop_parts=plan.drop_parts)
        if plan.zero_markov:
            zeros = torch.zeros(int(target.vocab_size), 1, dtype=next(iter(out.values())).dtype)
            out.update({k: zeros.clone() for k in _ZERO_MARKOV})
        ids = draft_ids(drafter)
        if ids is not None and plan.vocab_rank:
            return add_vocab_rank(out, ids, int(target.vocab_size))
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
            bad = sglang_problems(cfg)
            if bad:
                raise ImportUnsupported(f"{path}: " + "; ".join(bad) + " (SGLang reads both places)")
            dc = cfg["dflash_config"]
            ids_from_engine(str(path), None, weights, target)      # no d2t / lm_head: the target's own
            ids, weights = split_vocab_rank(str(path), weights)     # a draft vocabulary: one more Markov rank
            rank = int(dc["markov_rank"]) - (ids is not None)
            if ids is None and rank == 1 and all(k in weights and not weights[k].any() for k in _ZERO_MARKOV):
                weights = {k: v for k, v in weights.items() if k not in _ZERO_MARKOV}     # a zero head is no head
                rank = 0
            return _build(str(path), cfg, target, our_layer_ids=[int(i) for i in dc["target_layer_ids"]],
                          block_size=dc["block_size"], mask=dc["mask_token_id"],
                          markov_rank=rank, head_type=str(dc["markov_head_type"]),
                          conf=bool(dc.get("enable_confidence_head")),
                          conf_with_markov=bool(dc.get("confidence_head_with_markov")), ids=ids, weights=weights)
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
                      ids=ids_from_engine(str(path), cfg.get("draft_vocab_size"), weights, target), weights=weights)

    def held_vocabulary(self, fmt, path, cfg, vocab_size):
        """SGLang: the draft vocabulary the last Markov rank dimension marks (`deepspec.export.vocab_rank`)."""
        if fmt != "sglang":
            return None
        where = Path(path) / WEIGHTS_NAME
        try:
            weights = read_tensors(where, RANK_KEYS)
        except Exception as e:     # reported as the finding, not raised
            return None, [f"{where}: not a readable safetensors file ({type(e).__name__}: {e})"]
        return rank_problems(str(where), weights)

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
            ids = draft_ids(reimported)
            if fmt == "sglang" and ids is not None:     # every token scored; VOCAB_BIAS outside the vocabulary
                got["engine_max_abs_diff"] = max_abs_diff(eng_logits[..., ids], new["logits"][0])
                got["engine_mass_outside_vocab"] = mass_outside(eng_logits, ids)
            else:                                       # the engines' −inf outside the vocabulary (d2t)
                got["engine_max_abs_diff"] = max_abs_diff(eng_logits, place(new["logits"][0], ids,
                                                                             int(target.vocab_size)))
            if eng_conf is not None and new["confidence"] is not None:
                got["engine_confidence_max_abs_diff"] = max_abs_diff(eng_conf, new["confidence"][0])
        return got, new["logits"]

    # -- model card ----------------------------------------------------------------------------------------
    def title(self, fmt) -> str:
        return {"vllm": "vLLM — speculators DSpark format",
                "sglang": "SGLang — DSpark draft (DSparkDraftModel; SpecForge reads it too)"}[fmt]

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

    def vocab_layout(self, fmt) -> str:
        if fmt == "sglang":
            return f"one more Markov rank dimension, logit bias {VOCAB_BIAS:g} outside the draft vocabulary"
        return super().vocab_layout(fmt)

    def layer_ids_note(self, fmt, engine_config) -> Optional[str]:
        if fmt == "vllm":
            return (f"Engine layer ids: `aux_hidden_state_layer_ids = {engine_config.get('aux_hidden_state_layer_ids')}`"
                    " (vLLM captures the input of decoder layer k = deepspec id + 1).")
        return (f"Engine layer ids: `dflash_config.target_layer_ids = "
                f"{(engine_config.get('dflash_config') or {}).get('target_layer_ids')}` (layer outputs, as in "
                "deepspec).")


def _build(where: str, layer: Dict[str, Any], target, *, our_layer_ids, block_size: int, mask: int,
           markov_rank: int, head_type: str, conf: bool, conf_with_markov: bool, ids: Optional[torch.Tensor],
           weights: Dict[str, torch.Tensor]):
    """The parallel drafter an engine DSpark/DFlash config describes, holding its weights (``ids``: its
    draft vocabulary, None = the target's)."""
    check_sizes(where, layer, target, our_layer_ids)
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
