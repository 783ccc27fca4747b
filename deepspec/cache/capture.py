"""Records to shard rows: read the regen JSONL, tokenise, batch, capture, encode.

``scan_source`` fingerprints the input and ``iter_shards`` yields the lines of each wanted
shard in one pass; ``tokenize_records`` turns a shard's records into token ids + loss masks
(skipping or refusing bad ones per ``data.on_error``), ``length_batches`` packs them by length
into capture batches, ``capture_batch`` runs the target over a batch and ``encode_row`` compresses
one sample into a shard row.  Used by the build (`build`), the codec calibration (`calibrate`)
and the probes behind `deepspec plan` (`deepspec.plan.probes`).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from ..targets.chat import ChatTemplateError
from ..cache.codecs import Codec, encode_array
from ..cache.errors import CacheError


# -- input ---------------------------------------------------------------------------------------------
def scan_source(path: Path) -> Tuple[str, int, int]:
    """(sha256, number of lines, bytes) of the regen JSONL."""
    h = hashlib.sha256()
    lines = 0
    size = 0
    last = b"\n"
    with open(path, "rb") as f:
        while True:
            b = f.read(8 << 20)
            if not b:
                break
            h.update(b)
            lines += b.count(b"\n")
            size += len(b)
            last = b[-1:]
    if last != b"\n":
        lines += 1
    return h.hexdigest(), lines, size


def _parse_record(line: bytes, where: str) -> Tuple[Optional[str], List[Dict[str, str]]]:
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: a record must be a JSON object")
    conv = rec.get("conversations")
    if not isinstance(conv, list) or not conv:
        raise ValueError(f"{where}: 'conversations' must be a non-empty list")
    rid = rec.get("id")
    return (None if rid is None else str(rid)), conv


def iter_shards(path: Path, wanted: List[int], shard_samples: int
                ) -> Iterator[Tuple[int, List[Tuple[int, bytes]]]]:
    """Yield ``(k, [(line_index, raw_line), ...])`` for the wanted shards, in order, one pass."""
    want = set(wanted)
    if not want:
        return
    cur, buf = None, []
    with open(path, "rb") as f:
        for i, line in enumerate(f):
            k = i // shard_samples
            if k != cur:
                if cur in want:
                    yield cur, buf
                    want.discard(cur)
                    if not want:
                        return
                cur, buf = k, []
            if k in want and line.strip():
                buf.append((i, line))
    if cur in want:
        yield cur, buf
        want.discard(cur)
    for k in sorted(want):  # shards past the end of file hold nothing
        yield k, []


# -- tokenise, batch, capture, encode -------------------------------------------------------------------
class _Skip(Exception):
    pass


def tokenize_records(target, records, src: Path, max_length: int, on_error: str, skipped: List[Dict[str, Any]]):
    items = []
    for i, line in records:
        where = f"{src.name}:{i + 1}"
        try:
            rid, conv = _parse_record(line, where)
            try:
                enc = target.encode_chat(conv)
            except ChatTemplateError as e:
                raise ValueError(f"{where}: cannot encode the conversation ({e})") from None
            except Exception as e:  # template engines raise their own types on odd content
                raise ValueError(f"{where}: cannot encode the conversation ({type(e).__name__}: {e})") from None
            ids = list(enc.input_ids)[:max_length]
            mask = list(enc.loss_mask)[:max_length]
            if not ids:
                raise _Skip("no tokens")
            if not any(mask):
                raise _Skip("no assistant (loss) tokens within data.max_length")
        except _Skip as e:
            skipped.append({"index": i, "id": rid, "reason": str(e)})
            continue
        except ValueError as e:
            if on_error != "skip":
                raise CacheError(f"{e} (set data.on_error=skip to skip bad records)") from None
            skipped.append({"index": i, "id": None, "reason": str(e)[:300]})
            continue
        items.append({"index": i, "id": rid if rid is not None else str(i),
                      "ids": np.asarray(ids, dtype=np.int32), "mask": np.asarray(mask, dtype=np.uint8)})
    return items


def length_batches(items, batch_tokens: int):
    """Sort by length (longest first, then input order) and pack ≤ batch_tokens padded tokens."""
    order = sorted(items, key=lambda it: (-len(it["ids"]), it["index"]))
    batch: List[Dict[str, Any]] = []
    for it in order:
        t = len(it["ids"])
        longest = len(batch[0]["ids"]) if batch else t
        if batch and longest * (len(batch) + 1) > batch_tokens:
            yield batch
            batch = []
        batch.append(it)
    if batch:
        yield batch


def pad_token_id(target) -> int:
    tok = target.tokenizer
    if getattr(tok, "pad_token_id", None) is not None:
        return int(tok.pad_token_id)
    eos = target.eos_token_ids
    return int(eos[0]) if eos else 0


def capture_batch(target, batch, pad_id: int, codec: Optional[Codec] = None):
    lens = [len(it["ids"]) for it in batch]
    T = max(lens)
    ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
    am = torch.zeros((len(batch), T), dtype=torch.long)
    for b, it in enumerate(batch):
        ids[b, : lens[b]] = torch.from_numpy(it["ids"].astype(np.int64))
        am[b, : lens[b]] = 1
    cap = target.capture(ids, attention_mask=None if min(lens) == T else am)
    last = cap.last_hidden.to(torch.bfloat16)
    # the log-normaliser of the logits training will see: from last_hidden as ``codec`` stores it, in fp32
    lse = target.log_normalizer(last if codec is None else codec.stored_last_hidden(last.reshape(-1, last.shape[-1]))
                                .reshape(last.shape))
    return cap.features.to(torch.bfloat16).cpu(), last.cpu(), lse.cpu()


def encode_row(codec: Codec, it, feats: torch.Tensor, last: torch.Tensor, lse: torch.Tensor) -> Dict[str, Any]:
    t = len(it["ids"])
    return {"sample_index": it["index"], "id": it["id"], "num_tokens": t,
            "num_loss_tokens": int(it["mask"].sum()),
            "input_ids": encode_array(it["ids"].astype("<i4")), "loss_mask": encode_array(it["mask"]),
            "features": codec.encode(feats[:t], "features"), "last_hidden": codec.encode(last[:t], "last_hidden"),
            "target_lse": encode_array(lse[:t].numpy().astype("<f4"))}
