"""Training section (`train=...`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class TrainConfig:
    strategy: str = "ddp"  # ddp | fsdp | deepspeed | single
    lr: float = 6e-4
    weight_decay: float = 0.0
    betas_1: float = 0.9
    betas_2: float = 0.95
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0
    epochs: int = 10
    max_steps: Optional[int] = None
    global_batch_sequences: int = 512
    micro_batch_sequences: int = 4
    anchors_per_sequence: int = 512
    max_length: int = 4096
    grad_clip: float = 1.0
    bf16: bool = True
    compile: bool = False
    deepspeed_stage: int = 2
    save_every: int = 1000
    eval_every: int = 500
    heldout_fraction: float = 0.02
    log_every: int = 1
    keep_last: int = 3
    wandb: bool = False
    wandb_project: str = "deepspec"
    tensorboard: bool = True
    num_workers: int = 0
