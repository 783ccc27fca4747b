"""CUDA checks (marked `cuda`; skipped cleanly without a GPU): the fast paths of one accelerator stay
right there.

- the eval loop is lossless under greedy decoding on CUDA (fp32, tiny targets), through the single-sequence
  causal attention (`targets/attention.py`) that decoding uses on CUDA by default, and it equals the stock
  sdpa path;
- regeneration's static-cache loop replays one CUDA graph per step and gives transformers' `generate` tokens;
- a training step on CUDA (fused loss with the GPU chunk budget) equals the CPU step within tolerance, and
  a short training run from the cache (DataLoader workers, pinned copies) follows the CPU run's losses.
"""
from __future__ import annotations

import json

import pytest
import torch

from conftest import make_tiny_target

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def _greedy():
    from deepspec.decoding.warp import make_warp
    return make_warp(0.0)


def _cuda_target(family="llama", **kw):
    t = make_tiny_target(family, **kw)
    t.model.to("cuda")
    return t


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_greedy_speculative_equals_target_decode_on_cuda(family):
    from deepspec.drafts.model_free import TargetAsDraft
    from deepspec.decoding.chain import speculative_generate
    from deepspec.decoding.loop import target_generate
    from deepspec.config.draft import DraftConfig
    from deepspec.drafts import build_drafter
    t = _cuda_target(family, num_layers=2)
    prompt = list(range(20, 53))
    g = _greedy()
    base = target_generate(t, prompt, max_new_tokens=24, warp=g, eos_token_ids=[])
    assert len(base.tokens) == 24 and base.t_total > 0
    torch.manual_seed(0)
    dspark = build_drafter(t, DraftConfig(algorithm="dspark", num_layers=1, gamma=4, head_rank=16)).eval()
    for d in (TargetAsDraft(t, gamma=4), TargetAsDraft(t, gamma=4, logit_scale=-1.0), dspark):
        spec = speculative_generate(t, d, prompt, gamma=4, max_new_tokens=24, warp=g, eos_token_ids=[])
        assert spec.tokens == base.tokens, type(d).__name__
        assert all(r.t_verify > 0 and r.t_draft > 0 for r in spec.rounds)   # CUDA-event timings were read


def test_offset_causal_attention_on_cuda_matches_stock_sdpa():
    t = _cuda_target("llama")
    assert t.fast_attention is None and t._use_offset_causal()      # on by default on CUDA
    ids = torch.randint(10, t.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1)).cuda()
    outs = {}
    for fast in (False, True):
        t.fast_attention = fast
        o1 = t.decode(ids[:, :30])
        o2 = t.decode(ids[:, 30:38], o1.past_key_values)
        o3 = t.decode(ids[:, 38:39], o1.past_key_values)
        outs[fast] = (o1.logits, o2.logits, o3.logits)
    for a, b in zip(outs[False], outs[True]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_static_decode_replays_a_cuda_graph_and_equals_generate():
    from deepspec.engines import static_decode
    from deepspec.engines.base import SamplingParams
    from deepspec.engines.hf import HFEngine
    from deepspec.targets.tiny import build_tiny
    model, tok = build_tiny("llama")
    model = model.float().cuda()
    prompts = [[{"role": "user", "content": f"hello number {i}" + " tell me more" * (i % 4)}] for i in range(6)]
    sp = SamplingParams(max_new_tokens=20, temperature=0.0)
    auto = HFEngine(model, tok, batch_size=6)
    assert auto.loop == "static"
    a = auto.generate(prompts, sp)
    assert static_decode.LAST["graph"] and static_decode.LAST["replays"] > 0, static_decode.LAST
    b = HFEngine(model, tok, batch_size=6, loop="generate").generate(prompts, sp)
    assert [str(x) for x in a] == [str(x) for x in b]
    s = SamplingParams(max_new_tokens=20, temperature=0.9, seed=4)
    keys = [str(i) for i in range(6)]
    assert HFEngine(model, tok, batch_size=6).generate(prompts, s, keys=keys) == \
        HFEngine(model, tok, batch_size=6, loop="generate").generate(prompts, s, keys=keys)


def _batch(target, B=2, T=48, anchors=6, seed=0):
    from deepspec.train.anchors import sample_anchors
    from deepspec.train.data import collate
    g = torch.Generator().manual_seed(seed)
    samples = []
    for b in range(B):
        n = T - 5 * b
        ids = torch.randint(10, target.vocab_size, (1, n), generator=g)
        cap = target.capture(ids.to(target.device))
        mask = torch.zeros(n, dtype=torch.bool)
        mask[n // 3:] = True
        samples.append({"input_ids": ids[0], "loss_mask": mask, "features": cap.features[0].cpu().to(torch.bfloat16),
                        "last_hidden": cap.last_hidden[0].cpu().to(torch.bfloat16)})
    return collate(samples, [sample_anchors(s["loss_mask"], anchors, seed + i) for i, s in enumerate(samples)])


@pytest.mark.parametrize("algo", ["dspark", "dflash", "eagle3"])
def test_train_step_cpu_equals_cuda(algo):
    """One fp32 forward + backward on the CPU and on CUDA (same weights, same batch): loss and gradients agree."""
    from deepspec.config.draft import DraftConfig
    from deepspec.drafts import build_drafter
    cpu_t = make_tiny_target("llama")
    gpu_t = _cuda_target("llama")
    batch = _batch(cpu_t)
    cfg = DraftConfig(algorithm=algo, num_layers=1, gamma=4, head_rank=16, ttt_steps=3,
                      **({"sequential_head": "none", "confidence_head": False} if algo == "dflash" else {}))
    torch.manual_seed(0)
    d_cpu = build_drafter(cpu_t, cfg)
    torch.manual_seed(0)
    d_gpu = build_drafter(gpu_t, cfg)
    d_gpu.load_state_dict(d_cpu.state_dict())
    out_c = d_cpu(batch)
    out_g = d_gpu({k: v.cuda(non_blocking=True) for k, v in batch.items()})
    out_c["loss"].backward()
    out_g["loss"].backward()
    torch.testing.assert_close(out_g["loss"].cpu(), out_c["loss"], rtol=1e-4, atol=1e-5)
    for (n, pc), (_, pg) in zip(d_cpu.named_parameters(), d_gpu.named_parameters()):
        if pc.grad is not None:
            torch.testing.assert_close(pg.grad.cpu(), pc.grad, rtol=1e-3, atol=1e-5, msg=n)
    # bf16 autocast on CUDA stays close to fp32 (the trainer's default on a GPU)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        lb = d_gpu({k: v.cuda() for k, v in batch.items()})["loss"].float().cpu()
    ref = float(out_c["loss"].detach())
    assert abs(float(lb.detach()) - ref) <= 0.03 * abs(ref) + 1e-3


def test_short_training_run_from_the_cache_cpu_vs_cuda(tmp_path):
    """`deepspec train` from one cache on the CPU and on CUDA (workers + pinned copies there): same
    3-step loss trajectory within tolerance (fp32)."""
    from deepspec.config import load_config
    from deepspec.cache.writer import build_cache
    from tests.support.synthetic import write_regen_jsonl
    from deepspec.train.loop import run
    write_regen_jsonl(tmp_path / "regen.jsonl", 16, seed=3, max_words=40)

    def ov(run_dir, device):
        return [f"run_dir={run_dir}", "target.path=tiny:llama", "target.dtype=float32", "target.num_feature_layers=2",
                f"target.device={device}", "draft=dspark", "draft.num_layers=1", "draft.gamma=3", "draft.head_rank=16",
                f"data.regen_path={tmp_path / 'regen.jsonl'}", "data.max_length=96", f"cache.dir={tmp_path / 'cache'}",
                "train.strategy=single", "train.global_batch_sequences=4", "train.micro_batch_sequences=2",
                "train.anchors_per_sequence=6", "train.max_steps=3", "train.save_every=0", "train.eval_every=0",
                "data.heldout_fraction=0", "train.bf16=false", "train.tensorboard=false"]
    build_cache(load_config(ov(tmp_path / "prep", "cpu")), progress=False)
    losses = {}
    for device in ("cpu", "cuda"):
        rd = tmp_path / device
        run(load_config(ov(rd, device)))
        rows = [json.loads(x) for x in (rd / "metrics.jsonl").read_text().splitlines()]
        losses[device] = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses["cpu"]) == 3
    assert losses["cuda"] == pytest.approx(losses["cpu"], rel=1e-3)
