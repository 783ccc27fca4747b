"""vLLM (speculators format) and SGLang layouts of the parallel drafter: analysis, export, import.

What each engine can run (sources in docs/export.md):

============  =========================================  ==========================================
ours          vLLM (speculators ``dspark``)                SGLang (``Qwen3DSparkModel``)
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
eagle3        refused (architecture differs, below)      refused (architecture differs, below)
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
``dflash_config.target_layer_ids`` name layer outputs (it adds 1 itself), i.e. ours.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import mapping, schemas
from .common import CONFIG_NAME, PROVENANCE_NAME, WEIGHTS_NAME, write_json
from .errors import ExportError, ExportUnsupported, ImportUnsupported

log = logging.getLogger(__name__)

ENGINE_FORMATS = ("vllm", "sglang")

EAGLE3_UNSUPPORTED = (
    "deepspec's eagle3 drafter cannot be written in the {engine} EAGLE-3 layout without changing what it "
    "computes: (1) it projects concat[RMSNorm(embed), RMSNorm(fc(features))] with an extra `in_proj` Linear "
    "and then runs a standard pre-norm layer on the projection (residual = the projection), whereas the "
    "engines' first EAGLE-3 layer feeds the 2·hidden concatenation straight into q/k/v_proj with the residual "
    "taken from the fc output (`{ref}`); (2) our draft layers apply per-head q/k RMSNorm, the engines' Llama "
    "EAGLE-3 layer has none; (3) the engines' `fc` takes exactly 3 target layers (3·target_hidden_size), ours "
    "takes len(layer_ids)·hidden ({n_layers} layers here). Writing the weights anyway would give a draft that "
    "loads but proposes garbage, so nothing was written. Export the checkpoint with --to hf, or train a "
    "dspark/dflash draft for engine serving."
)
_EAGLE3_REF = {"vLLM": "vllm/model_executor/models/llama_eagle3.py LlamaDecoderLayer",
               "SGLang": "python/sglang/srt/models/llama_eagle3.py LlamaDecoderLayer"}


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
    engine = {"vllm": "vLLM", "sglang": "SGLang"}[fmt]
    if algorithm == "eagle3":
        raise ExportUnsupported(EAGLE3_UNSUPPORTED.format(engine=engine, ref=_EAGLE3_REF[engine],
                                                          n_layers=draft.get("_n_feature_layers", "?")))
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
def _dtype_name(dtype: torch.dtype) -> str:
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


def vllm_config(drafter, target, target_cfg, plan: Plan, dtype: torch.dtype) -> Dict[str, Any]:
    g = int(drafter.cfg.gamma)
    layer = layer_config(drafter, target)
    archs = list(getattr(target.model.config, "architectures", None) or [type(target.model).__name__])
    return {
        "architectures": ["DSparkDraftModel"],
        "speculators_model_type": "dspark",
        "speculators_config": {
            "algorithm": "dspark",
            # sample_from_anchor=True: all block_size slots are proposals
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": g,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name(target_cfg), "architectures": archs},
        },
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
        "torch_dtype": _dtype_name(dtype),
        "dtype": _dtype_name(dtype),
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
        "torch_dtype": _dtype_name(dtype),
        "dtype": _dtype_name(dtype),
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
    weights = {k: v.to(dtype) if v.is_floating_point() else v
               for k, v in mapping.to_engine(state, drop_parts=plan.drop_parts).items()}
    cfg = (vllm_config if fmt == "vllm" else sglang_config)(drafter, target, target_cfg, plan, dtype)
    schemas.check(cfg, SCHEMA_OF[fmt])
    write_json(out / CONFIG_NAME, cfg)
    save_file(weights, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    return plan, cfg


# -- import ------------------------------------------------------------------------------------------------
def detect_format(path) -> str:
    p = Path(path)
    cfg = json.loads((p / CONFIG_NAME).read_text())
    if "speculators_model_type" in cfg:
        return "vllm"
    if "dflash_config" in cfg:
        return "sglang"
    if "architecture" in cfg and "draft" in cfg:
        return "hf"
    raise ImportUnsupported(f"{p}: unknown draft format (no speculators_model_type, dflash_config or deepspec "
                            "architecture in config.json)")


def _theta(layer: Dict[str, Any]) -> float:
    t = layer.get("rope_theta")
    if t is None:
        t = (layer.get("rope_parameters") or {}).get("rope_theta")
    return float(t if t is not None else 10000.0)


def _build_from_engine(where: str, layer: Dict[str, Any], target, *, our_layer_ids, block_size: int, mask: int,
                       markov_rank: int, head_type: str, conf: bool, conf_with_markov: bool, vocab: int,
                       weights: Dict[str, torch.Tensor]):
    from ..config.draft import DraftConfig
    from ..drafts import build_drafter
    from ..drafts.layers import DraftDims
    if list(our_layer_ids) != list(target.layer_ids):
        raise ImportUnsupported(f"{where}: the draft reads target layers {list(our_layer_ids)} (deepspec convention: "
                                f"decoder-layer outputs) but the target is configured with {list(target.layer_ids)}; "
                                f"load the target with target.layer_ids={list(our_layer_ids)}")
    if vocab != int(target.vocab_size) or int(layer["vocab_size"]) != int(target.vocab_size):
        raise ImportUnsupported(f"{where}: draft vocabulary {vocab} != target vocabulary {target.vocab_size}; "
                                "reduced draft vocabularies (d2t/t2d) have no deepspec equivalent")
    if int(layer["hidden_size"]) != int(target.hidden_size):
        raise ImportUnsupported(f"{where}: draft hidden_size {layer['hidden_size']} != target hidden_size "
                                f"{target.hidden_size}")
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
                      confidence_head=bool(conf), mask_token_id=int(mask))
    dims = DraftDims.from_target(target.config, cfg)
    if abs(dims.rope_theta - _theta(layer)) > 1e-6 * max(1.0, dims.rope_theta):
        raise ImportUnsupported(f"{where}: rope_theta {_theta(layer)} differs from the target's {dims.rope_theta}; "
                                "deepspec draft layers always use the target's RoPE base")
    if abs(dims.rms_eps - float(layer["rms_norm_eps"])) > 1e-12:
        raise ImportUnsupported(f"{where}: rms_norm_eps {layer['rms_norm_eps']} differs from the target's "
                                f"{dims.rms_eps}; deepspec draft layers always use the target's epsilon")
    if layer.get("rope_scaling") not in (None, {}) or (layer.get("rope_parameters") or {}).get(
            "rope_type", "default") != "default":
        raise ImportUnsupported(f"{where}: scaled RoPE has no deepspec draft-layer equivalent")
    drafter = build_drafter(target, cfg)        # parameters in the default dtype, as `load_drafter` does
    ours = mapping.from_engine(weights)
    missing, unexpected = drafter.load_state_dict(ours, strict=False)
    if missing or unexpected:
        raise ImportUnsupported(f"{where}: weights do not fit a {algorithm} drafter: missing {sorted(missing)}, "
                                f"unexpected {sorted(unexpected)}")
    return drafter


def _load(path) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    from safetensors.torch import load_file
    p = Path(path)
    if not (p / CONFIG_NAME).is_file() or not (p / WEIGHTS_NAME).is_file():
        raise ImportUnsupported(f"{p}: needs {CONFIG_NAME} and {WEIGHTS_NAME}")
    try:
        cfg = json.loads((p / CONFIG_NAME).read_text(encoding="utf-8"))
    except ValueError as e:
        raise ExportError(f"{p / CONFIG_NAME}: not valid JSON ({type(e).__name__}: {e})") from None
    try:
        weights = load_file(str(p / WEIGHTS_NAME))
    except Exception as e:   # anything but safetensors (a pickle, a torch.save zip) is refused
        raise ExportError(f"{p / WEIGHTS_NAME}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    if not isinstance(cfg, dict):
        raise ExportError(f"{p / CONFIG_NAME}: expected a JSON object")
    return cfg, weights


def import_vllm(path, target):
    """A speculators-format (vLLM) DSpark/DFlash draft → our drafter, for ``target``."""
    cfg, weights = _load(path)
    kind = cfg.get("speculators_model_type")
    if kind not in ("dspark", "dflash"):
        raise ImportUnsupported(f"{path}: speculators_model_type={kind!r}; only dspark/dflash map onto deepspec "
                                "drafters (deepspec's eagle3 is a different architecture)")
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
    return _build_from_engine(str(path), layer, target, our_layer_ids=[int(i) - 1 for i in aux],
                              block_size=cfg["block_size"], mask=cfg["mask_token_id"],
                              markov_rank=int(cfg.get("markov_rank") or 0),
                              head_type=str(cfg.get("markov_head_type") or "vanilla"),
                              conf=bool(cfg.get("enable_confidence_head")),
                              conf_with_markov=bool(cfg.get("confidence_head_with_markov")),
                              vocab=int(cfg.get("draft_vocab_size") or layer["vocab_size"]), weights=weights)


def import_sglang(path, target):
    """An SGLang DSpark draft (``Qwen3DSparkModel``) → our drafter, for ``target``."""
    cfg, weights = _load(path)
    schemas.check(cfg, "sglang_dspark")
    dc = cfg["dflash_config"]
    return _build_from_engine(str(path), cfg, target, our_layer_ids=[int(i) for i in dc["target_layer_ids"]],
                              block_size=dc["block_size"], mask=dc["mask_token_id"],
                              markov_rank=int(cfg["markov_rank"]), head_type=str(cfg["markov_head_type"]),
                              conf=bool(cfg.get("enable_confidence_head")),
                              conf_with_markov=bool(cfg.get("confidence_head_with_markov")),
                              vocab=int(cfg["vocab_size"]), weights=weights)


def read_provenance(path) -> Optional[Dict[str, Any]]:
    p = Path(path) / PROVENANCE_NAME
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError:
        raise ExportError(f"{p}: not valid JSON")
