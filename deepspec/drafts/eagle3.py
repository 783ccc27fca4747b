"""Eagle3: an autoregressive draft layer over target features, trained with training-time test.

Model
    ``x_i = Linear(concat[RMSNorm(embed(token)); RMSNorm(g_i)])`` -> draft layer(s)
    -> draft norm -> target LM head (shared, full vocabulary), where ``g = fc(target
    features)`` when true features exist and ``g = the draft's own last-layer
    output`` (pre-norm) otherwise.

Pairing (CONTRACTS.md decoding semantics)
    Position i combines the features of x_i with the embedding of x_{i+1} and
    predicts x_{i+2}.  After the target prefilled x_0..x_{T-1}, the anchor x_T has
    no features, so the cache holds entries 0..T-2 and the last features wait
    (``pending``) until the anchor arrives.  `propose` step 0 is entry T-1
    (features of x_{T-1}, embedding of the anchor) -> d_1; step k is position
    T-1+k with the previous step's output and the embedding of d_k -> d_{k+1}.

Training-time test (exact formulation)
    Every position r is the root of a chain of ``ttt_steps`` steps.  Step j of the
    chain rooted at r sits at RoPE position r+j, reads token x_{r+1+j}, uses
    ``g`` = fc(f_r) for j = 0 and the chain's step j-1 output for j >= 1, and
    predicts x_{r+2+j} (target distribution: last_hidden[r+1+j]).  Its query sees
    the step-0 keys of positions <= r (the true-feature prefix, as the decoding
    cache does) and the keys of its own chain's steps 1..j (the speculative
    entries) — the "diagonal" keys of EAGLE-3's TTT, here with the matching RoPE
    positions.  Each step is one masked SDPA call over ``[K^0 ; ... ; K^j]``.
    Loss: soft cross-entropy to the target distribution, step weight
    ``step_decay**j``, only where x_{r+2+j} is loss-masked and inside the sequence.
    With ``draft.ttt_dense`` (default) every position roots a chain that carries the
    loss and ``batch["anchors"]`` is ignored; otherwise only the chains rooted at
    ``anchor - 1`` exist: step 0 still runs over every position (its keys are the
    true prefix), steps >= 1 only over those roots — the same LM-head rows as DFlash
    at the same anchors per sequence, and ~1/ttt_steps of the dense layer work.
    Metrics use k = j+1 (draft position k counted from the anchor x_{r+1}).

Layouts (``draft.eagle3_layout``)
    ``native``: the model above — ``in_proj`` maps the normed 2-wide concat to the draft
    width, then ``num_layers`` generic `DraftLayer`s (q/k RMSNorm, residual = the
    projection), over any number of target layers.
    ``engine``: the EAGLE-3 layer of vLLM (``llama_eagle3.py``), SGLang
    (``LlamaForCausalLMEagle3``) and speculators (``LlamaDecoderEagle3FirstLayer``):
    one layer whose q/k/v project ``concat[emb_norm(embed), feat_norm(g)]`` (2·hidden
    wide) directly, no q/k norm, residual = ``g`` itself (``norm_before_residual``
    false), ``fc`` over the target layers, draft width = target width (the engines' own
    checkpoints read exactly 3 layers, so `deepspec export` refuses any other count; DeepSpec's
    Eagle3 baseline is this layer over its 5 layers).  Here
    ``emb_norm`` / ``feat_norm`` are the engines' ``input_layernorm`` / ``hidden_norm``.
    Training, the pairing and decoding are the same for both; only ``_step`` differs.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional

import torch
from torch import nn

from .base import DraftState, Drafter, Proposal, TreeExpansion, batch_masks, draw, init_linear_weights
from .context import append_kv, as_input
from .layers import KV, DraftDims, DraftLayer, RMSNorm
from .fused_loss import fused_logit_loss
from .losses import metrics_from_stats, stat_sums, step_weights
from .registry import register_drafter


log = logging.getLogger(__name__)

LAYOUTS = ("native", "engine")
ENGINE_FEATURE_LAYERS = 3        # the engines' fc is Linear(3 * target_hidden, hidden)


def engine_layer_ids_hint(num_layers: int) -> str:
    """The engines' default low/mid/high layers in deepspec ids (outputs of layer i)."""
    # vLLM and SGLang capture the inputs of layers (2, L // 2, L - 3) = outputs of these
    ids = [1, num_layers // 2 - 1, num_layers - 4]
    if len(set(ids)) == 3 and min(ids) >= 0:
        return f"e.g. target.layer_ids={ids} (the engines' default low/mid/high layers)"
    return f"three distinct ids in [0, {num_layers - 1}]"


def check_engine_layout(cfg, target) -> None:
    """Refuse, naming the key, what the EAGLE-3 layer cannot hold.  Any number of feature layers trains
    (DeepSpec's baseline reads 5); the export to the engines, whose fc takes 3·hidden, checks that count."""
    if len(target.layer_ids) != ENGINE_FEATURE_LAYERS:
        log.info("draft.eagle3_layout=engine over %d target layers: trains, but vLLM/SGLang exports need 3 (%s)",
                 len(target.layer_ids), engine_layer_ids_hint(int(target.num_layers)))
    ids = [int(i) for i in target.layer_ids]
    if ids != sorted(set(ids)):
        raise ValueError(f"draft.eagle3_layout=engine needs strictly increasing target.layer_ids, got {ids}: the "
                         "engines concatenate the captured layers in layer order")
    if cfg.num_layers != 1:
        raise ValueError(f"draft.eagle3_layout=engine has one EAGLE-3 layer; got draft.num_layers={cfg.num_layers} "
                         "(SGLang's and vLLM's extra layers differ from each other)")
    if cfg.hidden_size not in (None, int(target.hidden_size)):
        raise ValueError(f"draft.eagle3_layout=engine needs the target's width: draft.hidden_size={cfg.hidden_size} "
                         f"!= target hidden size {target.hidden_size} (leave draft.hidden_size unset)")


@register_drafter("eagle3")
class Eagle3Drafter(Drafter):
    drafts_trees = True
    # `deepspec eval`'s default decoding (eval.decoding=auto).  A trained Eagle3 (native layout, the paper
    # configuration) on the 48 tuning prompts (bench/decoding_table.py), bf16, one thread, 2026-12-07, with
    # prompt lookup n ≤ 3: greedy an 8-node tree of width 4 grown 3 deep (1.37× over plain against the
    # parallel drafters' 16 × 8 of depth γ at 1.22×), sampled (T = 1) 6 nodes of width 3, 2 deep (1.11×
    # against 16 × 4's 0.90×).  Each depth costs a draft forward and each node a verification row, so small
    # shallow trees win (bench/results/decoding_table-t120_eagle3_depth_{greedy,sampled}.md).
    decoding_defaults = {"greedy": {"tree_nodes": 8, "tree_width": 4, "tree_depth": 3, "lookup_ngram": 3},
                         "sampled": {"tree_nodes": 6, "tree_width": 3, "tree_depth": 2, "lookup_ngram": 3}}

    def __init__(self, target, cfg):
        super().__init__(target, cfg)
        cfg = self.cfg
        if cfg.num_layers < 1 or cfg.ttt_steps < 1:
            raise ValueError("eagle3 needs draft.num_layers >= 1 and draft.ttt_steps >= 1")
        if cfg.eagle3_layout not in LAYOUTS:
            raise ValueError(f"draft.eagle3_layout={cfg.eagle3_layout!r}: choose from {', '.join(LAYOUTS)}")
        parallel_only = [k for k in ("anchor_feature", "embed_proj") if getattr(cfg, k)]
        if parallel_only:
            raise ValueError(f"draft.{parallel_only[0]}=true is an ablation of the parallel drafters (dspark, dflash); "
                             "eagle3 has no block input or context keys for it: leave it false")
        engine = cfg.eagle3_layout == "engine"
        if engine:
            check_engine_layout(cfg, target)
        self.dims = dims = DraftDims.from_target(target.config, cfg)
        D, Ht = dims.hidden_size, self.target_hidden_size
        self.fc = nn.Linear(self.feature_dim, D, bias=False)
        self.feat_norm = RMSNorm(D, dims.rms_eps)
        self.emb_norm = RMSNorm(Ht, dims.rms_eps)
        if engine:   # q/k/v read the normed concat directly; no q/k norm
            self.in_proj = None
            self.layers = nn.ModuleList([DraftLayer(dims, attn_in=2 * D, qk_norm=False)])
        else:
            self.in_proj = nn.Linear(Ht + D, D, bias=False)
            self.layers = nn.ModuleList(DraftLayer(dims) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(D, dims.rms_eps)
        self.out_proj = nn.Linear(D, Ht, bias=False) if D != Ht else None
        init_linear_weights(self)

    # -- one step over a set of positions ------------------------------------------------------
    def _features(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc(as_input(features, self.param_dtype, self.device))

    def _step(self, tokens: torch.Tensor, g: torch.Tensor, pos: torch.Tensor,
              prefixes: List[Optional[KV]], mask: Optional[torch.Tensor]):
        """tokens [B, n], g [B, n, D] -> (last-layer output [B, n, D], per-layer new (k, v))."""
        x = torch.cat([self.emb_norm(self.embed(tokens)), self.feat_norm(g)], dim=-1)
        if self.in_proj is None:      # engine layout: one layer, residual = g
            h, kv = self.layers[0](x, pos, prefix=prefixes[0], mask=mask, residual=g)
            return h, [kv]
        x = self.in_proj(x)
        kvs = []
        for layer, prefix in zip(self.layers, prefixes):
            x, kv = layer(x, pos, prefix=prefix, mask=mask)
            kvs.append(kv)
        return x, kvs

    def _head_logits(self, h: torch.Tensor) -> torch.Tensor:
        hn = self.norm(h)
        return self.draft_logits(self.out_proj(hn) if self.out_proj is not None else hn)

    # -- training -------------------------------------------------------------------------------
    def _ttt(self, batch: Dict[str, torch.Tensor], roots: Optional[torch.Tensor] = None):
        """Yields (step j, last-layer output h [B, N, D]) of the chains rooted at ``roots`` [B, N]
        (default: every position).  Step 0 runs over every position — its keys are the true
        prefix all chains read; steps j >= 1 run only for the chains' own queries."""
        dev = self.device
        ids, am, _ = batch_masks(batch, dev)
        B, T = ids.shape
        r = torch.arange(T, device=dev)
        roots = r.expand(B, T) if roots is None else roots.to(dev).long()
        N = roots.shape[1]
        causal = (r.view(T, 1) >= r.view(1, T)).unsqueeze(0) & am.unsqueeze(1)        # [B, T, T]
        pad = ids.new_full((B, self.cfg.ttt_steps + 1), self.mask_token_id)
        shifted = torch.cat([ids, pad], dim=1)
        h0, kv0 = self._step(shifted[:, 1:1 + T], self._features(batch["features"]), r.expand(B, T),
                             [None] * len(self.layers), causal.unsqueeze(1))
        h = h0.gather(1, roots.unsqueeze(-1).expand(B, N, h0.shape[-1]))
        yield 0, h
        rows = causal.gather(1, roots.unsqueeze(-1).expand(B, N, T))                      # prefix of each root
        diag = torch.eye(N, dtype=torch.bool, device=dev).expand(B, N, N)
        keys: List[List[KV]] = [[kv] for kv in kv0]
        for j in range(1, self.cfg.ttt_steps):
            tok = shifted.gather(1, roots + 1 + j)                                        # x_{r+1+j}
            mask = torch.cat([rows] + [diag] * j, dim=-1).unsqueeze(1)                   # [B, 1, N, T+jN]
            prefixes = [(torch.cat([k for k, _ in ks], 2), torch.cat([v for _, v in ks], 2)) for ks in keys]
            h, kvs = self._step(tok, h, roots + j, prefixes, mask)
            for ks, kv in zip(keys, kvs):
                ks.append(kv)
            yield j, h

    def _chunk_loss(self, h, tgt_hidden, tgt_lse, target_fn, tokens, valid, weight):
        """Soft CE to the target distribution through the fused logits loss (no [rows × V] tensors kept)."""
        coef = torch.zeros(valid.shape[0], 3, device=h.device)
        coef[:, 2] = valid * weight
        params = [p for m in (self.norm, self.out_proj) if m is not None for p in m.parameters()]
        num, t = fused_logit_loss(h, tgt_hidden, tokens, coef, self._head_logits, target_fn,
                                  params=params, vocab=self.vocab_size, draft_vocab=self.draft_vocab,
                                  t2d=self.target_to_draft(), target_lse=tgt_lse)
        return num, torch.stack([t["ce"], t["tv"], t["top1"], t["in_vocab"]])

    def forward(self, batch: Dict[str, torch.Tensor]) -> Dict[str, object]:
        dev = self.device
        ids, _, lm = batch_masks(batch, dev)
        B, T = ids.shape
        last = batch["last_hidden"].to(dev)
        S = self.cfg.ttt_steps
        w = step_weights(S, self.cfg.loss.step_decay)
        zeros_tok = ids.new_zeros(B, S + 2)
        ids_ext = torch.cat([ids, zeros_tok], 1)
        lm_ext = torch.cat([lm, torch.zeros_like(zeros_tok, dtype=torch.bool)], 1)
        last_ext = torch.cat([last, last.new_zeros(B, S + 2, last.shape[-1])], 1)
        target_fn, lse = self.target_side(batch)
        lse_ext = None if lse is None else torch.cat([lse, lse.new_zeros(B, S + 2)], 1)
        roots, keep = self._loss_roots(batch, B, T)                                       # [B, N] each
        Hl = last.shape[-1]
        total, denom, per_step, valids = 0.0, 0.0, [], []
        for j, h in self._ttt(batch, None if self.cfg.ttt_dense else roots):
            tokens = ids_ext.gather(1, roots + 2 + j)[keep]                               # x_{r+2+j}
            valid = lm_ext.gather(1, roots + 2 + j)[keep]
            tgt = last_ext.gather(1, (roots + 1 + j).unsqueeze(-1).expand(B, -1, Hl))[keep]  # last_hidden[r+1+j]
            tl = None if lse_ext is None else lse_ext.gather(1, roots + 1 + j)[keep]
            num, st = self._chunk_loss(h[keep], tgt, tl, target_fn, tokens, valid.float(), float(w[j]))
            total = total + num
            per_step.append(st)                                                           # [4, n]
            valids.append(valid)
            denom = denom + float(w[j]) * valid.sum()
        st = torch.stack(per_step, dim=-1)                                                # [4, n, S]
        terms = {"ce": st[0], "tv": st[1], "top1": st[2], "in_vocab": st[3]}
        metrics = metrics_from_stats(stat_sums(terms, torch.stack(valids, -1)))
        loss = total / torch.as_tensor(denom, device=dev).clamp(min=1e-8)
        metrics["loss"] = float(loss.detach())
        return {"loss": loss, "metrics": metrics}

    def _loss_roots(self, batch: Dict[str, torch.Tensor], B: int, T: int):
        """(roots [B, N] long, keep [B, N] bool): the chain roots that carry the loss — every
        position, or ``anchor - 1`` per anchor (padding and anchor 0 are not kept)."""
        if self.cfg.ttt_dense:
            return (torch.arange(T, device=self.device).expand(B, T),
                    torch.ones(B, T, dtype=torch.bool, device=self.device))
        if "anchors" not in batch:
            raise ValueError("eagle3 with draft.ttt_dense=false needs batch['anchors']")
        a = batch["anchors"].to(self.device).long() - 1
        keep = (a >= 0) & (a < T)
        return torch.where(keep, a, torch.zeros_like(a)), keep

    @torch.no_grad()
    def step_logits(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """Teacher-forced logits of every TTT step: [B, S, T, V]; [b, j, r] predicts x_{r+2+j}."""
        return torch.stack([self._head_logits(h) for _, h in self._ttt(batch)], dim=1)

    # -- decoding -------------------------------------------------------------------------------
    def _prefixes(self, kv: List[KV]) -> List[Optional[KV]]:
        return list(kv) if kv else [None] * len(self.layers)

    @torch.no_grad()
    def init_state(self, input_ids: torch.Tensor, features: torch.Tensor) -> DraftState:
        if input_ids.numel() < 1:
            raise ValueError("eagle3 needs at least one prompt token with target features")
        ids = input_ids.to(self.device).long().reshape(-1)
        g = self._features(features.unsqueeze(0))
        state = DraftState(tokens=ids[:1], cache={"kv": [], "pending": g[:, :1]})
        return self._append(state, ids[1:], g[:, 1:])

    def _append(self, state: DraftState, tokens: torch.Tensor, g_next: torch.Tensor) -> DraftState:
        """Entries for positions L-1 .. L+n-2 = (pending g, tokens[0]), (g_next[0], tokens[1]), ..."""
        n = tokens.shape[0]
        if n == 0:
            return state
        L = state.length
        g = torch.cat([state.cache["pending"], g_next[:, :n - 1]], dim=1)
        pos = torch.arange(L - 1, L - 1 + n, device=self.device).unsqueeze(0)
        P = L - 1
        mask = torch.ones(n, P + n, dtype=torch.bool, device=self.device)
        mask[:, P:] = torch.tril(mask[:, P:])
        _, kvs = self._step(tokens.unsqueeze(0), g, pos, self._prefixes(state.cache["kv"]),
                            mask.view(1, 1, n, P + n))
        state.cache["kv"] = append_kv(state.cache["kv"], kvs)
        state.cache["pending"] = g_next[:, n - 1:n]
        state.tokens = torch.cat([state.tokens, tokens])
        return state

    @torch.no_grad()
    def advance(self, state: DraftState, tokens: torch.Tensor, features: torch.Tensor) -> DraftState:
        tokens = tokens.to(self.device).long().reshape(-1)
        if features.shape[0] != tokens.shape[0]:
            raise ValueError(f"advance: {tokens.shape[0]} tokens but {features.shape[0]} feature rows")
        return self._append(state, tokens, self._features(features.unsqueeze(0)))

    @torch.no_grad()
    def propose(self, state: DraftState, anchor: int, gamma: int, warp, generator=None) -> Proposal:
        if gamma < 1:
            raise ValueError(f"propose: gamma={gamma} must be >= 1")
        L = state.length
        kv = list(state.cache["kv"])
        g = state.cache["pending"]
        tok = torch.tensor([[int(anchor)]]).to(self.device, non_blocking=True)   # no wait for queued GPU work
        toks, probs = [], []
        for k in range(gamma):
            pos = torch.tensor([[L - 1 + k]]).to(self.device, non_blocking=True)
            h, new = self._step(tok, g, pos, self._prefixes(kv), None)
            kv = append_kv(kv, new)
            q = warp(self._head_logits(h)[0]).float()                                     # [1, N]
            tok, q = self.to_target(draw(q, warp, generator), q)
            toks.append(tok.reshape(1))
            probs.append(q)
            g = h
        return Proposal(tokens=torch.cat(toks), probs=torch.cat(probs), confidence=None)

    @torch.no_grad()
    def tree_expansion(self, state: DraftState, anchor: int, gamma: int) -> TreeExpansion:
        """Dynamic draft trees (EAGLE-2; `deepspec.decoding.tree`) with tree attention over the draft's own
        KV cache.  Depth k runs the frontier's R rows as one step at position L−1+k: row r reads its own
        token and its parent's output h (the step's g), and attends to the cache, to the tree entries of its
        ancestors and to itself — what the chain step along its path would see.  A row's state is (h, its
        ancestor set over the tree entries made so far); the entries live only for this tree."""
        L, dev = state.length, self.device
        cache, P = list(state.cache["kv"]), state.length - 1
        tree_kv: List[KV] = []

        def expand(k, tokens, rstate):
            g, anc = rstate                                                     # [R, D], [R, M] bool
            R, M = tokens.shape[0], anc.shape[1]
            prefix = append_kv(cache, tree_kv) if tree_kv else cache
            eye = torch.eye(R, dtype=torch.bool, device=dev)
            mask = torch.cat([torch.ones(R, P, dtype=torch.bool, device=dev), anc, eye], 1).view(1, 1, R, P + M + R)
            pos = torch.full((1, R), L - 1 + k, device=dev)
            h, new = self._step(tokens.to(dev).view(1, R), g.view(1, R, -1), pos, self._prefixes(prefix), mask)
            tree_kv[:] = append_kv(tree_kv, new)
            return self._head_logits(h)[0], (h[0], torch.cat([anc, eye], 1))

        root = (state.cache["pending"][0], torch.zeros(1, 0, dtype=torch.bool, device=dev))
        return TreeExpansion(expand, root, self.draft_vocab)
