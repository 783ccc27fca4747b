"""Chat templates → token ids plus a loss mask over assistant tokens only.

The mask covers each assistant message's content and the end-of-turn text the
template writes right after it (e.g. ``<|im_end|>``).  Anything the template
inserts before the content — role headers, the empty ``<think></think>`` block
Qwen3 adds when thinking is off — is context, not a training target.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

ROLES = ("system", "user", "assistant")


class ChatTemplateError(ValueError):
    """A conversation the tokenizer's chat template cannot encode as asked."""


@dataclass
class ChatEncoding:
    input_ids: List[int]
    loss_mask: List[int]
    text: str = ""
    spans: List[Tuple[int, int]] = field(default_factory=list)  # assistant char spans


def render(tokenizer, messages: Sequence[Dict[str, str]], add_generation_prompt: bool = False,
           **kwargs) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')} has no chat template")
    return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **kwargs)


def _validate(messages: Sequence[Dict[str, str]]) -> None:
    if not messages:
        raise ChatTemplateError("empty conversation")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ChatTemplateError(f"message {i}: role must be one of {ROLES}, got {m!r:.80}")
        if not isinstance(m.get("content"), str):
            raise ChatTemplateError(f"message {i}: content must be a string")


def _assistant_spans(tokenizer, messages, full: str, kwargs) -> List[Tuple[int, int]]:
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or not m["content"]:
            continue
        upto = render(tokenizer, messages[: i + 1], **kwargs)
        content = m["content"]
        pos_upto = upto.rfind(content)
        if pos_upto < 0:
            raise ChatTemplateError(f"message {i}: the chat template rewrites assistant content; "
                                    "cannot locate it to build the loss mask")
        tail = upto[pos_upto + len(content):]
        start = full.find(content, cursor)
        if start < 0:
            raise ChatTemplateError(f"message {i}: assistant content not found in the rendered conversation")
        end = start + len(content)
        # the end-of-turn text follows the content in both renderings
        k = 0
        while k < len(tail) and end + k < len(full) and full[end + k] == tail[k]:
            k += 1
        spans.append((start, end + k))
        cursor = end + k
    return spans


def encode_chat(tokenizer, messages: Sequence[Dict[str, str]], add_generation_prompt: bool = False,
                **kwargs) -> ChatEncoding:
    """Render ``messages`` with the chat template; mask = assistant tokens (incl. end of turn)."""
    _validate(messages)
    full = render(tokenizer, messages, add_generation_prompt=add_generation_prompt, **kwargs)
    spans = _assistant_spans(tokenizer, messages, full, kwargs)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    mask = [0] * len(ids)
    for t, (a, b) in enumerate(enc["offset_mapping"]):
        if b <= a:
            continue
        for s, e in spans:
            if a < e and b > s:
                mask[t] = 1
                break
    return ChatEncoding(input_ids=ids, loss_mask=mask, text=full, spans=spans)


def encode_prompt(tokenizer, messages: Sequence[Dict[str, str]], **kwargs) -> List[int]:
    """Token ids of a conversation followed by the generation prompt."""
    text = render(tokenizer, messages, add_generation_prompt=True, **kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
