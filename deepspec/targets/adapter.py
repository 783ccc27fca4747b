"""One generic adapter over any Hugging Face decoder (`AutoModelForCausalLM`).

Index convention (used everywhere, written into cache manifests and checkpoints):
layer id ``i`` means the output of decoder layer ``i`` (0-based), which is
``hidden_states[i + 1]`` of a transformers forward with ``output_hidden_states``.
The final post-norm hidden state (the LM head's input) is kept separately.
"""
from __future__ import annotations

import hashlib
import logging
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn
from transformers import DynamicCache

from . import recurrent
from .architecture import TargetUnsupported, architecture
from .attention import cache_kwarg, offset_causal, supported as attention_supported, tree_causal
from .chat import ChatEncoding, encode_chat

log = logging.getLogger(__name__)
INDEX_CONVENTION = "decoder_layer_output:hidden_states[i+1]"


def default_layer_ids(num_layers: int, count: int = 5) -> List[int]:
    """Evenly spaced layers from 1 to L-3 (the paper's [1, 9, 17, 25, 33] for L=36).

    Models with fewer than 8 layers (tiny test targets) span 1..L-1 instead."""
    if count <= 0:
        raise ValueError("num_feature_layers must be positive")
    if num_layers <= count:
        return list(range(num_layers))
    lo, hi = 1, (num_layers - 3 if num_layers >= 8 else num_layers - 1)
    if count == 1:
        return [hi]
    step = (hi - lo) / (count - 1)
    ids = [int(round(lo + k * step)) for k in range(count)]
    return sorted(set(min(max(i, 0), num_layers - 1) for i in ids))


@dataclass
class Capture:
    features: torch.Tensor      # [B, T, L*H]: concatenated outputs of the layer ids
    last_hidden: torch.Tensor   # [B, T, H]: final post-norm hidden state


@dataclass
class DecodeOutput:
    logits: torch.Tensor        # [B, n, V] float32
    features: torch.Tensor      # [B, n, L*H]
    last_hidden: torch.Tensor   # [B, n, H]
    past_key_values: Any


class _LayerRecorder:
    def __init__(self, layer_ids: Sequence[int]):
        self.layer_ids = list(layer_ids)
        self.outputs: Dict[int, torch.Tensor] = {}

    def hook(self, i: int):
        def fn(_module, _inputs, output):
            self.outputs[i] = output[0] if isinstance(output, (tuple, list)) else output
        return fn

    def features(self) -> torch.Tensor:
        """The configured layers' outputs concatenated, on the device of the first (a target placed over several
        devices with ``target.device_map`` leaves them where each layer ran)."""
        first = self.outputs[self.layer_ids[0]].device
        return torch.cat([self.outputs[i].to(first) for i in self.layer_ids], dim=-1)


def _check_rolling(cache) -> None:
    """A rolling sliding-window cache (transformers' ``DynamicCache(config=...)``) that already dropped
    positions cannot be cropped back exactly: refuse it (the adapter's own caches keep every position)."""
    for i, layer in enumerate(getattr(cache, "layers", ())):
        window = getattr(layer, "sliding_window", None)
        if getattr(layer, "is_sliding", False) and window and not getattr(layer, "record_past", False) \
                and layer.get_seq_length() >= window:
            raise TargetUnsupported(f"cannot roll back layer {i} of this cache: its sliding window of {window} "
                                    "already dropped older positions (decode with TargetAdapter.new_cache())")


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


class TargetAdapter:
    """A frozen target: shared embedding / LM head, feature capture, KV-cached decode."""

    def __init__(self, model, tokenizer, layer_ids: Optional[Sequence[int]] = None,
                 num_feature_layers: int = 5, name: str = "target",
                 chat_template_kwargs: Optional[Dict[str, Any]] = None):
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name
        self.config = _text_config(model.config)
        self.num_layers = int(self.config.num_hidden_layers)
        self.hidden_size = int(self.config.hidden_size)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        ids = list(layer_ids) if layer_ids else default_layer_ids(self.num_layers, num_feature_layers)
        bad = [i for i in ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"target.layer_ids {bad} out of range for a {self.num_layers}-layer model")
        self.layer_ids = ids
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.softcap = getattr(self.config, "final_logit_softcapping", None)
        # layer kinds, window, sinks, experts: what verification can do with this model (`architecture`)
        self.arch = architecture(model)
        for cfg in {id(model.config): model.config, id(self.config): self.config}.values():
            if getattr(cfg, "output_router_logits", False):     # MoE routers: only a training loss reads them
                cfg.output_router_logits = False
        self._fingerprint: Optional[Dict[str, str]] = None
        # Single-sequence decode through causal attention kernels without mask tensors
        # (`targets/attention.py`): None = on CUDA, True/False to force.
        self.fast_attention: Optional[bool] = None
        self._offset_ok: Optional[bool] = None

    # -- shared frozen modules -------------------------------------------------
    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def feature_dim(self) -> int:
        return len(self.layer_ids) * self.hidden_size

    @property
    def eos_token_ids(self) -> List[int]:
        ids = set()
        gc = getattr(self.model, "generation_config", None)
        for src in (getattr(gc, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(src, int):
                ids.add(src)
            elif src:
                ids.update(int(x) for x in src)
        return sorted(ids)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings as the decoder sees them (family scaling included)."""
        return self.embed_tokens(input_ids)

    def head_weight(self, dtype: Optional[torch.dtype] = None, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The (frozen) LM head weight, or a cached copy of its ``rows`` (a draft vocabulary) cast to
        ``dtype`` (bf16 matmuls under autocast would otherwise cast the whole [V, H] head every call).
        Cached copies are matched by the rows' values (a tensor address can be reused by another
        drafter's vocabulary once the first is freed)."""
        w = self.lm_head.weight
        if (dtype is None or dtype == w.dtype) and rows is None:
            return w
        key = (dtype, w.device, w.data_ptr(), w._version, None if rows is None else rows.numel())
        cache = self.__dict__.setdefault("_head_casts", [])
        for k, r, sub in cache:
            if k == key and (rows is None or torch.equal(r, rows.to(r.device))):
                return sub
        with torch.no_grad():
            r = None if rows is None else rows.detach().to(w.device).clone()
            sub = (w.detach() if rows is None else w.detach().index_select(0, r)).to(dtype or w.dtype)
        if len(cache) >= 4:
            cache.clear()
        cache.append((key, r, sub))
        return sub

    def logits_from_hidden(self, hidden: torch.Tensor, dtype: Optional[torch.dtype] = None,
                           rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Target logits (fp32) from final post-norm hidden states; ``dtype`` = matmul precision
        (default: the head's own); ``rows`` = only these vocabulary entries (a draft vocabulary)."""
        w = self.head_weight(dtype, rows)
        logits = torch.nn.functional.linear(hidden.to(w.dtype), w).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def log_normalizer(self, hidden: torch.Tensor, logits_per_chunk: int = 1 << 22) -> torch.Tensor:
        """logsumexp over the whole vocabulary of the fp32 logits of ``hidden`` [..., H] -> [...] fp32,
        a chunk of rows at a time (never a [rows x V] tensor larger than ``logits_per_chunk``).  With
        it p_v = exp(logit_v - lse) needs only the logits of the tokens of interest (a draft vocabulary)."""
        with torch.no_grad():
            flat = hidden.reshape(-1, hidden.shape[-1])
            step = max(1, int(logits_per_chunk) // max(1, self.vocab_size))
            out = [torch.logsumexp(self.logits_from_hidden(flat[i:i + step].float(), dtype=torch.float32), dim=-1)
                   for i in range(0, flat.shape[0], step)]
            lse = torch.cat(out) if out else flat.new_zeros(0, dtype=torch.float32)
        return lse.reshape(hidden.shape[:-1])

    # -- forward passes ----------------------------------------------------------
    @property
    def decoder(self) -> nn.Module:
        return self.model.get_decoder()

    @property
    def layers(self) -> nn.ModuleList:
        return self.decoder.layers

    @contextmanager
    def _record_layers(self):
        """Record the outputs of the configured decoder layers with forward hooks."""
        rec = _LayerRecorder(self.layer_ids)
        handles = [self.layers[i].register_forward_hook(rec.hook(i)) for i in sorted(set(self.layer_ids))]
        try:
            yield rec
        finally:
            for h in handles:
                h.remove()

    @torch.inference_mode()
    def capture(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> Capture:
        """One forward: features of the configured layers + final post-norm state."""
        am = None if attention_mask is None else attention_mask.to(self.device)
        with self._record_layers() as rec:
            out = self.decoder(input_ids=input_ids.to(self.device), attention_mask=am, use_cache=False)
        return Capture(features=rec.features(), last_hidden=out.last_hidden_state)

    @torch.inference_mode()
    def decode(self, input_ids: torch.Tensor, past_key_values=None,
               attention_mask: Optional[torch.Tensor] = None,
               position_ids: Optional[torch.Tensor] = None) -> DecodeOutput:
        """KV-cached forward over new tokens; returns logits, features and the cache.  A 4-D
        ``attention_mask`` with its ``position_ids`` verifies a draft tree (`deepspec.decoding.tree_mask`)."""
        if past_key_values is None:
            past_key_values = self.new_cache()
        kw = {self._cache_kwarg: past_key_values}
        if position_ids is not None:
            kw["position_ids"] = position_ids.to(self.device)
        one = input_ids.shape[0] == 1 and self._use_offset_causal()
        if one and attention_mask is None:
            ctx = offset_causal(self.model)
        elif one and isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:   # a draft tree
            ctx = tree_causal(self.model)
        else:
            ctx = nullcontext()
        rec_state = recurrent.is_recurrent(past_key_values)
        if self.arch.recurrent and not rec_state:
            raise TargetUnsupported(f"target {self.name}: its recurrent layers need a cache from "
                                    "TargetAdapter.new_cache() (one that records their states)")
        if rec_state:
            recurrent.before_forward(past_key_values, int(input_ids.shape[1]))
        with self._record_layers() as rec, ctx:
            out = self.decoder(input_ids=input_ids.to(self.device), attention_mask=attention_mask,
                               use_cache=True, **kw)
        if rec_state:
            recurrent.after_forward(past_key_values)
        last = out.last_hidden_state
        return DecodeOutput(logits=self.logits_from_hidden(last), features=rec.features(),
                            last_hidden=last, past_key_values=past_key_values)

    def _use_offset_causal(self) -> bool:
        """`fast_attention`: None = wherever the model supports it (`targets/attention.py`)."""
        if self.fast_attention is False:
            return False
        if self._offset_ok is None:
            self._offset_ok = attention_supported(self.model)
            if not self._offset_ok:
                log.info("target %s: stock attention for decoding (sliding window, soft-cap or not sdpa)", self.name)
        return self._offset_ok

    def new_cache(self):
        """A KV cache that can roll back: attention layers keep every position (sliding-window layers
        included; the window is in the mask), recurrent layers record per-token states (`recurrent`)."""
        if self.arch.recurrent:
            return recurrent.new_cache(self.model.config, self.arch.layer_types)
        return DynamicCache()

    @staticmethod
    def cache_length(cache) -> int:
        return int(cache.get_seq_length())

    @staticmethod
    def rollback(cache, length: int) -> None:
        """Truncate a KV cache to its first ``length`` positions (rejected draft tokens)."""
        if recurrent.is_recurrent(cache):
            return recurrent.rollback(cache, length)
        cur = int(cache.get_seq_length())
        if length > cur or length < 0:
            raise ValueError(f"cannot roll a cache of {cur} positions back to {length}")
        if length < cur:
            _check_rolling(cache)
            cache.crop(length - cur)

    @staticmethod
    @torch.inference_mode()
    def keep_positions(cache, start: int, keep: torch.Tensor) -> None:
        """Keep the cache's first ``start`` positions and then positions ``start + keep`` (ascending):
        the verified path of a draft tree; the other tree nodes are dropped."""
        if recurrent.is_recurrent(cache):
            raise TargetUnsupported("keep_positions: a cache with recurrent layers keeps one sequence, not a tree")
        keep = torch.as_tensor(keep, dtype=torch.long).reshape(-1)
        cur = int(cache.get_seq_length())
        if keep.numel() and (int(keep.min()) < 0 or start + int(keep.max()) >= cur):
            raise ValueError(f"keep_positions: positions {start}+{keep.tolist()} outside a cache of {cur}")
        if keep.numel() and bool((keep[1:] <= keep[:-1]).any()):
            raise ValueError(f"keep_positions: {keep.tolist()} must be strictly increasing")
        # rows already in place (a prefix: keep is increasing) stay; only the rest are copied
        j0 = int((keep != torch.arange(keep.numel(), device=keep.device)).int().argmax()) if keep.numel() else 0
        if keep.numel() and int(keep[j0]) != j0:
            for layer in cache.layers:          # transformers ≥ 4.56: one object per layer with keys/values
                for name in ("keys", "values"):
                    t = getattr(layer, name)
                    t[:, :, start + j0:start + keep.numel()] = t[:, :, start + keep[j0:].to(t.device)]
        TargetAdapter.rollback(cache, start + keep.numel())

    @property
    def _cache_kwarg(self) -> str:
        if not hasattr(self, "_cache_kw"):
            self._cache_kw = cache_kwarg(self.decoder.forward)
        return self._cache_kw

    # -- chat ----------------------------------------------------------------------
    def encode_chat(self, messages: List[Dict[str, str]], add_generation_prompt: bool = False,
                    **template_kwargs) -> ChatEncoding:
        kw = {**self.chat_template_kwargs, **template_kwargs}
        return encode_chat(self.tokenizer, messages, add_generation_prompt=add_generation_prompt, **kw)

    # -- identity -------------------------------------------------------------------
    def fingerprint(self) -> Dict[str, str]:
        """Hashes that tie caches and drafts to this exact target and tokenizer."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            for name, t in sorted(self.model.state_dict().items()):
                h.update(name.encode())
                h.update(str(tuple(t.shape)).encode())
                # sample the tensor to keep hashing fast on big models
                flat = t.detach().reshape(-1)
                n = min(flat.numel(), 4096)
                idx = torch.arange(n, dtype=torch.int64) * (flat.numel() - 1) // max(n - 1, 1)
                h.update(flat[idx].float().cpu().numpy().tobytes())
            vocab = self.tokenizer.get_vocab()
            tok = hashlib.sha256(repr(sorted(vocab.items())).encode()).hexdigest()
            tmpl = hashlib.sha256((self.tokenizer.chat_template or "").encode()).hexdigest()
            self._fingerprint = {"weights_sha256": h.hexdigest(), "tokenizer_sha256": tok,
                                 "chat_template_sha256": tmpl}
        return dict(self._fingerprint)

    def describe(self) -> Dict[str, Any]:
        return {"name": self.name, "model_type": self.config.model_type, "num_layers": self.num_layers,
                "hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
                "layer_ids": list(self.layer_ids), "index_convention": INDEX_CONVENTION,
                "architecture": self.arch.describe(), **self.fingerprint()}
