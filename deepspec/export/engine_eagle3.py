"""An independent forward of the engines' EAGLE-3 draft, read from an exported directory.

Written from the engines' code, not from `deepspec.drafts`: vLLM
``llama_eagle3.py`` ``LlamaDecoderLayer.forward`` for layer 0 (``input_layernorm`` on the
token embeddings, ``hidden_norm`` on the hidden state whose *un-normed* value is the
residual when ``norm_before_residual`` is false, q/k/v over the 2·hidden concatenation, no
q/k norm, rotate-half RoPE, fused add + ``post_attention_layernorm``, SwiGLU MLP, final
``norm`` returning the normed state for the logits and the pre-norm one for the next step),
``Eagle3LlamaForCausalLM.compute_logits`` (draft logits placed at target ids
``arange(draft_vocab) + d2t``, −inf elsewhere) and ``combine_hidden_states`` (``fc`` over the
3 captured layers); SGLang's ``models/llama_eagle3.py`` computes the same.  The chain is
the proposer's: one pass over the prompt (entry i = fc(features of x_i) with the embedding
of x_{i+1}, at position i, causal), then each draft step feeds the previous step's
pre-norm output with the next token at the next position, attending to everything before.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from .engine_math import rms_norm, rope


class EngineEagle3:
    """The exported EAGLE-3 draft as the engines run it (fp32, one request)."""

    def __init__(self, layer: Dict, weights: Dict[str, torch.Tensor], prefix: str):
        self.c = layer
        self.w = {k: (v.float() if v.is_floating_point() else v) for k, v in weights.items()}
        self.mid = prefix
        theta = layer.get("rope_theta")
        self.theta = float(theta if theta is not None else (layer.get("rope_parameters") or {}).get("rope_theta"))
        self.eps = float(layer["rms_norm_eps"])

    @classmethod
    def from_dir(cls, path) -> "EngineEagle3":
        p = Path(path)
        cfg = json.loads((p / "config.json").read_text())
        weights = load_file(str(p / "model.safetensors"))
        if "speculators_model_type" in cfg:         # speculators (vLLM): layers.0.* (vLLM also maps midlayer.*)
            return cls(cfg["transformer_layer_config"], weights, "layers.0.")
        return cls(cfg, weights, "midlayer.")        # SGLang: flat config, midlayer.*

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return rms_norm(x, self.w[name], self.eps)

    def layer(self, emb: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor,
              cache: Optional[Tuple[torch.Tensor, torch.Tensor]] = None):
        """New entries (emb, hidden [n, H] at positions pos) after ``cache`` → (pre-norm out [n, H], new cache)."""
        w, m, c = self.w, self.mid, self.c
        nh, nkv, hd = int(c["num_attention_heads"]), int(c["num_key_value_heads"]), int(c["head_dim"])
        n = emb.shape[0]
        x = torch.cat([self._norm(emb, m + "input_layernorm.weight"), self._norm(hidden, m + "hidden_norm.weight")], -1)
        q = (x @ w[m + "self_attn.q_proj.weight"].t()).view(n, nh, hd).transpose(0, 1)
        k = (x @ w[m + "self_attn.k_proj.weight"].t()).view(n, nkv, hd).transpose(0, 1)
        v = (x @ w[m + "self_attn.v_proj.weight"].t()).view(n, nkv, hd).transpose(0, 1)
        q, k = rope(q, pos, self.theta), rope(k, pos, self.theta)
        if cache is not None:
            k, v = torch.cat([cache[0], k], 1), torch.cat([cache[1], v], 1)
        past = k.shape[1] - n
        rep = nh // nkv
        scores = (q @ k.repeat_interleave(rep, 0).transpose(-1, -2)) * hd ** -0.5       # [nh, n, past + n]
        allowed = torch.ones(n, past + n, dtype=torch.bool)
        allowed[:, past:] = torch.tril(allowed[:, past:])
        att = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
        out = (att @ v.repeat_interleave(rep, 0)).transpose(0, 1).reshape(n, nh * hd)
        h = hidden + out @ w[m + "self_attn.o_proj.weight"].t()                           # residual = un-normed hidden
        hm = self._norm(h, m + "post_attention_layernorm.weight")
        mlp = F.silu(hm @ w[m + "mlp.gate_proj.weight"].t()) * (hm @ w[m + "mlp.up_proj.weight"].t())
        return h + mlp @ w[m + "mlp.down_proj.weight"].t(), (k, v)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Target-vocabulary logits [n, V] of pre-norm outputs h [n, H] (draft ids mapped through d2t)."""
        draft = self._norm(h, "norm.weight") @ self.w["lm_head.weight"].t()
        vocab = int(self.c["vocab_size"])
        ids = torch.arange(draft.shape[-1]) + self.w.get("d2t", torch.zeros(draft.shape[-1], dtype=torch.long))
        out = draft.new_full((draft.shape[0], vocab), float("-inf"))
        out[:, ids] = draft
        return out

    def chain_logits(self, features: torch.Tensor, tokens: torch.Tensor, root: int, steps: int,
                     embed: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """[steps, V]: the draft chain after the prompt x_0..x_{root+1}; step j reads x_{root+1+j} and
        predicts x_{root+2+j} (features: the 3 captured layers of x_0..x_root, concatenated)."""
        hidden = features[:root + 1].float() @ self.w["fc.weight"].t()
        h, cache = self.layer(embed(tokens[1:root + 2]).float(), hidden, torch.arange(root + 1))
        prev, outs = h[-1:], [self.logits(h[-1:])]
        for j in range(1, steps):
            tok = tokens[root + 1 + j:root + 2 + j]
            prev, cache = self.layer(embed(tok).float(), prev, torch.tensor([root + j]), cache)
            outs.append(self.logits(prev))
        return torch.cat(outs)
