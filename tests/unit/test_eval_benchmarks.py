"""Benchmark JSONL loading (from the shared directory, never copied)."""
import json

import pytest

from deepspec.eval.benchmarks import DOMAINS, benchmark_path, domain_of, load_benchmark, load_benchmarks, resolve_data_dir


def test_load_turns_and_max_samples(tmp_path):
    (tmp_path / "mine.jsonl").write_text("\n".join(json.dumps({"turns": [f"q{i}", f"f{i}"]}) for i in range(5)) + "\n\n")
    s = load_benchmark(tmp_path, "mine", max_samples=3)
    assert [x.turns for x in s] == [["q0", "f0"], ["q1", "f1"], ["q2", "f2"]]
    assert s[1].id == "mine/1" and s[1].domain == "other"
    assert len(load_benchmark(str(tmp_path), "mine")) == 5


def test_errors_name_the_file(tmp_path):
    (tmp_path / "ok.jsonl").write_text(json.dumps({"turns": ["x"]}) + "\n")
    with pytest.raises(FileNotFoundError, match="missing.*ok"):
        benchmark_path(tmp_path, "missing")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"turns": []}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_benchmark(tmp_path, "bad")
    (tmp_path / "bad2.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="bad2.jsonl:1"):
        load_benchmark(tmp_path, "bad2")


def test_domains():
    assert domain_of("gsm8k") == "math" and domain_of("livecodebench") == "code"
    assert domain_of("arena-hard-v2") == "chat" and domain_of("alpaca") == "chat"
    assert sum(len(v) for v in DOMAINS.values()) == 9


def test_relative_data_dir_resolves_against_the_repository_root(monkeypatch, tmp_path):
    from tests.support.benchmarks import write_benchmarks
    import deepspec.eval.benchmarks as bm
    repo = tmp_path / "repo"
    write_benchmarks(repo / "prompts")
    monkeypatch.setattr(bm, "project_root", lambda: repo)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)                      # not found here: the repo root is tried next
    assert resolve_data_dir("prompts") == (repo / "prompts").resolve()
    b = load_benchmarks("prompts", ["gsm8k", "mt-bench", "humaneval"], max_samples=2)
    assert all(len(v) == 2 for v in b.values())
    assert len(b["mt-bench"][0].turns) == 2 and len(b["gsm8k"][0].turns) == 1