"""bench/tune_prompts.py: the tuning prompt set is the eval's benchmark format, from the stated conversations."""
import json


def test_tune_prompts_are_a_benchmark_file(tmp_path, bench_module):
    from deepspec.eval.benchmarks import load_benchmarks
    mod = bench_module("tune_prompts")
    out = tmp_path / "tune" / "sharegpt_tune.jsonl"
    mod.main(["--out", str(out), "--start", "15000", "--count", "5", "--min-chars", "20", "--max-chars", "600"])
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 5 and all(20 <= len(x["turns"][0]) <= 600 for x in lines)
    samples = load_benchmarks(out.parent, ["sharegpt_tune"], 5)["sharegpt_tune"]
    assert [s.turns[0] for s in samples] == [x["turns"][0] for x in lines]
    # the same call gives the same prompts (a fixed slice of a fixed corpus)
    again = tmp_path / "again.jsonl"
    mod.main(["--out", str(again), "--count", "5"])
    assert again.read_text() == out.read_text()
