"""Chat templates → token ids plus a loss mask over assistant tokens only.

The mask covers each assistant message's content and the end-of-turn text the
template writes right after it (e.g. ``<|im_end|>``).  Anything the template
inserts before the content — role headers, the empty ``<think></think>`` block
Qwen3 adds when thinking is off — is context, not a training target.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import DeepSpecError

ROLES = ("system", "user", "assistant")


class ChatTemplateError(DeepSpecError, ValueError):
    """A conversation the tokenizer's chat template cannot encode as asked."""


@dataclass
class ChatEncoding:
    input_ids: List[int]
    loss_mask: List[int]
    text: str = ""
    spans: List[Tuple[int, int]] = field(default_factory=list)  # assistant char spans


# `target.chat_template=plain`: a plain-text transcript for base models that ship no chat template.
# Each turn is a Markdown-style heading line and the text; a turn ends with a blank line (the
# assistant's end-of-turn text, trained with its content).  The generation prompt is the assistant
# heading, so the answer starts on a fresh line (no word-initial space to split between prompt and answer).
PLAIN_TEMPLATE = (
    "{{ bos_token or '' }}{% for m in messages %}"
    "{{ '### ' + {'system': 'System', 'user': 'User', 'assistant': 'Assistant'}[m['role']] + ':\n' }}"
    "{{ m['content'] + '\n\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '### Assistant:\n' }}{% endif %}"
)
BUILTIN_TEMPLATES = {"plain": PLAIN_TEMPLATE}


def resolve_template(value: Optional[str]) -> Optional[str]:
    """``target.chat_template``: None = the tokenizer's own; a built-in name (``plain``); or a Jinja file."""
    if value is None:
        return None
    if value in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[value]
    from pathlib import Path
    p = Path(value)
    if not p.is_file():
        raise ChatTemplateError(f"target.chat_template={value!r}: not a built-in template "
                                f"({', '.join(BUILTIN_TEMPLATES)}) nor a Jinja file")
    return p.read_text(encoding="utf-8")


def render(tokenizer, messages: Sequence[Dict[str, str]], add_generation_prompt: bool = False,
           **kwargs) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')} has no chat template "
                                "(a base model?): set target.chat_template=plain or a Jinja file")
    try:
        return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **kwargs)
    except ChatTemplateError:
        raise
    except Exception as e:  # jinja2 TemplateError (raise_exception), type errors inside the template, ...
        raise ChatTemplateError(f"the chat template failed on this conversation ({type(e).__name__}: "
                                f"{str(e)[:300]})") from None


def _validate(messages: Sequence[Dict[str, str]]) -> None:
    if not messages:
        raise ChatTemplateError("empty conversation")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ChatTemplateError(f"message {i}: role must be one of {ROLES}, got {m!r:.80}")
        if not isinstance(m.get("content"), str):
            raise ChatTemplateError(f"message {i}: content must be a string")
        try:
            m["content"].encode("utf-8")
        except UnicodeEncodeError as e:  # lone surrogates (e.g. "\\ud800" in JSON): no tokenizer takes them
            raise ChatTemplateError(f"message {i}: content is not valid Unicode ({e.reason} at {e.start})") from None


def _assistant_spans(tokenizer, messages, full: str, kwargs,
                     add_generation_prompt: bool = False) -> List[Tuple[int, int]]:
    spans = _spans_by_marker(tokenizer, messages, full, kwargs, add_generation_prompt)
    return spans if spans is not None else _spans_by_search(tokenizer, messages, full, kwargs)


def _markers(messages, full: str, n: int) -> List[str]:
    """``n`` strings that occur nowhere in the conversation nor in its rendering."""
    for attempt in range(64):
        marks = [f"\ue000{attempt:x}#{k}\ue001" for k in range(n)]
        if not any(mk in full or any(mk in m["content"] for m in messages) for mk in marks):
            return marks
    raise ChatTemplateError("cannot build unique placeholders for the assistant turns")


def _spans_by_marker(tokenizer, messages, full: str, kwargs,
                     add_generation_prompt: bool) -> Optional[List[Tuple[int, int]]]:
    """Exact spans: render with a unique placeholder in place of each assistant content.

    The placeholder keeps the content's leading/trailing whitespace, so templates that
    ``trim`` treat both renderings alike.  Replacing each placeholder by the content must
    give back the real rendering; otherwise (the template rewrites content, e.g. splits
    ``</think>``) this returns None and the caller falls back to text search.  The
    end-of-turn text is what the template writes after the content when the message is
    the last one (rendered without a generation prompt), as far as the full rendering agrees.
    """
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and m["content"]]
    if not turns:
        return []
    marks = _markers(messages, full, len(turns))
    sub, cores = [dict(m) for m in messages], {}
    for k, i in enumerate(turns):
        c = messages[i]["content"]
        core = c.strip()
        if core:
            lead, trail = c[: len(c) - len(c.lstrip())], c[len(c.rstrip()):]
        else:  # whitespace only
            lead, trail = c, ""
        sub[i]["content"] = lead + marks[k] + trail
        cores[i] = (marks[k], lead, core, trail)
    text = render(tokenizer, sub, add_generation_prompt=add_generation_prompt, **kwargs)
    # rebuild the real rendering, recording where each content lands
    out, pos, spans = [], 0, []
    for i in turns:
        mk, lead, core, trail = cores[i]
        p = text.find(mk, pos)
        if p < 0 or text.count(mk) != 1:
            return None
        out.append(text[pos:p])
        at = sum(len(x) for x in out)
        start = at - len(lead) if lead and p >= len(lead) and text[p - len(lead):p] == lead else at
        out.append(core)
        end = at + len(core)
        q = p + len(mk)
        if trail and text.startswith(trail, q):
            end += len(trail)
        spans.append([i, start, end])
        pos = q
    out.append(text[pos:])
    if "".join(out) != full:
        return None
    result = []
    for i, start, end in spans:
        mk = cores[i][0]
        upto = render(tokenizer, sub[: i + 1], **kwargs)
        q = upto.find(mk)
        if q < 0:
            return None
        tail = upto[q + len(mk):]
        trail = cores[i][3]
        if trail and full[end - len(trail):end] == trail and tail.startswith(trail):
            tail = tail[len(trail):]
        k = 0
        while k < len(tail) and end + k < len(full) and full[end + k] == tail[k]:
            k += 1
        result.append((start, end + k))
    return result


def _spans_by_search(tokenizer, messages, full: str, kwargs) -> List[Tuple[int, int]]:
    """Fallback for templates that rewrite assistant content: locate it by text search."""
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
        # the content cannot start before the rendering of the earlier messages ends
        try:
            prev = render(tokenizer, messages[:i], **kwargs) if i else ""
        except ChatTemplateError:  # e.g. a template that insists on a final user turn
            prev = ""
        common = len(prev) if full.startswith(prev) else 0
        start = full.find(content, max(cursor, common))
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
    spans = _assistant_spans(tokenizer, messages, full, kwargs, add_generation_prompt)
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
