"""Draft model section (`draft=dspark|dflash|eagle3`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional


@dataclass
class LossConfig:
    ce_weight: float = 0.1
    # Weight of the distribution term L1 = Σ_v |q(v) − p(v)| = 2·TV(q, p), as in the DSpark paper
    # (eq. 10) and DeepSpec's loss; the logged `tv` metric stays ½·L1 (the rejection probability).
    l1_weight: float = 0.9
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
    # Registered algorithm name: dspark | dflash | eagle3 (a registry, open to new algorithms: checked
    # by `deepspec.drafts.registry` when the drafter is built).
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
    sequential_head: Literal["none", "markov", "rnn"] = "markov"
    head_rank: int = 256
    # W1 of the sequential (and confidence) head: table = a learned V×head_rank table (the paper);
    # target = ablation, not part of the paper: the target's frozen token embedding through a learned
    # hidden×head_rank map (saves (V − hidden)·head_rank parameters; not exportable to the engines).
    head_embedding: Literal["table", "target"] = "table"
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
    eagle3_layout: Literal["native", "engine"] = "native"
    # Ablation for DFlash/DSpark, not part of either paper: also add a projection of the latest
    # target feature (position p-1) to every block input, the view Eagle3 gets in its layer input.
    # Default false keeps the published architecture (context only as extra K/V).
    anchor_feature: bool = False
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
    # Draft vocabulary: score only the N most frequent answer tokens of the training data (EAGLE-3's
    # d2t/t2d; selected by the trainer from the cache, saved in the checkpoint); null = all tokens.
    # Proposals stay lossless: the draft puts probability 0 outside it.
    vocab_size: Optional[int] = None
