"""The process group: join torchrun's (or make a one-process one), pick this rank's device, and
the few collectives the loop needs (barrier, all-reduce, all-gather / broadcast of objects).

Every collective is a no-op (or returns its input) when running alone.
"""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..utils.dist_env import local_rank, rank_world

STRATEGIES = ("single", "ddp", "fsdp", "deepspeed")   # train.strategy (implemented in `strategies`)


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: Optional[str] = None
    owns_group: bool = False   # we created the process group (destroy it at the end)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(train_cfg, device_name: str = "auto") -> DistEnv:
    """Join the torchrun process group (env://) or run alone; pick this rank's device.

    Under torchrun every strategy but `single` is allowed (ddp is the default); alone, `ddp`
    degrades to `single`, while `fsdp` / `deepspeed` get a one-process group so they still run."""
    strategy = train_cfg.strategy
    if strategy not in STRATEGIES:
        raise ValueError(f"train.strategy={strategy!r}: choose from {', '.join(STRATEGIES)}")
    rank, world = rank_world()
    local = local_rank()
    if world > 1 and strategy == "single":
        raise ValueError(f"train.strategy=single cannot run with {world} processes; use ddp, fsdp or deepspeed")
    cuda = torch.cuda.is_available() and device_name in ("auto", "cuda") or device_name.startswith("cuda")
    if cuda:
        torch.cuda.set_device(local if device_name in ("auto", "cuda") else torch.device(device_name))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    env = DistEnv(rank=rank, world_size=world, local_rank=local, device=device)
    need_group = world > 1 or strategy in ("fsdp", "deepspeed")
    if need_group and not dist.is_initialized():
        backend = train_cfg.dist_backend or ("nccl" if device.type == "cuda" else "gloo")
        timeout = datetime.timedelta(seconds=train_cfg.dist_timeout_s)
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=timeout, rank=rank, world_size=world,
                                    device_id=device if device.type == "cuda" else None)
        else:  # one process, no launcher
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                                    world_size=1, timeout=timeout)
        env.owns_group = True
    if dist.is_initialized():
        env.backend = dist.get_backend()
        env.rank, env.world_size = dist.get_rank(), dist.get_world_size()
    return env


def shutdown(env: DistEnv) -> None:
    if env.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()


def all_reduce_(t: torch.Tensor, env: DistEnv, op=None) -> torch.Tensor:
    if env.distributed and env.world_size > 1:
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t


def all_gather_object(obj, env: DistEnv) -> list:
    if not (env.distributed and env.world_size > 1):
        return [obj]
    out = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, env: DistEnv, src: int = 0):
    if not (env.distributed and env.world_size > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
