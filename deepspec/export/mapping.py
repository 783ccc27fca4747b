"""Our parameter names → the engines' weight names, in one table.

The parallel drafter (`deepspec.drafts.parallel.ParallelDrafter`, registered as "dspark"
and "dflash") is the DFlash/DSpark architecture both engines implement:

* speculators (vLLM): `DFlashDraftModel` / `DSparkDraftModel` module paths
  (`src/speculators/models/dflash/core.py`, `.../dflash/model_definitions.py`
  ``Qwen3DFlashDecoderLayer``, `.../dspark/model_definitions.py` ``MarkovHead`` /
  ``ConfidenceHead``).
* SGLang: `python/sglang/srt/models/dflash.py` ``DFlashDraftModel`` ("checkpoint provides
  layers.*, fc.weight, hidden_norm.weight, norm.weight") and `models/dspark.py`
  (``markov_head.*``, ``confidence_head.*``).  SGLang fuses q/k/v and gate/up at load
  time; the checkpoint names are the unfused HF ones below.

Both use the same names, so one table serves both formats.  ``transpose`` marks the one
tensor stored the other way round (our Markov W2 is a ``[rank, V]`` parameter used as
``e @ W2``; theirs is ``nn.Linear(rank, V).weight`` = ``[V, rank]``).

Eagle3 (engine layout, ``draft.eagle3_layout=engine``) has its own table, `eagle3_table`:
the engines' EAGLE-3 layer is ``layers.0.*`` in speculators/vLLM
(`speculators/models/eagle3/core.py` ``self.layers``; vLLM's `llama_eagle3.py` loader also
accepts ``midlayer.``) and ``midlayer.*`` in SGLang (`models/llama_eagle3.py`
``self.midlayer``; other prefixes are skipped there).  Our ``emb_norm`` / ``feat_norm`` are
that layer's ``input_layernorm`` / ``hidden_norm``.  ``lm_head.weight``, ``d2t`` and ``t2d``
come from the target and are added by `deepspec.export.eagle3`.

Not representable (no engine counterpart; the exporters' `analyze` refuses them with a reason):
``in_proj`` / ``out_proj`` (draft width ≠ target width: the engines feed the target's
embedding straight into draft layers and the draft's hidden straight into the target's
LM head) and ``conf_head.w1`` (a confidence head that owns its own token embedding
because there is no sequential head; the engines' confidence head either reads the
Markov embedding or none), and ``anchor_proj`` (the ``draft.anchor_feature`` ablation, which
adds the latest target feature to every block input; the engines' parallel drafters see
the target's features only as extra keys/values).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch


@dataclass(frozen=True)
class Rule:
    ours: str            # regex over our state_dict keys ({i} = layer index)
    engine: str          # engine key template
    transpose: bool = False
    part: str = "backbone"   # backbone | markov | rnn | confidence


# The one explicit table (ours → engine).  ``{i}`` is the draft layer index.
PARALLEL_TABLE: Tuple[Rule, ...] = (
    Rule("context.fc.weight", "fc.weight"),
    Rule("context.norm.weight", "hidden_norm.weight"),
    Rule("layers.{i}.input_norm.weight", "layers.{i}.input_layernorm.weight"),
    Rule("layers.{i}.attn.q_proj.weight", "layers.{i}.self_attn.q_proj.weight"),
    Rule("layers.{i}.attn.k_proj.weight", "layers.{i}.self_attn.k_proj.weight"),
    Rule("layers.{i}.attn.v_proj.weight", "layers.{i}.self_attn.v_proj.weight"),
    Rule("layers.{i}.attn.o_proj.weight", "layers.{i}.self_attn.o_proj.weight"),
    Rule("layers.{i}.attn.q_norm.weight", "layers.{i}.self_attn.q_norm.weight"),
    Rule("layers.{i}.attn.k_norm.weight", "layers.{i}.self_attn.k_norm.weight"),
    Rule("layers.{i}.post_attn_norm.weight", "layers.{i}.post_attention_layernorm.weight"),
    Rule("layers.{i}.mlp.gate_proj.weight", "layers.{i}.mlp.gate_proj.weight"),
    Rule("layers.{i}.mlp.up_proj.weight", "layers.{i}.mlp.up_proj.weight"),
    Rule("layers.{i}.mlp.down_proj.weight", "layers.{i}.mlp.down_proj.weight"),
    Rule("norm.weight", "norm.weight"),
    Rule("head.w1.weight", "markov_head.markov_w1.weight", part="markov"),
    Rule("head.w2", "markov_head.markov_w2.weight", transpose=True, part="markov"),
    Rule("head.cell.weight", "markov_head.joint_proj.weight", part="rnn"),
    Rule("head.cell.bias", "markov_head.joint_proj.bias", part="rnn"),
    Rule("conf_head.proj.weight", "confidence_head.proj.weight", part="confidence"),
    Rule("conf_head.proj.bias", "confidence_head.proj.bias", part="confidence"),
)

# Eagle3 engine layout (ours → engine); ``{mid}`` is the EAGLE-3 layer's prefix in that format.
EAGLE3_LAYER_PREFIX = {"vllm": "layers.0.", "sglang": "midlayer."}
_EAGLE3_RULES: Tuple[Rule, ...] = (
    Rule("fc.weight", "fc.weight"),
    Rule("emb_norm.weight", "{mid}input_layernorm.weight"),
    Rule("feat_norm.weight", "{mid}hidden_norm.weight"),
    Rule("layers.0.attn.q_proj.weight", "{mid}self_attn.q_proj.weight"),
    Rule("layers.0.attn.k_proj.weight", "{mid}self_attn.k_proj.weight"),
    Rule("layers.0.attn.v_proj.weight", "{mid}self_attn.v_proj.weight"),
    Rule("layers.0.attn.o_proj.weight", "{mid}self_attn.o_proj.weight"),
    Rule("layers.0.post_attn_norm.weight", "{mid}post_attention_layernorm.weight"),
    Rule("layers.0.mlp.gate_proj.weight", "{mid}mlp.gate_proj.weight"),
    Rule("layers.0.mlp.up_proj.weight", "{mid}mlp.up_proj.weight"),
    Rule("layers.0.mlp.down_proj.weight", "{mid}mlp.down_proj.weight"),
    Rule("norm.weight", "norm.weight"),
)


def eagle3_table(fmt: str) -> Tuple[Rule, ...]:
    """The Eagle3 (engine layout) table with ``fmt``'s layer prefix filled in."""
    mid = EAGLE3_LAYER_PREFIX[fmt]
    return tuple(Rule(r.ours, r.engine.replace("{mid}", mid)) for r in _EAGLE3_RULES)


# Our keys that have no engine counterpart, with the reason (used in error messages).
UNREPRESENTABLE = {
    r"in_proj\.weight": "an input projection (draft hidden_size != target hidden_size, or the draft.embed_proj "
                        "ablation): the engines feed the target's token embedding straight into the draft layers",
    r"out_proj\.weight": "an output projection (draft hidden_size != target hidden_size): the engines apply the "
                         "target's LM head straight to the draft's hidden state",
    r"anchor_proj\..+": "the anchor-feature ablation (draft.anchor_feature=true): the engines' drafters see the "
                        "target's features only as extra keys/values",
    r"head\.w1_proj\.weight": "a factored sequential-head embedding (draft.head_embedding=target): the engines' "
                              "Markov head reads its own token-embedding table",
    r"conf_head\.w1\.weight": "a confidence head with its own token embedding (there is no sequential head to "
                              "share one with): the engines' confidence head reads the Markov head's embedding "
                              "or the hidden state alone",
}


def _compile(template: str) -> "re.Pattern[str]":
    return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)") + "$")


_OURS = [(_compile(r.ours), r) for r in PARALLEL_TABLE]
_ENGINE = [(_compile(r.engine), r) for r in PARALLEL_TABLE]


def _match(key: str, table) -> Optional[Tuple[Rule, Optional[str]]]:
    for pat, rule in table:
        m = pat.match(key)
        if m:
            return rule, m.groupdict().get("i")
    return None


def unrepresentable(keys) -> Dict[str, str]:
    """Our keys the engines cannot hold → why."""
    out = {}
    for k in keys:
        for pat, why in UNREPRESENTABLE.items():
            if re.fullmatch(pat, k):
                out[k] = why
    return out


def _compiled(table, side: str):
    if table is PARALLEL_TABLE:
        return _OURS if side == "ours" else _ENGINE
    return [(_compile(getattr(r, side)), r) for r in table]


def to_engine(state: Dict[str, torch.Tensor], drop_parts=(), table: Tuple[Rule, ...] = PARALLEL_TABLE
              ) -> Dict[str, torch.Tensor]:
    """Rename (and transpose) our drafter weights to engine names (default: the parallel drafter's table).

    ``drop_parts`` (subset of markov/rnn/confidence) are left out; any other key the
    table does not cover raises, so a renamed parameter can never be silently lost."""
    out: Dict[str, torch.Tensor] = {}
    unknown: List[str] = []
    ours = _compiled(table, "ours")
    for key, t in state.items():
        hit = _match(key, ours)
        if hit is None:
            unknown.append(key)
            continue
        rule, i = hit
        if rule.part in drop_parts:
            continue
        name = rule.engine.replace("{i}", i) if i is not None else rule.engine
        out[name] = (t.t() if rule.transpose else t).detach().contiguous().cpu()
    if unknown:
        raise KeyError(f"no engine name for {sorted(unknown)} (deepspec.export.mapping)")
    return out


# engine keys that hold what we take from the target (checked by the importers, not loaded)
SHARED_KEYS = ("embed_tokens", "lm_head", "verifier_lm_head", "verifier_norm", "rotary_emb")


def from_engine(weights: Dict[str, torch.Tensor], table: Tuple[Rule, ...] = PARALLEL_TABLE
                ) -> Dict[str, torch.Tensor]:
    """Engine weight names → our state_dict keys (inverse of `to_engine`).

    Keys the engines keep but we take from the target (``embed_tokens``, ``lm_head`` of a
    full-vocabulary draft, ``verifier_*``) are skipped; anything else unknown raises."""
    out: Dict[str, torch.Tensor] = {}
    unknown: List[str] = []
    engine = _compiled(table, "engine")
    for key, t in weights.items():
        if key.split(".")[0] in SHARED_KEYS:
            continue
        hit = _match(key, engine)
        if hit is None:
            unknown.append(key)
            continue
        rule, i = hit
        name = rule.ours.replace("{i}", i) if i is not None else rule.ours
        out[name] = (t.t() if rule.transpose else t).contiguous()
    if unknown:
        raise KeyError(f"engine weights with no deepspec counterpart: {sorted(unknown)}")
    return out
