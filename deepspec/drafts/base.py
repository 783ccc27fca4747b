"""The `Drafter` base class, decoding records, and checkpoint I/O.

Shared target modules
---------------------
A drafter reads the target's token embedding (`target.embed`) and LM head
(`target.logits_from_hidden`) but never owns them: the `TargetAdapter` is kept as
a plain attribute (it is not an `nn.Module`), so the embedding and LM head are in
neither `parameters()` nor `state_dict()`, are never trained, and `.to()` on the
drafter does not move them.

Checkpoint format (`save_pretrained(dir)`)
------------------------------------------
* ``config.json``: ``architecture`` (the registered algorithm name),
  ``format_version``, ``draft`` (every `DraftConfig` field, loss weights included),
  ``mask_token_id`` (resolved), ``target`` (fingerprint, ``layer_ids``,
  ``feature_dim``, hidden/vocab size, model type), and ``shared_modules``
  naming what is referenced from the target instead of stored.
* ``model.safetensors``: the trainable weights only.  The embedding and LM head
  come from the target at load time, so a checkpoint is only meaningful with the
  same target: `from_pretrained` checks the fingerprint and refuses a different
  target unless ``allow_target_mismatch=True``; different layer ids or sizes are
  always refused (the weights would not fit).
"""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch
from torch import nn

from ..config.draft import DraftConfig, LossConfig
from ..errors import DeepSpecError

log = logging.getLogger(__name__)
FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


class DraftTargetMismatchError(DeepSpecError, ValueError):
    """A draft checkpoint was saved against a different target."""


class DraftCheckpointError(DeepSpecError, ValueError):
    """A draft checkpoint whose config.json is not JSON or whose weights are not safetensors.

    Only ``config.json`` and ``model.safetensors`` are ever read: no pickle, no ``.bin``/``.pt``."""


@dataclass
class Proposal:
    tokens: torch.Tensor                      # [γ] long: drafts for positions p+1 .. p+γ
    probs: torch.Tensor                       # [γ, V] float32: the warped q each token was sampled from
    confidence: Optional[torch.Tensor] = None  # [γ] in (0, 1), or None


@dataclass
class DraftState:
    """Decoding state: the tokens that have target features, plus per-algorithm caches."""
    tokens: torch.Tensor                      # [n] long
    cache: Dict[str, Any] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])


Warp = Callable[[torch.Tensor], torch.Tensor]


def draw(probs: torch.Tensor, warp: Warp, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """``torch.multinomial(probs, 1)``; under a greedy warp (one-hot rows) the argmax, which is the
    same token without drawing V exponentials per row."""
    if getattr(warp, "greedy", False):
        return probs.argmax(dim=-1, keepdim=True)
    return torch.multinomial(probs, 1, generator=generator)


def coerce_draft_config(cfg) -> DraftConfig:
    """A `DraftConfig` from a dataclass, an OmegaConf node or a plain dict (unknown keys dropped)."""
    if isinstance(cfg, DraftConfig):
        return dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss))
    if not isinstance(cfg, dict):
        from omegaconf import OmegaConf
        cfg = OmegaConf.to_container(cfg, resolve=True)
    d = dict(cfg)
    known = {f.name for f in dataclasses.fields(DraftConfig)}
    extra = sorted(set(d) - known)
    if extra:
        log.warning("ignoring unknown draft config keys %s", extra)
    loss = d.get("loss") or {}
    if not isinstance(loss, LossConfig):
        lknown = {f.name for f in dataclasses.fields(LossConfig)}
        loss = LossConfig(**{k: v for k, v in dict(loss).items() if k in lknown})
    d = {k: v for k, v in d.items() if k in known and k != "loss"}
    return DraftConfig(**d, loss=loss)


def resolve_mask_token_id(cfg: DraftConfig, tokenizer) -> int:
    if cfg.mask_token_id is not None:
        return int(cfg.mask_token_id)
    for name in ("pad_token_id", "unk_token_id", "eos_token_id"):
        tid = getattr(tokenizer, name, None)
        if isinstance(tid, int):
            return tid
    raise ValueError("no mask token: set draft.mask_token_id (the tokenizer has no pad/unk/eos token)")


def init_linear_weights(module: nn.Module, std: float = 0.02) -> None:
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


class Drafter(nn.Module):
    """Base of all drafters. Subclasses implement `forward`, `init_state`, `propose`, `advance`."""

    def __init__(self, target, cfg: DraftConfig):
        super().__init__()
        self.cfg = coerce_draft_config(cfg)
        self.algorithm = self.cfg.algorithm
        self.__dict__["_target"] = target   # plain reference: never a submodule, never saved
        self.vocab_size = int(target.vocab_size)
        self.target_hidden_size = int(target.hidden_size)
        self.feature_dim = int(target.feature_dim)
        self.layer_ids = list(target.layer_ids)
        self.mask_token_id = resolve_mask_token_id(self.cfg, target.tokenizer)
        self.cfg.mask_token_id = self.mask_token_id   # the effective config is what gets saved

    @property
    def target(self):
        return self.__dict__["_target"]

    @classmethod
    def from_target(cls, target, cfg) -> "Drafter":
        return cls(target, cfg).to(target.device)

    # -- shared frozen target modules -------------------------------------------------
    @property
    def param_dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Target input embeddings (frozen, no grad) in the draft's parameter dtype."""
        with torch.no_grad():
            return self.target.embed(ids.to(self.target.device)).to(self.device, self.param_dtype)

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits through the target's (frozen) LM head; gradients flow to ``hidden``.  Under
        autocast the matmul runs in the autocast dtype with a cached cast of the head."""
        dev = hidden.device.type
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        return self.target.logits_from_hidden(hidden, dtype=dt)

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]

    # -- training / decoding API -------------------------------------------------------------
    def forward(self, batch: Dict[str, torch.Tensor]) -> Dict[str, Any]:
        raise NotImplementedError

    def init_state(self, input_ids: torch.Tensor, features: torch.Tensor) -> DraftState:
        raise NotImplementedError

    def propose(self, state: DraftState, anchor: int, gamma: int, warp: Warp,
                generator: Optional[torch.Generator] = None) -> Proposal:
        raise NotImplementedError

    def advance(self, state: DraftState, tokens: torch.Tensor, features: torch.Tensor) -> DraftState:
        raise NotImplementedError

    # -- checkpoints ----------------------------------------------------------------------------
    def checkpoint_config(self) -> Dict[str, Any]:
        t = self.target
        return {
            "architecture": self.algorithm,
            "format_version": FORMAT_VERSION,
            "draft": dataclasses.asdict(self.cfg),
            "mask_token_id": self.mask_token_id,
            "target": {"fingerprint": t.fingerprint(), "layer_ids": list(self.layer_ids),
                       "feature_dim": self.feature_dim, "hidden_size": self.target_hidden_size,
                       "vocab_size": self.vocab_size,
                       "model_type": getattr(t.config, "model_type", None), "name": getattr(t, "name", None)},
            "shared_modules": {"embedding": "target.embed_tokens", "lm_head": "target.lm_head"},
        }

    def save_pretrained(self, out_dir) -> Path:
        from safetensors.torch import save_file
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / CONFIG_NAME).write_text(json.dumps(self.checkpoint_config(), indent=2, sort_keys=True))
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(tensors, str(out / WEIGHTS_NAME), metadata={"architecture": self.algorithm})
        return out

    @classmethod
    def from_pretrained(cls, in_dir, target, allow_target_mismatch: bool = False) -> "Drafter":
        from .registry import load_drafter
        drafter = load_drafter(in_dir, target, allow_target_mismatch=allow_target_mismatch)
        if not isinstance(drafter, cls):
            raise TypeError(f"{in_dir} holds a {type(drafter).__name__}, not a {cls.__name__}")
        return drafter


def check_target(saved: Dict[str, Any], target, allow_target_mismatch: bool = False, where: str = "") -> None:
    """Refuse a target that differs from the one the draft was trained against."""
    shape_keys = {"layer_ids": list(target.layer_ids), "feature_dim": int(target.feature_dim),
                  "hidden_size": int(target.hidden_size), "vocab_size": int(target.vocab_size)}
    for k, have in shape_keys.items():
        want = saved.get(k)
        if want is not None and want != have:
            hint = " (set target.layer_ids to the saved ids)" if k == "layer_ids" else ""
            raise DraftTargetMismatchError(f"draft {where}: target {k} is {have} but the draft was saved with "
                                           f"{want}{hint}")
    want_fp = saved.get("fingerprint") or {}
    have_fp = target.fingerprint()
    diff = sorted(k for k in want_fp if want_fp.get(k) != have_fp.get(k))
    if diff:
        msg = (f"draft {where} was trained against a different target ({', '.join(diff)} differ: saved "
               f"{saved.get('name')!r}, loading with {getattr(target, 'name', None)!r})")
        if not allow_target_mismatch:
            raise DraftTargetMismatchError(msg + "; pass allow_target_mismatch=True to load it anyway")
        log.warning("%s; loading anyway (allow_target_mismatch=True)", msg)
