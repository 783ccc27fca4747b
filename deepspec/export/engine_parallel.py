"""An independent forward of the engines' DFlash/DSpark draft, read from an exported directory.

Written from the engines' code, not from `deepspec.drafts`: speculators
``DFlashDraftModel._backbone_forward`` / ``Qwen3DFlashAttention`` (context K/V =
``k_proj``/``v_proj`` of ``hidden_norm(fc(features))`` concatenated in front of the
block's own, q/k RMSNorm per head, rotate-half RoPE at absolute positions, block =
``[anchor, mask…]`` attending to context positions < anchor and to the whole block),
``DSparkDraftModel.forward`` (Markov bias on ``norm(hidden)``; slot k is conditioned on
the token at position anchor+k when ``sample_from_anchor``), and SGLang's
``models/dflash.py`` / ``models/dspark.py`` (same math).  A reduced draft vocabulary is
vLLM's ``Qwen3DSparkForCausalLM``: draft logits from the checkpoint's own ``lm_head.weight``
``[N, H]`` plus the Markov bias (``markov_w2`` ``[N, r]``) in draft space, placed at the target
ids ``arange(N) + d2t`` with −inf elsewhere.  SGLang's DSpark (no ``d2t``) is computed as written: the
target's LM head plus the Markov bias over every token, the draft vocabulary being one more rank of
that head (`deepspec.export.vocab_rank`).  Used to check that what we write computes what our
drafter computes, by a second implementation.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from .engine_math import rms_norm, rope


class EngineDraft:
    """The exported draft as the engine would run it (fp32, one block at a time)."""

    def __init__(self, layer: Dict, weights: Dict[str, torch.Tensor], *, block_size: int, mask_token_id: int,
                 markov_rank: int, markov_head_type: str, confidence: bool, confidence_with_markov: bool):
        self.c = layer
        self.w = {k: (v.float() if v.is_floating_point() else v) for k, v in weights.items()}
        self.block_size = int(block_size)
        self.mask_token_id = int(mask_token_id)
        self.markov_rank = int(markov_rank)
        self.markov_head_type = markov_head_type
        self.confidence = confidence
        self.confidence_with_markov = confidence_with_markov
        theta = layer.get("rope_theta")
        if theta is None:
            theta = (layer.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        self.theta = float(theta)
        self.eps = float(layer.get("rms_norm_eps", 1e-6))

    @classmethod
    def from_dir(cls, path) -> "EngineDraft":
        p = Path(path)
        cfg = json.loads((p / "config.json").read_text())
        weights = load_file(str(p / "model.safetensors"))
        if "speculators_model_type" in cfg:       # speculators (vLLM)
            layer = cfg["transformer_layer_config"]
            return cls(layer, weights, block_size=cfg["block_size"], mask_token_id=cfg["mask_token_id"],
                       markov_rank=cfg.get("markov_rank", 0), markov_head_type=cfg.get("markov_head_type", "vanilla"),
                       confidence=bool(cfg.get("enable_confidence_head")),
                       confidence_with_markov=bool(cfg.get("confidence_head_with_markov")))
        dc = cfg["dflash_config"]                   # SGLang: flat config + dflash_config
        return cls(cfg, weights, block_size=dc["block_size"], mask_token_id=dc["mask_token_id"],
                   markov_rank=cfg.get("markov_rank", 0), markov_head_type=cfg.get("markov_head_type", "vanilla"),
                   confidence=bool(cfg.get("enable_confidence_head")),
                   confidence_with_markov=bool(cfg.get("confidence_head_with_markov")))

    def _attn(self, i: int, h: torch.Tensor, ctx: torch.Tensor, pos_q: torch.Tensor, pos_kv: torch.Tensor):
        c, w, pre = self.c, self.w, f"layers.{i}.self_attn."
        nh, nkv, hd = int(c["num_attention_heads"]), int(c["num_key_value_heads"]), int(c["head_dim"])
        q = (h @ w[pre + "q_proj.weight"].t()).view(-1, nh, hd)
        kv_in = torch.cat([ctx, h], 0)
        k = (kv_in @ w[pre + "k_proj.weight"].t()).view(-1, nkv, hd)
        v = (kv_in @ w[pre + "v_proj.weight"].t()).view(-1, nkv, hd)
        q = rms_norm(q, w[pre + "q_norm.weight"], self.eps).transpose(0, 1)          # [nh, n, hd]
        k = rms_norm(k, w[pre + "k_norm.weight"], self.eps).transpose(0, 1)
        v = v.transpose(0, 1)
        q, k = rope(q, pos_q, self.theta), rope(k, pos_kv, self.theta)
        rep = nh // nkv
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        att = torch.softmax((q @ k.transpose(-1, -2)) * hd ** -0.5, -1)          # no mask: context < p + whole block
        out = (att @ v).transpose(0, 1).reshape(h.shape[0], nh * hd)
        return out @ w[pre + "o_proj.weight"].t()

    def hidden(self, features: torch.Tensor, anchor_token: int, anchor_pos: int, embed) -> torch.Tensor:
        """Normed draft hidden [γ, H] of the block anchored at ``anchor_pos`` (context = features[:anchor_pos])."""
        w, c, g = self.w, self.c, self.block_size
        ctx = rms_norm(features[:anchor_pos].float() @ w["fc.weight"].t(), w["hidden_norm.weight"], self.eps)
        ids = torch.full((g,), self.mask_token_id, dtype=torch.long)
        ids[0] = int(anchor_token)
        x = embed(ids).float()
        pos_q = torch.arange(anchor_pos, anchor_pos + g)
        pos_kv = torch.cat([torch.arange(anchor_pos), pos_q])
        for i in range(int(c["num_hidden_layers"])):
            pre = f"layers.{i}."
            x = x + self._attn(i, rms_norm(x, w[pre + "input_layernorm.weight"], self.eps), ctx, pos_q, pos_kv)
            hmlp = rms_norm(x, w[pre + "post_attention_layernorm.weight"], self.eps)
            m = F.silu(hmlp @ w[pre + "mlp.gate_proj.weight"].t()) * (hmlp @ w[pre + "mlp.up_proj.weight"].t())
            x = x + m @ w[pre + "mlp.down_proj.weight"].t()
        return rms_norm(x, w["norm.weight"], self.eps)

    def heads(self, hn: torch.Tensor, prev: torch.Tensor) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Markov bias [γ, V] and confidence logits [γ] for teacher tokens ``prev`` [γ] (x_{anchor+k})."""
        w = self.w
        bias = emb = None
        if self.markov_rank > 0:
            emb = w["markov_head.markov_w1.weight"][prev]                              # [γ, r]
            w2 = w["markov_head.markov_w2.weight"]                                     # [V, r]
            if self.markov_head_type == "vanilla":
                bias = emb @ w2.t()
            elif self.markov_head_type == "rnn":
                state = torch.zeros(self.markov_rank)
                rows = []
                for k in range(hn.shape[0]):
                    z = torch.cat([state, emb[k], hn[k]])
                    gr, cr, orr = (z @ w["markov_head.joint_proj.weight"].t()
                                   + w["markov_head.joint_proj.bias"]).chunk(3)
                    gate = torch.sigmoid(gr)
                    state = gate * state + (1 - gate) * torch.tanh(cr)
                    rows.append(torch.tanh(orr) @ w2.t())
                bias = torch.stack(rows)
            else:
                raise ValueError(f"engine forward: markov_head_type {self.markov_head_type!r} not implemented")
        conf = None
        if self.confidence:
            feats = torch.cat([hn, emb], -1) if self.confidence_with_markov else hn
            conf = feats @ w["confidence_head.proj.weight"].t().squeeze(-1) + w["confidence_head.proj.bias"]
        return bias, conf

    def block_logits(self, features: torch.Tensor, tokens: torch.Tensor, anchors: Sequence[int], embed, lm_logits
                     ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Teacher-forced logits [N, γ, V] (and confidence logits [N, γ]) of the blocks at ``anchors``."""
        outs: List[torch.Tensor] = []
        confs: List[torch.Tensor] = []
        g = self.block_size
        for p in anchors:
            hn = self.hidden(features, int(tokens[p]), int(p), embed)
            # the draft's own head when it has one (a reduced vocabulary), else the target's shared one
            logits = hn @ self.w["lm_head.weight"].t() if "lm_head.weight" in self.w else lm_logits(hn).float()
            bias, conf = self.heads(hn, tokens[p:p + g].long())
            outs.append(self.to_target(logits if bias is None else logits + bias))
            if conf is not None:
                confs.append(conf)
        return torch.stack(outs), (torch.stack(confs) if confs else None)

    def to_target(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [.., N] at target ids ``arange(N) + d2t`` of [.., vocab_size], −inf elsewhere
        (vLLM ``compute_logits``); unchanged without ``d2t``."""
        d2t = self.w.get("d2t")
        if d2t is None:
            return logits
        out = logits.new_full((*logits.shape[:-1], int(self.c["vocab_size"])), float("-inf"))
        out[..., torch.arange(d2t.numel()) + d2t.long()] = logits
        return out
