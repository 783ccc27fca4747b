"""The short measured probes behind `deepspec plan` (`plan`), run on the current device.

`encode_conversations` tokenises the sampled conversations (assuming answer tokens for user-only
records), `probe_capture` runs the builder's own capture batching and codec on a few captured
tokens (bytes/token, capture tok/s, encode MB/s), `probe_decode` times greedy KV-cached decoding
and `probe_train` a forward+backward of the configured drafter.
"""
from __future__ import annotations

import time
from typing import List

import numpy as np
import torch

from ..cache.format import BLOB_COLUMNS
from ..drafts import build_drafter
from ..cache.capture import capture_batch, encode_row, length_batches, pad_token_id
from ..targets.chat import encode_prompt
from ..train.anchors import sample_anchors
from ..train.data import collate


def encode_conversations(target, convs, max_length: int, response_tokens: int):
    """Token ids + loss masks; user-only records get ``response_tokens`` assumed per turn."""
    items, assumed = [], 0
    for conv in convs:
        try:
            if any(m.get("role") == "assistant" and m.get("content") for m in conv):
                enc = target.encode_chat(conv)
                ids, mask = list(enc.input_ids), list(enc.loss_mask)
            else:
                turns = sum(m.get("role") == "user" for m in conv) or 1
                ids = encode_prompt(target.tokenizer, conv, **target.chat_template_kwargs)
                ids = ids + [ids[-1]] * (response_tokens * turns)  # stand-in tokens for the answers
                mask = [0] * (len(ids) - response_tokens * turns) + [1] * (response_tokens * turns)
                assumed += 1
        except Exception:  # a record the template cannot render: counted as skipped
            items.append(None)
            continue
        ids, mask = ids[:max_length], mask[:max_length]
        items.append((ids, mask) if any(mask) else None)
    return items, assumed


def probe_capture(target, codec, items, probe_tokens: int, batch_tokens: int):
    """(tokens, bytes/token incl. ids+mask, capture tok/s, encode MB/s, captured samples)."""
    chosen, tot = [], 0
    for k, (ids, mask) in enumerate(items):
        ids = ids[: max(1, probe_tokens - tot)] if tot else ids[:probe_tokens]
        mask = mask[: len(ids)]
        chosen.append({"index": k, "id": str(k), "ids": np.asarray(ids, np.int32),
                       "mask": np.asarray(mask, np.uint8)})
        tot += len(ids)
        if tot >= probe_tokens:
            break
    pad = pad_token_id(target)
    batches = list(length_batches(chosen, batch_tokens))
    capture_batch(target, batches[-1][:1], pad)  # warm-up (kernels, caches)
    cap_t = enc_t = 0.0
    nbytes = raw = 0
    captured = []
    for batch in batches:
        t0 = time.perf_counter()
        f, h, lse = capture_batch(target, batch, pad)
        if target.device.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        for b, it in enumerate(batch):
            row = encode_row(codec, it, f[b], h[b], lse[b])
            nbytes += sum(len(row[c]) for c in BLOB_COLUMNS)
            t = len(it["ids"])
            raw += t * 2 * (f.shape[-1] + h.shape[-1])
            captured.append({"input_ids": torch.from_numpy(it["ids"].astype(np.int64)),
                             "loss_mask": torch.from_numpy(it["mask"].astype(bool)),
                             "features": f[b, :t], "last_hidden": h[b, :t]})
        enc_t += time.perf_counter() - t1
        cap_t += t1 - t0
    return tot, nbytes / tot, tot / cap_t, raw / enc_t / 1e6, captured


@torch.inference_mode()
def probe_decode(target, prompts: List[List[int]], steps: int) -> float:
    """Greedy KV-cached decode tokens/s at batch len(prompts) (left-aligned equal-length prompts)."""
    T = min(len(p) for p in prompts)
    ids = torch.tensor([p[:T] for p in prompts], dtype=torch.long, device=target.device)
    out = target.decode(ids)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    pkv = out.past_key_values
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        out = target.decode(nxt, past_key_values=pkv)
        pkv = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    sync()
    return len(prompts) * steps / (time.perf_counter() - t0)


def probe_train(target, cfg, captured, max_anchors: int = 64, repeats: int = 3) -> float:
    """Drafter forward+backward on probe samples: anchor blocks per second.

    At most 2 sequences and ``max_anchors`` anchors each, so the probe stays short on a
    CPU; the context part of the cost is then spread over fewer anchors than in real
    training, which makes the estimate conservative."""
    drafter = build_drafter(target, cfg.draft)
    drafter.train()
    A = int(cfg.train.anchors_per_sequence)
    A = max_anchors if A <= 0 else min(A, max_anchors)
    samples = captured[: max(1, min(2, int(cfg.train.micro_batch_sequences), len(captured)))]
    anchors = [sample_anchors(s["loss_mask"], A, seed=i) for i, s in enumerate(samples)]
    n_anchors = sum(int(a.numel()) for a in anchors)
    if n_anchors == 0:
        raise ValueError("no valid anchor in the probe samples")
    batch = collate(samples, anchors)
    batch = {k: (v.to(target.device, target.dtype) if k in ("features", "last_hidden") else v.to(target.device))
             for k, v in batch.items()}
    params = [p for p in drafter.parameters() if p.requires_grad]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = drafter(batch)
        out["loss"].backward()
        for p in params:
            p.grad = None
        if target.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return n_anchors / min(times[1:] or times)
