"""Training section (`train=...`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Literal, Optional


@dataclass
class TrainConfig:
    # Data-parallel strategy: ddp | fsdp (FSDP2) | deepspeed (ZeRO, train.deepspeed_stage) | single (one process).
    strategy: Literal["ddp", "fsdp", "deepspeed", "single"] = "ddp"
    lr: float = 6e-4
    weight_decay: float = 0.0
    betas_1: float = 0.9
    betas_2: float = 0.999   # torch AdamW default, what DeepSpec trains with (utils/optim.py)
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0
    epochs: int = 10
    max_steps: Optional[int] = None
    global_batch_sequences: int = 512
    micro_batch_sequences: int = 4
    anchors_per_sequence: int = 512
    grad_clip: float = 1.0
    # bf16 autocast (fp32 master weights): true | false | null = where the device computes it natively
    # (GPUs with bf16; CPUs with AVX512-BF16/AMX, where the LM-head matmuls run ~4x faster).
    bf16: Optional[bool] = True
    compile: bool = False
    deepspeed_stage: int = 2
    save_every: int = 1000
    eval_every: int = 500
    log_every: int = 1
    keep_last: int = 3
    wandb: bool = False
    wandb_project: str = "deepspec"
    tensorboard: bool = True
    # DataLoader worker processes per rank (cache reads, decompression, collation); null = auto:
    # up to 4 on a GPU, 0 on a CPU and in online mode (train/data.py loader_workers).
    num_workers: Optional[int] = None
    # --- the trainer's own settings ---
    eps: float = 1e-8
    # Resume automatically from the latest complete checkpoint under {run_dir}/checkpoints.
    resume: bool = True
    # Online mode: dtype the target features are cast to — bfloat16 (what the cache stores,
    # so cached and online runs see the same inputs) | native (the target's own dtype).
    online_feature_dtype: Literal["bfloat16", "float32", "native"] = "bfloat16"
    # Sort each global batch by length before cutting micro-batches (less padding).
    group_by_length: bool = True
    pad_to_multiple_of: int = 1
    # Held-out sequences scored at each eval (None = all of the held-out split).
    eval_max_sequences: Optional[int] = 256
    # torch.distributed backend (None = nccl on GPU, gloo on CPU) and collective timeout.
    dist_backend: Optional[str] = None
    dist_timeout_s: int = 1800
    ddp_find_unused_parameters: bool = False
    # Check at every log step that the trainable parameters are identical on all ranks
    # (debugging / tests; one all-reduce of a checksum).
    verify_sync: bool = False
    wandb_entity: Optional[str] = None
    wandb_run_name: Optional[str] = None
    # Real-loop τ while training (train/decode_eval.py): every N steps (0 = off) decode the first turns
    # of decode_eval_samples held-out prompts with the lossless loop, once per temperature, and log
    # decode/tau_t{T} beside the teacher-forced eval/expected_tau.  Prompts: a {"turns": [...]} JSONL,
    # null = the regeneration's held-out prompts (heldout.jsonl beside regen.jsonl).
    decode_eval_every: int = 0
    decode_eval_prompts: Optional[str] = None
    decode_eval_samples: int = 8
    decode_eval_new_tokens: int = 32
    decode_eval_temperatures: List[float] = field(default_factory=lambda: [0.0, 1.0])
