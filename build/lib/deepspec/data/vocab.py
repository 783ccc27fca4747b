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

from ..errors import DeepSpecError

FORMAT = "deepspec.draft_vocab/1"
#: the sizes `deepspec cache info` reports coverage for (EAGLE-3 / SpecForge commonly use 32k)
REPORT_SIZES = (8192, 16384, 32768)


class VocabError(DeepSpecError, ValueError):
    """A draft vocabulary that does not fit its target or its data."""


def count_answer_tokens(samples: Iterable, vocab_size: Optional[int]) -> np.ndarray:
    """int64 [vocab_size]: how often each token is an answer (loss-masked) token in ``samples``
    (each a mapping with ``input_ids`` and ``loss_mask``).  ``vocab_size=None`` (the vocabulary is
    not known, e.g. `deepspec cache info` without a target): as long as the largest id seen + 1."""
    counts = np.zeros(int(vocab_size or 0), dtype=np.int64)
    for s in samples:
        ids = np.asarray(s["input_ids"]).reshape(-1)
        mask = np.asarray(s["loss_mask"]).reshape(-1).astype(bool)
        sel = ids[mask[: ids.shape[0]]]
        if not sel.size:
            continue
        if sel.min() < 0 or (vocab_size is not None and sel.max() >= vocab_size):
            bad = int(sel.min()) if sel.min() < 0 else int(sel.max())
            raise VocabError(f"token id {bad} outside the target vocabulary of {vocab_size}")
        b = np.bincount(sel, minlength=counts.shape[0])
        if b.shape[0] > counts.shape[0]:
            counts = np.concatenate([counts, np.zeros(b.shape[0] - counts.shape[0], dtype=np.int64)])
        counts += b
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


def top_coverage(counts: np.ndarray, n: int) -> float:
    """Coverage of the ``n`` most frequent tokens (ties do not change it; 1.0 once ``n`` reaches the
    number of distinct tokens) — `select_top` without tokens forced in, for data without a target."""
    total = int(counts.sum())
    if not total or int(n) >= int(np.count_nonzero(counts)):
        return 1.0
    if int(n) <= 0:
        return 0.0
    top = np.partition(counts, counts.shape[0] - int(n))[counts.shape[0] - int(n):]
    return float(top.sum() / total)


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


def ids_problem(ids, vocab_size: int) -> Optional[str]:
    """What is wrong with ``ids`` as a draft vocabulary of a ``vocab_size``-token target (None: nothing):
    a non-empty 1-D list of integer target ids, in range, strictly increasing."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.size == 0:
        return f"expected a non-empty 1-D list of token ids, got shape {list(ids.shape)}"
    if not np.issubdtype(ids.dtype, np.integer):
        return f"expected integer token ids, got {ids.dtype}"
    if ids.size > vocab_size:
        return f"{ids.size} ids for a target vocabulary of {vocab_size} tokens"
    if ids.min() < 0 or ids.max() >= vocab_size:
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        return f"token id {bad} outside the target vocabulary 0..{vocab_size - 1}"
    if np.any(np.diff(ids) <= 0):
        k = int(np.argmax(np.diff(ids) <= 0))
        return f"token ids must be strictly increasing (position {k + 1}: {int(ids[k])} then {int(ids[k + 1])})"
    return None


def check_ids(ids: np.ndarray, vocab_size: int, where: str = "draft vocabulary") -> None:
    problem = ids_problem(ids, vocab_size)
    if problem:
        raise VocabError(f"{where}: {problem}")
