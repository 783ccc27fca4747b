"""The `Drafter` base class, decoding records and helpers shared by the drafters.

Shared target modules
---------------------
A drafter reads the target's token embedding (`target.embed`) and LM head
(`target.logits_from_hidden`) but never owns them: the `TargetAdapter` is kept as
a plain attribute (it is not an `nn.Module`), so the embedding and LM head are in
neither `parameters()` nor `state_dict()`, are never trained, and `.to()` on the
drafter does not move them.

`save_pretrained` / `from_pretrained` write and read the checkpoint format of
`deepspec.drafts.checkpoint`.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, NamedTuple, Optional, Tuple

import torch
from safetensors.torch import save_file
from torch import nn

from ..config import ConfigError
from ..config.draft import DraftConfig
from ..targets.mask_token import choose_mask_token, target_tokens
from .checkpoint import CONFIG_NAME, FORMAT_VERSION, WEIGHTS_NAME, coerce_draft_config
from .fused_loss import autocast_dtype
from .registry import load_drafter


@dataclass
class Proposal:
    tokens: torch.Tensor                      # [γ] long: drafts for positions p+1 .. p+γ
    probs: torch.Tensor                       # [γ, V] float32: the warped q each token was sampled from
    confidence: Optional[torch.Tensor] = None  # [γ] in (0, 1), or None


class TreeExpansion(NamedTuple):
    """What a drafter gives the tree grower (`deepspec.decoding.tree.grow_tree`): ``expand(k, tokens [R],
    state) -> (logits [R, M], state)`` = the draft's logits at block position ``k + 1`` below R parent
    nodes whose tokens are ``tokens`` (at k = 0 the anchor) and the per-row state their children continue
    from; ``root_state`` the anchor's; column ``j`` of the logits is target token ``vocab[j]`` (None: ``j``)."""
    expand: Callable[[int, torch.Tensor, Any], Tuple[torch.Tensor, Any]]
    root_state: Any = None
    vocab: Optional[torch.Tensor] = None


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


def resolve_mask_token_id(cfg: DraftConfig, target) -> int:
    """``draft.mask_token_id``, else the target's token chosen by `deepspec.targets.mask_token`
    (a reserved/unused token, a spare embedding row, an unused added special token)."""
    if cfg.mask_token_id is not None:
        return int(cfg.mask_token_id)
    inventory, rows, stops = target_tokens(target)
    return choose_mask_token(inventory, rows, stops)[0]


def batch_masks(batch: Dict[str, torch.Tensor], device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``input_ids`` [B, T] of a teacher-forced batch on ``device`` with its bool attention mask
    (all ones when absent) and loss mask (the attention mask when absent, else both)."""
    ids = batch["input_ids"].to(device)
    am = batch.get("attention_mask")
    am = torch.ones_like(ids, dtype=torch.bool) if am is None else am.to(device).bool()
    lm = batch.get("loss_mask")
    lm = am if lm is None else lm.to(device).bool() & am
    return ids, am, lm


def init_linear_weights(module: nn.Module, std: float = 0.02) -> None:
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


class Drafter(nn.Module):
    """Base of all drafters. Subclasses implement `forward`, `init_state`, `propose`, `advance`."""
    drafts_trees = False     # True where `tree_expansion` is implemented (tree verification)
    # The lossless decoding `deepspec eval` runs when the user sets none (`deepspec.decoding.settings`):
    # eval keys per sampling mode ("greedy", "sampled"), chosen from measurements on the tuning prompts;
    # none = chains.
    decoding_defaults: Mapping[str, Mapping[str, Any]] = {}

    def __init__(self, target, cfg: DraftConfig):
        super().__init__()
        self.cfg = coerce_draft_config(cfg)
        self.algorithm = self.cfg.algorithm
        self.__dict__["_target"] = target   # plain reference: never a submodule, never saved
        self.vocab_size = int(target.vocab_size)
        self.target_hidden_size = int(target.hidden_size)
        self.feature_dim = int(target.feature_dim)
        self.layer_ids = list(target.layer_ids)
        self.mask_token_id = resolve_mask_token_id(self.cfg, target)
        self.cfg.mask_token_id = self.mask_token_id   # the effective config is what gets saved
        # Draft vocabulary (draft.vocab_size = N): the target ids the draft head scores, sorted; a
        # buffer, so checkpoints carry it.  Until `set_draft_vocab` it holds the first N ids.
        n = self.cfg.vocab_size
        if n is not None and not 1 <= int(n) <= self.vocab_size:
            raise ConfigError(f"draft.vocab_size={n}: must be between 1 and the target vocabulary size "
                              f"{self.vocab_size} (null = the full vocabulary)")
        self.out_vocab = int(n) if n is not None else self.vocab_size
        if n is not None:
            self.register_buffer("draft_vocab", torch.arange(int(n)), persistent=True)
        else:
            self.draft_vocab = None

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
        return self.target.logits_from_hidden(hidden, dtype=autocast_dtype(hidden))

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the draft head: the target's LM head restricted to the draft vocabulary
        (all of it without one) — [..., out_vocab]; index i is target token ``draft_vocab[i]``."""
        if self.draft_vocab is None:
            return self.lm_logits(hidden)
        return self.target.logits_from_hidden(hidden, dtype=autocast_dtype(hidden), rows=self.draft_vocab)

    def target_side(self, batch: Dict[str, torch.Tensor]):
        """(target logits function, per-token log-normaliser [B, T] or None) for the loss: with a draft
        vocabulary and the batch's ``target_lse`` (a cache column) p_S = exp(logits_S − lse) needs only
        the draft vocabulary's N target logits; otherwise the full-V logits (their softmax)."""
        lse = batch.get("target_lse")
        if self.draft_vocab is None or lse is None:
            return self.lm_logits, None
        return self.draft_logits, lse.to(self.device, torch.float32)

    def set_draft_vocab(self, ids) -> None:
        """Install a draft vocabulary (sorted target ids, as many as draft.vocab_size)."""
        if self.draft_vocab is None:
            raise ValueError("set_draft_vocab: this drafter scores the full vocabulary (draft.vocab_size=null)")
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        if ids.numel() != self.out_vocab:
            raise ValueError(f"set_draft_vocab: {ids.numel()} ids for draft.vocab_size={self.out_vocab}")
        if ids.min() < 0 or ids.max() >= self.vocab_size or bool((ids[1:] <= ids[:-1]).any()):
            raise ValueError("set_draft_vocab: ids must be strictly increasing target token ids")
        with torch.no_grad():
            self.draft_vocab.copy_(ids.to(self.draft_vocab.device))

    def target_to_draft(self) -> Optional[torch.Tensor]:
        """t2d as indices: [V] long, the draft index of each target token or -1 (None: full vocabulary)."""
        if self.draft_vocab is None:
            return None
        key = (self.draft_vocab.data_ptr(), self.draft_vocab._version, self.draft_vocab.device)
        cached = self.__dict__.get("_t2d")
        if cached is None or cached[0] != key:
            t2d = torch.full((self.vocab_size,), -1, dtype=torch.long, device=self.draft_vocab.device)
            t2d[self.draft_vocab] = torch.arange(self.out_vocab, device=t2d.device)
            cached = (key, t2d)
            self.__dict__["_t2d"] = cached
        return cached[1]

    def to_target(self, draft_ids: torch.Tensor, probs: torch.Tensor):
        """Draft-vocabulary samples and distributions [.., N] -> target ids and [.., V] (0 outside)."""
        if self.draft_vocab is None:
            return draft_ids, probs
        full = probs.new_zeros(*probs.shape[:-1], self.vocab_size)
        full[..., self.draft_vocab] = probs
        return self.draft_vocab[draft_ids], full

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

    def tree_expansion(self, state: DraftState, anchor: int, gamma: int) -> Optional[TreeExpansion]:
        """The per-depth draft logits below ``anchor`` that draft trees grow from (tree verification,
        ``eval.tree_nodes``; None = no draft nodes); drafters that draft chains only say so."""
        raise NotImplementedError(f"the {self.algorithm} drafter drafts chains only: tree verification "
                                  "(eval.tree_nodes) needs a drafter that drafts trees")

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
                       "vocab_size": self.vocab_size, "draft_vocab_size": self.out_vocab,
                       "model_type": getattr(t.config, "model_type", None), "name": getattr(t, "name", None)},
            "shared_modules": {"embedding": "target.embed_tokens", "lm_head": "target.lm_head"},
        }

    def save_pretrained(self, out_dir) -> Path:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / CONFIG_NAME).write_text(json.dumps(self.checkpoint_config(), indent=2, sort_keys=True))
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(tensors, str(out / WEIGHTS_NAME), metadata={"architecture": self.algorithm})
        return out

    @classmethod
    def from_pretrained(cls, in_dir, target, allow_target_mismatch: bool = False) -> "Drafter":
        drafter = load_drafter(in_dir, target, allow_target_mismatch=allow_target_mismatch)
        if not isinstance(drafter, cls):
            raise TypeError(f"{in_dir} holds a {type(drafter).__name__}, not a {cls.__name__}")
        return drafter

