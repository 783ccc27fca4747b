"""Prefix scheduler (Alg. 1): brute-force optimality, no look-ahead, policies."""
import numpy as np
import pytest

from deepspec.config import ConfigError
from deepspec.schedule.calibration import Calibration, cumulative
from deepspec.schedule.prefix_scheduler import (FixedLengthPolicy, PrefixSchedulerPolicy, ThresholdPolicy,
                                                admission_order, expected_throughput, make_policy,
                                                optimal_lengths_bruteforce, schedule_prefix,
                                                schedule_prefix_sequential, verify_lengths)
from deepspec.schedule.profile import SPSTable, constant_table, synthetic_gpu_table


def knee_sps(knee=6.0, base=100.0):
    """Flat up to `knee` tokens, then 1/B: small enough for brute force to bite."""
    return lambda b: base / np.maximum(1.0, np.asarray(b, dtype=np.float64) / knee)


def greedy_path_theta(a, sps):
    """Θ after each admission along the full greedy order (for the unimodality check)."""
    R = a.shape[0]
    vals = a.reshape(-1)[admission_order(a)]
    tau = R + np.concatenate([[0.0], np.cumsum(vals)])
    B = R + np.arange(vals.size + 1)
    return tau * sps(B)


def random_survival(rng, R, g):
    return cumulative(rng.uniform(0.2, 1.0, size=(R, g)))


@pytest.mark.parametrize("seed", range(40))
def test_matches_bruteforce_when_unimodal(seed):
    rng = np.random.default_rng(seed)
    R, g = int(rng.integers(1, 4)), int(rng.integers(1, 5))
    a = random_survival(rng, R, g)
    sps = knee_sps(knee=float(rng.integers(1, 8)))
    th = greedy_path_theta(a, sps)
    peak = int(np.argmax(th))
    unimodal = np.all(np.diff(th[:peak + 1]) > 0) and np.all(np.diff(th[peak:]) <= 0)
    res = schedule_prefix(a, sps)
    best, best_th = optimal_lengths_bruteforce(a, sps)
    if unimodal:
        assert res.throughput == pytest.approx(best_th, rel=1e-9)
        assert expected_throughput(a, res.lengths, sps) == pytest.approx(best_th, rel=1e-9)
    else:  # greedy stops at a local optimum: never better than the optimum
        assert res.throughput <= best_th + 1e-9
    seq = schedule_prefix_sequential(a, sps)
    np.testing.assert_array_equal(seq.lengths, res.lengths)
    assert seq.throughput == pytest.approx(res.throughput)


def test_bookkeeping_and_prefix_structure():
    rng = np.random.default_rng(7)
    a = random_survival(rng, 6, 5)
    res = schedule_prefix(a, knee_sps(knee=12))
    assert res.batch_tokens == int(np.sum(1 + res.lengths))
    assert res.expected_tokens == pytest.approx(sum(1 + a[r, :l].sum() for r, l in enumerate(res.lengths)))
    assert res.admitted == res.lengths.sum()
    # admitted items are exactly the top-k survival values
    k = res.admitted
    top = np.sort(a.reshape(-1))[::-1][:k]
    chosen = np.concatenate([a[r, :l] for r, l in enumerate(res.lengths)])
    np.testing.assert_allclose(np.sort(chosen)[::-1], top)


def test_no_lookahead():
    rng = np.random.default_rng(11)
    R, g = 8, 6
    a = random_survival(rng, R, g)
    sps = knee_sps(knee=20)
    res = schedule_prefix(a, sps)
    assert 0 < res.admitted < R * g, "want a stop in the middle for this test"
    order = admission_order(a)
    stop_val = a.reshape(-1)[order[res.admitted]]       # the item that stopped the scan
    after = order[res.admitted + 1:]                      # never examined
    assert res.examined == res.admitted + 1
    for trial in range(5):
        b = a.reshape(-1).copy()
        # change every never-examined item (keep it ranked after the stop item)
        b[after] = rng.uniform(0, stop_val, size=after.size)
        b = np.minimum.accumulate(b.reshape(R, g), axis=1)
        # the stop item itself and everything before stay
        keep = order[:res.admitted + 1]
        assert np.allclose(b.reshape(-1)[keep], a.reshape(-1)[keep])
        np.testing.assert_array_equal(schedule_prefix(b, sps).lengths, res.lengths)
    # appending more (low-survival) draft positions does not change the decision either
    longer = np.concatenate([a, a[:, -1:] * rng.uniform(0, 1, size=(R, 4)) * (a[:, -1:] < stop_val)], axis=1)
    longer = np.minimum(longer, np.where(np.arange(longer.shape[1]) >= g, stop_val * 0.99, 1.0))
    longer = np.minimum.accumulate(longer, axis=1)
    np.testing.assert_array_equal(schedule_prefix(longer, sps).lengths, res.lengths)


def test_flat_sps_verifies_everything_and_steep_sps_nothing():
    rng = np.random.default_rng(2)
    a = random_survival(rng, 4, 5)
    a = np.maximum(a, 1e-3)
    assert schedule_prefix(a, constant_table(50.0)).lengths.tolist() == [5] * 4
    # SPS ∝ 1/B² : adding any token costs more than it can bring
    steep = lambda b: 1.0 / np.asarray(b, dtype=np.float64) ** 2
    assert schedule_prefix(a, steep).lengths.tolist() == [0] * 4


def test_caps():
    a = np.full((3, 4), 0.99)
    assert schedule_prefix(a, constant_table(), max_batch_tokens=5).lengths.sum() == 2
    assert schedule_prefix(a, constant_table(), max_length=2).lengths.tolist() == [2, 2, 2]


def test_policies_and_verify_lengths():
    torch = pytest.importorskip("torch")
    conf = torch.tensor([[0.95, 0.9, 0.4, 0.9], [0.5, 0.9, 0.9, 0.9]])
    assert verify_lengths(conf, FixedLengthPolicy()) == [4, 4]
    assert verify_lengths(conf[0], FixedLengthPolicy(2)) == [2]
    # cumulative: row0 .95 .855 .342 .308 ; row1 .5 .45 .405 .365
    assert verify_lengths(conf, ThresholdPolicy(0.5)) == [2, 1]
    # calibration is applied before the cumulative product
    hot = Calibration(temperatures=[100.0] * 4, gamma=4)
    assert verify_lengths(conf, ThresholdPolicy(0.5, hot)) == [1, 1]  # all c̃ ≈ 0.5
    sched = PrefixSchedulerPolicy(synthetic_gpu_table())
    assert verify_lengths(conf[:1], sched) == [4]                    # R=1 on a GPU-like table: flat region
    assert sched.last is not None and sched.last.batch_tokens == 5
    assert isinstance(make_policy("scheduler", sps_table=constant_table()), PrefixSchedulerPolicy)
    with pytest.raises(ValueError):
        make_policy("threshold")
    with pytest.raises(ValueError):
        make_policy("oracle")


def test_policy_from_config(tmp_path):
    from deepspec.config import DeepSpecConfig
    from deepspec.schedule.prefix_scheduler import policy_from_config
    cfg = DeepSpecConfig()
    assert isinstance(policy_from_config(cfg), FixedLengthPolicy)
    cfg.schedule.threshold = 0.3
    with pytest.raises(ConfigError, match="schedule.threshold=0.3 is read by schedule.policy=threshold only"):
        policy_from_config(cfg)
    cfg.schedule.policy = "threshold"
    p = policy_from_config(cfg)
    assert isinstance(p, ThresholdPolicy) and p.threshold == 0.3 and p.calibration is None
    ck = tmp_path / "ck"
    ck.mkdir()
    Calibration(temperatures=[2.0, 2.0], gamma=2).save(ck)
    cfg.eval.checkpoint = str(ck)
    assert policy_from_config(cfg).calibration.temperatures == [2.0, 2.0]
    synthetic_gpu_table().save(tmp_path / "sps.json")
    cfg.schedule.policy, cfg.schedule.threshold = "scheduler", None
    cfg.schedule.sps_table = str(tmp_path / "sps.json")
    p = policy_from_config(cfg)
    assert isinstance(p, PrefixSchedulerPolicy) and isinstance(p.sps_table, SPSTable)


@pytest.mark.parametrize("seed", range(25))
def test_convex_table_greedy_is_optimal(seed):
    """Convex non-decreasing step time + concave τ along the order → Θ unimodal → greedy optimal."""
    rng = np.random.default_rng(100 + seed)
    R, g = int(rng.integers(1, 4)), int(rng.integers(1, 5))
    a = random_survival(rng, R, g)
    xs = np.unique(rng.integers(1, 20, size=6))
    noisy = SPSTable(batch_tokens=xs.tolist(), steps_per_second=rng.uniform(5, 100, size=xs.size).tolist())
    table = noisy.convexified()
    res = schedule_prefix(a, table)
    _, best_th = optimal_lengths_bruteforce(a, table)
    assert res.throughput == pytest.approx(best_th, rel=1e-9)
