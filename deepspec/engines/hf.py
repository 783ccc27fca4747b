"""The embedded engine: batched `model.generate` with left padding and a KV cache.

Prompts are rendered with the target's chat template (thinking on/off through the
adapter's ``chat_template_kwargs``), sorted by length, left-padded into batches of
``batch_size`` and generated with the model's KV cache.  Sampling (temperature,
top-k, top-p, min-p) is done per row with the row's own seed (`sampling.PerRowSampler`),
so a sample's text does not depend on the batch it landed in (up to the small
numeric differences padding can cause in low precision); temperature 0 is greedy.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence

import torch
from transformers import GenerationConfig, LogitsProcessorList

from ..targets import load_target
from ..targets.chat import encode_prompt
from .base import Completion, Engine, GenerationError, Messages, Result, SamplingParams, SeedKey, sample_seed
from .sampling import PerRowSampler

log = logging.getLogger(__name__)


class HFEngine(Engine):
    name = "hf"

    def __init__(self, model, tokenizer, *, batch_size: int = 16, chat_template_kwargs: Optional[Dict] = None,
                 max_prompt_tokens: Optional[int] = None, eos_token_ids: Optional[Sequence[int]] = None,
                 model_name: str = "target"):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = max(1, int(batch_size))
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.max_prompt_tokens = max_prompt_tokens
        self.model_name = model_name
        eos = set(int(x) for x in (eos_token_ids or []))
        if not eos:
            gc = getattr(model, "generation_config", None)
            for src in (getattr(gc, "eos_token_id", None), tokenizer.eos_token_id):
                if isinstance(src, int):
                    eos.add(src)
                elif src:
                    eos.update(int(x) for x in src)
        if not eos:
            raise ValueError("the target has no end-of-sequence token: cannot tell when an answer ends")
        self.eos_token_ids = sorted(eos)
        pad = tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else self.eos_token_ids[0])

    # -- construction ------------------------------------------------------------------
    @classmethod
    def from_target(cls, target, **kw) -> "HFEngine":
        """From a `TargetAdapter` (its chat template kwargs and eos ids)."""
        kw.setdefault("chat_template_kwargs", target.chat_template_kwargs)
        kw.setdefault("eos_token_ids", target.eos_token_ids)
        kw.setdefault("model_name", target.name)
        return cls(target.model, target.tokenizer, **kw)

    @classmethod
    def from_config(cls, cfg, device: Optional[str] = None) -> "HFEngine":
        target = load_target(cfg.target, device=device)
        max_prompt = cfg.engine.max_prompt_tokens or cfg.data.max_length
        return cls.from_target(target, batch_size=cfg.engine.batch_size, max_prompt_tokens=max_prompt)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def parallelism(self) -> int:
        return self.batch_size

    def describe(self) -> Dict[str, Any]:
        return {"engine": self.name, "model": self.model_name, "device": str(self.device),
                "dtype": str(next(self.model.parameters()).dtype).replace("torch.", ""),
                "chat_template_kwargs": dict(self.chat_template_kwargs)}

    # -- prompts -------------------------------------------------------------------------
    def encode(self, messages: Messages) -> List[int]:
        return encode_prompt(self.tokenizer, messages, **self.chat_template_kwargs)

    # -- generation ----------------------------------------------------------------------
    def generate(self, prompts: Sequence[Messages], params: SamplingParams,
                 keys: Optional[Sequence[SeedKey]] = None) -> List[Result]:
        n = len(prompts)
        if keys is not None and len(keys) != n:
            raise ValueError(f"{len(keys)} keys for {n} prompts")
        results: List[Optional[Result]] = [None] * n
        encoded: Dict[int, List[int]] = {}
        for i, msgs in enumerate(prompts):
            try:
                ids = self.encode(msgs)
            except Exception as e:  # a template that refuses this conversation
                results[i] = GenerationError(f"cannot render the prompt: {e}", code="bad_request")
                continue
            if self.max_prompt_tokens and len(ids) > self.max_prompt_tokens:
                results[i] = GenerationError(f"prompt has {len(ids)} tokens > max_prompt_tokens="
                                             f"{self.max_prompt_tokens}", code="prompt_too_long")
                continue
            encoded[i] = ids
        seeds = {i: sample_seed(params.seed, None if keys is None else keys[i]) for i in encoded}
        order = sorted(encoded, key=lambda i: (len(encoded[i]), i))
        for s in range(0, len(order), self.batch_size):
            idx = order[s:s + self.batch_size]
            for i, r in zip(idx, self._generate_safe([encoded[i] for i in idx], [seeds[i] for i in idx], params)):
                results[i] = r
        return results  # type: ignore[return-value]

    def _generate_safe(self, batch: List[List[int]], seeds: List[int], params: SamplingParams) -> List[Result]:
        try:
            return self._generate_batch(batch, seeds, params)
        except torch.OutOfMemoryError:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if len(batch) == 1:
                return [GenerationError("out of memory generating a single sequence", code="oom")]
            half = len(batch) // 2
            log.warning("out of memory at batch %d: splitting in two", len(batch))
            return (self._generate_safe(batch[:half], seeds[:half], params)
                    + self._generate_safe(batch[half:], seeds[half:], params))

    @torch.inference_mode()
    def _generate_batch(self, batch: List[List[int]], seeds: List[int], params: SamplingParams) -> List[Result]:
        dev = self.device
        T = max(len(x) for x in batch)
        input_ids = torch.full((len(batch), T), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros((len(batch), T), dtype=torch.long)
        for r, ids in enumerate(batch):
            input_ids[r, T - len(ids):] = torch.tensor(ids, dtype=torch.long)
            attn[r, T - len(ids):] = 1
        input_ids, attn = input_ids.to(dev), attn.to(dev)
        gc = GenerationConfig(max_new_tokens=params.max_new_tokens, do_sample=False, num_beams=1,
                              eos_token_id=list(self.eos_token_ids), pad_token_id=self.pad_token_id,
                              use_cache=True)
        procs = LogitsProcessorList()
        if not params.greedy:
            procs.append(PerRowSampler(torch.tensor(seeds, dtype=torch.int64, device=dev), T, params.temperature,
                                       params.top_k, params.top_p, params.min_p))
        # `generate` fills unset fields from `model.generation_config` (a hub model's repetition
        # penalty, min length, banned words, ...): none of that belongs in the target's own
        # distribution, so a neutral config stands in for the call.
        saved = self.model.generation_config
        self.model.generation_config = GenerationConfig(eos_token_id=list(self.eos_token_ids),
                                                        pad_token_id=self.pad_token_id,
                                                        bos_token_id=getattr(saved, "bos_token_id", None))
        try:
            out = self.model.generate(input_ids=input_ids, attention_mask=attn, generation_config=gc,
                                      logits_processor=procs)
        finally:
            self.model.generation_config = saved
        new = out[:, T:].tolist()
        eos = set(self.eos_token_ids)
        results: List[Result] = []
        for r, toks in enumerate(new):
            stop = next((k for k, t in enumerate(toks) if t in eos), None)
            body = toks if stop is None else toks[:stop]
            text = self.tokenizer.decode(body, skip_special_tokens=True)
            results.append(Completion(text, num_tokens=len(toks) if stop is None else stop + 1,
                                      finish_reason="length" if stop is None else "stop",
                                      prompt_tokens=len(batch[r])))
        return results
