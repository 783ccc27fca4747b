"""bench/learning_curve.py: ablation variant specs parse to the overrides the trainer gets."""
import pytest


def test_variants_default_to_only_and_get_the_shared_depth_except_eagle3(bench_module):
    mod = bench_module("learning_curve")
    assert mod.parse_variants([], ["dspark_markov", "eagle3"], 2) == [
        ("dspark_markov", "dspark_markov", ["draft.num_layers=2"]), ("eagle3", "eagle3", [])]


def test_variant_overrides_are_kept_and_an_explicit_depth_wins(bench_module):
    mod = bench_module("learning_curve")
    got = mod.parse_variants(["L3=dspark_markov,draft.num_layers=3",
                              "anchor=dflash,draft.anchor_feature=true"], ["eagle3"], 1)
    assert got == [("L3", "dspark_markov", ["draft.num_layers=3"]),
                   ("anchor", "dflash", ["draft.anchor_feature=true", "draft.num_layers=1"])]


@pytest.mark.parametrize("spec, words", [("x=nope", "DRAFTER one of"), ("x", "DRAFTER one of"),
                                         ("x=dflash,layers", "key=value")])
def test_bad_variant_specs_name_the_spec(spec, words, bench_module):
    mod = bench_module("learning_curve")
    with pytest.raises(SystemExit, match=words) as e:
        mod.parse_variants([spec], [], 1)
    assert repr(spec) in str(e.value)


def test_duplicate_variant_labels_are_an_error(bench_module):
    mod = bench_module("learning_curve")
    with pytest.raises(SystemExit, match="used twice"):
        mod.parse_variants(["a=dflash", "a=eagle3"], [], 1)


def _write_metrics(path, train_steps, evals, step_s=lambda s: 0.5 + 0.1 * s, torn=False):
    import json
    lines = []
    for s in range(1, max(train_steps + evals) + 1):
        if s in train_steps:
            lines.append(json.dumps({"step": s, "train/loss": 1.0, "step_time_s": step_s(s), "data_time_s": 0.01}))
        if s in evals:
            lines.append(json.dumps({"step": s, "eval/loss": 2.0, "eval/expected_tau": 1.0 + s / 100,
                                     "eval/accept_rate/1": s / 100, "eval/accept_rate/2": s / 200,
                                     "eval/ce": 3.0 - s / 100, "eval/tv": 0.5}))
    text = "\n".join(lines) + "\n" + ('{"step": 9, "train/lo' if torn else "")
    path.write_text(text)
    return path


def test_curve_accumulates_training_seconds_up_to_each_eval(tmp_path, bench_module):
    mod = bench_module("learning_curve")
    rows = mod.curve(_write_metrics(tmp_path / "metrics.jsonl", list(range(1, 9)), [4, 8], torn=True))
    assert [r["step"] for r in rows] == [4, 8]
    assert rows[0]["train_wall_s"] == pytest.approx(sum(0.5 + 0.1 * s for s in range(1, 5)))
    assert rows[1]["train_wall_s"] == pytest.approx(sum(0.5 + 0.1 * s for s in range(1, 9)))
    assert rows[0]["eval/expected_tau"] == pytest.approx(1.04) and rows[1]["eval/ce"] == pytest.approx(2.92)
    assert all(b["train_wall_s"] > a["train_wall_s"] for a, b in zip(rows, rows[1:]))


def test_curve_with_sparse_logging_and_without_step_times(tmp_path, bench_module):
    mod = bench_module("learning_curve")
    # train.log_every=2: a logged step's time stands for the unlogged step before it
    rows = mod.curve(_write_metrics(tmp_path / "a.jsonl", [2, 4, 6], [3, 6], step_s=lambda s: float(s)))
    assert [r["train_wall_s"] for r in rows] == pytest.approx([2 * 2.0, 2 * 2.0 + 2 * 4.0 + 2 * 6.0])
    # an eval before any training row, and metrics written without step times, have no seconds
    rows = mod.curve(_write_metrics(tmp_path / "b.jsonl", [], [2, 4]))
    assert [r["step"] for r in rows] == [2, 4] and all(r["train_wall_s"] is None for r in rows)


def test_records_with_and_without_times_render(tmp_path, bench_module):
    mod = bench_module("learning_curve")
    new = mod.curve(_write_metrics(tmp_path / "m.jsonl", list(range(1, 9)), [4, 8]))
    old = [{k: v for k, v in r.items() if k != "train_wall_s"} for r in new]   # a record before the times
    for drafters in ({"a": {"curve": new, "train_s": 10.0}, "b": {"curve": old, "train_s": 16.0}},
                     {"b": {"curve": old, "train_s": 16.0}}):
        record = {"args": {"steps": 8}, "drafters": drafters}
        md = mod.markdown(record)
        assert "| 8 |" in md and "| s/step |" in md
        png = tmp_path / f"lc{len(drafters)}.png"
        mod.plot(record, png)
        assert png.stat().st_size > 0
    assert mod.seconds_per_step({"curve": new, "train_s": 10.0}, 8) == pytest.approx(new[-1]["train_wall_s"] / 8)
    assert mod.seconds_per_step({"curve": old, "train_s": 16.0}, 8) == pytest.approx(2.0)


def test_start_step_is_the_newest_complete_checkpoint(tmp_path, bench_module):
    mod = bench_module("learning_curve")
    root = tmp_path / "checkpoints"
    assert mod.start_step(root) == 0
    for step in (40, 80):
        (root / f"step_{step}" / "training_state").mkdir(parents=True)
        (root / f"step_{step}" / "training_state" / "meta.json").write_text("{}")
    (root / "step_120.tmp").mkdir()            # a save cut short by a kill does not count
    (root / "step_160").mkdir()                # nor a step directory without its training state
    assert mod.start_step(root) == 80


def test_real_loop_tau_joins_the_held_out_points_and_renders(tmp_path, bench_module):
    import json
    mod = bench_module("learning_curve")
    path = _write_metrics(tmp_path / "m.jsonl", list(range(1, 9)), [4, 8])
    with path.open("a") as f:   # train.decode_eval_every=4: rows of their own, after the held-out eval
        for s, (t0, t1) in ((4, (1.30, 1.20)), (8, (1.45, 1.33))):
            f.write(json.dumps({"step": s, "decode/tau_t0": t0, "decode/tau_t1": t1, "decode/seconds": 3.0}) + "\n")
    rows = mod.curve(path)
    assert [(r["decode/tau_t0"], r["decode/tau_t1"]) for r in rows] == [(1.30, 1.20), (1.45, 1.33)]
    assert rows[1]["eval/expected_tau"] == pytest.approx(1.08) and "decode/seconds" not in rows[1]
    plain = mod.curve(_write_metrics(tmp_path / "p.jsonl", list(range(1, 9)), [4, 8]))
    record = {"args": {"steps": 8}, "drafters": {"a": {"curve": rows}, "b": {"curve": plain}}}
    assert mod.decode_keys(record) == ["decode/tau_t0", "decode/tau_t1"]
    md = mod.markdown(record)
    assert "| step | a τ t0 | b τ t0 | a τ t1 | b τ t1 |" in md
    assert "| 8 | 1.450 | — | 1.330 | — |" in md
    png = tmp_path / "lc.png"
    mod.plot(record, png)
    assert png.stat().st_size > 0
