"""bench/eval_drafters.py + bench/eval_tables.py: the paired τ-ratio bootstrap on per-request rows, what a
record keeps of an eval's results.json, the markdown of a record, and which checkpoint and config of a
training run directory are evaluated."""
import dataclasses
import itertools
import json
import random

import numpy as np
import pytest
import torch

from deepspec.eval.bootstrap import bootstrap_intervals, request_totals
from deepspec.eval.runner import RequestRecord
from deepspec.decoding.loop import GenerationResult, RoundStats
from deepspec.train.checkpoint import run_config_path


def _result(accepted, seconds=1.0):
    rounds = [RoundStats(drafted=4, proposed=4, accepted=a, emitted=a + 1, draft_tokens=[1, 2, 3, 4],
                         confidence=None) for a in accepted]
    n = 1 + sum(a + 1 for a in accepted)
    return GenerationResult(prompt_len=3, tokens=list(range(n)), stop_reason="max_new_tokens", rounds=rounds,
                            t_prefill=0.1 * seconds, t_total=seconds)


def _records(per_bench, baseline=True):
    """RequestRecords of ``{benchmark: [accepted per round of each request]}`` (what the evaluator keeps)."""
    out = []
    for bench, reqs in per_bench.items():
        for i, acc in enumerate(reqs):
            spec = _result(acc, seconds=1.0 + 0.1 * i)
            base = GenerationResult(prompt_len=3, tokens=list(range(spec.num_tokens)), stop_reason="max_new_tokens",
                                    t_prefill=0.1, t_total=2.0 + 0.05 * i) if baseline else None
            out.append(RequestRecord(f"{bench}/{i}", bench, i, 0, 3, spec, base))
    return out


def _rows(per_bench):
    """samples.jsonl rows, as `deepspec eval` writes them."""
    return [json.loads(json.dumps(r.to_json())) for r in _records(per_bench)]


def _varied(n, seed):
    rng = random.Random(seed)
    return [[rng.randint(0, 4) for _ in range(rng.randint(1, 10))] for _ in range(n)]


def test_request_table_reads_the_evaluators_totals_back_from_samples_rows(bench_module):
    tables = bench_module("eval_tables")
    per = {"gsm8k": _varied(7, 0), "mt-bench": _varied(5, 1)}
    got = tables.request_table(_rows(per))
    assert set(got) == set(per)
    for bench in per:
        want = request_totals([r for r in _records(per) if r.benchmark == bench])
        ids, t = got[bench]
        assert ids == sorted(f"{bench}/{i}" for i in range(len(per[bench])))
        order = [int(x.rsplit("/", 1)[1]) for x in ids]
        for field in ("tau_tokens", "rounds", "spec_tokens", "spec_time", "base_tokens", "base_time"):
            assert getattr(t, field).tolist() == pytest.approx(getattr(want, field)[order].tolist()), field
    # the same intervals the evaluator computes from its in-memory records
    ci = bootstrap_intervals({b: t for b, (_, t) in got.items()}, 300, seed=3)
    ref = bootstrap_intervals({b: request_totals([r for r in _records(per) if r.benchmark == b]) for b in per}, 300, 3)
    assert ci["overall"]["tau_ci95"] == pytest.approx(ref["overall"]["tau_ci95"])


def test_identical_drafters_have_ratio_one_with_a_degenerate_interval(bench_module):
    """Heterogeneous requests: an unpaired bootstrap would spread the ratio; paired draws cancel exactly."""
    tables = bench_module("eval_tables")
    per = {"gsm8k": _varied(12, 0), "humaneval": _varied(9, 1), "mt-bench": _varied(6, 2)}
    a, b = tables.request_table(_rows(per)), tables.request_table(_rows(per))
    r = tables.paired_ratio(a, b, 500, seed=0)
    assert r["ratio"] == 1.0 and r["ratio_ci95"] == [1.0, 1.0]
    assert all(e["ratio"] == 1.0 and e["ratio_ci95"] == [1.0, 1.0] for e in r["benchmarks"].values())
    assert r["tau_a"] == r["tau_b"] > 1.0


def test_twice_the_accepted_tokens_on_every_request(bench_module):
    """B accepts 1 draft token every round (τ 2), A accepts 2 (τ 3) on the same requests: 3/2 at every resample.
    Doubling the emitted tokens (accepted + 1) instead doubles τ: ratio 2."""
    tables = bench_module("eval_tables")
    rng = random.Random(0)
    shape = {"gsm8k": [rng.randint(1, 9) for _ in range(10)], "mbpp": [rng.randint(1, 9) for _ in range(6)]}
    b = tables.request_table(_rows({k: [[1] * n for n in v] for k, v in shape.items()}))
    a = tables.request_table(_rows({k: [[2] * n for n in v] for k, v in shape.items()}))
    r = tables.paired_ratio(a, b, 400, seed=1)
    assert r["tau_a"] == 3.0 and r["tau_b"] == 2.0
    assert r["ratio"] == pytest.approx(1.5) and r["ratio_ci95"] == pytest.approx([1.5, 1.5])
    per_b = {"gsm8k": _varied(10, 4), "mbpp": _varied(6, 5)}
    per_a = {k: [[2 * x + 1 for x in req] for req in v] for k, v in per_b.items()}   # (2x + 1) + 1 = 2 (x + 1)
    r2 = tables.paired_ratio(tables.request_table(_rows(per_a)), tables.request_table(_rows(per_b)), 400, seed=1)
    assert r2["ratio"] == pytest.approx(2.0) and r2["ratio_ci95"] == pytest.approx([2.0, 2.0])


def test_ratio_interval_contains_the_estimate_is_seeded_and_uses_the_macro_mean(bench_module):
    tables = bench_module("eval_tables")
    a = tables.request_table(_rows({"gsm8k": _varied(25, 0), "mt-bench": _varied(8, 1)}))
    b = tables.request_table(_rows({"gsm8k": _varied(25, 2), "mt-bench": _varied(8, 3)}))
    r = tables.paired_ratio(a, b, 800, seed=7)
    lo, hi = r["ratio_ci95"]
    assert lo < r["ratio"] < hi
    for e in r["benchmarks"].values():
        assert e["ratio_ci95"][0] <= e["ratio"] <= e["ratio_ci95"][1]
    # macro = unweighted mean over benchmarks, as the evaluator's macro (not the pooled rounds)
    tau = {name: t.tau_tokens.sum() / t.rounds.sum() for name, (_, t) in a.items()}
    assert r["tau_a"] == pytest.approx(np.mean(list(tau.values())))
    assert r["ratio"] == pytest.approx(r["tau_a"] / r["tau_b"])
    assert tables.paired_ratio(a, b, 800, seed=7) == r
    assert tables.paired_ratio(a, b, 800, seed=8)["ratio_ci95"] != r["ratio_ci95"]
    assert tables.paired_ratio(a, b, 0)["ratio_ci95"] is None


def test_ratio_of_evals_on_different_requests_is_refused(bench_module):
    tables = bench_module("eval_tables")
    a = tables.request_table(_rows({"gsm8k": _varied(5, 0)}))
    with pytest.raises(ValueError, match="different requests"):
        tables.paired_ratio(a, tables.request_table(_rows({"gsm8k": _varied(4, 0)})), 10)
    with pytest.raises(ValueError, match="different benchmarks"):
        tables.paired_ratio(a, tables.request_table(_rows({"mbpp": _varied(5, 0)})), 10)


def test_eval_summary_keeps_the_evaluators_numbers(bench_module):
    """`eval_summary` of a results.json as the evaluator writes it (`summarize`, through JSON): τ with its
    interval per benchmark and macro, the pooled speedup, both loops' tokens/s, the round split and the
    greedy check's counts."""
    from deepspec.eval.runner import summarize
    tables = bench_module("eval_tables")
    per = {"gsm8k": _varied(6, 0), "mt-bench": _varied(4, 1)}
    res = summarize(_records(per), gamma=4, greedy=True, bootstrap_resamples=50, bootstrap_seed=0)
    res["setup"] = {"policy": "tree(nodes=6, width=2, lookup=3..1)"}
    res = json.loads(json.dumps(res))                                   # as read back from results.json
    s = tables.eval_summary(res)
    assert s["setup"]["policy"] == "tree(nodes=6, width=2, lookup=3..1)" and s["gamma"] == 4
    assert set(s["benchmarks"]) == set(per) and set(s["macro"]) <= set(tables.STAT_KEYS)
    for name, b in s["benchmarks"].items():
        assert b["tau"] == res["benchmarks"][name]["all_turns"]["tau"] and len(b["tau_ci95"]) == 2
        assert b["requests"] == len(per[name]) and b["first_turn"] is None
    assert s["macro"]["tau"] == pytest.approx(np.mean([b["tau"] for b in s["benchmarks"].values()]))
    lo, hi = s["macro"]["tau_ci95"]
    assert lo <= s["macro"]["tau"] <= hi and s["macro"]["requests"] == 10
    sp = s["speed"]
    assert sp["speedup_pooled"] == pytest.approx(sp["spec_tokens_per_s"] / sp["baseline_tokens_per_s"])
    assert sp["verified_tokens_per_round"] == 5.0 and sp["rounds"] == sum(len(r) for v in per.values() for r in v)
    assert sp["plain_decode_ms_per_token"] > 0
    assert s["greedy_check"] == {"compared": 10, "matched": 10}        # the counts, not the request list
    assert s["bootstrap"]["resamples"] == 50


def _result_entry(taus, gamma=4):
    benches = {b: {"requests": 3, "tau": t, "tau_ci95": [t - 0.1, t + 0.2]} for b, t in taus.items()}
    return {"gamma": gamma, "benchmarks": benches,
            "macro": {"requests": 3 * len(taus), "tau": float(np.mean(list(taus.values()))), "tau_ci95": [1.5, 2.5],
                      "speedup": 1.25, "speedup_ci95": [1.1, 1.4], "conditional_acceptance": [0.5, 0.25]},
            "speed": {"speedup_pooled": 1.3, "draft_ms": 4.0, "verify_ms": 10.0, "overhead_ms": 1.0, "round_ms": 15.0,
                      "tokens_per_round": 2.0, "plain_decode_ms_per_token": 9.0, "verify_over_plain_decode": 1.11},
            "greedy_check": {"compared": 3, "matched": 3}}


def test_markdown_of_a_small_record(bench_module):
    tables = bench_module("eval_tables")
    record = {"date": "2026-12-04T00:00:00+00:00", "label": "x", "command": "/opt/py/bin/python bench/eval_drafters.py",
              "eval_settings": {"benchmarks": ["gsm8k", "mbpp"], "max_samples": 3, "max_new_tokens": 8,
                                "temperature": 0.0, "multi_turn": True},
              "machine": {"cpus": 2, "loadavg_start": [1.0, 1, 1], "loadavg_end": [2.0, 2, 2]}, "threads": 1, "jobs": 2,
              "drafters": {"a": {"checkpoint_step": 200, "result": _result_entry({"gsm8k": 2.31, "mbpp": 1.9})},
                           "b": {"checkpoint_step": 150, "result": _result_entry({"gsm8k": 1.5})},
                           "c": {"error": "eval exited with 1"}},
              "ratios": {"a/b": {"tau_a": 2.105, "tau_b": 1.5, "ratio": 1.4033, "ratio_ci95": [1.2, 1.6],
                                 "benchmarks": {"gsm8k": {"ratio": 1.54, "ratio_ci95": [1.3, 1.7]}}},
                         "a/c": {"error": "an eval failed"}}}
    md = tables.markdown(record)
    lines = md.splitlines()
    assert lines[0] == "# eval_drafters-x" and "/opt/py" not in md
    assert "| benchmark | a | b |" in lines          # failed drafters have no column, but a note
    assert "**c: failed** — eval exited with 1" in md
    assert "| gsm8k | 2.31 [2.21, 2.51] | 1.50 [1.40, 1.70] |" in lines
    assert "| mbpp | 1.90 [1.80, 2.10] | – |" in lines
    assert "| **macro** | 2.10 [1.50, 2.50] | 1.50 [1.50, 2.50] |" in lines
    assert "| checkpoint step | 200 | 150 |" in lines
    assert any(l.startswith("| a | 4 | 1.30 | 1.25 [1.10, 1.40] | 4.0 | 10.0 | 1.0 | 15.0 |") and l.endswith("| 3/3 |")
               for l in lines)
    assert "| a | 0.50 | 0.25 |" in lines
    assert "| gsm8k | 1.540 [1.300, 1.700] | – |" in lines
    assert "| **macro** | 1.403 [1.200, 1.600] (2.10 ÷ 1.50) | an eval failed |" in lines
    for header in ("| benchmark | a | b |", "| benchmark | a/b | a/c |"):   # rows as wide as their header
        block = list(itertools.takewhile(lambda l: l.startswith("|"), lines[lines.index(header):]))
        assert len(block) >= 4 and all(l.count("|") == header.count("|") for l in block)
    assert "Notes:" not in md
    md = tables.markdown({**record, "notes": ["sized down: 4 prompts", "cache in /x/checkout/bench/work/c"]})
    assert md.endswith("Notes:\n\n- sized down: 4 prompts\n- cache in bench/work/c\n")


def _save(root, step, run_yaml="seed: 0\n"):
    from deepspec.train.checkpoint import save_checkpoint

    def draft(path):
        (path / "config.json").write_text("{}")
        (path / "model.safetensors").write_bytes(b"")
    w = {"w": torch.zeros(2)}
    return save_checkpoint(root, step, save_draft=draft, weights=w, optimizer={"w": {"exp_avg": torch.zeros(2)}},
                           meta={"sequences_consumed": step}, rng=[], config_yaml=run_yaml)


def test_final_checkpoint_and_config_of_a_run_directory(tmp_path, bench_module):
    mod = bench_module("eval_drafters")
    run = tmp_path / "run"
    for s in (2, 4):
        _save(run / "checkpoints", s, run_yaml=f"seed: {s}\n")
    (run / "checkpoints" / "step_6.tmp").mkdir()                      # killed while saving
    (run / "checkpoints" / "step_8").mkdir()                          # no training_state/meta.json
    assert mod.final_checkpoint(run) == (run / "checkpoints" / "step_4", 4)
    assert mod.final_checkpoint(run / "checkpoints" / "step_2") == (run / "checkpoints" / "step_2", 2)
    ck = run / "checkpoints" / "step_4"
    assert run_config_path(run, ck) == ck / "run.yaml"                  # no run.yaml in the run dir yet
    (run / "run.yaml").write_text("seed: 0\n")
    assert run_config_path(run, ck) == run / "run.yaml"
    assert run_config_path(ck, ck) == ck / "run.yaml"
    with pytest.raises(SystemExit, match="no complete checkpoint"):
        mod.final_checkpoint(tmp_path / "empty")
    with pytest.raises(SystemExit, match="no complete checkpoint"):     # step_8 has neither state nor weights
        mod.final_checkpoint(run / "checkpoints" / "step_8")
    converted = tmp_path / "converted" / "checkpoints" / "step_600"    # weights only (bench/deepspec_quality.py)
    converted.mkdir(parents=True)
    (converted / "config.json").write_text("{}")
    (converted / "run.yaml").write_text("seed: 0\n")
    assert mod.final_checkpoint(converted) == (converted, 600)
    with pytest.raises(SystemExit, match="no complete checkpoint"):     # not picked from its run directory
        mod.final_checkpoint(tmp_path / "converted")


def test_drafters_of_curve_records_and_run_entries(tmp_path, bench_module, monkeypatch):
    mod = bench_module("eval_drafters")
    checkout = tmp_path / "checkout"
    (checkout / "bench" / "results").mkdir(parents=True)
    (checkout / "bench" / "work" / "c" / "a-10").mkdir(parents=True)
    curve = checkout / "bench" / "results" / "learning_curve-x.json"
    curve.write_text(json.dumps({"drafters": {
        "a": {"drafter": "dspark_markov", "overrides": ["draft.num_layers=1"], "run_dir": "bench/work/c/a-10"},
        "b": {"drafter": "eagle3", "overrides": [], "run_dir": str(tmp_path / "b")}}}))
    monkeypatch.chdir(tmp_path)
    got = mod.select_drafters([str(curve)], ["z=runs/z"], [])
    assert list(got) == ["a", "b", "z"]
    assert got["a"]["run_dir"] == checkout / "bench" / "work" / "c" / "a-10"   # relative to the record's checkout
    assert got["a"]["overrides"] == ["draft.num_layers=1"] and got["z"]["run_dir"] == tmp_path / "runs" / "z"
    assert list(mod.select_drafters([str(curve)], [], ["b"])) == ["b"]
    with pytest.raises(SystemExit, match="given twice"):
        mod.select_drafters([str(curve)], ["a=x"], [])
    with pytest.raises(SystemExit, match="not among"):
        mod.select_drafters([str(curve)], [], ["nope"])
    with pytest.raises(SystemExit, match="A/B"):
        mod.parse_ratios(["a/a"], ["a", "b"])
    assert mod.parse_ratios(["a/b", "b/a"], ["a", "b"]) == [("a", "b"), ("b", "a")]


def test_eval_config_keeps_the_runs_target_and_draft(tmp_path, bench_module):
    from deepspec.config import load_config, to_yaml
    mod = bench_module("eval_drafters")
    train_cfg = load_config(["target.path=tiny:llama", "draft=eagle3", "draft.gamma=5", "eval.max_samples=99"])
    (tmp_path / "run.yaml").write_text(to_yaml(train_cfg))
    cfg = mod.eval_config(tmp_path / "run.yaml", tmp_path / "ck", tmp_path / "out",
                          ["eval.benchmarks=[gsm8k,mt-bench]", "eval.max_samples=2", "eval.temperature=0.0"])
    assert cfg.target.path == "tiny:llama" and cfg.draft.algorithm == "eagle3" and cfg.draft.gamma == 5
    assert cfg.eval.checkpoint == str(tmp_path / "ck") and cfg.eval.out_dir == str(tmp_path / "out")
    assert cfg.eval.benchmarks == ["gsm8k", "mt-bench"] and cfg.eval.max_samples == 2
    assert cfg.eval.temperature == 0.0 and cfg.eval.progress is False


def test_request_totals_kept_in_a_record_pair_like_the_eval_directory(bench_module):
    """What a record keeps of an eval's requests (JSON) gives the same paired ratio as its samples.jsonl."""
    tables = bench_module("eval_tables")
    per_a = {"gsm8k": _varied(9, 0), "mt-bench": _varied(5, 1)}
    per_b = {"gsm8k": _varied(9, 2), "mt-bench": _varied(5, 3)}
    a, b = tables.request_table(_rows(per_a)), tables.request_table(_rows(per_b))
    kept = tables.totals_from_json(json.loads(json.dumps(tables.totals_to_json(a))))
    assert set(kept) == set(a)
    for name, (ids, t) in a.items():
        assert kept[name][0] == ids
        for field in tables.TOTAL_FIELDS:
            assert getattr(kept[name][1], field).tolist() == getattr(t, field).tolist(), field
    assert tables.paired_ratio(kept, b, 300, seed=2) == tables.paired_ratio(a, b, 300, seed=2)
    no_base = {n: (ids, dataclasses.replace(t, base_tokens=None, base_time=None)) for n, (ids, t) in a.items()}
    back = tables.totals_from_json(json.loads(json.dumps(tables.totals_to_json(no_base))))
    assert all(t.base_tokens is None and t.base_time is None for _, t in back.values())


def _settings(**kw):
    s = {"benchmarks": ["gsm8k", "mt-bench"], "max_samples": 5, "max_new_tokens": 8, "temperature": 1.0,
         "multi_turn": False, "data_dir": "/data", "bootstrap_resamples": 100, "seed": 0, "extra": []}
    return {**s, **kw}


def test_drafters_from_an_earlier_record_join_the_ratios(tmp_path, bench_module):
    """``--from-record``: a drafter whose eval directory is gone pairs through the totals its record kept;
    other eval settings, a missing drafter or a record without totals are refused by name."""
    tables, mod = bench_module("eval_tables"), bench_module("eval_drafters")
    per_old, per_new = {"gsm8k": _varied(5, 0), "mt-bench": _varied(5, 1)}, {"gsm8k": _varied(5, 2), "mt-bench": _varied(5, 3)}
    old = tables.request_table(_rows(per_old))
    rec = tmp_path / "eval_drafters-old.json"
    rec.write_text(json.dumps({"eval_settings": _settings(bootstrap_resamples=1000),   # resamples may differ
                               "drafters": {"old": {"result": {"macro": {"tau": 1.5}}, "eval_dir": "/gone",
                                                    "request_totals": tables.totals_to_json(old)},
                                            "bare": {"result": {"macro": {"tau": 1.2}}}}}))
    got = mod.imported_drafters([f"{rec}:old"], _settings(), ["new"])
    assert list(got) == ["old"] and got["old"]["eval_dir"] is None and got["old"]["result"]["macro"]["tau"] == 1.5
    written = json.loads(rec.read_text())          # a record as write_record leaves it: absolute paths cut
    written["eval_settings"]["data_dir"] = "…/data"
    rec_cut = tmp_path / "eval_drafters-cut.json"
    rec_cut.write_text(json.dumps(written))
    assert list(mod.imported_drafters([f"{rec_cut}:old"], _settings(data_dir="/elsewhere/data"), [])) == ["old"]
    new_totals = tables.totals_to_json(tables.request_table(_rows(per_new)))       # what `collect` keeps
    drafters = {"new": {"result": {"macro": {}}, "eval_dir": str(tmp_path), "request_totals": new_totals}, **got}
    r = mod.ratios(drafters, [("new", "old")], 200, 0)["new/old"]
    assert r == tables.paired_ratio(tables.request_table(_rows(per_new)), old, 200, 0)
    with pytest.raises(SystemExit, match="eval_settings.temperature is 1.0 there and 0.0 here"):
        mod.imported_drafters([f"{rec}:old"], _settings(temperature=0.0), [])
    with pytest.raises(SystemExit, match="eval_settings.extra"):
        mod.imported_drafters([f"{rec}:old"], _settings(extra=["target.dtype=bfloat16"]), [])
    with pytest.raises(SystemExit, match="no drafter 'nope'"):
        mod.imported_drafters([f"{rec}:nope"], _settings(), [])
    with pytest.raises(SystemExit, match="kept no per-request totals for 'bare'"):
        mod.imported_drafters([f"{rec}:bare"], _settings(), [])
    with pytest.raises(SystemExit, match="already in this record"):
        mod.imported_drafters([f"{rec}:old"], _settings(), ["old"])
    with pytest.raises(SystemExit, match="expected RECORD.json:NAME"):
        mod.imported_drafters([str(rec)], _settings(), [])
    assert "no per-request totals" in mod.ratios({"new": drafters["new"], "bare": {"result": {"macro": {}}, "eval_dir": None}},
                                                 [("new", "bare")], 10, 0)["new/bare"]["error"]
