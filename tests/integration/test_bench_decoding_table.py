"""bench/decoding_table.py end to end on a tiny target: an Eagle3 checkpoint and no_draft, greedy and sampled,
a lookup setting chosen on "tuning" prompts, the row-invariant row, transformers' plain and prompt-lookup
generate on the same prompts; the record's numbers and its table.  ``--write-tune-prompts``: the tuning prompt
set is the eval's benchmark format, from the stated conversations."""
import json

import pytest
import torch


def test_decoding_table_record(tmp_path, eval_data_dir, bench_module):
    from deepspec.config import TargetConfig
    from deepspec.config.draft import DraftConfig
    from deepspec.drafts import build_drafter
    from deepspec.targets import load_target
    mod = bench_module("decoding_table")
    target = load_target(TargetConfig(path="tiny:llama", dtype="float32", device="cpu", num_feature_layers=2))
    torch.manual_seed(0)
    ckpt = build_drafter(target, DraftConfig(algorithm="eagle3", gamma=3, num_layers=1)).save_pretrained(tmp_path / "e3")
    out = tmp_path / "rec.json"
    tiny = ["target.path=tiny:llama", "target.device=cpu", "target.num_feature_layers=2"]
    rec = mod.main(["--drafter", f"eagle3={ckpt}", "--drafter", "no_draft=none", "--dtype", "float32",
                    "--temperatures", "0", "1", "--trees", "tree6x2", "--lookups", "tree6x2l3", "tree4x1l2",
                    "--benchmarks", "gsm8k", "humaneval", "--max-samples", "2", "--max-new-tokens", "8",
                    "--data-dir", str(eval_data_dir), "--tune-data-dir", str(eval_data_dir),
                    "--tune-benchmarks", "mbpp", "--tune-samples", "1", "--resamples", "50",
                    "--hf-lookup-tokens", "2", "3", "--in-process", "--work", str(tmp_path / "work"), "--out", str(out),
                    "--extra", *tiny, "--hf-extra", *tiny])
    assert json.loads(out.read_text())["rows"].keys() == rec["rows"].keys()
    rows = rec["rows"]
    chosen = {k: v["chosen"] for k, v in rec["tuning"].items()}
    assert set(chosen) == {f"{d}/lookup/T{t}" for d in ("eagle3", "no_draft") for t in ("0", "1")} | {
        f"transformers/prompt_lookup_num_tokens/T{t}" for t in ("0", "1")}
    assert {v for k, v in chosen.items() if "/lookup/" in k} <= {"tree6x2l3", "tree4x1l2"}
    assert {v for k, v in chosen.items() if k.startswith("transformers")} <= {2, 3}
    e3 = [r for r in rows.values() if r["kind"] == "deepspec" and r["drafter"] == "eagle3"]
    assert {(r["setting"].startswith("tree"), r["temperature"]) for r in e3} == {(a, t) for a in (0, 1) for t in (0, 1)}
    for r in e3 + [r for r in rows.values() if r["kind"] == "deepspec" and r["drafter"] == "no_draft"]:
        assert r["tau"] >= 1 and r["speed"]["speedup_pooled"] > 0 and r["speed"]["verify_ms"] > 0
        if r["temperature"] == 0:                       # fp32: every greedy output is plain decoding's
            assert r["greedy_check"]["matched"] == r["greedy_check"]["compared"] == 4
    assert any(r["row_invariant"] for r in e3)
    assert [r["setting"] for r in rows.values() if r["kind"] == "deepspec" and r["drafter"] == "no_draft"
            and not r["row_invariant"]] == [chosen["no_draft/lookup/T0"], chosen["no_draft/lookup/T1"]]
    hf = {n: r for n, r in rows.items() if r["kind"] == "transformers"}
    assert len(hf) == 4 and all(r["requests"] == 4 and r["tokens_per_s"] > 0 for r in hf.values())
    look = next(r for n, r in hf.items() if n.startswith("transformers prompt lookup") and n.endswith("T=0"))
    assert look["identical"] == {"matched": 4, "compared": 4} and look["tau"] >= 1
    assert set(rec["fastest_plain_tokens_per_s"]) == {"0", "1"}
    md = out.with_suffix(".md").read_text()
    assert "no smaller model" in md and "n/a (sampled)" in md and "| 4/4 |" in md
    # --no-eval combines the finished evals and the transformers rows measured above (not re-measured)
    args = ["--drafter", f"eagle3={ckpt}", "--drafter", "no_draft=none", "--dtype", "float32",
            "--temperatures", "0", "1", "--trees", "tree6x2", "--lookups", "tree6x2l3", "tree4x1l2",
            "--benchmarks", "gsm8k", "humaneval", "--max-samples", "2", "--max-new-tokens", "8",
            "--data-dir", str(eval_data_dir), "--tune-data-dir", str(eval_data_dir),
            "--tune-benchmarks", "mbpp", "--tune-samples", "1", "--resamples", "50",
            "--hf-lookup-tokens", "2", "3", "--work", str(tmp_path / "work"), "--no-eval",
            "--out", str(tmp_path / "again.json"), "--extra", *tiny, "--hf-extra", *tiny]
    again = mod.main(args)
    assert again["rows"] == json.loads(out.read_text())["rows"] and again["tuning"] == rec["tuning"]
    with pytest.raises(SystemExit, match="no transformers rows"):
        mod.main([a if a != "3" else "4" for a in args])
    with pytest.raises(SystemExit, match="NAME=CHECKPOINT"):
        mod.parse_drafter("eagle3")
    # --kinds: only eagle3's tree + lookup rows (reused from above; its chains and trees left out)
    i = args.index("no_draft=none")
    part = mod.main(args[:i - 1] + args[i + 1:] + ["--kinds", "eagle3=lookup", "--out", str(tmp_path / "part.json")])
    got = [(r["setting"], r["temperature"], r["row_invariant"]) for r in part["rows"].values() if r["kind"] == "deepspec"]
    assert got == [(chosen["eagle3/lookup/T0"], 0, False), (chosen["eagle3/lookup/T1"], 1, False),
                   (chosen["eagle3/lookup/T0"], 0, True)]
    none = mod.main(args[:i - 1] + args[i + 1:] + ["--kinds", "eagle3=lookup", "--exact-rows-for", "--out",
                                                   str(tmp_path / "none.json")])
    assert not any(r.get("row_invariant") for r in none["rows"].values()) and len(none["rows"]) == len(part["rows"]) - 1
    with pytest.raises(SystemExit, match="--kinds"):
        mod.parse_kinds(["eagle3=chains"])
    with pytest.raises(SystemExit):                     # names no drafter
        mod.main(args + ["--kinds", "dflash=chain"])


def test_tune_prompts_are_a_benchmark_file(tmp_path, bench_module):
    from deepspec.eval.benchmarks import load_benchmarks
    mod = bench_module("decoding_table")
    out = tmp_path / "tune" / "sharegpt_tune.jsonl"
    got = mod.main(["--write-tune-prompts", str(out), "--tune-start", "15000", "--tune-samples", "5",
                    "--tune-min-chars", "20", "--tune-max-chars", "600"])
    assert got == {"tune_prompts": str(out), "prompts": 5}
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 5 and all(20 <= len(x["turns"][0]) <= 600 for x in lines)
    samples = load_benchmarks(out.parent, ["sharegpt_tune"], 5)["sharegpt_tune"]
    assert [s.turns[0] for s in samples] == [x["turns"][0] for x in lines]
    # the same call gives the same prompts (a fixed slice of a fixed corpus)
    again = tmp_path / "again.jsonl"
    mod.main(["--write-tune-prompts", str(again), "--tune-samples", "5"])
    assert again.read_text() == out.read_text()
    with pytest.raises(SystemExit):                     # no --drafter: nothing to evaluate
        mod.main(["--max-samples", "1"])
