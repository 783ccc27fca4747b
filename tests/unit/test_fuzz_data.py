"""Fuzzing prompt ingestion: JSONL lines, (truncated) JSON arrays and record → conversation rules.

Whatever the bytes, ingestion yields records or raises `DataError` — never a foreign
exception (RecursionError on deep nesting, ValueError on 5000-digit numbers, UnicodeEncodeError
on lone surrogates were found this way and fixed).  Accepted conversations are always
well-formed and writable (UTF-8 encodable, at least one non-empty user turn).
"""
from __future__ import annotations

import json

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from deepspec.config import DataConfig
from deepspec.data import (ROLE_ALIASES, Conversation, DataError, iter_json_array, iter_jsonl, load_conversations,
                           record_to_conversation)

_S = settings(max_examples=60, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

_keys = st.sampled_from(["id", "turns", "conversations", "messages", "system", "role", "content", "from",
                         "value", "type", "text", "x"])
_roles = st.sampled_from(sorted(ROLE_ALIASES) + ["bing", "", "Human ", "tool"])
_scalars = (st.none() | st.booleans() | st.integers(-2 ** 80, 2 ** 80) | st.floats(allow_nan=True)
            | st.text(max_size=8) | st.sampled_from(["\ud800", " ", "hi", "\x00"]) | _roles)
_json = st.recursive(_scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(_keys, kids, max_size=5),
                     max_leaves=20)
# records shaped like the real thing, so the deeper rules are reached
_message = st.one_of(
    st.fixed_dictionaries({"role": _roles, "content": _scalars | st.lists(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]), "text": _scalars}), max_size=2)}),
    st.fixed_dictionaries({"from": _roles, "value": _scalars}), _json)
_record = st.one_of(
    st.fixed_dictionaries({"turns": st.lists(_scalars, max_size=3) | _scalars},
                          optional={"id": _scalars, "system": _scalars}),
    st.fixed_dictionaries({"conversations": st.lists(_message, max_size=4) | _scalars},
                          optional={"id": _scalars | _json, "system": _scalars}),
    st.fixed_dictionaries({"messages": st.lists(_message, max_size=4)}), _json)


def _check_conversation(c: Conversation) -> None:
    assert isinstance(c.id, str) and c.id
    c.id.encode("utf-8")
    assert c.messages and any(m["role"] == "user" and m["content"].strip() for m in c.messages)
    for m in c.messages:
        assert m["role"] in ("system", "user", "assistant") and isinstance(m["content"], str)
        m["content"].encode("utf-8")
    json.dumps(c.to_dict(), ensure_ascii=False).encode("utf-8")    # what regen / heldout files write
    assert len(c.content_hash()) == 64


@_S
@given(rec=_record)
@example(rec={"turns": ["\ud800"]})
@example(rec={"id": "\udfff", "turns": ["q"]})
@example(rec={"conversations": [{"role": "human", "content": [{"type": "text", "text": "a"}]}]})
def test_record_to_conversation_gives_a_conversation_or_data_error(rec):
    try:
        c = record_to_conversation(rec, origin="f.jsonl:1", default_id="d")
    except DataError as e:
        assert e.origin == "f.jsonl:1" and e.reason
        return
    _check_conversation(c)


_line = st.one_of(_record.map(lambda r: json.dumps(r)), st.text(max_size=30),
                  st.binary(max_size=30).map(lambda b: b.decode("latin-1")),
                  st.sampled_from(["[" * 5000 + "]" * 5000, '{"turns": [' + "7" * 5000 + "]}",
                                   '{"turns": ["\\ud800"]}', "{", "", "   ", "null", '"str"']))


@_S
@given(lines=st.lists(_line, max_size=8), raw=st.binary(max_size=200), use_raw=st.booleans(),
       on_error=st.sampled_from(["error", "skip"]))
def test_jsonl_files_of_anything(tmp_path_factory, lines, raw, use_raw, on_error):
    d = tmp_path_factory.mktemp("j")
    p = d / "in.jsonl"
    if use_raw:
        p.write_bytes(raw)
    else:
        p.write_bytes("\n".join(lines).encode("utf-8", "surrogatepass"))
    # the line reader: one record per non-blank line, each a value or a DataError naming file:line
    recs = list(iter_jsonl(p))
    assert [r.line for r in recs] == [i + 1 for i, ln in enumerate(p.read_bytes().split(b"\n")) if _counts(ln)]
    for r in recs:
        if r.error is not None:
            assert r.value is None and isinstance(r.error, DataError) and r.error.origin == f"{p}:{r.line}"
    # the whole ingestion, as `prepare` runs it
    errs = d / "errors.jsonl"
    try:
        convs, stats = load_conversations(DataConfig(source="jsonl", path=str(p), on_error=on_error), errs)
    except DataError as e:
        assert on_error == "error" and str(p) in str(e)
        return
    for c in convs:
        _check_conversation(c)
    assert len({c.id for c in convs}) == len(convs)
    assert stats.kept == len(convs) and stats.records == stats.kept + stats.num_skipped
    written = [json.loads(x) for x in errs.read_text(encoding="utf-8").splitlines()]
    assert len(written) == stats.num_skipped


def _counts(b: bytes) -> bool:
    """Does this line produce a record?  Blank lines are skipped; undecodable ones are reported."""
    try:
        return bool(b.decode("utf-8").strip())
    except UnicodeDecodeError:
        return True


_finite = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
                       lambda kids: st.lists(kids, max_size=3) | st.dictionaries(_keys, kids, max_size=3),
                       max_leaves=8)
# array elements are containers (a truncated bare number would still parse, as a shorter number)
_element = st.one_of(
    st.fixed_dictionaries({"turns": st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=2)}),
    st.lists(_finite, max_size=3), st.dictionaries(_keys, _finite, max_size=3))


def _element_ends(items, indent):
    """Character offset where each element of ``json.dumps(items, indent)`` ends."""
    close = 1 if indent is None else 2          # "]" or "\n]"
    return [len(json.dumps(items[:k + 1], indent=indent)) - close for k in range(len(items))]


@_S
@given(items=st.lists(_element, max_size=6), cut=st.floats(0, 1), chunk=st.integers(1, 40),
       indent=st.sampled_from([None, 1]), allow_truncated=st.booleans())
def test_truncated_json_arrays_keep_exactly_the_complete_elements(tmp_path_factory, items, cut, chunk, indent,
                                                                    allow_truncated):
    text = json.dumps(items, indent=indent)
    n = int(cut * len(text))
    p = tmp_path_factory.mktemp("a") / "in.json"
    p.write_text(text[:n], encoding="utf-8")
    try:
        recs = list(iter_json_array(p, chunk_chars=chunk, allow_truncated=allow_truncated))
    except DataError as e:            # nothing before the cut but whitespace
        assert not text[:n].strip() and str(p) in str(e)
        return
    values = [r.value for r in recs if r.error is None]
    errors = [r.error for r in recs if r.error is not None]
    complete = sum(1 for e in _element_ends(items, indent) if e <= n)
    assert values == items[:complete], "exactly the complete elements, whole and in order"
    assert all(r.error is None for r in recs[:-1])   # an error, if any, is the last record
    if n == len(text):
        assert not errors
    else:
        assert len(errors) == 1 and errors[0].reason in ("truncated", "invalid_json")
        if allow_truncated:
            assert errors[0].reason == "truncated"
        assert str(p) in errors[0].origin


@_S
@given(raw=st.binary(max_size=120), prefix=st.sampled_from([b"", b"[", b"[{", b"\xef\xbb\xbf["]))
def test_json_array_reader_on_arbitrary_bytes(tmp_path_factory, raw, prefix):
    p = tmp_path_factory.mktemp("b") / "in.json"
    p.write_bytes(prefix + raw)
    try:
        for r in iter_json_array(p, chunk_chars=16):
            assert (r.error is None) or isinstance(r.error, DataError)
    except DataError:
        pass
