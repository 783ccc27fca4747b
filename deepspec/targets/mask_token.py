"""The mask token of parallel drafts: a token id that is never a real token of the target.

DFlash / DSpark blocks are ``[x_p, MASK×(γ−1)]``.  Serving engines pre-fill their draft
block with the mask id and scan proposals for stop tokens, so the mask must never be the
end of a turn, and it should not be a token that occurs in text (the draft could not tell a
masked slot from that token).  With ``draft.mask_token_id`` unset, `choose_mask_token`
takes, in this order:

1. an added token whose name marks it reserved or unused (Llama 3's
   ``<|reserved_special_token_N|>``, Gemma's ``<unusedN>``): the lowest such id;
2. a spare embedding row beyond the tokenizer (``len(tokenizer) < embedding rows``): id
   ``len(tokenizer)`` (Qwen3: 151669 of 151936 rows);
3. an added special token that is not BOS/EOS/PAD/UNK, not a generation stop token and not
   written by the chat template: the highest such id (SmolLM2: ``<empty_output>``, 16);

else a `ConfigError` asking for ``draft.mask_token_id``.  `mask_token_problem` says why a
given id is unfit to serve (a stop token, an ordinary vocabulary token), naming the id
`choose_mask_token` would take instead.

A `TokenInventory` is what the choice reads of a tokenizer (its size, special ids, added
tokens and chat template), so a tokenizer can be described without loading it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, Iterable, Optional, Set, Tuple

from ..config import ConfigError

RESERVED_NAME = re.compile(r"reserved|unused", re.IGNORECASE)
_ROLES = ("bos", "eos", "pad", "unk")


@dataclass(frozen=True)
class AddedToken:
    content: str
    special: bool


@dataclass
class TokenInventory:
    """What the mask-token choice reads of a tokenizer."""
    size: int                                            # len(tokenizer): ids below it are tokens
    added: Dict[int, AddedToken] = field(default_factory=dict)
    special_ids: Dict[str, Optional[int]] = field(default_factory=dict)   # bos / eos / pad / unk
    chat_template: str = ""

    @classmethod
    def of(cls, tokenizer) -> "TokenInventory":
        """The inventory of a transformers tokenizer."""
        added = {int(i): AddedToken(str(t.content), bool(t.special))
                 for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
        ids = {r: getattr(tokenizer, f"{r}_token_id", None) for r in _ROLES}
        return cls(size=len(tokenizer), added=added, chat_template=_template_text(tokenizer.chat_template),
                   special_ids={r: int(v) for r, v in ids.items() if isinstance(v, int)})

    def name(self, token_id: int) -> str:
        if token_id in self.added:
            return self.added[token_id].content
        return "a spare embedding row" if token_id >= self.size else "an ordinary token"

    def in_template(self, token_id: int) -> bool:
        tok = self.added.get(token_id)
        return tok is not None and tok.content in self.chat_template


def _template_text(template) -> str:
    if isinstance(template, dict):         # named templates (default, tool_use, ...)
        return "\n".join(str(v) for v in template.values())
    if isinstance(template, list):         # [{"name": ..., "template": ...}]
        return "\n".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    return str(template or "")


def _ids(value) -> Set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {int(value)}
    return {int(v) for v in value if isinstance(v, int)}


def stop_token_ids(inventory: TokenInventory, generation_eos=None) -> Set[int]:
    """The tokenizer's EOS and the generation config's ``eos_token_id`` (an id or a list of them)."""
    return _ids(inventory.special_ids.get("eos")) | _ids(generation_eos)


def choose_mask_token(inventory: TokenInventory, embedding_rows: int, stop_ids: Iterable[int] = ()
                      ) -> Tuple[int, str]:
    """(mask token id, why it was chosen) by the order in the module docstring; `ConfigError` if none fits."""
    roles = {v for v in inventory.special_ids.values() if v is not None}
    stops = set(stop_ids) | _ids(inventory.special_ids.get("eos"))
    free = {i: t for i, t in inventory.added.items() if i not in roles and i not in stops and i < embedding_rows}
    reserved = sorted(i for i, t in free.items() if RESERVED_NAME.search(t.content))
    if reserved:
        return reserved[0], f"the reserved token {inventory.added[reserved[0]].content!r}"
    if inventory.size < int(embedding_rows):
        return inventory.size, (f"the first spare embedding row ({embedding_rows} rows, {inventory.size} tokenizer "
                                "tokens)")
    spare = sorted(i for i, t in free.items() if t.special and not inventory.in_template(i))
    if spare:
        return spare[-1], f"the added special token {inventory.added[spare[-1]].content!r}, unused by the chat template"
    raise ConfigError("no mask token: the tokenizer has no reserved/unused token, no spare embedding row and no added "
                      "special token outside BOS/EOS/PAD/UNK, the stop tokens and the chat template; set "
                      "draft.mask_token_id to an id that never occurs in text and is not a stop token")


def mask_token_fault(inventory: TokenInventory, token_id: int, embedding_rows: int,
                     stop_ids: Iterable[int] = ()) -> Optional[str]:
    """What makes ``token_id`` unfit as a served draft's mask token (None if it is fit)."""
    token_id = int(token_id)
    stops = set(stop_ids) | _ids(inventory.special_ids.get("eos"))
    if not 0 <= token_id < int(embedding_rows):
        return f"outside the target's {embedding_rows} embedding rows"
    if token_id in stops:
        return f"a stop token ({inventory.name(token_id)!r}): engines stop a block at the first stop token"
    if token_id < inventory.size and token_id not in inventory.added:
        return "an ordinary vocabulary token: a masked slot reads like that token in text"
    if inventory.in_template(token_id) or token_id == inventory.special_ids.get("bos"):
        return f"written into every conversation ({inventory.name(token_id)!r} is in the chat template or BOS)"
    return None


def suggested_mask_token(inventory: TokenInventory, embedding_rows: int, stop_ids: Iterable[int] = ()
                         ) -> Optional[int]:
    """The id `choose_mask_token` takes, or None when no token fits."""
    try:
        return choose_mask_token(inventory, embedding_rows, stop_ids)[0]
    except ConfigError:
        return None


def mask_token_problem(inventory: TokenInventory, token_id: int, embedding_rows: int,
                       stop_ids: Iterable[int] = ()) -> Optional[str]:
    """Why ``token_id`` is unfit as a served draft's mask token and the fix (None if it is fit)."""
    fault = mask_token_fault(inventory, token_id, embedding_rows, stop_ids)
    if fault is None:
        return None
    best = suggested_mask_token(inventory, embedding_rows, stop_ids)
    fix = (f"retrain with draft.mask_token_id={best}" if best is not None else
           "retrain with draft.mask_token_id set to an id that never occurs in text and is not a stop token")
    return f"the mask token id {int(token_id)} is {fault}; {fix}"


def target_tokens(target) -> Tuple[TokenInventory, int, Set[int]]:
    """(inventory, embedding rows, stop ids) of a loaded `TargetAdapter`."""
    inv = TokenInventory.of(target.tokenizer)
    gen = getattr(target.model, "generation_config", None)
    rows = int(target.embed_tokens.weight.shape[0])
    return inv, rows, stop_token_ids(inv, getattr(gen, "eos_token_id", None))
