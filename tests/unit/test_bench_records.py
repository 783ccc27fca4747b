"""bench/records.py: one naming scheme for every benchmark record, and records and docs name no machine's
directories."""
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PY = sorted(p for p in (REPO / "bench").glob("*.py") if p.stem != "__init__")
SCRIPTS = [p.stem for p in PY if 'if __name__ == "__main__":' in p.read_text()]
MODULES = [p.stem for p in PY if p.stem not in SCRIPTS]


def test_record_and_part_paths(bench_module):
    rec = bench_module("records")
    assert rec.record_path("verify_batched") == REPO / "bench" / "results" / "verify_batched.json"
    path = rec.record_path("schedule_gain", "real_dspark")
    assert path.name == "schedule_gain-real_dspark.json"
    assert rec.part_path(path, "pareto-synthetic-gpu", "png").name == "schedule_gain-real_dspark.pareto-synthetic-gpu.png"
    assert path.with_suffix(".md").name == "schedule_gain-real_dspark.md"
    with pytest.raises(SystemExit, match="--label 'a/b'"):
        rec.record_path("reference", "a/b")


@pytest.mark.parametrize("text, want", [
    ("/x/checkout/.venv/bin/python bench/learning_curve.py --work /x/checkout/bench/work/ref1600 --steps 80",
     ".venv/bin/python bench/learning_curve.py --work bench/work/ref1600 --steps 80"),
    ("/usr/bin/python3.11 bench/learning_curve.py cache.dir=/x/y/runs/a/cache", "python3.11 bench/learning_curve.py cache.dir=runs/a/cache"),
    ("--eval-data /srv/shared/eval_datasets", "--eval-data …/eval_datasets"),
    ("bench/work/abl https://example.org/a/b", "bench/work/abl https://example.org/a/b"),   # relative paths, URLs stay
])
def test_repo_relative(bench_module, text, want):
    assert bench_module("records").repo_relative(text) == want


def test_repo_relative_is_idempotent(bench_module):
    rr = bench_module("records").repo_relative
    for text in ("/x/checkout/bench/work/a", "/srv/shared/eval_datasets", "…/deepspec-pr41/deepspec"):
        assert rr(rr(text)) == rr(text)


def test_write_record_stores_repo_relative_paths(tmp_path, bench_module):
    import json
    rec = bench_module("records")
    record = {**rec.header(), "run_dir": Path("/x/checkout/bench/work/c/a-10"),
              "nested": [{"/x/checkout/runs/r/cache": "cache.dir=/x/checkout/runs/r/cache"}],
              "data_dir": "/srv/shared/eval_datasets", "steps": 10}
    record["command"] = "/x/checkout/.venv/bin/python bench/eval_drafters.py --work /x/checkout/bench/work/c"
    out = rec.write_record(record, "eval_drafters", out=str(tmp_path / "r.json"),
                           markdown="`/usr/bin/python3 bench/x.py --out /x/checkout/bench/results/r.json`")
    got = json.loads(out.read_text())
    assert got["command"] == ".venv/bin/python bench/eval_drafters.py --work bench/work/c"
    assert got["run_dir"] == "bench/work/c/a-10" and got["steps"] == 10
    assert got["nested"] == [{"runs/r/cache": "cache.dir=runs/r/cache"}]
    assert got["data_dir"] == "…/eval_datasets"
    assert got["machine"]["loadavg_end"] is not None or not hasattr(__import__("os"), "getloadavg")
    assert out.with_suffix(".md").read_text() == "`python3 bench/x.py --out bench/results/r.json`\n"


def test_committed_records_name_no_machine_directories():
    bad = re.compile(r"(?<![\w.~:/…])/(work|tmp|root|home|usr|opt|srv)/")
    for f in sorted((REPO / "bench" / "results").iterdir()):
        if f.suffix in (".json", ".md"):
            for i, line in enumerate(f.read_text().splitlines(), 1):
                assert not bad.search(line), f"bench/results/{f.name}:{i}: {line.strip()[:120]}"


def test_every_result_file_follows_the_scheme_and_belongs_to_a_listed_record():
    """<name>[-<label>][.<part>].<ext>, beside its record, with <name> a record name of bench/README.md's table."""
    readme = (REPO / "bench" / "README.md").read_text()
    name = re.compile(r"(?P<name>[a-z0-9_]+)(-[A-Za-z0-9_]+)?(\.[A-Za-z0-9_-]+)?\.(json|md|png)")
    for f in (REPO / "bench" / "results").iterdir():
        m = name.fullmatch(f.name)
        assert m, f"bench/results/{f.name}: not <name>[-<label>][.<part>].<ext>"
        assert re.search(rf"`{m['name']}(\[|\.|-)", readme), f"bench/results/{f.name}: {m['name']} is no record name"
        record = REPO / "bench" / "results" / (f.name.split(".")[0] + ".json")
        assert record.is_file(), f"bench/results/{f.name}: no record {record.name} beside it"


def test_bench_readme_lists_every_script_and_module():
    readme = (REPO / "bench" / "README.md").read_text()
    assert "learning_curve" in SCRIPTS and "records" in MODULES
    for script in SCRIPTS:
        assert f"`{script}.py`" in readme and f"bench/{script}.py" in readme, script
    for module in MODULES:
        assert f"`bench/{module}.py`" in readme, module


def test_docs_name_no_machine_directories():
    bad = re.compile(r"(?<![\w.])/(work|root|tmp|home)/")
    for doc in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for i, line in enumerate(doc.read_text().splitlines(), 1):
            assert not bad.search(line), f"{doc.relative_to(REPO)}:{i}: {line.strip()}"
