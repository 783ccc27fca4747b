"""STS calibration, metrics, rollout I/O and the calibrate stage (numpy only, fast)."""
import json

import numpy as np
import pytest

from deepspec.schedule.calibration import (Calibration, apply_temperatures, auroc, brier, calibration_metrics,
                                           cumulative, ece, fit_sts, temperature_grid, threshold_lengths,
                                           threshold_sweep)
from deepspec.schedule.rollouts import (RolloutRecord, RolloutWriter, group_by_request, make_record,
                                        observed_mask, prefix_survival, read_rollouts, synthetic_rollouts,
                                        to_arrays, write_rollouts)


@pytest.fixture(scope="module")
def overconfident():
    return to_arrays(synthetic_rollouts(n_requests=48, rounds_per_request=24, gamma=5, seed=3,
                                        overconfidence=2.5))


def test_auroc_matches_pairwise_count():
    rng = np.random.default_rng(0)
    s = np.round(rng.random(200), 1)          # many ties
    y = rng.random(200) < s
    pos, neg = s[y], s[~y]
    pairs = (pos[:, None] > neg[None, :]).mean() + 0.5 * (pos[:, None] == neg[None, :]).mean()
    assert auroc(s, y) == pytest.approx(pairs, abs=1e-12)
    assert np.isnan(auroc(s, np.ones_like(y)))


def test_ece_brier_known_values():
    p = np.array([0.9, 0.9, 0.1, 0.1])
    y = np.array([1, 0, 0, 0])
    # two bins used: mean p 0.9 vs freq 0.5 (weight 1/2), mean 0.1 vs 0 (weight 1/2)
    assert ece(p, y, n_bins=10) == pytest.approx(0.5 * 0.4 + 0.5 * 0.1)
    assert brier(p, y) == pytest.approx((0.01 + 0.81 + 0.01 + 0.01) / 4)
    assert ece(np.array([0.0, 1.0]), np.array([0, 1]), n_bins=15) == pytest.approx(0.0)


def test_apply_temperatures_identity_and_torch():
    torch = pytest.importorskip("torch")
    c = np.array([[0.2, 0.6, 0.95]])
    np.testing.assert_allclose(apply_temperatures(c, [1.0, 1.0, 1.0]), c, atol=1e-9)
    hot = apply_temperatures(c, [2.0])  # last temperature is reused for later positions
    assert np.all(np.abs(hot - 0.5) < np.abs(c - 0.5))
    t = apply_temperatures(torch.tensor(c, dtype=torch.float32), [2.0, 2.0, 2.0])
    assert isinstance(t, torch.Tensor) and t.dtype == torch.float32
    np.testing.assert_allclose(t.numpy(), hot, atol=1e-5)


def test_grid_contains_one_and_is_logspaced():
    g = temperature_grid(0.25, 4.0, 64)
    assert 1.0 in g and g.min() == pytest.approx(0.25) and g.max() == pytest.approx(4.0)
    assert np.all(np.diff(g) > 0)


def test_sts_lowers_ece_and_preserves_ranking(overconfident):
    arr = overconfident
    cal = fit_sts(arr.confidence, arr.accepted, n_bins=15)
    assert len(cal.temperatures) == arr.gamma
    assert all(t > 1.2 for t in cal.temperatures)        # overconfident → softened
    surv = arr.survival()
    raw, fit = cumulative(arr.confidence), cal.survival(arr.confidence)
    for k in range(arr.gamma):
        e0, e1 = ece(raw[:, k], surv[:, k]), ece(fit[:, k], surv[:, k])
        assert e1 < 0.5 * e0
        assert cal.ece_after[k] == pytest.approx(e1) and cal.ece_before[k] == pytest.approx(e0)
        # a temperature is monotone: per-position ranking is unchanged exactly
        cal_k = cal.apply(arr.confidence)[:, k]
        assert auroc(cal_k, surv[:, k]) == pytest.approx(auroc(arr.confidence[:, k], surv[:, k]), abs=1e-12)
        # the cumulative product's ranking barely moves
        assert auroc(fit[:, k], surv[:, k]) == pytest.approx(auroc(raw[:, k], surv[:, k]), abs=0.02)
    assert auroc(fit[:, 0], surv[:, 0]) == pytest.approx(auroc(raw[:, 0], surv[:, 0]), abs=1e-12)


def test_sts_never_worse_on_fit_set_and_calibrated_input_keeps_t1():
    rng = np.random.default_rng(1)
    N, g = 3000, 3
    conf = rng.uniform(0.05, 0.95, size=(N, g))
    ok = rng.random((N, g)) < conf                         # perfectly calibrated conditionals
    acc = np.where(ok.all(1), g, np.argmin(ok, axis=1))
    cal = fit_sts(conf, acc, n_bins=10)
    assert all(a <= b + 1e-12 for a, b in zip(cal.ece_after, cal.ece_before))
    assert all(0.7 < t < 1.45 for t in cal.temperatures)


def test_sts_sequential_earlier_positions_fixed(overconfident):
    arr = overconfident
    full = fit_sts(arr.confidence, arr.accepted)
    head = fit_sts(arr.confidence[:, :2], np.minimum(arr.accepted, 2))
    assert full.temperatures[:2] == head.temperatures


def test_censored_positions_are_masked():
    acc = np.array([2, 1, 3])
    ver = np.array([2, 3, 3])
    m = observed_mask(acc, ver, 4)
    # round 0: verified 2 and all accepted → positions 3,4 unknown; round 1 broke at 2 → all known
    np.testing.assert_array_equal(m, [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]])
    np.testing.assert_array_equal(prefix_survival(acc, 4), [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]])
    cal = fit_sts(np.full((3, 4), 0.7), acc, verified=ver)
    assert len(cal.temperatures) == 4


def test_calibration_json_roundtrip(tmp_path, overconfident):
    cal = fit_sts(overconfident.confidence, overconfident.accepted)
    p = cal.save(tmp_path)
    assert p.name == "calibration.json"
    back = Calibration.load(tmp_path)
    assert back.temperatures == cal.temperatures and back.gamma == cal.gamma
    np.testing.assert_allclose(back.apply(overconfident.confidence), cal.apply(overconfident.confidence))


def test_threshold_sweep_bookkeeping(overconfident):
    arr = overconfident
    a = cumulative(arr.confidence)
    sw = threshold_sweep(a, arr.accepted, thresholds=[0.0, 0.5, 1.01])
    assert sw["verified"][0] == arr.gamma                    # t=0 verifies everything
    assert sw["accepted"][0] == pytest.approx(arr.accepted.mean())
    assert sw["verified"][-1] == 0 and sw["tokens_per_step"][-1] == 1.0
    for i in range(3):
        assert sw["accepted"][i] + sw["rejected"][i] == pytest.approx(sw["verified"][i])
    ell = threshold_lengths(a, 0.5)
    assert np.all(a[np.arange(len(ell))[ell > 0], ell[ell > 0] - 1] >= 0.5)


def test_metrics_rows(overconfident):
    cal = fit_sts(overconfident.confidence, overconfident.accepted)
    rows = calibration_metrics(overconfident.confidence, overconfident.accepted, cal)
    assert [r["position"] for r in rows] == list(range(1, overconfident.gamma + 1))
    assert all(r["ece_after"] < r["ece_before"] for r in rows)


def test_rollout_jsonl_roundtrip(tmp_path):
    torch = pytest.importorskip("torch")
    p = tmp_path / "r.jsonl"
    with RolloutWriter(p) as w:
        w.write(make_record("a", 0, torch.tensor([0.9, 0.5, 0.2]), accepted=2, draft_tokens=torch.tensor([4, 5, 6])))
        w.write(make_record("a", 1, [0.8, 0.7, 0.1], accepted=1, verified=2, meta={"bench": "gsm8k"}))
        w.write(make_record("b", 0, np.array([0.3, 0.2, 0.1]), accepted=0))
    recs = read_rollouts(p)
    assert [r.accepted for r in recs] == [2, 1, 0]
    assert recs[0].draft_tokens == [4, 5, 6] and recs[1].verified == 2 and recs[1].meta == {"bench": "gsm8k"}
    line = json.loads(p.read_text().splitlines()[2])
    assert set(line) == {"request_id", "round", "confidence", "accepted"}
    write_rollouts(tmp_path / "copy.jsonl", recs)
    assert read_rollouts(tmp_path / "copy.jsonl") == recs
    traces = group_by_request(recs)
    assert [t.request_id for t in traces] == ["a", "b"] and len(traces[0]) == 2
    with pytest.raises(ValueError):
        make_record("x", 0, [0.5, 0.5], accepted=3)
    (tmp_path / "bad.jsonl").write_text('{"request_id": "x", "confidence": [0.5]}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_rollouts(tmp_path / "bad.jsonl")


def test_calibrate_stage_writes_outputs(tmp_path):
    from deepspec.config import DeepSpecConfig
    from deepspec.schedule import calibrate
    write_rollouts(tmp_path / "rollouts.jsonl", synthetic_rollouts(n_requests=10, rounds_per_request=10, gamma=4))
    ck = tmp_path / "ckpt"
    ck.mkdir()
    cfg = DeepSpecConfig()
    cfg.run_dir = str(tmp_path / "run")
    cfg.schedule.rollouts = str(tmp_path / "rollouts.jsonl")
    cfg.schedule.temperature_grid_size = 16
    cfg.eval.checkpoint = str(ck)
    paths = calibrate.run(cfg)
    out = tmp_path / "calibration"
    for name in ("calibration.json", "report.md", "metrics.json", "reliability.png", "threshold_sweep.png"):
        assert (out / name).is_file(), name
    assert (ck / "calibration.json").is_file() and paths["checkpoint_calibration"] == str(ck / "calibration.json")
    assert "SYNTHETIC" in (out / "report.md").read_text()
    assert Calibration.load(ck).gamma == 4
