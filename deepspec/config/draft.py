"""Draft model section (`draft=dspark|dflash|eagle3`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class LossConfig:
    ce_weight: float = 0.1
    # Weight of the distribution term L1 = Σ_v |q(v) − p(v)| = 2·TV(q, p), as in the DSpark paper
    # (eq. 10) and DeepSpec's loss; the logged `tv` metric stays ½·L1 (the rejection probability).
    l1_weight: float = 0.9
    # Parallel drafters: weight of the soft cross-entropy −Σ_v p(v) log q(v) (the forward KL up to the
    # target's entropy, Eagle3's only term).  0 in the paper and DeepSpec; an ablation of the loss.
    soft_ce_weight: float = 0.0
    conf_weight: float = 1.0
    # Position weight w_k = exp(-k / decay) with k counted from 0 (DeepSpec);
    # decay <= 0 disables the decay (all weights 1).
    position_decay: float = 4.0
    # Eagle3 step weights: step_decay ** k.
    step_decay: float = 0.8
    # Anchors per backbone chunk of the parallel drafters (0 = all at once); the vocabulary-sized
    # loss tensors are bounded separately by the fused loss (drafts/fused_loss.py).
    chunk_size: int = 64


@dataclass
class DraftConfig:
    # Registered algorithm name: dspark | dflash | eagle3.
    algorithm: str = "dspark"
    gamma: int = 7
    num_layers: int = 5
    # Width of the draft layers; None = target hidden size.
    hidden_size: Optional[int] = None
    intermediate_size: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    # DSpark sequential head: none | markov | rnn.
    sequential_head: str = "markov"
    head_rank: int = 256
    # W1 of the sequential (and confidence) head: table = a learned V×head_rank table (the paper);
    # target = ablation, not part of the paper: the target's frozen token embedding through a learned
    # hidden×head_rank map (saves (V − hidden)·head_rank parameters; not exportable to the engines).
    head_embedding: str = "table"
    confidence_head: bool = True
    # Token id used for the mask slots; None = one that is never a real token: a reserved/unused token,
    # else a spare embedding row, else an unused added special token (deepspec/targets/mask_token.py).
    mask_token_id: Optional[int] = None
    # Eagle3: training-time-test horizon.
    ttt_steps: int = 7
    # Eagle3: true = every position roots a chain that carries the loss (EAGLE-3's recipe);
    # false = only chains rooted at the batch's anchors (root = anchor - 1) carry it, so the
    # LM-head work per step equals DFlash/DSpark's at the same train.anchors_per_sequence.
    # The draft layers run over every position either way (chains need the true prefix).
    ttt_dense: bool = True
    # Eagle3 architecture: native = deepspec's (in_proj over the normed concat, then generic
    # draft layers with q/k norm; any number of feature layers and layers); engine = the
    # vLLM/SGLang/speculators EAGLE-3 layer (q/k/v read the 2·hidden concat, residual = the
    # hidden stream, no q/k norm), exportable with `deepspec export --to vllm|sglang` when it reads
    # exactly 3 target.layer_ids (DeepSpec's baseline reads 5: trains, not exportable); needs draft.num_layers=1
    # and draft.hidden_size unset.
    eagle3_layout: str = "native"
    # Ablation for DFlash/DSpark, not part of either paper: also add a projection of the latest
    # target feature (position p-1) to every block input, the view Eagle3 gets in its layer input.
    # Default false keeps the published architecture (context only as extra K/V).
    anchor_feature: bool = False
    # Ablation for DFlash/DSpark, not part of either paper: a residual SwiGLU (width = the draft's
    # intermediate size) over each context position before the norm, so the context keys/values come
    # from a learned per-position encoding of the target features instead of one linear map (Eagle3's
    # context is a full layer's output).  Still per position: decoding caches it like the plain map.
    context_mlp: bool = False
    # Ablation, not part of the papers: none = the target features enter the projection as they are;
    # channel = each feature channel is divided by its RMS over a fixed probe text (computed from the
    # target when the draft is built, saved with it), so the few "massive activation" channels of the
    # target's residual stream (10-30x the median channel on SmolLM2) enter at unit scale.
    feature_norm: str = "none"
    # Ablation for DFlash/DSpark, not part of either paper: pass the block's token embeddings through a
    # learned linear map even when the draft is as wide as the target (otherwise only when widths
    # differ). With tied target embeddings (SmolLM2) the raw anchor embedding otherwise reaches the
    # tied LM head through the residual stream, which favours proposing the anchor token again.
    embed_proj: bool = False
    loss: LossConfig = field(default_factory=LossConfig)
    # Sequential temperature scaling (filled in by `deepspec calibrate`).
    # Initialise from a saved draft directory: weights with matching names and shapes are
    # copied (e.g. a DSpark backbone from a DFlash checkpoint); the rest keep their init.
    init_from: Optional[str] = None
    # Ablation, not part of either paper: initialise every draft layer's attention and MLP
    # projections from this decoder layer of the target (negative = counted from the end, -1 the
    # last), instead of N(0, 0.02). Norms keep their init. Needs the target's layer sizes (draft
    # width and heads unset); applied before init_from, so a saved draft still overrides it.
    init_from_target_layer: Optional[int] = None
    # Draft vocabulary: score only the N most frequent answer tokens of the training data (EAGLE-3's
    # d2t/t2d; selected by the trainer from the cache, saved in the checkpoint); null = all tokens.
    # Proposals stay lossless: the draft puts probability 0 outside it.
    vocab_size: Optional[int] = None
