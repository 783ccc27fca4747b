"""Draft vocabulary: the N most frequent target tokens of the training data (EAGLE-3's d2t / t2d).

A drafter with ``draft.vocab_size = N`` scores only these N target tokens.  They are chosen from
the training split's *answer* tokens (the positions the draft is trained to predict), most frequent
first, ties by token id, plus tokens that must always be reachable (the end-of-turn / EOS tokens a
chat template ends answers with).  The ids are kept sorted ascending: draft index i is target token
``ids[i]`` (EAGLE-3 stores this as ``d2t[i] = ids[i] - i``; ``t2d[v]`` says whether v is in the set).

``coverage`` is the fraction of answer tokens inside the set: a drafter can never propose the rest,
so it bounds per-position acceptance from above (on data like its training data).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Iterable, Optional, Sequence

import numpy as np

FORMAT = "deepspec.draft_vocab/1"


class VocabError(ValueError):
    """A draft vocabulary that does not fit its target or its data."""


def count_answer_tokens(samples: Iterable, vocab_size: int) -> np.ndarray:
    """int64 [vocab_size]: how often each token is an answer (loss-masked) token in ``samples``
    (each a mapping with ``input_ids`` and ``loss_mask``)."""
    counts = np.zeros(int(vocab_size), dtype=np.int64)
    for s in samples:
        ids = np.asarray(s["input_ids"]).reshape(-1)
        mask = np.asarray(s["loss_mask"]).reshape(-1).astype(bool)
        sel = ids[mask[: ids.shape[0]]]
        if sel.size and (sel.min() < 0 or sel.max() >= vocab_size):
            raise VocabError(f"token id {int(sel.max())} outside the target vocabulary of {vocab_size}")
        counts += np.bincount(sel, minlength=vocab_size)[:vocab_size]
    return counts


def select_top(counts: np.ndarray, n: int, always: Sequence[int] = ()) -> np.ndarray:
    """Sorted int64 [n]: ``always`` plus the most frequent other tokens (ties by lower id)."""
    V = int(counts.shape[0])
    if not 1 <= int(n) <= V:
        raise VocabError(f"draft.vocab_size={n}: must be between 1 and the target vocabulary size {V}")
    must = sorted({int(t) for t in always if 0 <= int(t) < V})
    if len(must) > n:
        raise VocabError(f"draft.vocab_size={n} is smaller than the {len(must)} tokens that must stay reachable")
    order = np.lexsort((np.arange(V), -counts))          # count descending, then id ascending
    rest = [int(t) for t in order if int(t) not in set(must)][: n - len(must)]
    return np.sort(np.asarray(must + rest, dtype=np.int64))


def coverage(counts: np.ndarray, ids: np.ndarray) -> float:
    total = int(counts.sum())
    return float(counts[np.asarray(ids, dtype=np.int64)].sum() / total) if total else 1.0


def coverage_table(counts: np.ndarray, sizes: Sequence[int], always: Sequence[int] = ()) -> Dict[int, float]:
    """{N: coverage of the top-N selection} for each N that fits the vocabulary."""
    V = int(counts.shape[0])
    return {int(n): coverage(counts, select_top(counts, n, always)) for n in sizes if 1 <= int(n) <= V}


def save_vocab(path, ids: np.ndarray, *, vocab_size: int, tokenizer_fingerprint: Optional[str],
               coverage_value: float, source: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rec = {"format": FORMAT, "target_vocab_size": int(vocab_size), "draft_vocab_size": int(len(ids)),
           "tokenizer": tokenizer_fingerprint, "coverage": coverage_value, "source": source,
           "ids": [int(x) for x in ids]}
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(rec))
    tmp.replace(path)
    return path


def load_vocab(path, *, vocab_size: int, tokenizer_fingerprint: Optional[str] = None) -> np.ndarray:
    """The sorted ids of a saved draft vocabulary, checked against the target it will serve."""
    path = Path(path)
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise VocabError(f"{path}: not a readable draft vocabulary ({e})") from None
    if not isinstance(rec, dict) or rec.get("format") != FORMAT:
        raise VocabError(f"{path}: not a {FORMAT} file")
    if int(rec.get("target_vocab_size", -1)) != int(vocab_size):
        raise VocabError(f"{path}: made for a vocabulary of {rec.get('target_vocab_size')} tokens, "
                         f"the target has {vocab_size}")
    if tokenizer_fingerprint and rec.get("tokenizer") and rec["tokenizer"] != tokenizer_fingerprint:
        raise VocabError(f"{path}: made with another tokenizer ({rec['tokenizer'][:12]}… vs "
                         f"{tokenizer_fingerprint[:12]}…)")
    ids = np.asarray(rec.get("ids", []), dtype=np.int64)
    check_ids(ids, vocab_size, where=str(path))
    return ids


def check_ids(ids: np.ndarray, vocab_size: int, where: str = "draft vocabulary") -> None:
    if ids.ndim != 1 or ids.size == 0:
        raise VocabError(f"{where}: expected a non-empty list of token ids")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise VocabError(f"{where}: token ids outside 0..{vocab_size - 1}")
    if np.any(np.diff(ids) <= 0):
        raise VocabError(f"{where}: token ids must be strictly increasing")
