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

Not representable (no engine counterpart): `UNSERVABLE` lists each of our parameters the
engines have no place for with the draft setting that creates it and the one to retrain with
(``in_proj`` / ``out_proj``: ``draft.hidden_size`` or ``draft.embed_proj``; ``anchor_proj``:
``draft.anchor_feature``; ...); the exporters' `analyze` refuses such drafts naming those settings.
``head.w1_proj`` (``draft.head_embedding=target``, W1 as a map of the target embedding) is written as the
table it stands for (`deepspec.export.parallel.materialized_w1`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

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


def _width(draft: Dict) -> Tuple[str, str]:
    if draft.get("hidden_size") is not None:
        return f"draft.hidden_size={draft['hidden_size']}", "draft.hidden_size=null"
    return "draft.embed_proj=true", "draft.embed_proj=false"


def _setting(key: str, value: str, servable: str):
    return lambda draft: (f"draft.{key}={value}", f"draft.{key}={servable}")


@dataclass(frozen=True)
class Unservable:
    """Our keys (regex) that no engine holds: the draft setting that creates them, the one that avoids them, why."""
    keys: str
    option: Callable[[Dict], Tuple[str, str]]
    why: str


# What the engines cannot hold (the exporters' `analyze` refuses it, naming the option to retrain with).
UNSERVABLE: Tuple[Unservable, ...] = (
    Unservable(r"in_proj\.weight", _width, "an input projection: the engines feed the target's token embedding "
               "straight into the draft layers"),
    Unservable(r"out_proj\.weight", _width, "an output projection: the engines apply the target's LM head "
               "straight to the draft's hidden state"),
    Unservable(r"anchor_proj\..+", _setting("anchor_feature", "true", "false"),
               "the anchor-feature ablation: the engines' drafters see the target's features only as extra keys/values"),
    Unservable(r"conf_head\.w1\.weight", lambda d: ("draft.confidence_head=true with draft.sequential_head=none",
                                                   "draft.confidence_head=false"),
               "a confidence head with its own token embedding: the engines' confidence head reads the Markov "
               "head's embedding or the hidden state alone"),
)


def unservable(keys, draft: Dict) -> List[Tuple[str, str, str]]:
    """(the draft setting, the setting to retrain with, why) for each part of our keys no engine holds."""
    out: Dict[str, Tuple[str, str, str]] = {}
    for rule in UNSERVABLE:
        if any(re.fullmatch(rule.keys, k) for k in keys):
            cause, fix = rule.option(draft)
            out.setdefault(cause, (cause, fix, rule.why))
    return list(out.values())


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
