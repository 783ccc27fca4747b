"""Real-loop τ while training: the lossless decoding loop on fixed held-out prompts.

The trainer's held-out evaluation is teacher-forced (expected τ from per-position acceptance
probabilities on the target's own answers).  What a user gets is the acceptance length of the real
loop, where each round's drafts condition on the tokens the loop itself accepted.  Every
``train.decode_eval_every`` steps this module decodes the first turns of
``train.decode_eval_samples`` held-out prompts (``train.decode_eval_prompts``, by default the
regeneration's ``heldout.jsonl``: prompts whose ids the data split kept out of training) with the
drafter being trained, once per temperature in ``train.decode_eval_temperatures``, and reports

    decode/tau_t{T}      tokens per round, bonus token included (Σ (accepted + 1) / rounds)
    decode/accept_t{T}   accepted / proposed draft tokens
    decode/seconds       wall time of the whole evaluation

The prompts, their order and each request's random generator are fixed, so points along a run (and
across runs on the same prompts) compare.  Runs on rank 0 only; the other ranks wait.
"""
from __future__ import annotations

import time
import zlib
from pathlib import Path
from typing import Dict, List, Sequence

import torch

from deepspec import paths
from deepspec.data.prompts import read_turns_file
from deepspec.targets.chat import encode_prompt

__all__ = ["DecodeEval", "decode_eval_prompts_path"]


def decode_eval_prompts_path(cfg) -> Path:
    """``train.decode_eval_prompts`` or the regeneration's held-out prompts (``heldout.jsonl``)."""
    p = cfg.train.decode_eval_prompts
    return Path(p) if p else paths.heldout_path(cfg)


def _metric_tag(t: float) -> str:
    return f"t{t:g}".replace(".", "p")


class DecodeEval:
    """Decodes the same held-out prompts with the current drafter; ``__call__`` returns the metrics."""

    def __init__(self, cfg, target):
        tc = cfg.train
        path = decode_eval_prompts_path(cfg)
        if not path.is_file():
            raise FileNotFoundError(
                f"train.decode_eval_every={tc.decode_eval_every}: no prompts at {path} (the regeneration's "
                "held-out prompts are written there when data.heldout_fraction > 0); set "
                "train.decode_eval_prompts to a JSONL of {\"turns\": [...]} or train.decode_eval_every=0")
        turns = read_turns_file(path, max_rows=tc.decode_eval_samples)
        if not turns:
            raise ValueError(f"train.decode_eval_prompts: {path} holds no prompts")
        kw = dict(getattr(target, "chat_template_kwargs", {}) or {})
        self.prompts: List[List[int]] = [encode_prompt(target.tokenizer, [{"role": "user", "content": t[0]}], **kw)
                                         for t in turns]
        self.target = target
        self.path = path
        self.temperatures: Sequence[float] = [float(t) for t in tc.decode_eval_temperatures]
        self.max_new_tokens = int(tc.decode_eval_new_tokens)
        self.seed = int(cfg.seed)

    def _generator(self, i: int, temperature: float) -> torch.Generator:
        g = torch.Generator(device=self.target.device)
        g.manual_seed((self.seed * 1_000_003 + zlib.crc32(f"{i}/{temperature:g}".encode())) % (2 ** 63))
        return g

    @torch.no_grad()
    def __call__(self, drafter) -> Dict[str, float]:
        # the loop lives with the evaluator; imported here so that training without it never loads it
        from deepspec.decoding.warp import make_warp
        from deepspec.decoding.chain import speculative_generate

        gamma = int(getattr(drafter, "gamma", None) or drafter.cfg.gamma)
        was_training = drafter.training
        drafter.eval()
        t0 = time.perf_counter()
        out: Dict[str, float] = {}
        try:
            for temp in self.temperatures:
                warp = make_warp(temperature=temp)
                rounds = accepted = proposed = 0
                for i, ids in enumerate(self.prompts):
                    res = speculative_generate(self.target, drafter, ids, gamma=gamma,
                                               max_new_tokens=self.max_new_tokens, warp=warp,
                                               generator=self._generator(i, temp),
                                               eos_token_ids=self.target.eos_token_ids)
                    rounds += len(res.rounds)
                    accepted += sum(r.accepted for r in res.rounds)
                    proposed += sum(r.proposed for r in res.rounds)
                tag = _metric_tag(temp)
                out[f"decode/tau_{tag}"] = (accepted + rounds) / rounds if rounds else float("nan")
                out[f"decode/accept_{tag}"] = accepted / proposed if proposed else float("nan")
        finally:
            drafter.train(was_training)
        out["decode/seconds"] = time.perf_counter() - t0
        return out
