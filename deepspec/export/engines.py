"""vLLM (speculators format) and SGLang layouts of our drafters: analysis and export.

The parallel drafter (dflash/dspark) is handled here; Eagle3 in `deepspec.export.engines_eagle3`;
the import readers live in `deepspec.export.importers` (re-exported here).

What each engine can run (sources in docs/export.md):

============  =========================================  ==========================================
ours          vLLM (speculators ``dspark`` / ``eagle3``)   SGLang (``Qwen3DSparkModel`` /
                                                          ``LlamaForCausalLMEagle3``)
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
eagle3        speculators ``eagle3``: ``layers.0.*``,     ``LlamaForCausalLMEagle3``: ``midlayer.*``,
 engine       ``fc``, ``norm``, target ``lm_head``,        ``fc``, ``norm``, target ``lm_head``,
 layout       identity ``d2t``/``t2d``                     identity ``d2t``/``t2d``
eagle3        refused: ``in_proj``, q/k norm and any      refused (same reasons)
 native       number of feature layers have no engine
              counterpart (train with
              ``draft.eagle3_layout=engine``)
============  =========================================  ==========================================

Block convention: our block anchored at p is ``[x_p, MASK×(γ−1)]`` at positions
p..p+γ−1, sees target features of positions < p, and slot k predicts x_{p+k+1}
(every slot trained).  That is speculators' ``sample_from_anchor=True`` (the DSpark
default) and exactly the convention SGLang's ``models/dspark.py`` is written for
("DeepSpec trains block slot k to predict anchor+k+1"); the DFlash runtimes of both
engines instead read slot k as a prediction of x_{p+k} (slot 0 = bonus token), which is
why even our head-less "dflash" is written as a DSpark config with the Markov head off.

Layer ids: ours are decoder-layer *outputs* (``hidden_states[i+1]``).  vLLM captures the
residual stream *entering* layer k, so its ``eagle_aux_hidden_state_layer_ids`` — and the
speculators ``aux_hidden_state_layer_ids`` passed straight into them — are ours + 1
(vLLM derives the DFlash ``target_layer_ids`` as aux − 1).  SGLang's
``dflash_config.target_layer_ids`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``
name layer outputs (it adds 1 itself), i.e. ours.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import mapping, schemas
from .common import CONFIG_NAME, WEIGHTS_NAME, write_json
from .errors import ExportUnsupported
from .importers import detect_format, import_sglang, import_vllm, read_provenance  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

ENGINE_FORMATS = ("vllm", "sglang")
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}

@dataclass
class Plan:
    """What goes into an engine export of a parallel drafter."""
    fmt: str
    algorithm: str
    seq_head: str                   # none | markov | rnn  (what is written)
    confidence: bool                # confidence head written
    head_rank: int
    drop_parts: Tuple[str, ...] = ()
    dropped: List[str] = field(default_factory=list)     # human descriptions of what was left out
    warnings: List[str] = field(default_factory=list)

    @property
    def markov_rank(self) -> int:
        return self.head_rank if self.seq_head != "none" else 0

    @property
    def markov_head_type(self) -> str:
        return {"markov": "vanilla", "rnn": "rnn"}.get(self.seq_head, "vanilla")


def analyze(fmt: str, algorithm: str, draft: Dict[str, Any], state_keys, allow_drop_heads: bool = False) -> Plan:
    """Decide what an ``fmt`` export writes, or raise `ExportUnsupported` saying what would be lost."""
    if fmt not in ENGINE_FORMATS:
        raise ValueError(f"not an engine format: {fmt}")
    engine = ENGINE_NAMES[fmt]
    if algorithm == "eagle3":
        from .engines_eagle3 import analyze_eagle3
        return analyze_eagle3(fmt, draft, state_keys)
    if algorithm not in ("dspark", "dflash"):
        raise ExportUnsupported(f"no {engine} layout is known for draft algorithm {algorithm!r}")
    bad = mapping.unrepresentable(state_keys)
    if bad:
        raise ExportUnsupported(
            f"{engine} cannot hold this draft: it has " + "; ".join(f"{k} — {why}" for k, why in sorted(bad.items()))
            + ". Train with draft.hidden_size unset (= the target's) to export it.")
    seq = str(draft.get("sequential_head") or "none")
    conf = bool(draft.get("confidence_head"))
    rank = int(draft.get("head_rank") or 0)
    plan = Plan(fmt, algorithm, seq, conf, rank)

    def need_drop(parts, what_lost, why):
        msg = f"{engine} cannot serve {what_lost}: {why}"
        if not allow_drop_heads:
            raise ExportUnsupported(
                msg + f". Exporting would lose {what_lost}; nothing was written. Pass --allow-drop-heads to write "
                "the parallel backbone alone (lossless decoding still holds, acceptance will be lower than "
                "measured in deepspec eval), or choose another format.")
        plan.drop_parts = tuple(sorted(set(plan.drop_parts) | set(parts)))
        plan.dropped.append(f"{what_lost} ({why})")

    if fmt == "vllm":
        if seq == "rnn":
            need_drop(("markov", "rnn", "confidence") if conf else ("markov", "rnn"),
                      "the RNN sequential head" + (" and the confidence head that reads its embedding" if conf else ""),
                      "vLLM's speculators `dspark` config updater documents only markov_head_type='vanilla' at "
                      "inference (use --to sglang, which runs RNN heads)")
            plan.seq_head, plan.confidence = "none", False
        elif seq == "none" and conf:
            need_drop(("confidence",), "the confidence head",
                      "it owns a token embedding of its own (no sequential head), which the speculators "
                      "ConfidenceHead has no place for")
            plan.confidence = False
        if plan.confidence:
            plan.warnings.append("the confidence head is written (speculators carries it) but vLLM does not use it "
                                 "at inference; confidence-scheduled verification needs deepspec's own engine")
    else:
        if seq == "none":
            raise ExportUnsupported(
                "SGLang cannot serve this draft: it has no sequential head, and SGLang's DSpark model "
                "(models/dspark.py) requires markov_rank > 0 while SGLang's DFlash runtime reads block slot k as a "
                "prediction of token anchor+k (slot 0 = bonus token) — our drafter's slot k predicts anchor+k+1, "
                "so every proposal would be one position off. Nothing was written; use --to vllm (speculators "
                "dspark with the Markov head off) or --to hf.")
        if not conf:
            plan.warnings.append("this draft has no confidence head; SGLang's DSpark loader builds one unless its "
                                 "ragged-verify mode is static (models/dspark.py build_confidence_head), so serve it "
                                 "in that mode")
    return plan


# -- config builders ------------------------------------------------------------------------------------
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def layer_config(drafter, target) -> Dict[str, Any]:
    """The Qwen3-style decoder-layer config of our draft layers (what the engines build)."""
    d = drafter.dims
    tc = target.config
    n = int(drafter.cfg.num_layers)
    return {
        "model_type": "qwen3",
        "hidden_size": int(d.hidden_size),
        "intermediate_size": int(d.intermediate_size),
        "num_hidden_layers": n,
        "num_attention_heads": int(d.num_heads),
        "num_key_value_heads": int(d.num_kv_heads),
        "head_dim": int(d.head_dim),
        "rms_norm_eps": float(d.rms_eps),
        # transformers 4 reads rope_theta/rope_scaling, transformers 5 rope_parameters; our RoPE is the
        # default (unscaled) rotation at the target's base frequency
        "rope_theta": float(d.rope_theta),
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(d.rope_theta)},
        "vocab_size": int(target.vocab_size),
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": int(getattr(tc, "max_position_embeddings", None) or 32768),
        "layer_types": ["full_attention"] * n,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": False,
    }


def verifier_name(target_cfg) -> str:
    path = str(target_cfg.path)
    if path.startswith("reference:"):
        from ..targets.reference import reference_dir
        return str(reference_dir(path.split(":", 1)[1]))
    return path


def speculators_block(algorithm: str, tokens: int, target, target_cfg) -> Dict[str, Any]:
    """``speculators_config``: one greedy proposal method of ``tokens`` drafts, and the verifier."""
    archs = list(getattr(target.model.config, "architectures", None) or [type(target.model).__name__])
    return {"algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name(target_cfg), "architectures": archs}}


def vllm_config(drafter, target, target_cfg, plan: Plan, dtype: torch.dtype) -> Dict[str, Any]:
    g = int(drafter.cfg.gamma)
    layer = layer_config(drafter, target)
    return {
        "architectures": ["DSparkDraftModel"],
        "speculators_model_type": "dspark",
        # sample_from_anchor=True: all block_size slots are proposals
        "speculators_config": speculators_block("dspark", g, target, target_cfg),
        "transformer_layer_config": layer,
        "draft_vocab_size": int(target.vocab_size),
        "block_size": g,
        "target_hidden_size": None if int(target.hidden_size) == layer["hidden_size"] else int(target.hidden_size),
        "aux_hidden_state_layer_ids": [int(i) + 1 for i in target.layer_ids],
        "mask_token_id": int(drafter.mask_token_id),
        "sample_from_anchor": True,
        "sliding_window_non_causal": False,
        "markov_rank": plan.markov_rank,
        "markov_head_type": plan.markov_head_type,
        "enable_confidence_head": plan.confidence,
        "confidence_head_with_markov": plan.confidence and plan.seq_head != "none",
        "torch_dtype": dtype_name(dtype),
        "dtype": dtype_name(dtype),
    }


def sglang_config(drafter, target, target_cfg, plan: Plan, dtype: torch.dtype) -> Dict[str, Any]:
    g = int(drafter.cfg.gamma)
    return {
        **layer_config(drafter, target),
        "architectures": ["Qwen3DSparkModel"],
        "dflash_config": {"block_size": g, "mask_token_id": int(drafter.mask_token_id),
                          "target_layer_ids": [int(i) for i in target.layer_ids]},
        "num_target_layers": int(target.num_layers),
        "markov_rank": plan.markov_rank,
        "markov_head_type": plan.markov_head_type,
        "enable_confidence_head": plan.confidence,
        "confidence_head_with_markov": plan.confidence and plan.seq_head != "none",
        "torch_dtype": dtype_name(dtype),
        "dtype": dtype_name(dtype),
    }


SCHEMA_OF = {"vllm": "speculators_dspark", "sglang": "sglang_dspark"}


def target_blockers(target) -> List[str]:
    """Target properties the engines' draft path does not reproduce (each a reason to refuse)."""
    out = []
    if getattr(target, "softcap", None):
        out.append(f"the target soft-caps its final logits (final_logit_softcapping={target.softcap}); our draft "
                   "was trained on soft-capped draft logits but the engines' draft logits are plain LM-head outputs")
    ids = torch.arange(min(int(target.vocab_size), 64), device=target.device)
    with torch.no_grad():
        scaled = target.embed(ids).float()
        raw = torch.nn.functional.embedding(ids, target.embed_tokens.weight).float()
    if not torch.allclose(scaled, raw, rtol=1e-3, atol=1e-6):
        out.append("the target scales its input embeddings (e.g. Gemma's sqrt(hidden_size)); our draft embeds block "
                   "tokens through that scaled module, the engines embed draft tokens with the raw embedding table")
    return out


# -- export ------------------------------------------------------------------------------------------------
def export_engine(fmt: str, drafter, target, target_cfg, out: Path, allow_drop_heads: bool = False,
                  draft_meta: Optional[Dict[str, Any]] = None,
                  dtype: Optional[torch.dtype] = None) -> Tuple[Plan, Dict[str, Any]]:
    """Write ``config.json`` + ``model.safetensors`` of ``drafter`` in ``fmt`` into ``out``.

    ``dtype``: the dtype to store floating-point weights in (default: the drafter's)."""
    from safetensors.torch import save_file
    meta = dict(draft_meta or dataclasses.asdict(drafter.cfg))
    meta["_n_feature_layers"] = len(target.layer_ids)
    state = drafter.state_dict()
    plan = analyze(fmt, drafter.algorithm, meta, state.keys(), allow_drop_heads=allow_drop_heads)
    blockers = target_blockers(target)
    if blockers:
        raise ExportUnsupported(f"{fmt}: " + "; ".join(blockers) + ". Nothing was written.")
    if max(target.layer_ids) == target.num_layers - 1 and fmt == "vllm":
        plan.warnings.append(f"layer id {target.num_layers - 1} is the target's last decoder layer: vLLM captures "
                             "the input of layer k, so it needs aux id = num_layers, which not every vLLM model "
                             "captures")
    dtype = dtype or next(iter(state.values())).dtype
    if drafter.algorithm == "eagle3":
        from . import engines_eagle3 as e3
        raw = e3.engine_weights(drafter, target, fmt)
        cfg, schema = e3.engine_config(fmt, drafter, target, target_cfg, dtype), e3.SCHEMA_OF[fmt]
    else:
        raw = mapping.to_engine(state, drop_parts=plan.drop_parts)
        cfg = (vllm_config if fmt == "vllm" else sglang_config)(drafter, target, target_cfg, plan, dtype)
        schema = SCHEMA_OF[fmt]
    weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in raw.items()}
    schemas.check(cfg, schema)
    write_json(out / CONFIG_NAME, cfg)
    save_file(weights, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    return plan, cfg
