"""Which rank of how many this process is: the one lookup every stage uses.

An explicit value wins, then an initialised ``torch.distributed`` group, then the variables
torchrun sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), then a single
process.  Joining or creating a process group is the caller's business.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch.distributed as dist


def rank_world(rank: Optional[int] = None, world_size: Optional[int] = None) -> Tuple[int, int]:
    """``(rank, world_size)``; `ValueError` when the rank does not fit the world size."""
    if (rank is None or world_size is None) and dist.is_available() and dist.is_initialized():
        rank = dist.get_rank() if rank is None else rank
        world_size = dist.get_world_size() if world_size is None else world_size
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"bad rank {rank} for world size {world_size}")
    return int(rank), int(world_size)


def local_rank(default: int = 0) -> int:
    """This process's rank on its node (``LOCAL_RANK``)."""
    return int(os.environ.get("LOCAL_RANK", default))


def local_world_size(default: int = 1) -> int:
    """Processes on this node (``LOCAL_WORLD_SIZE``)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", default))
