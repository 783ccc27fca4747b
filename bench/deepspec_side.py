"""DeepSpec's own DSpark (deepseek-ai/DeepSpec: its model, loss and optimizer) on our cache, for comparison.

Not a script: `bench/train_vs_deepspec.py` uses it.  A DeepSpec checkout is given by path (never
vendored); its modules are imported from there, beside ours.

- `load_checkout(path)`: DeepSpec's modules, with a dense-mask attention patched in where the checkout only
  has flex_attention (which has no backward on a CPU).
- `build_dspark(...)`: their `Qwen3DSparkModel` at a target's sizes (their "Qwen3" draft layer is our draft
  layer: Llama plus q/k norm), their embedding and LM head copied from the target and frozen.
- `to_ours(...)`: their weights in one of our drafters, through the SGLang parameter table (`deepspec.export
  .mapping`), which SpecForge's and SGLang's DSpark share with DeepSpec: the converted drafter is scored and
  decoded by our own held-out evaluation and eval loop.
- `train(...)`: the loop of their `BaseTrainer.train` (loss ÷ accumulation, clip 1.0, their `BF16Optimizer`
  with its warm-up + cosine schedule) on micro-batches of one sequence, over the same sequences, in the same
  order, as our trainer's run of the same config.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, Optional

import torch


def dense_mask(*, anchor_positions, block_keep_mask, seq_len, block_size, device, **_):
    """Additive [B, 1, Q, KV] mask with DeepSpec's DSpark semantics, for checkouts whose mask is flex only:
    query block i sees context < its anchor and its own block only; rows of dropped blocks see key 0."""
    B, N = anchor_positions.shape
    kv = torch.arange(seq_len + N * block_size, device=device)
    qb = torch.arange(N * block_size, device=device) // block_size
    ctx = (kv < seq_len) & (kv.view(1, 1, -1) < anchor_positions[:, qb].unsqueeze(-1))
    own = (kv >= seq_len) & (qb.view(-1, 1) == (kv - seq_len).div(block_size, rounding_mode="floor"))
    ok = (ctx | own) & block_keep_mask[:, qb].unsqueeze(-1)
    ok[..., 0] |= ~ok.any(-1)
    return torch.zeros(ok.shape, device=device).masked_fill(~ok, torch.finfo(torch.float32).min).unsqueeze(1)


@dataclasses.dataclass
class Checkout:
    path: str
    modeling: object          # deepspec.modeling.dspark.qwen3.modeling
    loss: object              # deepspec.modeling.dspark.loss
    config: object            # deepspec.modeling.dspark.qwen3.config
    optim: object             # deepspec.utils.optim
    metrics: object           # deepspec.utils.metrics
    ConfigNode: type
    patched_mask: bool


def _ours() -> Dict[str, object]:
    return {k: m for k, m in sys.modules.items() if k == "deepspec" or k.startswith("deepspec.")}


def load_checkout(path: str) -> Checkout:
    """DeepSpec's modules from ``path``, beside ours in one process: both projects are packages named
    `deepspec`, so theirs is imported with ours set aside, then ours is put back under the name (their
    modeling, loss and optimizer modules import nothing of their package at call time)."""
    ours = _ours()
    for k in ours:
        del sys.modules[k]
    root = str(Path(path).resolve())
    sys.path.insert(0, root)
    try:
        import importlib
        mods = {k: importlib.import_module(f"deepspec.{v}") for k, v in
                {"modeling": "modeling.dspark.qwen3.modeling", "loss": "modeling.dspark.loss",
                 "config": "modeling.dspark.qwen3.config", "optim": "utils.optim", "metrics": "utils.metrics",
                 "common": "modeling.dspark.common", "cfgutil": "utils.config"}.items()}
    finally:
        sys.path.remove(root)
        for k in _ours():
            del sys.modules[k]
        sys.modules.update(ours)
    import torch.distributed as dist
    if not dist.is_initialized():   # compute_dspark_loss all-reduces its denominators
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp(prefix='ds_gloo_')}",
                                rank=0, world_size=1)
    patched = "attn_implementation" not in inspect.signature(mods["common"].create_dspark_attention_mask).parameters
    if patched:
        mods["modeling"].create_dspark_attention_mask = dense_mask
    return Checkout(str(path), mods["modeling"], mods["loss"], mods["config"], mods["optim"], mods["metrics"],
                    mods["cfgutil"].ConfigNode, patched)


def model_args(ck: Checkout, gamma: int, layers: int, layer_ids, mask_token_id: int, anchors: int, rank: int):
    """Their config node for a DSpark with a vanilla Markov head and a confidence head over it (their paper
    configuration, `config/dspark/dspark_qwen3_4b.py`, at other sizes)."""
    return ck.ConfigNode(block_size=gamma, num_draft_layers=layers, target_layer_ids=list(layer_ids),
                         mask_token_id=mask_token_id, num_anchors=anchors, markov_rank=rank,
                         markov_head_type="vanilla", confidence_head_alpha=1.0, confidence_head_with_markov=True,
                         loss_decay_gamma=4.0, ce_loss_alpha=0.1, l1_loss_alpha=0.9, attn_implementation="sdpa")


def qwen3_config(target_config):
    """A `Qwen3Config` with the target's sizes, norms and rotary settings (their draft layers read it)."""
    from transformers import Qwen3Config
    d = target_config.to_dict()
    keep = {k: v for k, v in d.items() if k not in ("architectures", "model_type", "transformers_version",
                                                     "auto_map", "torch_dtype", "dtype")}
    cfg = Qwen3Config(**keep)
    cfg.head_dim = getattr(target_config, "head_dim", None) or target_config.hidden_size // target_config.num_attention_heads
    cfg.tie_word_embeddings = False
    return cfg


def build_dspark(ck: Checkout, target, margs, dtype: torch.dtype):
    """Their `Qwen3DSparkModel` for ``target`` with its embedding and LM head copied in and frozen."""
    dcfg = ck.config.build_draft_config(qwen3_config(target.config), margs)
    dcfg._attn_implementation = "sdpa"
    model = ck.modeling.Qwen3DSparkModel(dcfg)
    emb = target.model.get_input_embeddings()
    head = target.model.get_output_embeddings()
    model.initialize_embeddings_and_head(embed_tokens=emb, lm_head=head, freeze=True)
    return model.to(dtype).train()


def to_ours(model, drafter) -> None:
    """Their trainable weights into our ``drafter`` (built with the same sizes), through the SGLang table."""
    from deepspec.export import mapping
    theirs = {k: v.detach().float() for k, v in model.state_dict().items()
              if not k.startswith(("embed_tokens.", "lm_head.", "rotary_emb."))}
    ours = mapping.from_engine(theirs)
    own = drafter.state_dict()
    missing = sorted(k for k in own if k not in ours and not k.startswith(("draft_vocab",)))
    unexpected = sorted(set(ours) - set(own))
    if missing or unexpected:
        raise ValueError(f"DeepSpec weights do not fit the drafter: missing {missing[:6]}, unexpected {unexpected[:6]}")
    with torch.no_grad():
        for k, v in ours.items():
            own[k].copy_(v.to(own[k].dtype))


def train(ck: Checkout, model, batches: Callable[[int], list], steps: int, lr: float, warmup_ratio: float,
          clip: float, on_step: Optional[Callable[[int, Dict], None]] = None) -> None:
    """Their training loop: per step, each micro-batch's loss ÷ the accumulation count, backward, clip,
    their BF16Optimizer (fp32 master weights, AdamW, warm-up + cosine to 0).  ``batches(step)`` gives the
    step's micro-batches as dicts of their forward's inputs."""
    opt = ck.optim.BF16Optimizer(model, lr=lr, total_steps=steps, warmup_ratio=warmup_ratio, weight_decay=0.0)
    params = [p for p in model.parameters() if p.requires_grad]
    for step in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        micro = batches(step)
        total = 0.0
        for mb in micro:
            out = model(**mb)
            loss = ck.loss.compute_dspark_loss(outputs=out, loss_decay_gamma=4.0, ce_loss_alpha=0.1,
                                               l1_loss_alpha=0.9, confidence_head_alpha=1.0) / len(micro)
            loss.backward()
            total += float(loss.detach())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        lr_now = opt.get_learning_rate()
        opt.step()
        ck.metrics.reset()   # their trainer flushes these every logging window
        if on_step is not None:
            on_step(step + 1, {"train/loss": total, "lr": lr_now, "grad_norm": grad_norm,
                               "step_time_s": time.perf_counter() - t0, "step_cpu_s": time.process_time() - c0})


def their_batch(sample: Dict[str, torch.Tensor], dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """One of our cached sequences as their forward's inputs (a batch of one, as their trainer's default)."""
    return {"input_ids": sample["input_ids"][None].long(),
            "target_hidden_states": sample["features"][None].to(dtype),
            "loss_mask": sample["loss_mask"][None].to(dtype),
            "target_last_hidden_states": sample["last_hidden"][None].to(dtype)}


def checkout_id(path: str) -> Dict[str, object]:
    """Which DeepSpec code ran: the git commit when it is a checkout, and a hash of its DSpark sources."""
    import hashlib
    import subprocess
    root = Path(path)
    h = hashlib.sha256()
    for f in sorted((root / "deepspec" / "modeling" / "dspark").rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    r = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
    return {"commit": r.stdout.strip() if r.returncode == 0 else None, "dspark_sources_sha256": h.hexdigest()}


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=lambda x: None if isinstance(x, float) and math.isnan(x)
                               else str(x)) + "\n")
