"""vLLM (speculators ``eagle3``) and SGLang (``LlamaForCausalLMEagle3``) layouts of the Eagle3 drafter.

Only drafts trained with ``draft.eagle3_layout=engine`` are written: that layout *is* the
engines' EAGLE-3 layer (see `deepspec.drafts.eagle3`), so the export is a renaming
(`deepspec.export.mapping.eagle3_table`) plus what the engines keep and we share with the
target:

* ``lm_head.weight`` — the target's LM head (``draft_vocab_size`` = the full vocabulary);
* ``d2t`` (int64, ``[V]``, zeros) and ``t2d`` (bool, ``[V]``, all true) — the identity
  draft→target vocabulary map in the EAGLE repo's convention (target id = draft id + d2t);
* no ``embed_tokens.weight``: both engines use the target's embedding for an EAGLE-3 draft
  of the target's width (vLLM skips the key when absent, SGLang ``set_embed``).

Sources: vLLM ``vllm/model_executor/models/llama_eagle3.py`` (``LlamaDecoderLayer`` with
2·hidden ``qkv_proj`` and ``hidden_norm``; ``Eagle3LlamaForCausalLM.load_weights``:
``midlayer.`` → ``layers.0.``, ``d2t`` → ``draft_id_to_target_id``, ``t2d`` skipped) and
``vllm/transformers_utils/configs/speculators/algos.py`` ``update_eagle3``; speculators
``src/speculators/models/eagle3/{config,core,model_definitions_llama}.py``; SGLang
``python/sglang/srt/models/llama_eagle3.py`` (``midlayer``, ``fc``, ``norm``, ``lm_head``,
``d2t`` → ``hot_token_id``) and ``model_executor/model_runner.py`` (``eagle_config``).
"""
from __future__ import annotations

from typing import Any, Dict, List

import torch

from . import mapping, schemas
from .engines import ENGINE_NAMES, Plan, dtype_name, layer_config, speculators_block
from .errors import ExportUnsupported, ImportUnsupported
from .importers import build_and_load, check_sizes

SCHEMA_OF = {"vllm": "speculators_eagle3", "sglang": "sglang_eagle3"}

NATIVE_REFUSED = (
    "this eagle3 draft uses deepspec's native layout (draft.eagle3_layout=native), which the {engine} EAGLE-3 "
    "layer cannot compute: (1) it projects concat[RMSNorm(embed), RMSNorm(fc(features))] with an extra `in_proj` "
    "Linear and runs a standard pre-norm layer on the projection, whereas the engines' EAGLE-3 layer feeds the "
    "2·hidden concatenation straight into q/k/v_proj with the residual taken from the hidden stream (`{ref}`); "
    "(2) its draft layers apply per-head q/k RMSNorm, the engines' Llama EAGLE-3 layer has none; (3) the engines' "
    "`fc` takes exactly 3 target layers, this draft takes {n_layers}. Nothing was written. Train with "
    "draft.eagle3_layout=engine (3 target.layer_ids, draft.num_layers=1) for an engine-exportable Eagle3 draft, or "
    "export this one with --to hf."
)
_REF = {"vllm": "vllm/model_executor/models/llama_eagle3.py LlamaDecoderLayer",
        "sglang": "python/sglang/srt/models/llama_eagle3.py LlamaDecoderLayer"}


def analyze_eagle3(fmt: str, draft: Dict[str, Any], state_keys) -> Plan:
    """Refuse (`ExportUnsupported`) an eagle3 draft the engines cannot run exactly."""
    engine = ENGINE_NAMES[fmt]
    n = draft.get("_n_feature_layers")
    if (draft.get("eagle3_layout") or "native") != "engine":
        raise ExportUnsupported(NATIVE_REFUSED.format(engine=engine, ref=_REF[fmt], n_layers=n if n else "?"))
    problems: List[str] = []
    if n is not None and int(n) != 3:
        problems.append(f"{n} target feature layers (the engines' fc takes exactly 3)")
    if int(draft.get("num_layers") or 0) != 1:
        problems.append(f"draft.num_layers={draft.get('num_layers')} (the engines' EAGLE-3 has one layer)")
    problems += [f"{k} — {why}" for k, why in sorted(mapping.unrepresentable(state_keys).items())]
    if problems:
        raise ExportUnsupported(f"{engine} cannot hold this eagle3 draft: " + "; ".join(problems)
                                + ". Nothing was written.")
    return Plan(fmt, "eagle3", "none", False, 0)


def _check_feature_order(target) -> None:
    ids = [int(i) for i in target.layer_ids]
    if ids != sorted(set(ids)):
        raise ExportUnsupported(f"target.layer_ids={ids} are not strictly increasing: the engines concatenate the "
                                "captured layers in layer order, so fc would read them in another order than "
                                "trained. Nothing was written.")


# -- export ------------------------------------------------------------------------------------------------
def llama_layer_config(drafter, target) -> Dict[str, Any]:
    """The Llama decoder-layer config of the EAGLE-3 layer (speculators ``transformer_layer_config``)."""
    cfg = layer_config(drafter, target)
    for key in ("layer_types", "use_sliding_window", "sliding_window"):
        cfg.pop(key, None)
    cfg.update(model_type="llama", mlp_bias=False, tie_word_embeddings=False)
    return cfg


def engine_config(fmt: str, drafter, target, target_cfg, dtype: torch.dtype) -> Dict[str, Any]:
    layer = llama_layer_config(drafter, target)
    ids = [int(i) for i in target.layer_ids]
    vocab = int(target.vocab_size)
    dt = {"torch_dtype": dtype_name(dtype), "dtype": dtype_name(dtype)}
    if fmt == "vllm":
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_config": speculators_block("eagle3", int(drafter.cfg.gamma), target, target_cfg),
            "transformer_layer_config": layer,
            "draft_vocab_size": vocab,
            "norm_before_residual": False,      # vLLM's update_eagle3 defaults it to true when absent
            "target_hidden_size": None,         # draft width = target width
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in ids],   # vLLM captures the input of layer k
            **dt,
        }
    return {
        **layer,
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": vocab,              # set ⇒ SGLang loads lm_head from this checkpoint
        "norm_before_residual": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        **dt,
    }


def engine_weights(drafter, target, fmt: str) -> Dict[str, torch.Tensor]:
    """The EAGLE-3 layer under ``fmt``'s names, the target's LM head and the identity d2t / t2d."""
    _check_feature_order(target)
    out = mapping.to_engine(drafter.state_dict(), table=mapping.eagle3_table(fmt))
    vocab = int(target.vocab_size)
    out["lm_head.weight"] = target.lm_head.weight.detach().to("cpu").clone().contiguous()
    out["d2t"] = torch.zeros(vocab, dtype=torch.int64)
    out["t2d"] = torch.ones(vocab, dtype=torch.bool)
    return out


# -- import ------------------------------------------------------------------------------------------------
def _check_shared(where: str, weights: Dict[str, torch.Tensor], target) -> None:
    """d2t / t2d must be the identity; lm_head / embed_tokens, when present, the target's own."""
    vocab = int(target.vocab_size)
    d2t, t2d = weights.get("d2t"), weights.get("t2d")
    if d2t is not None and (d2t.numel() != vocab or bool(d2t.any())):
        raise ImportUnsupported(f"{where}: d2t is not the identity map over the {vocab}-token vocabulary; reduced or "
                                "permuted draft vocabularies have no deepspec equivalent")
    if t2d is not None and (t2d.numel() != vocab or not bool(t2d.bool().all())):
        raise ImportUnsupported(f"{where}: t2d does not keep every target token; reduced draft vocabularies have no "
                                "deepspec equivalent")
    for key, module in (("lm_head.weight", target.lm_head), ("embed_tokens.weight", target.embed_tokens)):
        w = weights.get(key)
        if w is not None and not torch.equal(w, module.weight.detach().to("cpu", w.dtype)):
            raise ImportUnsupported(f"{where}: {key} differs from the target's; deepspec drafters share the target's "
                                    "embedding and LM head")


def import_eagle3(fmt: str, path, cfg: Dict[str, Any], weights: Dict[str, torch.Tensor], target):
    """A speculators ``eagle3`` (vLLM) or SGLang ``LlamaForCausalLMEagle3`` draft → our engine-layout drafter."""
    from ..config.draft import DraftConfig
    where = str(path)
    if fmt == "vllm":
        nbr = cfg.get("norm_before_residual", True)        # vLLM's default when absent
        layer = cfg.get("transformer_layer_config") or {}
        aux = [int(i) - 1 for i in cfg.get("eagle_aux_hidden_state_layer_ids") or []]
        weights = {k.replace("midlayer.", "layers.0.", 1) if k.startswith("midlayer.") else k: v
                   for k, v in weights.items()}           # vLLM's loader accepts both prefixes
    else:
        nbr = cfg.get("norm_before_residual", False)
        layer = cfg
        aux = [int(i) for i in (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or []]
    if nbr is not False:
        raise ImportUnsupported(f"{where}: norm_before_residual is true (residual = hidden_norm(hidden)); deepspec's "
                                "engine layout adds the un-normed hidden stream (norm_before_residual false)")
    if cfg.get("target_hidden_size") not in (None, layer.get("hidden_size")):
        raise ImportUnsupported(f"{where}: target_hidden_size {cfg['target_hidden_size']} != draft hidden_size "
                                f"{layer.get('hidden_size')}; deepspec's engine layout has the target's width")
    schemas.check(cfg, SCHEMA_OF[fmt])                  # 3 layer ids, Llama layer fields, one layer
    check_sizes(where, layer, target, aux, int(cfg["draft_vocab_size"]))
    _check_shared(where, weights, target)
    gamma = DraftConfig().gamma                         # SGLang takes the draft length from its server args
    if fmt == "vllm":
        gamma = int(cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
    dcfg = DraftConfig(algorithm="eagle3", eagle3_layout="engine", gamma=gamma, ttt_steps=gamma, num_layers=1,
                       intermediate_size=int(layer["intermediate_size"]),
                       num_attention_heads=int(layer["num_attention_heads"]),
                       num_key_value_heads=int(layer["num_key_value_heads"]), head_dim=int(layer["head_dim"]),
                       sequential_head="none", confidence_head=False)
    layer_weights = {k: v for k, v in weights.items() if k not in ("d2t", "t2d")}      # checked above
    return build_and_load(where, layer, target, dcfg, mapping.from_engine(layer_weights, mapping.eagle3_table(fmt)))
