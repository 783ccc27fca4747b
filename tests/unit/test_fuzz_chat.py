"""Fuzzing the chat-template / loss-mask builder (`deepspec.targets.chat.encode_chat`).

Arbitrary message lists (odd roles, non-strings, lone surrogates, text that repeats role
names, template fragments or other messages' content) either encode — with the loss mask
exactly on the assistant contents and their end-of-turn text — or raise `ChatTemplateError`.

The oracle is independent of the implementation: the three tiny chat templates are
re-implemented here in plain Python, giving the rendered text and the true character spans
of every assistant turn; the expected mask is "token overlaps a true span".
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from deepspec.targets.chat import ChatTemplateError, encode_chat, encode_prompt
from deepspec.targets.tiny import tiny_tokenizer

FAMILIES = ("llama", "qwen3", "gemma3")
_TOK = {f: tiny_tokenizer(f) for f in FAMILIES}


def _oracle(family, messages, add_generation_prompt):
    """(text, assistant spans) of the tiny templates, written out by hand."""
    out, spans = [], []

    def put(s):
        out.append(s)
        return sum(map(len, out))

    if family == "llama":
        put("<|begin_of_text|>")
        for m in messages:
            s = put(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n")
            put(m["content"])
            e = put("<|eot_id|>")
            if m["role"] == "assistant" and m["content"]:
                spans.append((s, e))
        if add_generation_prompt:
            put("<|start_header_id|>assistant<|end_header_id|>\n\n")
    elif family == "qwen3":
        last_user = max([i for i, m in enumerate(messages) if m["role"] == "user"], default=-1)
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                s = put("<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if i > last_user else ""))
            else:
                s = put(f"<|im_start|>{m['role']}\n")
            put(m["content"])
            e = put("<|im_end|>\n")
            if m["role"] == "assistant" and m["content"]:
                spans.append((s, e))
        if add_generation_prompt:
            put("<|im_start|>assistant\n")
    else:  # gemma3: system text goes into the first turn after it
        put("<bos>")
        for i, m in enumerate(messages):
            if m["role"] == "system":
                continue
            put("<start_of_turn>" + ("model" if m["role"] == "assistant" else "user") + "\n")
            s = put(messages[0]["content"] + "\n\n" if i == 1 and messages[0]["role"] == "system" else "")
            put(m["content"])
            e = put("<end_of_turn>\n")
            if m["role"] == "assistant" and m["content"]:
                spans.append((s, e))
        if add_generation_prompt:
            put("<start_of_turn>model\n")
    return "".join(out), spans


# text that collides with the templates: role names, headers, end-of-turn markers, whitespace
_TRICKY = ["user", "assistant", "model", "system", "\n", "\n\n", " ", "n", "hi", "4", "<|eot_id|>",
           "<|im_end|>", "<end_of_turn>", "<|im_start|>", "<think>", "</think>", "<start_of_turn>",
           "<|end_header_id|>", "\ue000", "\ue0010#0\ue001", "{{", "}}", "{%", "é", "你好", "🙂"]
_text = st.one_of(st.sampled_from(_TRICKY), st.text(max_size=12),
                  st.lists(st.sampled_from(_TRICKY) | st.text(max_size=4), max_size=4).map("".join))
_role = st.sampled_from(["system", "user", "assistant"])
_msg = st.fixed_dictionaries({"role": _role, "content": _text})
_bad_msg = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["robot", "", "USER", "tool"]) | st.none() | st.integers(),
                           "content": _text}),
    st.fixed_dictionaries({"role": _role, "content": st.none() | st.integers() | st.lists(st.text(max_size=3))}),
    st.fixed_dictionaries({"role": _role, "content": st.sampled_from(["\ud800", "a\udfffb"])}),
    st.just("not a dict"), st.just({"content": "no role"}))


def _check(family, messages, agp):
    tok = _TOK[family]
    valid = bool(messages) and all(
        isinstance(m, dict) and m.get("role") in ("system", "user", "assistant") and isinstance(m.get("content"), str)
        and not any(0xD800 <= ord(ch) <= 0xDFFF for ch in m["content"]) for m in messages)
    try:
        enc = encode_chat(tok, messages, add_generation_prompt=agp)
    except ChatTemplateError:
        assert not valid, f"valid conversation refused: {messages!r}"
        return
    assert valid, f"invalid conversation accepted: {messages!r}"
    text, spans = _oracle(family, messages, agp)
    assert enc.text == text
    assert sorted(enc.spans) == spans, (messages, enc.spans, spans)
    got = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert enc.input_ids == list(got["input_ids"])
    want = [int(b > a and any(a < e and b > s for s, e in spans)) for a, b in got["offset_mapping"]]
    assert enc.loss_mask == want, (messages, [tok.decode([i]) for i, m in zip(enc.input_ids, enc.loss_mask) if m])
    assert len(enc.loss_mask) == len(enc.input_ids)
    if not any(m["role"] == "assistant" and m["content"] for m in messages):
        assert not any(enc.loss_mask)
    # the prompt encoder shares the renderer: same validity, and a generation-prompt suffix
    ids = encode_prompt(tok, messages)
    assert ids == list(tok(_oracle(family, messages, True)[0], add_special_tokens=False)["input_ids"])


_SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("family", FAMILIES)
@_SETTINGS
@given(messages=st.lists(_msg, min_size=0, max_size=6), agp=st.booleans())
@example(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hi"}], agp=False)
@example(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "n"}], agp=False)
@example(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "assistant"}], agp=True)
@example(messages=[{"role": "user", "content": "4"}, {"role": "assistant", "content": " \n"},
                   {"role": "user", "content": "x"}, {"role": "assistant", "content": "4"}], agp=False)
def test_encode_chat_masks_exactly_the_assistant_turns(family, messages, agp):
    _check(family, messages, agp)


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=st.lists(st.one_of(_msg, _bad_msg), min_size=1, max_size=5), agp=st.booleans())
def test_malformed_messages_raise_chat_template_error(family, messages, agp):
    _check(family, messages, agp)


def test_template_exceptions_become_chat_template_errors():
    tok = tiny_tokenizer("llama")
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
                         "{{ raise_exception('system must come first') }}{% endif %}{{ m['content'] }}{% endfor %}")
    msgs = [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="system must come first"):
        encode_chat(tok, msgs)
    with pytest.raises(ChatTemplateError, match="system must come first"):
        encode_prompt(tok, msgs)
    tok.chat_template = "{{ messages[0]['content'] + 1 }}"          # a TypeError inside the template
    with pytest.raises(ChatTemplateError, match="TypeError"):
        encode_chat(tok, [{"role": "user", "content": "a"}])
