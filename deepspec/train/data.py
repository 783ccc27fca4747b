"""Training data: sequences from the cache (or online from regen JSONL) → anchored micro-batches.

Order of samples (deterministic, independent of world size):
  * the train/held-out split is a seeded permutation of the source's indices;
  * the training stream is the concatenation of per-epoch seeded permutations of the train
    indices; global batch ``k`` after ``consumed`` sequences is stream[consumed : consumed + G];
  * inside a global batch, sequences are sorted by length (less padding) and cut into
    micro-batches of ``M``; micro-batch ``j`` goes to rank ``j % world`` — so the set of
    micro-batches of a step is the same for any world size, only their placement changes;
  * anchors of a sample depend on (seed, epoch, sample index) only (`anchors.py`).
The data position is therefore just "sequences consumed", which a checkpoint stores.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from deepspec.cache.manifest import layer_positions
from deepspec.data.split import is_heldout
from deepspec.targets.chat import ChatTemplateError

from .anchors import anchor_seed, sample_anchors

log = logging.getLogger(__name__)

_EPOCH_SALT = 0xDA7A


# ---------------------------------------------------------------------------------------------
# sources: index -> {"input_ids", "loss_mask"[, "features", "last_hidden"[, "target_lse"]]}
# ---------------------------------------------------------------------------------------------
class CachedSequences:
    """Samples of a hidden-state cache (`deepspec.cache.CacheReader`), cut to ``max_length``."""

    has_features = True

    def __init__(self, reader, max_length: Optional[int] = None, layer_ids: Optional[Sequence[int]] = None):
        """``layer_ids``: a subset of the cache's layers to read (None = all of them, in cache order)."""
        self.reader = reader
        self.max_length = max_length
        self._lengths: Optional[List[int]] = None
        pos = None if layer_ids is None else layer_positions(reader.layer_ids, layer_ids)
        self._layers = None if pos == list(range(len(reader.layer_ids))) else pos

    def __len__(self) -> int:
        return len(self.reader)

    def lengths(self) -> List[int]:
        if self._lengths is None:
            self._lengths = [min(n, self.max_length or n) for n in _cache_lengths(self.reader)]
        return self._lengths

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        s = self.reader[int(i)]
        n = s["input_ids"].shape[0] if not self.max_length else min(s["input_ids"].shape[0], self.max_length)
        feats = s["features"][:n]
        if self._layers is not None:    # [n, L·H] → the chosen layers' slices, in the drafter's order
            feats = feats.view(n, len(self.reader.layer_ids), -1)[:, self._layers].reshape(n, -1)
        out = {"input_ids": s["input_ids"][:n].long(), "loss_mask": s["loss_mask"][:n].bool(),
               "features": feats, "last_hidden": s["last_hidden"][:n]}
        if "target_lse" in s:
            out["target_lse"] = s["target_lse"][:n]
        return out

    def sample_ids(self) -> List[str]:
        return [self.reader.sample_id(i) for i in range(len(self.reader))]

    def tokens(self, i: int) -> Dict[str, torch.Tensor]:
        """input_ids and loss_mask only (no feature decoding), cut like ``self[i]``."""
        s = self.reader.tokens(int(i))
        n = s["input_ids"].shape[0] if not self.max_length else min(s["input_ids"].shape[0], self.max_length)
        return {"input_ids": s["input_ids"][:n], "loss_mask": s["loss_mask"][:n]}


def _cache_lengths(reader) -> List[int]:
    """Per-sample token counts, from the reader's index when it has one (no feature reads)."""
    for name in ("lengths", "sample_lengths"):
        v = getattr(reader, name, None)
        if v is not None:
            v = v() if callable(v) else v
            return [int(x) for x in v]
    fn = getattr(reader, "length", None)
    if callable(fn):
        return [int(fn(i)) for i in range(len(reader))]
    man = getattr(reader, "manifest", None) or {}
    if isinstance(man.get("lengths"), list) and len(man["lengths"]) == len(reader):
        return [int(x) for x in man["lengths"]]
    log.info("cache reader has no length index: reading every sample once to get lengths")
    return [int(reader[i]["input_ids"].shape[0]) for i in range(len(reader))]


class OnlineSequences:
    """Regenerated conversations tokenized with the target's chat template (no features)."""

    has_features = False

    def __init__(self, samples: List[Tuple[List[int], List[int]]], ids: Optional[List[str]] = None):
        self.samples = samples
        self.ids = ids or [str(i) for i in range(len(samples))]

    @classmethod
    def from_jsonl(cls, path, target, max_length: Optional[int] = None) -> "OnlineSequences":
        """Encode every conversation; like the cache builder, keep ``max_length`` (data.max_length)
        tokens and skip conversations without assistant tokens there."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"online training needs the regenerated conversations at {path} "
                                    "(run `deepspec prepare` or set data.regen_path)")
        samples, ids, bad, empty = [], [], 0, 0
        with path.open() as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                rec = json.loads(line)
                try:
                    enc = target.encode_chat(rec["conversations"])
                except (ChatTemplateError, KeyError, TypeError) as e:
                    bad += 1
                    log.warning("%s:%d: skipped (%s)", path, lineno, e)
                    continue
                n = len(enc.input_ids) if not max_length else min(len(enc.input_ids), max_length)
                if n == 0 or not any(enc.loss_mask[:n]):   # nothing to learn (the cache skips these too)
                    empty += 1
                    continue
                samples.append((list(enc.input_ids[:n]), list(enc.loss_mask[:n])))
                ids.append(str(rec.get("id", lineno)))
        if bad:
            log.warning("%s: %d conversation(s) could not be encoded and were skipped", path, bad)
        if empty:
            log.info("%s: %d conversation(s) without assistant tokens within %s tokens skipped", path, empty,
                     max_length)
        return cls(samples, ids)

    def __len__(self) -> int:
        return len(self.samples)

    def lengths(self) -> List[int]:
        return [len(s[0]) for s in self.samples]

    def sample_ids(self) -> List[str]:
        return list(self.ids)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        ids, mask = self.samples[int(i)]
        return {"input_ids": torch.tensor(ids, dtype=torch.long), "loss_mask": torch.tensor(mask, dtype=torch.bool)}


class OnlineFeatures:
    """Adds target features to a collated batch: one frozen forward per micro-batch.

    Runs in inference mode (in the target's dtype, e.g. bf16) and casts to ``dtype`` (bf16 by
    default, what the cache stores) so online and cached training see the same inputs.  With
    ``with_lse`` it adds ``target_lse`` as a cache build stores it (fp32, from the cast last_hidden)."""

    def __init__(self, target, dtype: Optional[torch.dtype] = torch.bfloat16, with_lse: bool = False):
        self.target = target
        self.dtype = dtype
        self.with_lse = with_lse

    def __call__(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        am = batch["attention_mask"]
        cap = self.target.capture(batch["input_ids"], attention_mask=am.long())
        keep = am.to(cap.features.device)[..., None]
        for key, t in (("features", cap.features), ("last_hidden", cap.last_hidden)):
            # copy=True leaves inference mode's tensors behind (they cannot be saved for backward)
            out = t.to(dtype=self.dtype or t.dtype, copy=True)
            batch[key] = out.masked_fill_(~keep, 0)
        if self.with_lse:
            batch["target_lse"] = self.target.log_normalizer(batch["last_hidden"]).masked_fill_(~keep[..., 0], 0)
        return batch


# ---------------------------------------------------------------------------------------------
# split and order
# ---------------------------------------------------------------------------------------------
def split_heldout(sample_ids: Sequence[str], fraction: float, seed: int) -> Tuple[List[int], List[int]]:
    """(train indices, held-out indices) of a source's samples, both sorted: the data split of
    `deepspec.data.split` (a seeded hash of each sample id, ``data.heldout_fraction``), the same one
    that chose the held-out prompts at regeneration."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"data.heldout_fraction must be in [0, 1), got {fraction}")
    train, held = [], []
    for i, sid in enumerate(sample_ids):
        (held if is_heldout(sid, fraction, seed) else train).append(i)
    return train, held


@dataclass
class MicroBatchRef:
    """One micro-batch: the (epoch, sample index) pairs it holds."""
    items: List[Tuple[int, int]]


class GlobalBatchPlan:
    """Which samples each rank's micro-batches hold, as a pure function of sequences consumed."""

    def __init__(self, indices: Sequence[int], global_batch: int, micro_batch: int, world_size: int,
                 seed: int, lengths: Optional[Sequence[int]] = None):
        check_batch_sizes(global_batch, micro_batch, world_size)
        if len(indices) == 0:
            raise ValueError("no training sequences (the dataset or its train split is empty)")
        self.indices = np.asarray(list(indices), dtype=np.int64)
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.world_size = world_size
        self.seed = seed
        self.lengths = None if lengths is None else np.asarray(list(lengths), dtype=np.int64)
        self.accum = global_batch // (micro_batch * world_size)

    def __len__(self) -> int:
        return len(self.indices)

    @lru_cache(maxsize=4)
    def epoch_order(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([int(self.seed) & 0xFFFFFFFF, int(epoch), _EPOCH_SALT])
        return self.indices[rng.permutation(len(self.indices))]

    def global_batch_at(self, consumed: int) -> List[Tuple[int, int]]:
        """The G (epoch, sample index) pairs of the global batch starting at stream position ``consumed``."""
        n = len(self.indices)
        out = []
        for q in range(consumed, consumed + self.global_batch):
            epoch, pos = divmod(q, n)
            out.append((epoch, int(self.epoch_order(epoch)[pos])))
        if self.lengths is not None:  # longest first, stable: same micro-batches for any world size
            out.sort(key=lambda t: -int(self.lengths[t[1]]))
        return out

    def micro_batches(self, consumed: int, rank: int) -> List[MicroBatchRef]:
        """This rank's ``accum`` micro-batches of the global batch at ``consumed``."""
        items = self.global_batch_at(consumed)
        M, W = self.micro_batch, self.world_size
        chunks = [items[j * M:(j + 1) * M] for j in range(len(items) // M)]
        return [MicroBatchRef(chunks[j]) for j in range(rank, len(chunks), W)]


def check_batch_sizes(global_batch: int, micro_batch: int, world_size: int) -> int:
    """Gradient accumulation steps; a clear error unless G = M × world × accum."""
    if global_batch <= 0 or micro_batch <= 0:
        raise ValueError(f"train.global_batch_sequences ({global_batch}) and train.micro_batch_sequences "
                         f"({micro_batch}) must be positive")
    per_step = micro_batch * world_size
    if global_batch % per_step:
        raise ValueError(
            f"train.global_batch_sequences={global_batch} is not divisible by train.micro_batch_sequences "
            f"× world size = {micro_batch} × {world_size} = {per_step}; the global batch must equal "
            f"micro_batch × world × accumulation (e.g. global_batch_sequences="
            f"{max(per_step, (global_batch // per_step) * per_step)})")
    return global_batch // per_step


# ---------------------------------------------------------------------------------------------
# collate
# ---------------------------------------------------------------------------------------------
def collate(samples: Sequence[Dict[str, torch.Tensor]], anchors: Sequence[torch.Tensor],
            pad_to_multiple_of: int = 1) -> Dict[str, torch.Tensor]:
    """Right-padded training batch (see CONTRACTS.md "Training batch")."""
    B = len(samples)
    lens = [int(s["input_ids"].shape[0]) for s in samples]
    T = max(lens) if lens else 0
    if pad_to_multiple_of > 1:
        T = -(-T // pad_to_multiple_of) * pad_to_multiple_of
    N = max([int(a.numel()) for a in anchors] + [1])
    batch = {"input_ids": torch.zeros(B, T, dtype=torch.long),
             "loss_mask": torch.zeros(B, T, dtype=torch.bool),
             "attention_mask": torch.zeros(B, T, dtype=torch.bool),
             "anchors": torch.full((B, N), -1, dtype=torch.long)}
    per_token = [k for k in ("features", "last_hidden", "target_lse") if k in samples[0]]
    for key in per_token:
        ref = samples[0][key]
        batch[key] = torch.zeros(B, T, *ref.shape[1:], dtype=ref.dtype)
    for b, (s, a) in enumerate(zip(samples, anchors)):
        n = lens[b]
        batch["input_ids"][b, :n] = s["input_ids"]
        batch["loss_mask"][b, :n] = s["loss_mask"]
        batch["attention_mask"][b, :n] = True
        batch["anchors"][b, :a.numel()] = a
        for key in per_token:
            batch[key][b, :n] = s[key]
    return batch


class MicroBatches(torch.utils.data.Dataset):
    """Map-style dataset of this rank's micro-batches from step ``start_step`` on.

    Item ``j`` is micro-batch ``j % accum`` of step ``start_step + j // accum``; the global batch
    of a step starts at ``start_consumed + (step - start_step) * G`` sequences into the stream.
    """

    def __init__(self, source, plan: GlobalBatchPlan, rank: int, start_step: int, start_consumed: int,
                 num_steps: int, anchors_per_sequence: Optional[int], seed: int,
                 pad_to_multiple_of: int = 1):
        self.source, self.plan, self.rank = source, plan, rank
        self.start_step, self.start_consumed, self.num_steps = start_step, start_consumed, num_steps
        self.anchors_per_sequence, self.seed = anchors_per_sequence, seed
        self.pad_to_multiple_of = pad_to_multiple_of

    def __len__(self) -> int:
        return max(self.num_steps, 0) * self.plan.accum

    def consumed_at(self, step: int) -> int:
        return self.start_consumed + (step - self.start_step) * self.plan.global_batch

    def __getitem__(self, j: int) -> Dict[str, torch.Tensor]:
        k, a = divmod(int(j), self.plan.accum)
        ref = self.plan.micro_batches(self.consumed_at(self.start_step + k), self.rank)[a]
        return build_micro_batch(self.source, ref.items, self.anchors_per_sequence, self.seed,
                                 self.pad_to_multiple_of)


def build_micro_batch(source, items: Sequence[Tuple[int, int]], anchors_per_sequence: Optional[int],
                      seed: int, pad_to_multiple_of: int = 1) -> Dict[str, torch.Tensor]:
    samples = [source[i] for _, i in items]
    anchors = [sample_anchors(s["loss_mask"], anchors_per_sequence, anchor_seed(seed, e, i))
               for s, (e, i) in zip(samples, items)]
    return collate(samples, anchors, pad_to_multiple_of)


def loader_workers(num_workers: Optional[int], device: torch.device, world_size: int = 1,
                   online: bool = False) -> int:
    """``train.num_workers``, or None = auto: on a GPU up to 4 worker processes per rank read, decompress and
    collate the next micro-batches while the chip computes (the main process only copies pinned batches);
    on a CPU 0 (workers would take cores from the step), as in online mode (no decompression to hide)."""
    if num_workers is not None:
        return max(0, int(num_workers))
    if device.type != "cuda" or online:
        return 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(4, cpus // max(world_size, 1) - 1))


def heldout_micro_batches(indices: Sequence[int], micro_batch: int, rank: int, world_size: int,
                          max_sequences: Optional[int] = None) -> List[Tuple[List[Tuple[int, int]], float]]:
    """This rank's share of the held-out micro-batches; every rank gets the same count (padded with
    repeats that carry weight 0, so sharded strategies run the same number of forwards)."""
    idx = list(indices)[: max_sequences] if max_sequences else list(indices)
    chunks = [[(-1, i) for i in idx[j:j + micro_batch]] for j in range(0, len(idx), micro_batch)]
    per_rank = -(-len(chunks) // world_size) if chunks else 0
    mine = chunks[rank::world_size]
    weights = [1.0] * len(mine)
    while len(mine) < per_rank:
        mine.append(chunks[0])
        weights.append(0.0)
    return list(zip(mine, weights))
