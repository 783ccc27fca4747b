"""Train / held-out split: deterministic, disjoint, stable under reordering; eval-ready output."""
from __future__ import annotations

import json
import random

import pytest

from deepspec.data import Conversation, is_heldout, split_conversations, split_score, write_heldout


def _convs(n):
    return [Conversation(id=f"id{i}", messages=[{"role": "user", "content": f"q{i}"}]) for i in range(n)]


def test_split_deterministic_disjoint_and_complete():
    convs = _convs(2000)
    tr, ho = split_conversations(convs, 0.1, seed=3)
    tr2, ho2 = split_conversations(convs, 0.1, seed=3)
    assert [c.id for c in tr] == [c.id for c in tr2] and [c.id for c in ho] == [c.id for c in ho2]
    assert not {c.id for c in tr} & {c.id for c in ho}
    assert len(tr) + len(ho) == 2000
    assert 130 < len(ho) < 270  # ~10%
    # input order kept on both sides
    order = {c.id: i for i, c in enumerate(convs)}
    assert [order[c.id] for c in tr] == sorted(order[c.id] for c in tr)


def test_split_stable_under_reordering_and_subsets():
    convs = _convs(500)
    _, ho = split_conversations(convs, 0.2, seed=1)
    shuffled = convs[:]
    random.Random(0).shuffle(shuffled)
    _, ho_s = split_conversations(shuffled[:300], 0.2, seed=1)
    assert {c.id for c in ho_s} == {c.id for c in ho} & {c.id for c in shuffled[:300]}


def test_split_seed_and_fraction():
    convs = _convs(500)
    a = {c.id for c in split_conversations(convs, 0.2, seed=0)[1]}
    b = {c.id for c in split_conversations(convs, 0.2, seed=1)[1]}
    assert a != b
    assert split_conversations(convs, 0.0)[1] == [] and split_conversations(convs, 1.0)[0] == []
    # a bigger fraction only adds samples to the held-out side
    assert a <= {c.id for c in split_conversations(convs, 0.4, seed=0)[1]}
    assert 0 <= split_score("x", 0) < 1
    with pytest.raises(ValueError):
        is_heldout("x", 1.5)


def test_write_heldout_turns_jsonl(tmp_path):
    c = Conversation(id="a", messages=[{"role": "system", "content": "S"}, {"role": "user", "content": "q1"},
                                       {"role": "assistant", "content": "x"}, {"role": "user", "content": "q2"}])
    p = write_heldout([c, _convs(1)[0]], tmp_path / "sub" / "heldout.jsonl")
    rows = [json.loads(x) for x in p.read_text().splitlines()]
    assert rows[0] == {"id": "a", "turns": ["q1", "q2"], "system": "S"}
    assert rows[1] == {"id": "id0", "turns": ["q0"]}
    assert not list(p.parent.glob(".*tmp*"))
