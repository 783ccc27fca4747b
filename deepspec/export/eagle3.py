"""The Eagle3 drafter (`deepspec.drafts.eagle3`) in vLLM's speculators ``eagle3`` format and SGLang's
``LlamaForCausalLMEagle3``.

Only drafts trained with ``draft.eagle3_layout=engine`` are written: that layout *is* the
engines' EAGLE-3 layer (see `deepspec.drafts.eagle3`), so the export is a renaming
(`deepspec.export.mapping.eagle3_table`) plus what the engines keep and we share with the
target:

* ``lm_head.weight`` — the target's LM head, ``[V, H]``; for a reduced draft vocabulary
  (``draft.vocab_size = N``) its rows of the N draft tokens, ``[N, H]``, and ``draft_vocab_size = N``;
* ``d2t`` (int64, ``[draft_vocab_size]``) and ``t2d`` (bool, ``[V]``) — the draft→target
  vocabulary map in the EAGLE repo's convention (target id = draft id + d2t): in the vllm
  (speculators) format for a reduced vocabulary only (speculators 0.9.0's full-vocabulary model has
  no such buffers and reports them as unexpected keys); in the sglang format always, zeros / all true
  for the full vocabulary (SpecForge 0.2.0's ``LlamaForCausalLMEagle3`` holds both buffers and its
  SGLang exporter requires them; SGLang turns ``d2t`` into ``hot_token_id``) (`deepspec.export.vocab_map`);
* ``embed_tokens.weight`` — the target's token embedding: speculators 0.9.0 keeps what the
  checkpoint holds and refills only NaN weights from the verifier, so without it the draft
  embeds every token as zeros; vLLM loads it as the draft's own (equal to the target's), SGLang
  replaces it with the target's (``set_embed``).

Sources: vLLM ``vllm/model_executor/models/llama_eagle3.py`` (``LlamaDecoderLayer`` with
2·hidden ``qkv_proj`` and ``hidden_norm``; ``Eagle3LlamaForCausalLM.load_weights``:
``midlayer.`` → ``layers.0.``, ``d2t`` → ``draft_id_to_target_id``, ``t2d`` skipped) and
``vllm/transformers_utils/configs/speculators/algos.py`` ``update_eagle3``; speculators
``src/speculators/models/eagle3/{config,core,model_definitions_llama}.py``; SGLang
``python/sglang/srt/models/llama_eagle3.py`` (``midlayer``, ``fc``, ``norm``, ``lm_head``,
``d2t`` → ``hot_token_id``) and ``model_executor/model_runner.py`` (``eagle_config``).

============  =========================================  ==========================================
ours          vLLM (speculators ``eagle3``)               SGLang (``LlamaForCausalLMEagle3``)
============  =========================================  ==========================================
eagle3        speculators ``eagle3``: ``layers.0.*``,     ``LlamaForCausalLMEagle3``: ``midlayer.*``,
 engine       ``fc``, ``norm``, target ``embed_tokens`` and  ``fc``, ``norm``, target ``embed_tokens`` and
 layout       ``lm_head`` (rows of the draft vocabulary),  ``lm_head`` (rows of the draft vocabulary),
              ``d2t``/``t2d`` for a reduced vocabulary     ``d2t``/``t2d``
eagle3        refused: ``in_proj``, q/k norm and any      refused (same reasons)
 native       number of feature layers have no engine
              counterpart (train with
              ``draft.eagle3_layout=engine``)
============  =========================================  ==========================================

Config schemas, written from the engines' loaders:

* ``SPECULATORS_EAGLE3`` — speculators ``eagle3`` read by vLLM: the same
  ``speculators_config`` checks as DSpark's, ``algos.py`` ``update_eagle3`` (``draft_vocab_size``,
  ``target_hidden_size``, ``norm_before_residual`` — default **true** when absent —
  ``eagle_aux_hidden_state_layer_ids``); fields as declared by speculators
  `src/speculators/models/eagle3/config.py` ``Eagle3SpeculatorConfig`` (LlamaConfig layer).
* ``SGLANG_EAGLE3`` — SGLang's ``LlamaForCausalLMEagle3`` (`python/sglang/srt/models/llama_eagle3.py`):
  a flat LlamaConfig plus ``draft_vocab_size`` and ``eagle_config``
  {``eagle_aux_hidden_state_layer_ids``, ``use_aux_hidden_state``} (read in
  `model_executor/model_runner.py`).
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..config.draft import DraftConfig
from . import mapping, schemas
from .vocab_map import draft_ids, engine_vocab_tensors, ids_from_engine, lm_head_rows, place, without_vocab_keys
from .engine_formats import ENGINE_FORMATS, ENGINE_NAMES, Plan, dtype_name, layer_config, speculators_block
from .errors import ExportUnsupported, ImportUnsupported, refusal
from .importers import build_and_load, check_sizes
from .engine_eagle3 import EngineEagle3
from .engine_math import max_abs_diff
from .registry import Exporter, register_exporter
from .schemas import NONNEG_INT, POS_INT, QWEN3_LAYER, speculators_common

# EAGLE-3's layer is a Llama decoder layer (no q/k norm): speculators' ``transformer_layer_config``
# is a LlamaConfig (`models/eagle3/config.py`), SGLang's draft config a flat LlamaConfig.
LLAMA_LAYER = {
    "type": "object",
    "required": QWEN3_LAYER["required"] + ["mlp_bias", "tie_word_embeddings"],
    "properties": {
        **{k: v for k, v in QWEN3_LAYER["properties"].items() if k != "layer_types"},
        "model_type": {"const": "llama"},
        "num_hidden_layers": {"const": 1},
        "mlp_bias": {"const": False},
        "tie_word_embeddings": {"const": False},
    },
}
_EAGLE3_IDS = {"type": "array", "items": NONNEG_INT, "minItems": 3, "maxItems": 3}


# vLLM `update_eagle3` (algos.py): copies draft_vocab_size, target_hidden_size (if not null),
# eagle_aux_hidden_state_layer_ids, and norm_before_residual *defaulting to true* when absent —
# so it must be written (false: our residual is the un-normed hidden stream).
SPECULATORS_EAGLE3: Dict[str, Any] = {
    "type": "object",
    "required": ["speculators_model_type", "architectures", "speculators_config", "transformer_layer_config",
                 "draft_vocab_size", "norm_before_residual", "eagle_aux_hidden_state_layer_ids"],
    "properties": {
        **speculators_common("eagle3", "Eagle3Speculator", LLAMA_LAYER),
        "norm_before_residual": {"const": False},
        "eagle_aux_hidden_state_layer_ids": _EAGLE3_IDS,
    },
}

# SGLang `models/llama_eagle3.py` + `model_executor/model_runner.py`: a flat LlamaConfig;
# draft_vocab_size set ⇒ lm_head is loaded from the checkpoint (null ⇒ taken from the target);
# eagle_config.eagle_aux_hidden_state_layer_ids are layer outputs (SGLang adds 1 itself).
SGLANG_EAGLE3: Dict[str, Any] = {
    "type": "object",
    "required": LLAMA_LAYER["required"] + ["architectures", "draft_vocab_size", "eagle_config"],
    "forbidden": ["speculators_model_type", "dflash_config"],
    "properties": {
        **LLAMA_LAYER["properties"],
        "architectures": {"type": "array", "items": {"const": "LlamaForCausalLMEagle3"}, "minItems": 1},
        "draft_vocab_size": POS_INT,
        "norm_before_residual": {"const": False},
        "eagle_config": {"type": "object", "required": ["eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state"],
                         "properties": {"eagle_aux_hidden_state_layer_ids": _EAGLE3_IDS,
                                        "use_aux_hidden_state": {"const": True}}},
    },
}

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


@register_exporter("eagle3")
class Eagle3Exporter(Exporter):
    schemas = {"vllm": ("speculators_eagle3", SPECULATORS_EAGLE3), "sglang": ("sglang_eagle3", SGLANG_EAGLE3)}

    # -- export ------------------------------------------------------------------------------------------
    def analyze(self, fmt, algorithm, draft, state_keys, allow_drop_heads=False) -> Plan:
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
        if problems:
            raise ExportUnsupported(f"{engine} cannot hold this eagle3 draft: " + "; ".join(problems)
                                    + ". Nothing was written.")
        unservable = mapping.unservable(state_keys, draft)
        if unservable:
            raise refusal(f"{engine} cannot hold this eagle3 draft", unservable)
        return Plan(fmt, algorithm)

    def engine_config(self, fmt, drafter, target, target_cfg, plan, dtype) -> Dict[str, Any]:
        layer = llama_layer_config(drafter, target)
        ids = [int(i) for i in target.layer_ids]
        vocab = int(drafter.out_vocab)             # the draft vocabulary (= target's unless draft.vocab_size)
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

    def engine_weights(self, fmt, drafter, target, plan) -> Dict[str, torch.Tensor]:
        """The EAGLE-3 layer under ``fmt``'s names, the target's token embedding and LM head (its rows of the
        draft vocabulary), and d2t / t2d where the format reads them: speculators for a reduced vocabulary
        only (its full-vocabulary model has no such buffers), SGLang always (SpecForge's
        ``LlamaForCausalLMEagle3`` holds both buffers, identity maps for the full vocabulary).  The embedding
        is written because speculators' EAGLE-3 keeps whatever the checkpoint holds (it refills only NaN
        weights from the verifier); vLLM and SGLang use it as the draft's own, equal to the target's."""
        _check_feature_order(target)
        state = {k: v for k, v in drafter.state_dict().items() if k != "draft_vocab"}
        out = mapping.to_engine(state, table=mapping.eagle3_table(fmt))
        vocab = int(target.vocab_size)
        ids = draft_ids(drafter)
        out["embed_tokens.weight"] = target.embed_tokens.weight.detach().to("cpu").clone().contiguous()
        out["lm_head.weight"] = lm_head_rows(target, ids)
        if ids is not None or fmt == "sglang":
            out.update(engine_vocab_tensors(torch.arange(vocab) if ids is None else ids, vocab))
        return out

    # -- import ------------------------------------------------------------------------------------------
    def reads(self, fmt, cfg) -> bool:
        if fmt == "vllm":
            return cfg.get("speculators_model_type") == "eagle3"
        return "dflash_config" not in cfg and ("eagle_config" in cfg
                                               or "LlamaForCausalLMEagle3" in (cfg.get("architectures") or []))

    def import_draft(self, fmt, path, cfg, weights, target):
        """A speculators ``eagle3`` (vLLM) or SGLang ``LlamaForCausalLMEagle3`` draft → our engine-layout drafter."""
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
            raise ImportUnsupported(f"{where}: norm_before_residual is true (residual = hidden_norm(hidden)); "
                                    "deepspec's engine layout adds the un-normed hidden stream "
                                    "(norm_before_residual false)")
        if cfg.get("target_hidden_size") not in (None, layer.get("hidden_size")):
            raise ImportUnsupported(f"{where}: target_hidden_size {cfg['target_hidden_size']} != draft hidden_size "
                                    f"{layer.get('hidden_size')}; deepspec's engine layout has the target's width")
        schemas.check(cfg, self.schemas[fmt][0])           # 3 layer ids, Llama layer fields, one layer
        check_sizes(where, layer, target, aux)
        vocab_ids = ids_from_engine(where, int(cfg["draft_vocab_size"]), weights, target)   # d2t/t2d, lm_head
        gamma = DraftConfig().gamma                         # SGLang takes the draft length from its server args
        if fmt == "vllm":
            gamma = int(cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
        dcfg = DraftConfig(algorithm="eagle3", eagle3_layout="engine", gamma=gamma, ttt_steps=gamma, num_layers=1,
                           intermediate_size=int(layer["intermediate_size"]),
                           num_attention_heads=int(layer["num_attention_heads"]),
                           num_key_value_heads=int(layer["num_key_value_heads"]), head_dim=int(layer["head_dim"]),
                           sequential_head="none", confidence_head=False,
                           vocab_size=None if vocab_ids is None else int(vocab_ids.numel()))
        ours = mapping.from_engine(without_vocab_keys(weights), mapping.eagle3_table(fmt))    # checked above
        if vocab_ids is not None:
            ours["draft_vocab"] = vocab_ids
        return build_and_load(where, layer, target, dcfg, ours)

    def recorded_layer_ids(self, fmt, cfg) -> Tuple[Optional[List[int]], Optional[int]]:
        if fmt == "vllm":        # vLLM ids = ours + 1
            return [int(i) - 1 for i in cfg.get("eagle_aux_hidden_state_layer_ids") or []], cfg.get("mask_token_id")
        return [int(i) for i in (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or []], None

    # -- self-check ----------------------------------------------------------------------------------------
    def compare(self, out, fmt, original, reimported, batch, target, nothing_dropped):
        """Teacher-forced step logits of the re-import vs the trained draft's, and (engine formats) the
        independent engine forward (`deepspec.export.engine_eagle3`) on the written files vs the re-import.

        Engine formats do not carry our TTT padding token, so only chain steps inside the probe are compared."""
        new = reimported.step_logits(batch)
        old = original.step_logits(batch)
        if fmt not in ENGINE_FORMATS:
            return {"reimport_max_abs_diff": max_abs_diff(old, new)}, new
        S, T = min(old.shape[1], new.shape[1]), new.shape[2]       # the engine formats carry γ, not ttt_steps
        old_s, new_s = old[:, :S], new[:, :S]
        ids = draft_ids(reimported)
        inside = (torch.arange(T).view(1, T) + torch.arange(S).view(S, 1)) <= T - 2     # x_{r+1+j} exists
        got = {"reimport_max_abs_diff": max_abs_diff(old_s[0][inside], new_s[0][inside])}
        eng = EngineEagle3.from_dir(out)

        def embed(ids):   # the engines embed draft tokens with the target's (raw) embedding table
            with torch.no_grad():
                return torch.nn.functional.embedding(ids.to(target.device), target.embed_tokens.weight).float().cpu()

        diffs = []
        for r in sorted({0, T // 2, T - 2}):
            steps = min(S, T - 1 - r)
            ref = eng.chain_logits(batch["features"][0], batch["input_ids"][0], r, steps, embed)
            diffs.append(max_abs_diff(ref, place(new_s[0, :steps, r], ids, int(target.vocab_size))))
        got["engine_max_abs_diff"] = max(diffs)
        return got, new

    # -- model card ----------------------------------------------------------------------------------------
    def title(self, fmt) -> str:
        return {"vllm": "vLLM — speculators EAGLE-3 format",
                "sglang": "SGLang — EAGLE-3 draft (LlamaForCausalLMEagle3)"}[fmt]

    def serve_command(self, fmt, out, verifier, gamma) -> Optional[str]:
        if fmt == "vllm":
            spec = json.dumps({"model": out, "method": "eagle3", "num_speculative_tokens": gamma})
            return f"vllm serve {verifier} --speculative-config '{spec}'"
        return (f"python -m sglang.launch_server --model-path {verifier} --speculative-algorithm EAGLE3 "
                f"--speculative-draft-model-path {out} --speculative-num-steps {gamma} --speculative-eagle-topk 1 "
                f"--speculative-num-draft-tokens {gamma + 1}")

    def draft_rows(self, algorithm, draft) -> List[Tuple[str, str]]:
        return [("training-time-test steps", f"{draft.get('ttt_steps')} (layout {draft.get('eagle3_layout') or 'native'})"),
                ("confidence head", "False")]

    def layer_ids_note(self, fmt, engine_config) -> Optional[str]:
        if fmt == "vllm":
            return (f"Engine layer ids: `eagle_aux_hidden_state_layer_ids = "
                    f"{engine_config.get('eagle_aux_hidden_state_layer_ids')}` (vLLM captures the input of decoder "
                    "layer k = deepspec id + 1).")
        return (f"Engine layer ids: `eagle_config.eagle_aux_hidden_state_layer_ids = "
                f"{(engine_config.get('eagle_config') or {}).get('eagle_aux_hidden_state_layer_ids')}` (layer "
                "outputs, as in deepspec; SGLang adds 1 itself).")


def _check_feature_order(target) -> None:
    ids = [int(i) for i in target.layer_ids]
    if ids != sorted(set(ids)):
        raise ExportUnsupported(f"target.layer_ids={ids} are not strictly increasing: the engines concatenate the "
                                "captured layers in layer order, so fc would read them in another order than "
                                "trained. Nothing was written.")


def llama_layer_config(drafter, target) -> Dict[str, Any]:
    """The Llama decoder-layer config of the EAGLE-3 layer (speculators ``transformer_layer_config``)."""
    cfg = layer_config(drafter, target)
    for key in ("layer_types", "use_sliding_window", "sliding_window"):
        cfg.pop(key, None)
    cfg.update(model_type="llama", mlp_bias=False, tie_word_embeddings=False)
    return cfg
