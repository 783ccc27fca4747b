"""The four ways to run the same training step: single, DDP, FSDP2, DeepSpeed.

Every strategy exposes the same small surface used by `loop.py`:

    strategy.setup(drafter)                 wrap the model, build AdamW (fp32 state)
    strategy.forward(batch)                 -> {"loss", "metrics"}
    with strategy.sync(last): ...           skip gradient sync on non-final micro-batches
    strategy.backward(loss, accum, last)
    strategy.step(lr) -> grad norm          clip, update, zero grads
    strategy.full_state()                   -> (weights {name: fp32}, optimizer {name: {key: tensor}})
                                               complete on rank 0 (collective: call on all ranks)
    strategy.load_optimizer_state(state)    the same format, any world size / strategy

Weights are loaded into the plain drafter before `setup`, so every strategy starts from them.
The process group itself (`DistEnv`, `init_distributed`, the collectives) is `distributed`.
FSDP2's modules (``torch.distributed.checkpoint`` takes about a second to import) and DeepSpeed
are imported only by the strategy that uses them.
"""
from __future__ import annotations

import importlib
import logging
import os
from contextlib import contextmanager, nullcontext
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from deepspec.config.loader import project_root

from .distributed import DistEnv
from .optim import build_adamw, param_groups, trainable_named_parameters
from .precision import use_bf16

log = logging.getLogger(__name__)

OptimState = Dict[str, Dict[str, torch.Tensor]]


# ---------------------------------------------------------------------------------------------
# strategies
# ---------------------------------------------------------------------------------------------
class SingleStrategy:
    """One process (or the plain per-rank logic the others extend)."""

    name = "single"

    def __init__(self, env: DistEnv, cfg):
        self.env, self.cfg = env, cfg
        self.drafter: Optional[nn.Module] = None
        self.model: Optional[nn.Module] = None
        self.optimizer: Optional[torch.optim.Optimizer] = None

    # -- setup -------------------------------------------------------------------------------
    def setup(self, drafter: nn.Module) -> None:
        self.drafter = drafter
        if self.cfg.compile:
            drafter.compile()   # in place: parameter names are unchanged
        self.model = self._wrap(drafter)
        self.optimizer = build_adamw(self.named_trainable(), self.cfg)

    def _wrap(self, drafter: nn.Module) -> nn.Module:
        return drafter

    def named_trainable(self) -> List[Tuple[str, nn.Parameter]]:
        return trainable_named_parameters(self.drafter)

    # -- step ----------------------------------------------------------------------------------
    def forward(self, batch):
        return self.model(batch)

    def sync(self, last: bool):
        return nullcontext()

    def backward(self, loss: torch.Tensor, accum: int, last: bool) -> None:
        (loss / accum).backward()

    def _set_lr(self, groups, lr: float) -> None:
        for g in groups:
            g["lr"] = lr

    def step(self, lr: float) -> float:
        self._set_lr(self.optimizer.param_groups, lr)
        params = [p for _, p in self.named_trainable()]
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip and self.cfg.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return _to_float(norm)

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    # -- state ---------------------------------------------------------------------------------
    def full_state(self) -> Tuple[Dict[str, torch.Tensor], OptimState]:
        names = {id(p): n for n, p in self.named_trainable()}
        weights = {n: p.detach().float().cpu().clone() for n, p in self.named_trainable()}
        optim = {names[id(p)]: {k: v.detach().cpu().clone() for k, v in st.items() if torch.is_tensor(v)}
                 for p, st in self.optimizer.state.items() if id(p) in names}
        return weights, optim

    def load_optimizer_state(self, state: OptimState) -> None:
        sd = self.optimizer.state_dict()
        names = {id(p): n for n, p in self.named_trainable()}
        order = [names[id(p)] for g in self.optimizer.param_groups for p in g["params"]]
        missing = [n for n in order if n not in state]
        if missing:
            raise KeyError(f"optimizer state missing for {len(missing)} parameter(s), e.g. {missing[:3]}")
        sd["state"] = {i: dict(state[n]) for i, n in enumerate(order)}
        self.optimizer.load_state_dict(sd)

    def sync_checksum(self) -> Optional[float]:
        """A checksum of the trainable weights on this rank (None where sharded)."""
        acc = torch.zeros((), dtype=torch.float64)
        for i, (_, p) in enumerate(self.named_trainable()):
            d = p.detach().double().cpu().reshape(-1)
            acc += d.sum() * (i + 1) + (d * d).sum()
        return float(acc)


class DDPStrategy(SingleStrategy):
    name = "ddp"

    def _wrap(self, drafter: nn.Module) -> nn.Module:
        if not self.env.distributed or self.env.world_size == 1:
            return drafter
        ids = [self.env.device.index] if self.env.device.type == "cuda" else None
        return DDP(drafter, device_ids=ids, broadcast_buffers=False,
                   find_unused_parameters=self.cfg.ddp_find_unused_parameters)

    def sync(self, last: bool):
        if last or self.model is self.drafter:
            return nullcontext()
        return self.model.no_sync()


class FSDPStrategy(SingleStrategy):
    """FSDP2 (`fully_shard`) on the drafter as one unit.

    Parameters, gradients and AdamW state are sharded across ranks; the forward all-gathers
    the draft once.  Blocks are deliberately not sharded separately: drafters call their
    layers outside ``forward`` (e.g. projecting the context K/V of every layer up front),
    which per-block FSDP hooks would not see.  Drafts are small next to the target, so one
    unit costs little.  Frozen parameters, if a drafter has any, are left unsharded."""

    name = "fsdp"

    def _wrap(self, drafter: nn.Module) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh(self.env.device.type, (self.env.world_size,))
        frozen = {p for p in drafter.parameters() if not p.requires_grad}
        kw = {"mesh": mesh}
        if use_bf16(self.cfg.bf16, self.env.device) and self.env.device.type == "cuda":
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fully_shard(drafter, ignored_params=frozen or None, **kw)
        return drafter

    @contextmanager
    def sync(self, last: bool):
        self.model.set_requires_gradient_sync(last)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def _options(self, **kw):
        from torch.distributed.checkpoint.state_dict import StateDictOptions
        return StateDictOptions(full_state_dict=True, **kw)

    def full_state(self):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
        names = [n for n, _ in self.named_trainable()]
        msd = get_model_state_dict(self.model, options=self._options(cpu_offload=True))
        osd = get_optimizer_state_dict(self.model, self.optimizer, options=self._options(cpu_offload=True))
        if not self.env.is_main:
            return {}, {}
        weights = {n: msd[n].float() for n in names}
        optim = {n: {k: v for k, v in st.items() if torch.is_tensor(v)} for n, st in osd["state"].items()}
        return weights, optim

    def load_optimizer_state(self, state: OptimState) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
        names = {id(p): n for n, p in self.named_trainable()}
        groups = []
        for g in self.optimizer.param_groups:
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": [names[id(p)] for p in g["params"]]})
        set_optimizer_state_dict(self.model, self.optimizer, {"state": state, "param_groups": groups},
                                 options=self._options())

    def sync_checksum(self):
        return None  # one copy of each shard: in sync by construction


class DeepSpeedStrategy(SingleStrategy):
    """DeepSpeed ZeRO-1/2 with torch's own AdamW (`torch_adam`): nothing is JIT-compiled."""

    name = "deepspeed"

    def setup(self, drafter: nn.Module) -> None:
        self.drafter = drafter
        if self.cfg.compile:
            drafter.compile()
        deepspeed = _import_deepspeed(self.env)
        t = self.cfg
        if t.deepspeed_stage not in (1, 2):
            raise ValueError(f"train.deepspeed_stage={t.deepspeed_stage}: ZeRO stage 1 or 2 is supported")
        accum = t.global_batch_sequences // (t.micro_batch_sequences * self.env.world_size)
        config = {
            "train_batch_size": t.global_batch_sequences,
            "train_micro_batch_size_per_gpu": t.micro_batch_sequences,
            "gradient_accumulation_steps": accum,
            "optimizer": {"type": "AdamW", "params": {
                "lr": t.lr, "betas": [t.betas_1, t.betas_2], "eps": t.eps, "weight_decay": t.weight_decay,
                "torch_adam": True}},
            "zero_optimization": {"stage": t.deepspeed_stage, "contiguous_gradients": True,
                                  "overlap_comm": self.env.device.type == "cuda"},
            "gradient_clipping": t.grad_clip if t.grad_clip and t.grad_clip > 0 else 0.0,
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }
        engine, optimizer, _, _ = deepspeed.initialize(
            model=drafter, model_parameters=param_groups(self.named_trainable(), t.weight_decay),
            config=config, dist_init_required=False)
        self.model, self.optimizer = engine, optimizer

    def backward(self, loss, accum, last):
        self.model.backward(loss)          # DeepSpeed divides by the accumulation steps itself
        if not last:
            self.model.step()              # bookkeeping only off the accumulation boundary

    def step(self, lr: float) -> float:
        self._set_lr(self.optimizer.param_groups, lr)
        self.model.step()
        norm = self.model.get_global_grad_norm()
        return _to_float(norm) if norm is not None else float("nan")

    def _zero(self):
        return self.optimizer  # DeepSpeedZeroOptimizer

    def full_state(self):
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
        zero = self._zero()
        # DeepSpeed links each parameter to its optimizer-state fragment after the first step of
        # param group 0, before the other groups have state; link again now that all have it.
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()
        step = None
        for flat in zero.single_partition_of_fp32_groups:
            st = zero.optimizer.state.get(flat, {})
            if "step" in st:
                step = torch.as_tensor(st["step"]).detach().cpu().float().clone()
                break
        weights, optim = {}, {}
        for n, p in self.named_trainable():   # collectives: same order on every rank
            w = safe_get_full_fp32_param(p)
            st = {k: safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")}
            if self.env.is_main:
                weights[n] = w.detach().float().cpu().clone()
                optim[n] = {k: v.detach().float().cpu().clone() for k, v in st.items() if v is not None}
                if step is not None:
                    optim[n]["step"] = step.clone()
        return weights, optim

    def load_optimizer_state(self, state: OptimState) -> None:
        from deepspeed.utils import safe_set_full_optimizer_state
        zero = self._zero()
        any_state = next(iter(state.values()), {})
        step = torch.as_tensor(any_state.get("step", 0.0)).float()
        for flat in zero.single_partition_of_fp32_groups:
            zero.optimizer.state[flat] = {"step": step.clone(), "exp_avg": torch.zeros_like(flat),
                                          "exp_avg_sq": torch.zeros_like(flat)}
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()
        for n, p in self.named_trainable():
            for k in ("exp_avg", "exp_avg_sq"):
                safe_set_full_optimizer_state(p, state[n][k].to(p.device, torch.float32), k)

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)


def _import_deepspeed(env: DistEnv):
    """Import DeepSpeed so that nothing gets JIT-compiled: on CPU its shared-memory collective
    op (a C++ extension) is marked unavailable and gloo does the communication."""
    if "TORCH_EXTENSIONS_DIR" not in os.environ:
        root = project_root() / ".torch_extensions"
        try:
            root.mkdir(parents=True, exist_ok=True)
            os.environ["TORCH_EXTENSIONS_DIR"] = str(root)
        except OSError:
            pass
    import deepspeed
    ops = importlib.import_module("deepspeed.ops")
    if env.device.type == "cpu":
        compat = ops.__dict__.get("__compatible_ops__")
        if compat is None:
            ops.__compatible_ops__ = {"deepspeed_shm_comm": False}
        else:
            compat["deepspeed_shm_comm"] = False
    try:
        from deepspeed.utils import logger as ds_logger
        ds_logger.setLevel(logging.WARNING)
    except Exception:  # pragma: no cover - logging only
        pass
    return deepspeed


def _to_float(x) -> float:
    if hasattr(x, "full_tensor"):
        x = x.full_tensor()
    return float(x)


def build_strategy(env: DistEnv, train_cfg):
    name = train_cfg.strategy
    if name == "ddp" and env.world_size == 1:
        log.info("train.strategy=ddp with one process: running as single")
    return {"single": SingleStrategy, "ddp": DDPStrategy, "fsdp": FSDPStrategy,
            "deepspeed": DeepSpeedStrategy}[name](env, train_cfg)
