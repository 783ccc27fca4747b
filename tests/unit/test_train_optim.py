"""Warmup + cosine schedule and AdamW parameter groups."""
import math

import pytest
import torch

from deepspec.config import TrainConfig
from deepspec.train.optim import build_adamw, lr_at, param_groups, warmup_steps


def test_warmup_then_cosine_to_min():
    total, base = 100, 1e-3
    lrs = [lr_at(s, total, base, warmup_ratio=0.1, min_lr_ratio=0.1) for s in range(total)]
    assert warmup_steps(total, 0.1) == 10
    assert lrs[:10] == pytest.approx([base * (s + 1) / 10 for s in range(10)])
    assert lrs[9] == pytest.approx(base) and lrs[10] == pytest.approx(base)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))           # monotone decay
    mid = 10 + 45
    assert lrs[mid] == pytest.approx(base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5))))
    assert lr_at(total, total, base, 0.1, 0.1) == pytest.approx(0.1 * base)  # end of the run
    assert min(lrs) > 0.1 * base - 1e-12


def test_no_warmup_and_single_step():
    assert lr_at(0, 10, 1.0, 0.0, 0.0) == pytest.approx(1.0)
    assert lr_at(0, 1, 1.0, 0.5, 0.0) == pytest.approx(1.0)   # warmup of one step reaches the peak


def test_param_groups_decay_only_matrices():
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    groups = param_groups(m.named_parameters(), 0.1)
    assert [len(g["params"]) for g in groups] == [1, 3]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    opt = build_adamw(m.named_parameters(), TrainConfig(lr=1e-3, weight_decay=0.1))
    assert opt.defaults["betas"] == (0.9, 0.999)
    with pytest.raises(TypeError, match="fp32"):
        build_adamw(torch.nn.Linear(2, 2).to(torch.bfloat16).named_parameters(), TrainConfig())


def test_adamw_is_fused_for_plain_parameters():
    from deepspec.config.train import TrainConfig
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = build_adamw([("w", p)], TrainConfig())
    assert opt.defaults["fused"] is True


def test_bf16_flag_auto_follows_the_device():
    from deepspec.train.precision import cpu_has_native_bf16, use_bf16
    cpu = torch.device("cpu")
    assert use_bf16(None, cpu) == cpu_has_native_bf16()
    assert use_bf16(True, cpu) is True and use_bf16(False, cpu) is False
