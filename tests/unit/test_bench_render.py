"""bench/render_benchmarks.py: docs/benchmarks.md comes from the reference record alone (not the run's
scratch directory) and names no machine's directories."""
import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_train_rate_skips_warmup_and_reports_last_step(bench_module):
    mod = bench_module("render_benchmarks")
    rows = [{"step": s, "tokens": 100, "step_time_s": 10.0 if s == 1 else 1.0, "tokens_per_s": 0,
             "train/loss": 3.0 - s * 0.1, "train/expected_tau": 1.0 + s / 100} for s in range(1, 11)]
    rows.append({"step": 10, "eval/expected_tau": 1.2})
    t = mod.train_rate(rows)
    assert t["steps"] == 10 and t["tokens_per_s"] == 100.0       # the slow first step is skipped
    assert abs(t["loss"] - 2.0) < 1e-9 and abs(t["expected_tau"] - 1.1) < 1e-9


def test_render_without_work_dir_uses_the_record(tmp_path, bench_module, monkeypatch):
    mod = bench_module("render_benchmarks")
    rec = json.loads((REPO / "bench" / "results" / "reference.json").read_text())
    rec["args"]["work"] = str(tmp_path / "deleted")              # scratch dir gone, as after a real run
    monkeypatch.setattr(mod, "REPO", tmp_path)                    # render() names the file relative to REPO
    src = tmp_path / "bench" / "results" / "reference-test.json"
    src.parent.mkdir(parents=True)
    src.write_text(json.dumps(rec))
    out = tmp_path / "benchmarks.md"
    text = mod.render(src, out).read_text()
    for name, entry in rec["drafters"].items():
        held = entry["train_last_metrics"]["eval/expected_tau"]
        assert f"| {name} | {held:.3f} |" in text                  # held-out table from the record
        summary = entry.get("train_summary")
        if summary:
            assert f"| {name} | {summary['steps']} | {summary['tokens_per_s']:.0f} |" in text
    assert not re.search(r"(?<![\w.])/(work|root|tmp|home)/", text)      # commands are repo-relative
    assert "benchmarks-notes.md" in text and "`bench/results/reference-test.json`" in text


def test_render_picks_the_newest_full_record_by_its_date_not_its_file_name(tmp_path, bench_module, monkeypatch):
    mod = bench_module("render_benchmarks")
    rec = json.loads((REPO / "bench" / "results" / "reference.json").read_text())
    assert set(mod.ORDER) <= set(rec["drafters"])
    rec["args"]["work"] = str(tmp_path / "deleted")
    monkeypatch.setattr(mod, "REPO", tmp_path)
    res = tmp_path / "bench" / "results"
    res.mkdir(parents=True)
    # file names sort the other way round from the dates the records state
    (res / "reference-a-old.json").write_text(json.dumps({**rec, "date": "2026-01-02T00:00:00+00:00",
                                                          "commands": ["OLDER"]}))
    (res / "reference-b-new.json").write_text(json.dumps({**rec, "date": "2026-01-01T00:00:00+00:00",
                                                          "commands": ["NEWER-BY-NAME"]}))
    partial = {**rec, "date": "2026-01-03T00:00:00+00:00", "commands": ["PARTIAL"],
               "drafters": {"eagle3": rec["drafters"]["eagle3"]}}
    (res / "reference.json").write_text(json.dumps(partial))   # newest, but not all four drafters
    (res / "reference-d.part.json").write_text("not a record")   # a record's companion file is skipped
    text = mod.render(None, tmp_path / "benchmarks.md").read_text()
    assert "reference-a-old.json" in text and "2026-01-02" in text
    assert "PARTIAL" not in text and "NEWER-BY-NAME" not in text


def test_load_note_reports_the_recorded_load_or_says_none_was_recorded(bench_module):
    mod = bench_module("render_benchmarks")
    rec = {"drafters": {"a": {}, "b": {"load_avg": None}}}
    assert "did not capture" in mod._load_note(rec, ["a", "b"])
    rec = {"drafters": {"a": {"load_avg": {"after_train": [1.04, 1.5, 1.2], "after_eval": [2.26, 2.0, 1.9]}},
                        "b": {"load_avg": {"after_train": [0.97, 1.0, 1.0], "after_eval": [1.1, 1.0, 1.0]}}}}
    note = mod._load_note(rec, ["a", "b"])
    assert "1.0–2.3" in note and "did not capture" not in note
