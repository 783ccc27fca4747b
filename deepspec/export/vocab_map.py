"""Reduced draft vocabularies (``draft.vocab_size = N``) in the engine formats: EAGLE-3's ``d2t`` / ``t2d``.

A pruned drafter scores only its ``draft_vocab``: N sorted target ids (`deepspec.data.vocab`).  The
engines carry that set the way the EAGLE-3 repository does (sources in docs/export.md):

* ``draft_vocab_size`` = N in the config; the layer config's ``vocab_size`` stays the target's V (the
  engines embed target tokens with it; the DSpark Markov ``markov_w1`` is ``[V, r]``);
* ``d2t`` int64 ``[N]``: draft id i is target id ``i + d2t[i]`` (vLLM ``draft_id_to_target_id``,
  ``compute_logits`` / ``map_draft_to_target``; SGLang ``hot_token_id = d2t + arange(N)``);
* ``t2d`` bool ``[V]``: true on the N draft tokens (speculators ``DraftVocabMixin``; both engines skip
  it at load, we write and check it for consistency);
* ``lm_head.weight`` ``[N, H]``: the target's LM-head rows of those tokens, in draft-id order — the
  engines load the draft's own head whenever ``draft_vocab_size`` differs from the target's
  vocabulary (vLLM refuses a reduced DSpark checkpoint without it).

The drafts are sorted, so ``d2t`` is non-decreasing and ``lm_head`` = ``target_lm_head[t2d]`` (the
speculators construction).  Draft logits are over the N tokens; the engines place them at their
target ids with −inf elsewhere, which is exactly our q = 0 outside the draft vocabulary.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from safetensors import safe_open

from ..data.vocab import ids_problem
from .common import CONFIG_NAME as CONFIG, WEIGHTS_NAME as WEIGHTS
from .errors import ImportUnsupported


def draft_ids(drafter) -> Optional[torch.Tensor]:
    """The sorted target ids [N] (int64, CPU) a drafter scores, or None for the full vocabulary."""
    ids = getattr(drafter, "draft_vocab", None)
    return None if ids is None else ids.detach().to("cpu", torch.long).clone()


def engine_vocab_tensors(ids: torch.Tensor, vocab_size: int) -> Dict[str, torch.Tensor]:
    """``d2t`` int64 [N] (target id − draft id) and ``t2d`` bool [V] of the sorted target ids ``ids``."""
    ids = ids.to("cpu", torch.long)
    t2d = torch.zeros(int(vocab_size), dtype=torch.bool)
    t2d[ids] = True
    return {"d2t": ids - torch.arange(ids.numel()), "t2d": t2d}


def lm_head_rows(target, ids: Optional[torch.Tensor]) -> torch.Tensor:
    """The target's LM head ``[V, H]``, or its rows ``ids`` ``[N, H]`` (CPU copy)."""
    w = target.lm_head.weight.detach().to("cpu")
    return (w if ids is None else w.index_select(0, ids.to("cpu", torch.long))).clone().contiguous()


def mapping_problems(draft_vocab_size: int, d2t: Optional[torch.Tensor], t2d: Optional[torch.Tensor],
                     vocab_size: int) -> List[str]:
    """What is wrong with an engine draft's ``draft_vocab_size`` / ``d2t`` / ``t2d`` for a target of
    ``vocab_size`` tokens, each naming its key (empty list: a consistent mapping)."""
    n, V = int(draft_vocab_size), int(vocab_size)
    out: List[str] = []
    if not 1 <= n <= V:
        return [f"draft_vocab_size={n} is not between 1 and the target vocabulary size {V}"]
    if d2t is None:
        if n < V:
            out.append(f"draft_vocab_size={n} < {V} but there is no d2t (draft id → target id offsets)")
        ids = None
    else:
        if d2t.dim() != 1 or d2t.numel() != n:
            return [f"d2t has shape {list(d2t.shape)}, draft_vocab_size is {n}: they must agree"]
        if d2t.is_floating_point() or d2t.dtype == torch.bool:
            return [f"d2t has dtype {str(d2t.dtype).replace('torch.', '')}, expected integer offsets"]
        ids = torch.arange(n) + d2t.to("cpu", torch.long)
        problem = ids_problem(ids.numpy(), V)
        if problem:
            out.append(f"d2t: the target ids arange({n}) + d2t: {problem}")
            ids = None
    if t2d is not None:
        if t2d.dim() != 1 or t2d.numel() != V:
            out.append(f"t2d has shape {list(t2d.shape)}, expected [{V}] (one flag per target token)")
        else:
            mask = t2d.to("cpu").bool()
            if int(mask.sum()) != n:
                out.append(f"t2d marks {int(mask.sum())} target tokens, draft_vocab_size is {n}")
            elif ids is not None and not bool(mask[ids].all()):
                k = int((~mask[ids]).nonzero()[0])
                out.append(f"d2t and t2d disagree: draft id {k} maps to target id {int(ids[k])}, which t2d does "
                           "not mark")
    return out


def ids_from_engine(where: str, draft_vocab_size: Optional[int], weights: Dict[str, torch.Tensor], target
                    ) -> Optional[torch.Tensor]:
    """The draft vocabulary an engine draft holds (sorted target ids [N], or None for the full
    vocabulary), after checking ``d2t`` / ``t2d`` and that ``lm_head.weight`` (required when N < V) is
    the target's head on those tokens; `ImportUnsupported` naming the key otherwise."""
    V = int(target.vocab_size)
    n = V if draft_vocab_size is None else int(draft_vocab_size)
    d2t, t2d = weights.get("d2t"), weights.get("t2d")
    if n == V and d2t is not None and d2t.numel() == V and not d2t.is_floating_point() and bool(d2t.any()):
        raise ImportUnsupported(f"{where}: d2t is not the identity map over the {V}-token vocabulary "
                                "(draft_vocab_size = the target's); permuted draft vocabularies have no deepspec "
                                "equivalent")
    problems = mapping_problems(n, d2t, t2d, V)
    if problems:
        raise ImportUnsupported(f"{where}: " + "; ".join(problems))
    ids = None if n == V else torch.arange(n) + d2t.to("cpu", torch.long)
    head = weights.get("lm_head.weight")
    if head is None and ids is not None:
        raise ImportUnsupported(f"{where}: a reduced draft vocabulary ({n} of {V} tokens) needs lm_head.weight "
                                f"[{n}, hidden]: the engines cannot share the target's head")
    if head is not None:
        want = lm_head_rows(target, ids)
        if tuple(head.shape) != tuple(want.shape) or not torch.equal(head, want.to(head.dtype)):
            rows = "" if ids is None else " rows of the draft vocabulary (d2t)"
            raise ImportUnsupported(f"{where}: lm_head.weight differs from the target's LM head{rows}; deepspec "
                                    "drafters score with the target's embedding and LM head")
    emb = weights.get("embed_tokens.weight")
    if emb is not None and not torch.equal(emb, target.embed_tokens.weight.detach().to("cpu", emb.dtype)):
        raise ImportUnsupported(f"{where}: embed_tokens.weight differs from the target's; deepspec drafters share "
                                "the target's embedding and LM head")
    return ids


def without_vocab_keys(weights: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The weights minus what `ids_from_engine` checked (d2t, t2d, lm_head, embed_tokens)."""
    return {k: v for k, v in weights.items() if k not in ("d2t", "t2d", "lm_head.weight", "embed_tokens.weight")}


def place(logits: torch.Tensor, ids: Optional[torch.Tensor], vocab_size: int) -> torch.Tensor:
    """Draft-vocabulary logits [..., N] at their target ids in [..., V], −inf elsewhere (as the engines do)."""
    if ids is None:
        return logits
    out = logits.new_full((*logits.shape[:-1], int(vocab_size)), float("-inf"))
    out[..., ids.to(logits.device)] = logits
    return out


# -- files: the run's draft_vocab.json, the mapping a draft directory holds --------------------------------------
VOCAB_FILE = "draft_vocab.json"


def find_vocab_file(path: Path, source_checkpoint: Optional[str] = None) -> Optional[Path]:
    """The ``draft_vocab.json`` describing the draft at ``path``: next to it (exports write one), else in
    the run directory of the checkpoint (``RUN/checkpoints/step_N`` → ``RUN/draft_vocab.json``)."""
    dirs = [Path(path)] + ([Path(source_checkpoint)] if source_checkpoint else [])
    for d in dirs:
        cands = [d / VOCAB_FILE] + ([d.parent.parent / VOCAB_FILE] if d.parent.name == "checkpoints" else [])
        for c in cands:
            if c.is_file():
                return c
    return None


def read_tensors(path: Path, keys) -> Dict[str, torch.Tensor]:
    """The tensors ``keys`` of a safetensors file that has them (nothing else is read)."""
    with safe_open(str(path), framework="pt") as f:
        have = set(f.keys())
        return {k: f.get_tensor(k) for k in keys if k in have}


def read_mapping(path: Path, config: Dict[str, Any], vocab_size: int) -> Tuple[Optional[torch.Tensor], List[str]]:
    """(sorted target ids [N] or None for the full vocabulary, problems naming file and key) of the draft
    vocabulary a draft directory holds: a deepspec checkpoint's ``draft_vocab`` (against its config's
    ``draft.vocab_size``) or an engine export's ``draft_vocab_size`` / ``d2t`` / ``t2d``, and that the
    exported ``lm_head.weight`` has one row per draft token."""
    V = int(vocab_size)
    where_w, where_c = f"{path / WEIGHTS}", f"{path / CONFIG}"
    ours = "architecture" in config and "draft" in config       # a deepspec checkpoint (or an hf export)
    claimed = (config.get("draft") or {}).get("vocab_size") if ours else config.get("draft_vocab_size")
    try:
        w = read_tensors(path / WEIGHTS, ("draft_vocab", "d2t", "t2d", "lm_head.weight"))
    except Exception as e:   # unreadable weights: reported when the config says the vocabulary is reduced
        reduced = claimed is not None and int(claimed) < V
        return None, ([f"{where_w}: not a readable safetensors file ({type(e).__name__}: {e})"] if reduced else [])
    if ours:
        n = claimed
        ids = w.get("draft_vocab")
        if n is None and ids is None:
            return None, []
        if ids is None:
            return None, [f"{where_c} says draft.vocab_size={n} but {where_w} holds no draft_vocab"]
        if n is None:
            return None, [f"{where_w} holds a draft_vocab of {ids.numel()} tokens but {where_c} says "
                          "draft.vocab_size=null"]
        recorded = (config.get("target") or {}).get("draft_vocab_size")
        problems = []
        if ids.dim() != 1 or ids.numel() != int(n):
            problems.append(f"{where_w} draft_vocab has shape {list(ids.shape)}, {where_c} says draft.vocab_size={n}")
        elif recorded is not None and int(recorded) != int(n):
            problems.append(f"{where_c}: target.draft_vocab_size={recorded} but draft.vocab_size={n}")
        problem = ids_problem(ids.numpy(), V)
        if problem:
            problems.append(f"{where_w} draft_vocab: {problem}")
        return (None if problems else ids.long()), problems
    n = config.get("draft_vocab_size")
    d2t, t2d = w.get("d2t"), w.get("t2d")
    if n is None and d2t is None and t2d is None:
        return None, []
    n = V if n is None else int(n)
    problems = [f"{where_w} / {where_c}: {p}" for p in mapping_problems(n, d2t, t2d, V)]
    if problems:
        return None, problems
    ids = None if d2t is None else torch.arange(n) + d2t.long()
    head = w.get("lm_head.weight")
    if head is not None and head.shape[0] != n:
        problems.append(f"{where_w} lm_head.weight has {head.shape[0]} rows, draft_vocab_size is {n}")
    if ids is not None and n == V:
        ids = None
    return ids, problems
