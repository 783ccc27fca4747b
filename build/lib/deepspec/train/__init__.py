"""`deepspec train`: distributed, resumable training of any registered drafter.

    from deepspec.train import run
    final_checkpoint_dir = run(cfg)          # cfg: DeepSpecConfig (or `deepspec train key=value ...`)

Modules: `anchors` (valid anchor positions, seeded sampling), `data` (cache / online sources,
world-size independent batch plan, collate), `optim` (AdamW, warmup + cosine), `distributed`
(process group, collectives), `strategies` (single / DDP / FSDP2 / DeepSpeed ZeRO-1/2),
`checkpoint` (atomic, pickle-free), `logging` (tqdm, metrics.jsonl, TensorBoard, wandb),
`accumulate` (per-step statistics reduced across ranks), `stopping` (SIGTERM / Ctrl-C,
non-finite loss), `loop` (the loop itself).
"""
from .loop import run

__all__ = ["run"]
