"""Crash-safe part files and the multi-turn plan."""
from __future__ import annotations

import json

from deepspec.data import Conversation
from deepspec.engines.base import Completion, GenerationError
from deepspec.prepare.parts import PartStore
from deepspec.prepare.turns import SampleRun, plan_turns


def test_torn_last_line_ignored_and_cut_before_append(tmp_path):
    st = PartStore(tmp_path / "parts", rank=0)
    st.append([{"i": 0, "id": "a", "ok": True}, {"i": 1, "id": "b", "ok": False}])
    st.close()
    with open(st.own_file, "ab") as f:
        f.write(b'{"i": 2, "id": "c", "ok": tr')  # killed mid-write
    assert sorted(PartStore(tmp_path / "parts").load()) == [0, 1]
    st2 = PartStore(tmp_path / "parts", rank=0)
    st2.append([{"i": 2, "id": "c", "ok": True}])
    st2.close()
    lines = st.own_file.read_text().splitlines()
    assert [json.loads(x)["i"] for x in lines] == [0, 1, 2]


def test_success_wins_over_failure_and_ranks_merge(tmp_path):
    a = PartStore(tmp_path, rank=0)
    b = PartStore(tmp_path, rank=1)
    a.append([{"i": 0, "ok": True, "v": 1}, {"i": 2, "ok": False}])
    b.append([{"i": 1, "ok": True}, {"i": 0, "ok": False}, {"i": 2, "ok": True, "v": 3}])
    a.close(), b.close()
    got = PartStore(tmp_path).load()
    assert got[0]["ok"] and got[0]["v"] == 1 and got[2]["v"] == 3 and sorted(got) == [0, 1, 2]
    PartStore(tmp_path).clear()
    assert not tmp_path.exists()


def test_plan_turns():
    msgs = [{"role": "assistant", "content": "orphan"}, {"role": "system", "content": "S"},
            {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "q2a"}, {"role": "user", "content": "q2b"},
            {"role": "assistant", "content": "a2"}, {"role": "user", "content": "q3"}]
    steps = plan_turns(msgs)
    assert [[m["content"] for m in s] for s in steps] == [["S", "q1"], ["q2a", "q2b"], ["q3"]]
    assert len(plan_turns(msgs, max_turns=2)) == 2
    assert plan_turns([{"role": "system", "content": "S"}]) == []


def test_sample_run_multi_turn_and_truncation():
    c = Conversation(id="x", messages=[{"role": "user", "content": "q1"}, {"role": "assistant", "content": "old"},
                                       {"role": "user", "content": "q2"}, {"role": "user", "content": "q3"},
                                       {"role": "assistant", "content": "old"}, {"role": "user", "content": "q4"}])
    r = SampleRun(0, c, None)
    assert r.prompt() == [{"role": "user", "content": "q1"}]
    r.accept(Completion("A1", num_tokens=3))
    assert r.prompt() == [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "A1"},
                          {"role": "user", "content": "q2"}, {"role": "user", "content": "q3"}]
    r.accept(GenerationError("too long", code="prompt_too_long"))
    assert not r.active and r.truncated == 2
    e = r.entry({"engine": "t"})
    assert e["ok"] and e["sample"]["conversations"][-1] == {"role": "assistant", "content": "A1"}
    assert e["sample"]["meta"]["truncated_turns"] == 2 and e["sample"]["meta"]["num_tokens"] == 3
    # a first turn that does not fit is a failure
    r2 = SampleRun(1, c, None)
    r2.accept(GenerationError("too long", code="prompt_too_long"))
    assert not r2.entry({})["ok"]
