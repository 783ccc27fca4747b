"""bench/render_converged.py: the converged-drafters section is computed from the records (verdicts against
the paper's margins, the ordering from paired intervals, one-change variants at the last common step)."""
import json


def _curve(points):
    return [{"step": s, "eval/expected_tau": t, "eval/accept_rate/1": p, "train_wall_s": 10.0 * s}
            for s, t, p in points]


def _records(tmp_path):
    res = tmp_path / "bench" / "results"
    res.mkdir(parents=True)
    curve = {"date": "D1", "args": {"steps": 200, "anchors": 32, "layers": 1, "label": "converge"}, "drafters": {
        "dspark": {"drafter": "dspark_markov", "overrides": ["draft.vocab_size=8192", "draft.num_layers=1"],
                   "curve": _curve([(100, 1.2, 0.2), (200, 1.40, 0.30)])},
        "dspark_rnn": {"drafter": "dspark_rnn", "overrides": ["draft.vocab_size=8192", "draft.num_layers=1"],
                       "curve": _curve([(100, 1.25, 0.22), (200, 1.50, 0.33)])},
        "dflash": {"drafter": "dflash", "overrides": ["draft.num_layers=1"],
                   "curve": _curve([(100, 1.1, 0.1), (200, 1.25, 0.2)])},
        "eagle3": {"drafter": "eagle3", "overrides": [], "curve": _curve([(100, 1.3, 0.25), (200, 1.60, 0.38)])}}}
    ratios = {"dspark/dflash": {"ratio": 1.12, "ratio_ci95": [1.10, 1.14]},
              "dspark_rnn/dflash": {"ratio": 1.20, "ratio_ci95": [1.17, 1.23]},
              "dspark/eagle3": {"ratio": 0.875, "ratio_ci95": [0.86, 0.89]},
              "dspark_rnn/eagle3": {"ratio": 0.95, "ratio_ci95": [0.93, 1.02]}}
    ev = {"date": "D2", "eval_settings": {"max_samples": 20, "benchmarks": ["gsm8k", "mbpp"], "max_new_tokens": 40,
                                          "temperature": 0.0, "extra": []},
          "drafters": {n: {"result": {"macro": {"tau": 1.4, "tau_ci95": [1.3, 1.5]}, "speed": {}}}
                       for n in curve["drafters"]},
          "ratios": ratios}
    (res / "learning_curve-converge.json").write_text(json.dumps(curve))
    (res / "eval_drafters-converge.json").write_text(json.dumps(ev))
    return res, curve


def test_verdicts_and_ordering_follow_the_numbers(tmp_path, bench_module):
    mod = bench_module("render_converged")
    res, _ = _records(tmp_path)
    text = "\n".join(mod.render_converged(res, variant_labels=()))
    # held-out 1.40/1.25 = 1.120 < 1.16; eval 1.12 < 1.16
    assert "| DSpark (Markov) / dflash | 1.120 | 1.120 [1.100, 1.140] | 1.16 | not met | not met |" in text
    # held-out 1.50/1.25 = 1.200, eval 1.20: both met
    assert "| DSpark (RNN) / dflash | 1.200 | 1.200 [1.170, 1.230] | 1.16 | met | met |" in text
    assert "ordering DSpark > dflash on this target: holds" in text
    # one head's interval crosses 1 -> not resolved, even though both point estimates are below 1
    assert "ordering DSpark > eagle3 on this target: is not resolved" in text


def test_reversed_ordering_when_every_interval_is_below_one(tmp_path, bench_module):
    mod = bench_module("render_converged")
    res, _ = _records(tmp_path)
    ev = json.loads((res / "eval_drafters-converge.json").read_text())
    ev["ratios"]["dspark_rnn/eagle3"]["ratio_ci95"] = [0.93, 0.97]
    (res / "eval_drafters-converge.json").write_text(json.dumps(ev))
    assert "ordering DSpark > eagle3 on this target: is reversed" in "\n".join(mod.render_converged(res, variant_labels=()))


def test_variants_are_compared_at_the_last_step_both_reached(tmp_path, bench_module):
    mod = bench_module("render_converged")
    res, _ = _records(tmp_path)
    var = {"args": {"anchors": 128, "layers": 1, "label": "converge_a128"}, "drafters": {
        "dspark_rnn": {"drafter": "dspark_rnn", "overrides": ["draft.vocab_size=8192", "draft.num_layers=1"],
                       "curve": _curve([(100, 1.30, 0.25)])}}}           # stopped at step 100
    deep = {"args": {"anchors": 32, "layers": 3, "label": "converge_L3"}, "drafters": {
        "dflash": {"drafter": "dflash", "overrides": ["draft.num_layers=3"], "curve": _curve([(100, 1.0, 0.1)])}}}
    (res / "learning_curve-converge_a128.json").write_text(json.dumps(var))
    (res / "learning_curve-converge_L3.json").write_text(json.dumps(deep))
    text = "\n".join(mod.render_converged(res, variant_labels=("converge_L3", "converge_a128", "missing")))
    assert ("| dspark_rnn (converge_a128) | 32 → 128 anchors per sequence | 100 | 1.300 (0.250) | 1.250 (0.220) "
            "| +0.050 | 1000 (1000) |") in text
    assert "| dflash (converge_L3) | 1 → 3 layers | 100 | 1.000 (0.100) | 1.100 (0.100) | -0.100 |" in text


def test_a_variant_of_a_variant_is_compared_with_the_nearer_run(tmp_path, bench_module):
    """A run that changes one setting of a one-change run is compared with that run, named in its row."""
    mod = bench_module("render_converged")
    res, _ = _records(tmp_path)
    base_ov = ["draft.vocab_size=8192", "draft.num_layers=1"]
    w1 = {"args": {"steps": 200, "anchors": 32, "layers": 1, "label": "converge_w1emb"}, "drafters": {
        "dspark_rnn": {"drafter": "dspark_rnn", "overrides": base_ov + ["draft.head_embedding=target"],
                       "curve": _curve([(100, 1.30, 0.25), (200, 1.55, 0.35)])}}}
    ep = {"args": {"steps": 200, "anchors": 32, "layers": 1, "label": "converge_eproj"}, "drafters": {
        "dspark_rnn": {"drafter": "dspark_rnn",
                       "overrides": base_ov + ["draft.head_embedding=target", "draft.embed_proj=true"],
                       "curve": _curve([(100, 1.33, 0.27), (200, 1.57, 0.36)])}}}
    (res / "learning_curve-converge_w1emb.json").write_text(json.dumps(w1))
    (res / "learning_curve-converge_eproj.json").write_text(json.dumps(ep))
    text = "\n".join(mod.render_converged(res, variant_labels=("converge_w1emb", "converge_eproj")))
    assert ("| dspark_rnn (converge_eproj) vs dspark_rnn (converge_w1emb) | `draft.embed_proj=true` | 200 | "
            "1.570 (0.360) | 1.550 (0.350) | +0.020 |") in text
    # the run one change away from the converged run is still compared with it
    assert "| dspark_rnn (converge_w1emb) | `draft.head_embedding=target` | 200 | 1.550 (0.350) | 1.500 (0.330) |" in text


def test_a_longer_schedule_is_compared_end_to_end(tmp_path, bench_module):
    mod = bench_module("render_converged")
    res, _ = _records(tmp_path)
    long = {"args": {"steps": 400, "anchors": 32, "layers": 1, "label": "converge_2k"}, "drafters": {
        "dflash": {"drafter": "dflash", "overrides": ["draft.num_layers=1"],
                   "curve": _curve([(200, 1.20, 0.15), (400, 1.30, 0.21)])}}}
    (res / "learning_curve-converge_2k.json").write_text(json.dumps(long))
    text = "\n".join(mod.render_converged(res, variant_labels=("converge_2k",)))
    # the baseline ends at 200 (1.25): the variant's end (1.30 at 400), not its mid-schedule 1.20 at 200
    assert "| dflash (converge_2k) | 200 → 400 steps | 400 vs 200 | 1.300 (0.210) | 1.250 (0.200) | +0.050 |" in text


def test_no_section_without_both_records(tmp_path, bench_module):
    mod = bench_module("render_converged")
    res, _ = _records(tmp_path)
    (res / "eval_drafters-converge.json").unlink()
    assert mod.render_converged(res) == []


def test_paired_rows_join_eval_ratios_with_held_out_by_run_dir(tmp_path, bench_module):
    mod = bench_module("render_converged")
    res, curve = _records(tmp_path)
    for name, e in curve["drafters"].items():
        e["run_dir"] = f"bench/work/x/curve/converge/{name}-200"
    engine = {"args": {"label": "converge_e3engine"}, "drafters": {"eagle3_engine": {
        "drafter": "eagle3", "overrides": ["draft.eagle3_layout=engine"],
        "run_dir": "bench/work/x/curve/converge_e3engine/eagle3_engine-200", "curve": _curve([(200, 1.25, 0.2)])}}}
    (res / "learning_curve-converge.json").write_text(json.dumps(curve))
    (res / "learning_curve-converge_e3engine.json").write_text(json.dumps(engine))
    ev = {"date": "D3", "drafters": {
        "dspark_rnn": {"algorithm": "dspark", "run_dir": "/abs/bench/work/x/curve/converge/dspark_rnn-200"},
        "eagle3_engine": {"algorithm": "eagle3", "run_dir": "/abs/bench/work/x/curve/converge_e3engine/eagle3_engine-200"},
        "eagle3": {"algorithm": "eagle3", "run_dir": "/abs/bench/work/x/curve/converge/eagle3-200"}},
        "ratios": {"dspark_rnn/eagle3_engine": {"ratio": 1.31, "ratio_ci95": [1.28, 1.34]},
                   "eagle3/eagle3_engine": {"ratio": 1.2, "ratio_ci95": [1.1, 1.3]}}}
    (res / "eval_drafters-converge_variants.json").write_text(json.dumps(ev))
    text = "\n".join(mod.render_converged(res, variant_labels=("converge_e3engine",)))
    # held-out 1.50 / 1.25 = 1.200 < 1.30 (not met), eval 1.31 >= 1.30 (met)
    assert "| dspark_rnn / eagle3_engine | 1.200 | 1.310 [1.280, 1.340] | 1.30 | not met | met |" in text
    assert "| eagle3 / eagle3_engine | 1.280 | 1.200 [1.100, 1.300] | – | – | – |" in text   # no goal between baselines


def test_runs_on_other_data_are_no_variants_and_their_held_out_is_not_divided(tmp_path, bench_module):
    mod = bench_module("render_converged")
    res, curve = _records(tmp_path)
    curve["args"]["extra"] = ["train.heldout_fraction=0.05"]
    for name, e in curve["drafters"].items():
        e["run_dir"] = f"bench/work/x/curve/converge/{name}-200"
    more = {"date": "D4", "args": {"steps": 200, "anchors": 32, "layers": 1, "label": "converge_data3k",
                                    "extra": ["train.heldout_fraction=0.05", "cache.extra_dirs=[/a,/b]"]},
            "drafters": {n: {"drafter": curve["drafters"][n]["drafter"], "overrides": [],
                             "run_dir": f"bench/work/x/curve/converge_data3k/{n}-200",
                             "curve": _curve([(200, t, 0.4)])} for n, t in (("dspark_rnn", 1.80), ("dflash", 1.50))}}
    (res / "learning_curve-converge.json").write_text(json.dumps(curve))
    (res / "learning_curve-converge_data3k.json").write_text(json.dumps(more))
    ev = {"date": "D5", "drafters": {
        "dspark_rnn": {"algorithm": "dspark", "run_dir": "/abs/bench/work/x/curve/converge/dspark_rnn-200"},
        "dspark_rnn_3k": {"algorithm": "dspark", "run_dir": "/abs/bench/work/x/curve/converge_data3k/dspark_rnn-200"},
        "dflash_3k": {"algorithm": "dflash", "run_dir": "/abs/bench/work/x/curve/converge_data3k/dflash-200"}},
        "ratios": {"dspark_rnn_3k/dflash_3k": {"ratio": 1.17, "ratio_ci95": [1.15, 1.19]},
                   "dspark_rnn_3k/dspark_rnn": {"ratio": 1.08, "ratio_ci95": [1.05, 1.11]}}}
    (res / "eval_drafters-converge_variants.json").write_text(json.dumps(ev))
    text = "\n".join(mod.render_converged(res, variant_labels=("converge_data3k",), data_labels=("converge_data3k",)))
    assert "(converge_data3k) |" not in text                      # not listed as a one-change variant
    assert "### Other training data: `converge_data3k` (D4)" in text and "`cache.extra_dirs=[/a,/b]`" in text
    assert "| dspark_rnn | 200 | 1.800 | 0.400 |" in text
    # same split: 1.80 / 1.50 = 1.200 held-out; across splits no held-out ratio
    assert "| dspark_rnn_3k / dflash_3k | 1.200 | 1.170 [1.150, 1.190] | 1.16 | met | met |" in text
    assert "| dspark_rnn_3k / dspark_rnn | – | 1.080 [1.050, 1.110] | – | – | – |" in text


def test_another_work_directory_or_regeneration_setting_is_other_data(tmp_path, bench_module):
    mod = bench_module("render_converged")
    res, curve = _records(tmp_path)
    curve["args"].update(work="bench/work/x", extra=["train.heldout_fraction=0.05"])
    for name, e in curve["drafters"].items():
        e["run_dir"] = f"bench/work/x/curve/converge/{name}-200"
    greedy = {"date": "D6", "args": {"steps": 200, "anchors": 32, "layers": 1, "label": "converge_greedy",
                                      "work": "bench/work/g",
                                      "extra": ["train.heldout_fraction=0.05", "engine.temperature=0"]},
              "drafters": {"dspark_rnn": {"drafter": "dspark_rnn", "overrides": [],
                                          "run_dir": "bench/work/g/curve/converge_greedy/dspark_rnn-200",
                                          "curve": _curve([(200, 2.10, 0.5)])}}}
    (res / "learning_curve-converge.json").write_text(json.dumps(curve))
    (res / "learning_curve-converge_greedy.json").write_text(json.dumps(greedy))
    assert mod.data_key(greedy) != mod.data_key(curve)
    assert mod.data_key({**greedy, "args": {**greedy["args"], "work": "bench/work/x"}}) != mod.data_key(curve)
    ev = {"date": "D7", "drafters": {
        "dspark_rnn": {"algorithm": "dspark", "run_dir": "/abs/bench/work/x/curve/converge/dspark_rnn-200"},
        "dspark_rnn_greedy": {"algorithm": "dspark",
                              "run_dir": "/abs/bench/work/g/curve/converge_greedy/dspark_rnn-200"}},
        "ratios": {"dspark_rnn_greedy/dspark_rnn": {"ratio": 1.1, "ratio_ci95": [1.05, 1.15]}}}
    (res / "eval_drafters-converge_variants.json").write_text(json.dumps(ev))
    text = "\n".join(mod.render_converged(res, variant_labels=("converge_greedy",), data_labels=("converge_greedy",)))
    assert "(converge_greedy) |" not in text
    assert "### Other training data: `converge_greedy` (D6)" in text
    assert "`--work bench/work/g`" in text and "`engine.temperature=0`" in text
    assert "| dspark_rnn_greedy / dspark_rnn | – | 1.100 [1.050, 1.150] | – | – | – |" in text


def test_a_change_on_other_data_is_compared_with_the_run_on_that_data(tmp_path, bench_module):
    mod = bench_module("render_converged")
    res, curve = _records(tmp_path)
    curve["args"]["extra"] = ["train.heldout_fraction=0.05"]
    extra = ["train.heldout_fraction=0.05", "cache.extra_dirs=[/a,/b]"]
    more = {"date": "D4", "args": {"steps": 200, "anchors": 32, "layers": 1, "label": "converge_data3k", "extra": extra},
            "drafters": {"dspark_rnn": {"drafter": "dspark_rnn", "overrides": ["draft.head_embedding=target"],
                                        "curve": _curve([(100, 1.60, 0.35), (200, 1.70, 0.41)])}}}
    r384 = {"args": {"steps": 200, "anchors": 32, "layers": 1, "label": "converge_data3k_r384", "extra": extra},
            "drafters": {"dspark_rnn_r384": {"drafter": "dspark_rnn",
                                             "overrides": ["draft.head_embedding=target", "draft.head_rank=384"],
                                             "curve": _curve([(100, 1.62, 0.36), (200, 1.73, 0.42)])}}}
    (res / "learning_curve-converge.json").write_text(json.dumps(curve))
    (res / "learning_curve-converge_data3k.json").write_text(json.dumps(more))
    (res / "learning_curve-converge_data3k_r384.json").write_text(json.dumps(r384))
    text = "\n".join(mod.render_converged(res, variant_labels=("converge_data3k_r384",),
                                          data_labels=("converge_data3k",)))
    assert "One change at a time against `converge_data3k`" in text
    # against the data3k run (1.70 at 200), not against the converge run on other data (1.50)
    assert ("| dspark_rnn_r384 (converge_data3k_r384) | `draft.head_rank=384` | 200 | 1.730 (0.420) | 1.700 (0.410) "
            "| +0.030 |") in text
    assert text.count("(converge_data3k_r384) |") == 1
