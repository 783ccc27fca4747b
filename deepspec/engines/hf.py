"""The embedded engine: batched, KV-cached generation with left padding.

Prompts are rendered with the target's chat template (thinking on/off through the
adapter's ``chat_template_kwargs``), sorted by length (each batch holds prompts of
neighbouring lengths, so little padding), left-padded into batches of ``batch_size``.
Sampling (temperature, top-k, top-p, min-p) is done per row with the row's own seed
(`sampling.sample_tokens`), so a sample's text does not depend on the batch it landed in
(up to the small numeric differences padding can cause in low precision); temperature 0
is greedy.

Decode loops (``loop``; ``"auto"`` = ``static`` on CUDA where the model allows it, else ``deepspec``):

- ``"deepspec"``: one forward per step on a `DynamicCache`, nothing else per step but the row
  sampler and one host check for finished rows; rows that reached an end-of-sequence token are
  dropped from the batch (the cache, mask, positions and seeds keep the live rows only) once they
  are an eighth of it, so finished rows stop costing compute (what counts on a CPU);
- ``"static"``: a static KV cache and a decode step with fixed shapes, captured as one CUDA graph
  per batch (`static_decode`): on a GPU a step of a small target costs one graph replay instead
  of every layer's Python and kernel launches;
- ``"generate"``: transformers' ``model.generate`` with the same sampler as a logits processor
  (the reference the others are tested against: same tokens under greedy decoding in fp32).
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList

from ..targets import load_target
from ..targets.chat import encode_prompt
from ..targets.attention import cache_kwarg
from .base import Completion, Engine, GenerationError, Messages, Result, SamplingParams, SeedKey, sample_seed
from .sampling import PerRowSampler, sample_tokens
from .static_decode import static_decode, supported

log = logging.getLogger(__name__)


class HFEngine(Engine):
    name = "hf"

    LOOPS = ("auto", "deepspec", "static", "generate")

    def __init__(self, model, tokenizer, *, batch_size: int = 16, chat_template_kwargs: Optional[Dict] = None,
                 max_prompt_tokens: Optional[int] = None, eos_token_ids: Optional[Sequence[int]] = None,
                 model_name: str = "target", loop: str = "auto"):
        if loop not in self.LOOPS:
            raise ValueError(f"engine.hf_loop={loop!r}: choose from {', '.join(self.LOOPS)}")
        self.model = model.eval()
        if loop == "auto":
            loop = "static" if self.device.type == "cuda" and supported(self.model) else "deepspec"
        elif loop == "static":
            if not supported(self.model):
                raise ValueError("engine.hf_loop=static needs a plain causal decoder on sdpa attention "
                                 "(no sliding window or soft-capping): use deepspec or generate")
        self.loop = loop
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
        return cls.from_target(target, batch_size=cfg.engine.batch_size, max_prompt_tokens=max_prompt,
                               loop=getattr(cfg.engine, "hf_loop", "auto"))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def parallelism(self) -> int:
        return self.batch_size

    def describe(self) -> Dict[str, Any]:
        return {"engine": self.name, "loop": self.loop, "model": self.model_name, "device": str(self.device),
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

    def _left_padded(self, batch: List[List[int]]):
        T = max(len(x) for x in batch)
        input_ids = torch.full((len(batch), T), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros((len(batch), T), dtype=torch.long)
        for r, ids in enumerate(batch):
            input_ids[r, T - len(ids):] = torch.tensor(ids, dtype=torch.long)
            attn[r, T - len(ids):] = 1
        dev = self.device
        return input_ids.to(dev, non_blocking=True), attn.to(dev, non_blocking=True), T

    def _generate_batch(self, batch: List[List[int]], seeds: List[int], params: SamplingParams) -> List[Result]:
        loop = {"deepspec": self._decode_loop, "static": self._static_loop, "generate": self._generate_hf}[self.loop]
        return self._results(batch, loop(batch, seeds, params))

    def _static_loop(self, batch: List[List[int]], seeds: List[int], params: SamplingParams) -> List[List[int]]:
        input_ids, attn, _ = self._left_padded(batch)
        seeds_t = torch.tensor(seeds, dtype=torch.int64, device=self.device)
        temp = 0.0 if params.greedy else params.temperature

        def sample(logits, step):
            return sample_tokens(logits, seeds_t, step, temp, params.top_k, params.top_p, params.min_p)
        return static_decode(self.model, input_ids, attn, max_new_tokens=params.max_new_tokens, sample=sample,
                             eos_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id)

    @property
    def _cache_kwarg(self) -> str:
        if not hasattr(self, "_cache_kw"):
            self._cache_kw = cache_kwarg(self.model.forward)
        return self._cache_kw

    def _step_logits(self, ids, attn, pos, cache) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1,
                         **{self._cache_kwarg: cache})
        return out.logits[:, -1, :].float()

    @torch.inference_mode()
    def _decode_loop(self, batch: List[List[int]], seeds: List[int], params: SamplingParams) -> List[List[int]]:
        """Generated token ids per row (EOS included; anything after it is cut by `_results`)."""
        input_ids, attn, _ = self._left_padded(batch)
        dev, B, N = self.device, len(batch), params.max_new_tokens
        pos = (attn.cumsum(-1) - 1).clamp_(min=0)
        seeds_t = torch.tensor(seeds, dtype=torch.int64, device=dev)
        eos_t = torch.tensor(self.eos_token_ids, dtype=torch.long, device=dev)
        out = torch.full((B, N), self.pad_token_id, dtype=torch.long, device=dev)
        rows = torch.arange(B, device=dev)                 # batch row -> original row
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        cache = DynamicCache(config=self.model.config)      # the model's own layer kinds (recurrent ones too)
        droppable = all(hasattr(layer, "batch_select_indices") for layer in cache.layers)
        logits = self._step_logits(input_ids, attn, pos, cache)
        temp = 0.0 if params.greedy else params.temperature
        for step in range(N):
            tok = sample_tokens(logits, seeds_t, step, temp, params.top_k, params.top_p, params.min_p)
            out[rows, step] = tok.masked_fill(done, self.pad_token_id)
            done |= torch.isin(tok, eos_t)
            if step + 1 == N:
                break
            n_done = int(done.sum())                       # the one host synchronisation of a step
            if n_done == done.numel():
                break
            if n_done >= max(1, done.numel() // 8) and droppable:   # drop finished rows
                keep = (~done).nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                attn, pos, seeds_t, rows, tok = attn[keep], pos[keep], seeds_t[keep], rows[keep], tok[keep]
                done = done[keep]
            attn = torch.cat([attn, attn.new_ones(attn.shape[0], 1)], dim=1)
            pos = pos[:, -1:] + 1
            logits = self._step_logits(tok[:, None], attn, pos, cache)
        return out.tolist()

    @torch.inference_mode()
    def _generate_hf(self, batch: List[List[int]], seeds: List[int], params: SamplingParams) -> List[List[int]]:
        dev = self.device
        input_ids, attn, T = self._left_padded(batch)
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
        return out[:, T:].tolist()

    def _results(self, batch: List[List[int]], new: List[List[int]]) -> List[Result]:
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
