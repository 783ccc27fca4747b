"""The parallel block drafter: DFlash, and DSpark = DFlash + sequential/confidence heads.

One class, one code path.  "dspark" builds it with the configured heads;
"dflash" is registered as the same class with both heads forced off.  Loss
weights always come from ``cfg.loss`` (conf/draft/dflash.yaml sets DFlash's CE 1.0,
L1 0; the dataclass defaults are DSpark's CE 0.1, L1 0.9, confidence 1.0).

Backbone
    ``H_ctx = RMSNorm(Linear(features))``; each draft layer attends to
    ``[K/V of H_ctx ; K/V of the block]`` (context injected as extra keys/values).
    A block anchored at p has input ``[x_p, MASK × (γ−1)]`` (frozen target
    embedding), RoPE positions p..p+γ−1 (context at its absolute positions), sees
    context positions < p and its whole block (bidirectional), never later context
    nor other blocks.  With ``draft.anchor_feature`` (an ablation, off by default) every
    block input also gets ``RMSNorm(Linear(features[p-1]))`` added, the latest target
    feature fed straight in as Eagle3 does.  γ inputs -> γ hidden states -> draft final norm -> target
    LM head = base logits ``U_k`` predicting x_{p+k}, k = 1..γ.

Training (`forward`)
    All anchors of a batch (``batch["anchors"]``, -1 = padding) are run at once,
    in chunks of anchors (``cfg.loss.chunk_size`` anchors over the batch, so
    ``chunk_size // B`` anchor columns per chunk): queries = chunk blocks, keys =
    ``[context ; chunk blocks]`` with a mask (blocks never see each other, so
    chunking is exact).  The loss goes through `fused_loss` (LM head, softmaxes and their
    gradients a chunk of rows at a time, no recomputation).
    As in the reference, a block counts when its anchor and first target are answer
    tokens (p >= 0, p+1 < length, loss_mask[p] and loss_mask[p+1]); position k is
    supervised while x_{p+1..p+k} all lie inside the sequence and the answer (a block
    cut by the end of the answer is trained as a prefix).  Metric ``blocks`` counts
    the valid blocks.  The distance term is the reference's L1 = Σ|q − p| (= 2·TV).

Decoding
    `init_state` projects the prompt's context K/V for every layer and caches it;
    `advance` projects only the new positions.  `propose` runs one parallel pass
    of a γ_train block at the anchor (a shorter ``gamma`` keeps the first
    positions of the trained block size), then samples left to right: DFlash from
    ``warp(U_k)``; DSpark from ``warp(U_k + bias(x_{<k}))`` with the token just
    sampled fed to the head, confidence from the confidence head.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .base import DraftState, Drafter, Proposal, TreeExpansion, batch_masks, draw, init_linear_weights
from .context import ContextProjector, append_kv, context_kv
from .heads import ConfidenceHead, build_sequential_head
from .layers import KV, DraftDims, DraftLayer, RMSNorm
from .fused_loss import fused_logit_loss
from .losses import STAT_ROWS, metrics_from_stats, position_weights, stat_sums
from .registry import register_drafter


def _gather_pos(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, T, ...] gathered at idx [B, ...] along T (idx clamped to range)."""
    B, T = x.shape[:2]
    flat = idx.clamp(0, T - 1).reshape(B, -1)
    if x.dim() == 2:
        return x.gather(1, flat).reshape(idx.shape)
    out = x.gather(1, flat.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
    return out.reshape(*idx.shape, x.shape[-1])


@register_drafter("dspark")
@register_drafter("dflash", sequential_head="none", confidence_head=False)
class ParallelDrafter(Drafter):
    drafts_trees = True
    # `deepspec eval`'s default decoding (eval.decoding=auto).  Greedy: the shipped DSpark on the 48 tuning
    # prompts (bench/decoding_table.py --write-tune-prompts), bf16 target, one thread, 2026-12-07: a 6-node
    # tree of width 3 with prompt lookup n ≤ 3 (1.43× over plain; 16 × 8, the earlier default, 1.24×: each
    # node is one more verification row and, for DSpark, one more row of its sequential head); on the 120
    # eval prompts τ 2.08 at 1.46× (bench/results/decoding_table-t120_dspark_greedy.md).  Sampled (T = 1, the
    # same prompts and day): the same 6 × 3 tree with lookup (1.11× over plain sampling; 16 × 4, the earlier
    # default, 0.93×; bench/results/decoding_table-t120_dspark_sampled.md).
    decoding_defaults = {mode: {"tree_nodes": 6, "tree_width": 3, "lookup_ngram": 3} for mode in ("greedy", "sampled")}

    def __init__(self, target, cfg):
        super().__init__(target, cfg)
        cfg = self.cfg
        if cfg.gamma < 1 or cfg.num_layers < 1:
            raise ValueError(f"draft.gamma and draft.num_layers must be >= 1 (got {cfg.gamma}, {cfg.num_layers})")
        self.dims = dims = DraftDims.from_target(target.config, cfg)
        D, Ht = dims.hidden_size, self.target_hidden_size
        self.context = ContextProjector(self.feature_dim, D, dims.rms_eps)
        self.in_proj = nn.Linear(Ht, D, bias=False) if D != Ht or cfg.embed_proj else None
        self.anchor_proj = (ContextProjector(self.feature_dim, D, dims.rms_eps)
                            if cfg.anchor_feature else None)
        self.layers = nn.ModuleList(DraftLayer(dims) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(D, dims.rms_eps)
        self.out_proj = nn.Linear(D, Ht, bias=False) if D != Ht else None
        init_linear_weights(self)
        if cfg.head_embedding not in ("table", "target"):
            raise ValueError(f"draft.head_embedding={cfg.head_embedding!r}: choose table or target")
        factored = cfg.head_embedding == "target"
        self.head = build_sequential_head(cfg.sequential_head, self.vocab_size, D, cfg.head_rank, self.out_vocab,
                                          token_embed=self.embed if factored else None,
                                          embed_dim=Ht if factored else None)
        self.conf_head = None
        if cfg.confidence_head:
            self.conf_head = ConfidenceHead(D, cfg.head_rank, None if self.head is not None else self.vocab_size)

    # -- backbone -------------------------------------------------------------------------
    def _context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> List[KV]:
        return context_kv(self.layers, self.context(features), positions)

    def _backbone(self, anchor_tokens: torch.Tensor, anchor_pos: torch.Tensor, ctx_kv: List[KV],
                  mask: Optional[torch.Tensor], anchor_feat: Optional[torch.Tensor] = None) -> torch.Tensor:
        """anchor_tokens/pos [B, C] -> normed hidden [B, C, γ, D] of blocks [x_p, MASK...].
        ``anchor_feat`` [B, C, D] (anchor-feature ablation) is added to all γ inputs of each block."""
        B, C = anchor_tokens.shape
        g = self.cfg.gamma
        ids = anchor_tokens.new_full((B, C, g), self.mask_token_id)
        ids[..., 0] = anchor_tokens
        x = self.embed(ids.reshape(B, C * g))
        if self.in_proj is not None:
            x = self.in_proj(x)
        if anchor_feat is not None:
            x = (x.reshape(B, C, g, -1) + anchor_feat.unsqueeze(2).to(x.dtype)).reshape(B, C * g, -1)
        pos = (anchor_pos.clamp(min=0).unsqueeze(-1) + torch.arange(g, device=x.device)).reshape(B, C * g)
        for layer, kv in zip(self.layers, ctx_kv):
            x, _ = layer(x, pos, prefix=kv, mask=mask)
        return self.norm(x).reshape(B, C, g, -1)

    def _block_mask(self, anchors: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
        """Bool [B, 1, C·γ, T + C·γ]: block c sees context t < p_c (valid) and its own block only."""
        B, C = anchors.shape
        g, T = self.cfg.gamma, key_valid.shape[1]
        t = torch.arange(T, device=anchors.device)
        ctx = (t.view(1, 1, T) < anchors.unsqueeze(-1)) & key_valid.unsqueeze(1)       # [B, C, T]
        ctx = ctx.unsqueeze(2).expand(B, C, g, T).reshape(B, C * g, T)
        blk_id = torch.arange(C, device=anchors.device).repeat_interleave(g)
        own = (blk_id.unsqueeze(1) == blk_id.unsqueeze(0)).expand(B, -1, -1)            # [B, Cγ, Cγ]
        return torch.cat([ctx, own], dim=-1).unsqueeze(1)

    def _logits(self, hn: torch.Tensor, prev: torch.Tensor):
        """Normed hidden [..., γ, D] + teacher tokens x_{k-1} [..., γ] -> (logits [..., γ, V] fp32, conf logits)."""
        lead = hn.shape[:-2]
        h2 = hn.reshape(-1, *hn.shape[-2:])
        p2 = prev.reshape(-1, prev.shape[-1])
        base = self._head_logits(h2)
        e = None
        if self.head is not None:
            bias, e = self.head(h2, p2)
            base = base + bias.float()
        conf = self.conf_head(h2, e, p2) if self.conf_head is not None else None
        return base.reshape(*lead, *base.shape[-2:]), (None if conf is None else conf.reshape(*lead, -1))

    # -- training -----------------------------------------------------------------------------
    def _prepare(self, batch: Dict[str, torch.Tensor]) -> SimpleNamespace:
        """Everything a training/teacher-forced pass needs, gathered per anchor (k = 1..γ):
        tokens x_{p+k}, teacher inputs x_{p+k-1}, target hidden last_hidden[p+k-1], and
        ``valid_pos`` [B, N, γ]: position k is supervised (a prefix of each block; ``valid`` =
        its first position)."""
        dev = self.device
        ids, am, lm = batch_masks(batch, dev)
        B, T = ids.shape
        anchors = batch["anchors"].to(dev).long()
        g = self.cfg.gamma
        span = anchors.unsqueeze(-1) + torch.arange(g + 1, device=dev)                 # p .. p+γ
        lengths = am.sum(1).view(B, 1, 1)
        ok = (anchors >= 0).unsqueeze(-1) & (span < lengths) & _gather_pos(lm, span)    # [B, N, γ+1]
        valid_pos = ok[..., :1] & torch.cumprod(ok[..., 1:].int(), dim=-1).bool()      # prefix of k = 1..γ
        pos_prev = span[..., :g]                                                        # p+k-1 for k=1..γ
        feats = batch["features"].to(dev)
        target_fn, lse = self.target_side(batch)
        return SimpleNamespace(
            ids=ids, am=am, anchors=anchors, valid=valid_pos[..., 0], valid_pos=valid_pos,
            ctx_kv=self._context_kv(feats, torch.arange(T, device=dev).expand(B, T)),
            tokens=_gather_pos(ids, pos_prev + 1), prev=_gather_pos(ids, pos_prev),
            tgt_hidden=_gather_pos(batch["last_hidden"].to(dev), pos_prev),
            target_fn=target_fn, tgt_lse=None if lse is None else _gather_pos(lse, pos_prev),
            anchor_feat=self._anchor_feat(feats, anchors))

    def _anchor_feat(self, features: torch.Tensor, anchors: torch.Tensor) -> Optional[torch.Tensor]:
        """Anchor-feature ablation: projected features[p-1] per anchor [B, C, D] (zero where p = 0)."""
        if self.anchor_proj is None:
            return None
        h = self.anchor_proj(_gather_pos(features, anchors - 1))
        return h * (anchors > 0).unsqueeze(-1).to(h.dtype)

    def _head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Base logits U_k of normed hidden states (draft out-projection, then the target's LM head)."""
        return self.draft_logits(self.out_proj(h) if self.out_proj is not None else h)

    def _chunk_loss(self, hn, tgt_hidden, tokens, prev, valid_pos, target_fn, tgt_lse):
        """Loss numerator and per-position stats of one anchor chunk: 0.1·CE + 0.9·L1 (L1 = Σ|q − p| =
        2·TV) through the fused logits loss (its soft-CE coefficient 0: that term is Eagle3's), plus
        1.0·BCE(c_k, 1 − TV_k), each weighted by w_k."""
        lc = self.cfg.loss
        D, g = hn.shape[-1], hn.shape[-2]
        h2, p2 = hn.reshape(-1, g, D), prev.reshape(-1, g)
        wv = (position_weights(g, lc.position_decay, hn.device) * valid_pos).reshape(-1).float()
        coef = torch.stack([lc.ce_weight * wv, lc.l1_weight * wv, torch.zeros_like(wv)], -1)
        u = e = None
        if self.head is not None:
            u, e = self.head.low_rank(h2, p2)
        num, terms = fused_logit_loss(
            h2.reshape(-1, D), tgt_hidden.reshape(-1, tgt_hidden.shape[-1]), tokens.reshape(-1), coef,
            self._head_logits, target_fn, u=None if u is None else u.reshape(-1, u.shape[-1]),
            w2=None if u is None else self.head.w2, vocab=self.vocab_size,
            draft_vocab=self.draft_vocab, t2d=self.target_to_draft(),
            target_lse=None if tgt_lse is None else tgt_lse.reshape(-1),
            params=[] if self.out_proj is None else list(self.out_proj.parameters()))
        terms = {k: v.reshape(valid_pos.shape) for k, v in terms.items()}
        if self.conf_head is not None:  # always in the graph (weight 0 included): no unused parameters under DDP
            conf = self.conf_head(h2, e, p2).reshape(valid_pos.shape)
            terms["bce"] = F.binary_cross_entropy_with_logits(conf.float(), 1 - terms["tv"], reduction="none")
            num = num + lc.conf_weight * (terms["bce"] * wv.view(valid_pos.shape)).sum()
        return num, stat_sums(terms, valid_pos)

    def forward(self, batch: Dict[str, torch.Tensor]) -> Dict[str, object]:
        b = self._prepare(batch)
        B, N = b.anchors.shape
        g = self.cfg.gamma
        w = position_weights(g, self.cfg.loss.position_decay, b.ids.device)
        denom = (b.valid_pos * w).sum().clamp(min=1e-8)
        step = max(1, self.cfg.loss.chunk_size // max(B, 1)) if self.cfg.loss.chunk_size > 0 else N
        total, stats = None, None
        for s in range(0, N, step):
            a, sl = b.anchors[:, s:s + step], slice(s, s + step)
            af = None if b.anchor_feat is None else b.anchor_feat[:, sl]
            hn = self._backbone(_gather_pos(b.ids, a), a, b.ctx_kv, self._block_mask(a, b.am), af)
            num, st = self._chunk_loss(hn, b.tgt_hidden[:, sl], b.tokens[:, sl], b.prev[:, sl],
                                       b.valid_pos[:, sl], b.target_fn, None if b.tgt_lse is None else b.tgt_lse[:, sl])
            total = num if total is None else total + num
            stats = st if stats is None else stats + st
        if total is None:  # no anchor columns at all
            total = sum(p.sum() for p in self.parameters()) * 0.0
            stats = torch.zeros(len(STAT_ROWS), g, device=b.ids.device)
        metrics = metrics_from_stats(stats)
        metrics["blocks"] = float(b.valid.sum())
        loss = total / denom
        metrics["loss"] = float(loss.detach())
        return {"loss": loss, "metrics": metrics}

    @torch.no_grad()
    def block_logits(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Teacher-forced pass over all anchors at once (no chunking), as in training:
        logits [B, N, γ, V] (fp32), confidence logits [B, N, γ] or None, the tokens they
        predict [B, N, γ], the target's hidden state for each [B, N, γ, H], valid blocks [B, N] and
        supervised positions ``valid_pos`` [B, N, γ]."""
        b = self._prepare(batch)
        hn = self._backbone(_gather_pos(b.ids, b.anchors), b.anchors, b.ctx_kv, self._block_mask(b.anchors, b.am),
                            b.anchor_feat)
        logits, conf = self._logits(hn, b.prev)
        return {"logits": logits, "confidence": conf, "tokens": b.tokens, "target_hidden": b.tgt_hidden,
                "valid": b.valid, "valid_pos": b.valid_pos}

    # -- decoding -------------------------------------------------------------------------------
    @torch.no_grad()
    def init_state(self, input_ids: torch.Tensor, features: torch.Tensor) -> DraftState:
        state = DraftState(tokens=input_ids.new_zeros(0).to(self.device), cache={"ctx_kv": []})
        return self.advance(state, input_ids, features)

    @torch.no_grad()
    def advance(self, state: DraftState, tokens: torch.Tensor, features: torch.Tensor) -> DraftState:
        tokens = tokens.to(self.device).long().reshape(-1)
        if features.shape[0] != tokens.shape[0]:
            raise ValueError(f"advance: {tokens.shape[0]} tokens but {features.shape[0]} feature rows")
        if tokens.numel():
            L = state.length
            pos = torch.arange(L, L + tokens.shape[0], device=self.device).unsqueeze(0)
            new = self._context_kv(features.to(self.device).unsqueeze(0), pos)
            state.cache["ctx_kv"] = append_kv(state.cache["ctx_kv"], new)
            if self.anchor_proj is not None:   # the latest feature row, for the next block's anchor_feat
                state.cache["last_feature"] = features[-1:].to(self.device)
            state.tokens = torch.cat([state.tokens, tokens])
        return state

    def _block(self, state: DraftState, anchor: int, gamma: int):
        """One block pass after ``state``: (anchor id [1, 1], h_1..h_γ [γ, D], base logits [γ, N])."""
        if not 1 <= gamma <= self.cfg.gamma:
            raise ValueError(f"propose: gamma={gamma} outside 1..{self.cfg.gamma} (the trained block size)")
        dev = self.device
        # non_blocking: a small host → device copy without waiting for the queued GPU work
        p = torch.tensor([[state.length]]).to(dev, non_blocking=True)
        a = torch.tensor([[int(anchor)]]).to(dev, non_blocking=True)
        ctx = state.cache["ctx_kv"] or None
        if ctx is None:  # empty prompt: no context keys
            ctx = [None] * len(self.layers)
        af = None
        if self.anchor_proj is not None and "last_feature" in state.cache:   # no context (empty prompt): none
            af = self.anchor_proj(state.cache["last_feature"]).unsqueeze(0)   # [1, 1, D]
        hn = self._backbone(a, p, ctx, None, af)[0, 0, :gamma]                         # [γ, D]
        return a, hn, self._head_logits(hn)                                             # [γ, N]

    @torch.no_grad()
    def tree_expansion(self, state: DraftState, anchor: int, gamma: int) -> TreeExpansion:
        """Draft trees (`deepspec.decoding.tree`): one block pass gives every position's base logits;
        the sequential head, when there is one, conditions each node's children on the node's token."""
        _, hn, base = self._block(state, anchor, gamma)
        head = self.head

        def expand(k, tokens, hstate):
            rows = tokens.shape[0]
            logits = base[k:k + 1].expand(rows, -1)
            if head is not None:
                bias, hstate = head.step(hstate, hn[k:k + 1].expand(rows, -1), head.embed(tokens.to(hn.device)))
                logits = logits + bias.float()
            return logits, hstate

        root = head.init_state(1, hn) if head is not None else None
        return TreeExpansion(expand, root, self.draft_vocab)

    @torch.no_grad()
    def propose(self, state: DraftState, anchor: int, gamma: int, warp, generator=None) -> Proposal:
        a, hn, base = self._block(state, anchor, gamma)
        if self.head is None and self.conf_head is None:
            probs = warp(base).float()
            toks, probs = self.to_target(draw(probs, warp, generator).squeeze(-1), probs)
            return Proposal(tokens=toks, probs=probs, confidence=None)
        toks, probs, confs = [], [], []
        prev = a.reshape(1)
        hstate = self.head.init_state(1, hn) if self.head is not None else None
        for k in range(gamma):
            logits, e = base[k:k + 1], None
            if self.head is not None:
                e = self.head.embed(prev)
                bias, hstate = self.head.step(hstate, hn[k:k + 1], e)
                logits = logits + bias.float()
            if self.conf_head is not None:
                confs.append(torch.sigmoid(self.conf_head(hn[k:k + 1], e, prev).float()))
            q = warp(logits).float()
            prev, q = self.to_target(draw(q, warp, generator).reshape(1), q)
            toks.append(prev)
            probs.append(q)
        return Proposal(tokens=torch.cat(toks), probs=torch.cat(probs),
                        confidence=torch.cat(confs) if confs else None)
