"""transformers' own decoding on the eval prompts, for `bench/decoding_table.py` (not a benchmark by itself).

`hf_rows` runs `model.generate` on the same target weights, prompts, chat template, token budget and stop
tokens as the `deepspec eval` rows: plain decoding, prompt-lookup decoding
(``prompt_lookup_num_tokens``) and, where an assistant model is given, assisted generation; greedy
(``do_sample=False``) or sampled (``temperature=T, top_k=0, top_p=1``: the eval's warp).  Per row: tokens/s
(generated tokens ÷ wall time of each whole call, prefill included, pooled), τ = tokens per target forward
after the prefill (forwards counted with a hook) with a 95% bootstrap interval over requests, and for greedy
rows how many outputs equal transformers' plain greedy output.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

__all__ = ["choose_lookup_tokens", "eval_prompts", "hf_rows"]


def eval_prompts(target, data_dir: str, benchmarks: Sequence[str], max_samples: int) -> List[List[int]]:
    """First-turn prompt ids of the eval's benchmarks, encoded as `deepspec eval` encodes them."""
    from deepspec.eval.benchmarks import load_benchmarks
    from deepspec.targets.chat import encode_prompt
    kw = dict(getattr(target, "chat_template_kwargs", {}) or {})
    benches = load_benchmarks(data_dir, list(benchmarks), max_samples)
    return [list(encode_prompt(target.tokenizer, [{"role": "user", "content": s.turns[0]}], **kw))
            for ss in benches.values() for s in ss]


def _ratio_ci(num: np.ndarray, den: np.ndarray, resamples: int, seed: int):
    if resamples <= 0 or len(num) == 0 or den.sum() <= 0:
        return None
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(num), size=(resamples, len(num)))
    vals = num[idx].sum(1) / np.maximum(den[idx].sum(1), 1e-12)
    return [float(np.percentile(vals, 2.5)), float(np.percentile(vals, 97.5))]


def _generate_all(model, prompts, gen_kw: Dict[str, Any], seed: int):
    """Per request: (output ids, seconds, target forwards)."""
    import torch
    calls = [0]
    hook = model.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    out = []
    try:
        for i, ids in enumerate(prompts):
            torch.manual_seed(seed * 1_000_003 + i)
            x = torch.tensor([ids], device=model.device)
            calls[0] = 0
            t0 = time.perf_counter()
            with torch.inference_mode():
                y = model.generate(x, attention_mask=torch.ones_like(x), **gen_kw)
            out.append((y[0, x.shape[1]:].tolist(), time.perf_counter() - t0, calls[0]))
    finally:
        hook.remove()
    return out


def _row(runs, resamples: int, seed: int, reference: Optional[list] = None) -> Dict[str, Any]:
    gen = np.array([len(o) for o, _, _ in runs], dtype=float)
    secs = np.array([s for _, s, _ in runs])
    rounds = np.array([max(c - 1, 0) for _, _, c in runs], dtype=float)
    tau_num = np.maximum(gen - 1, 0)
    row = {"requests": len(runs), "tokens_per_s": float(gen.sum() / secs.sum()), "generated_tokens": int(gen.sum()),
           "tau": float(tau_num.sum() / rounds.sum()) if rounds.sum() else None,
           "tau_ci95": _ratio_ci(tau_num, rounds, resamples, seed)}
    if reference is not None:
        row["identical"] = {"matched": sum(o == r for (o, _, _), (r, _, _) in zip(runs, reference)),
                            "compared": len(runs)}
    return row


def _gen_kwargs(max_new_tokens: int, eos: List[int], T: float) -> Dict[str, Any]:
    kw = dict(max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos[0])
    kw.update(dict(do_sample=False, temperature=None, top_k=None, top_p=None) if T == 0 else
              dict(do_sample=True, temperature=float(T), top_k=0, top_p=1.0))
    return kw


def choose_lookup_tokens(target, prompts: List[List[int]], max_new_tokens: int, T: float,
                         candidates: Sequence[int], seed: int = 0) -> Dict[str, Any]:
    """The ``prompt_lookup_num_tokens`` with the most tokens/s on ``prompts`` (the tuning prompts)."""
    base = _gen_kwargs(max_new_tokens, list(target.eos_token_ids), T)
    _generate_all(target.model, prompts[:1], {**base, "max_new_tokens": 8}, seed)
    got = {}
    for k in candidates:
        runs = _generate_all(target.model, prompts, {**base, "prompt_lookup_num_tokens": int(k)}, seed)
        got[str(k)] = sum(len(o) for o, _, _ in runs) / sum(s for _, s, _ in runs)
    return {"tokens_per_s": got, "chosen": int(max(got, key=got.get))}


def hf_rows(target, prompts: List[List[int]], max_new_tokens: int, temperatures: Sequence[float],
            lookup_tokens: Dict[float, int], assistant: Optional[str] = None, resamples: int = 1000,
            seed: int = 0) -> Dict[str, Dict[str, Any]]:
    """{row name: numbers} for plain, prompt-lookup (``lookup_tokens[T]``) and (with ``assistant``) assisted
    generation per temperature."""
    from transformers import AutoModelForCausalLM
    model = target.model
    eos = list(target.eos_token_ids)
    helper = AutoModelForCausalLM.from_pretrained(assistant, torch_dtype=model.dtype) if assistant else None
    rows: Dict[str, Dict[str, Any]] = {}
    for T in temperatures:
        base = _gen_kwargs(max_new_tokens, eos, T)
        _generate_all(model, prompts[:1], {**base, "max_new_tokens": 8}, seed)          # warm-up
        plain = _generate_all(model, prompts, base, seed)
        rows[f"transformers plain generate, T={T:g}"] = {**_row(plain, resamples, seed), "temperature": T,
                                                           "plain": True}
        k = lookup_tokens[T]
        look = _generate_all(model, prompts, {**base, "prompt_lookup_num_tokens": k}, seed)
        rows[f"transformers prompt lookup (prompt_lookup_num_tokens={k}), T={T:g}"] = {
            **_row(look, resamples, seed, plain if T == 0 else None), "temperature": T}
        if helper is not None:
            asst = _generate_all(model, prompts, {**base, "assistant_model": helper}, seed)
            rows[f"transformers assisted generation, T={T:g}"] = {
                **_row(asst, resamples, seed, plain if T == 0 else None), "temperature": T}
    return rows
