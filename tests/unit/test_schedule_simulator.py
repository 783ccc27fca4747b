"""Serving simulator bookkeeping (no timing asserts: time comes from the SPS table)."""
import numpy as np
import pytest

from deepspec.schedule.prefix_scheduler import FixedLengthPolicy, PrefixSchedulerPolicy, ThresholdPolicy
from deepspec.schedule.profile import SPSTable, constant_table, synthetic_gpu_table
from deepspec.schedule.rollouts import RequestTrace, group_by_request, synthetic_rollouts
from deepspec.schedule.simulator import best_threshold_results, compare_policies, plot_pareto, simulate


def all_accept_traces(n=5, rounds=7, gamma=4):
    return [RequestTrace(f"r{i}", np.full((rounds, gamma), 0.9), np.full(rounds, gamma), np.full(rounds, gamma))
            for i in range(n)]


def test_fixed_all_accept_gives_gamma_plus_one():
    g = 4
    for R in (1, 3, 8):
        res = simulate(all_accept_traces(gamma=g), FixedLengthPolicy(), constant_table(10.0), R, steps=25)
        assert res.tokens == R * 25 * (g + 1)
        assert res.tokens_per_request_step == g + 1
        assert res.rejected_drafts == 0 and res.verified_drafts == R * 25 * g
        assert res.mean_batch_tokens == R * (g + 1)
        assert res.time_s == pytest.approx(25 / 10.0)
        assert res.system_tps == pytest.approx(R * (g + 1) * 10.0)
        assert res.per_user_tps == pytest.approx((g + 1) * 10.0)


def test_truncation_keeps_min_of_logged_and_length():
    tr = [RequestTrace("a", np.array([[0.9, 0.9, 0.1, 0.1]] * 3), np.array([3, 1, 0]), np.full(3, 4))]
    res = simulate(tr, FixedLengthPolicy(2), constant_table(1.0), 1, steps=3, seed=0)
    # accepted per round min(logged, 2) = 2, 1, 0 in some rotation → 3 drafts + 3 bonus tokens
    assert res.accepted_drafts == 3 and res.tokens == 6 and res.rejected_drafts == 6 - 3


@pytest.mark.parametrize("policy", [FixedLengthPolicy(), ThresholdPolicy(0.4),
                                    PrefixSchedulerPolicy(synthetic_gpu_table(knee_tokens=32))])
def test_conservation(policy):
    traces = group_by_request(synthetic_rollouts(n_requests=12, rounds_per_request=9, gamma=5, seed=4))
    R, steps = 16, 40
    res = simulate(traces, policy, synthetic_gpu_table(knee_tokens=32), R, steps=steps)
    assert res.request_steps == R * steps
    assert res.tokens == res.accepted_drafts + res.request_steps
    assert res.verified_drafts == res.accepted_drafts + res.rejected_drafts
    assert res.batch_tokens_total == res.request_steps + res.verified_drafts
    t = synthetic_gpu_table(knee_tokens=32)
    assert res.time_s >= steps * t.step_time(res.batch_tokens_total / steps) * 0.5  # sane scale


def test_same_inputs_across_policies_and_scheduler_gain():
    traces = group_by_request(synthetic_rollouts(n_requests=16, rounds_per_request=12, gamma=6, seed=5))
    table = synthetic_gpu_table(knee_tokens=64)
    fixed = simulate(traces, FixedLengthPolicy(), table, 64, steps=30, seed=1)
    zero = simulate(traces, FixedLengthPolicy(0), table, 64, steps=30, seed=1)
    sched = simulate(traces, PrefixSchedulerPolicy(table), table, 64, steps=30, seed=1)
    # identical replay: the fixed policy's accepted drafts bound any policy's
    assert sched.accepted_drafts <= fixed.accepted_drafts and zero.accepted_drafts == 0
    assert sched.rejected_drafts < fixed.rejected_drafts
    assert sched.system_tps > fixed.system_tps            # past the knee the scheduler trims drafts
    one_f = simulate(traces, FixedLengthPolicy(), table, 1, steps=30, seed=1)
    one_s = simulate(traces, PrefixSchedulerPolicy(table), table, 1, steps=30, seed=1)
    assert one_s.tokens == one_f.tokens                    # R=1, flat region: verify everything


def test_compare_and_plot(tmp_path):
    traces = group_by_request(synthetic_rollouts(n_requests=6, rounds_per_request=5, gamma=3, seed=6))
    table = synthetic_gpu_table(knee_tokens=16)
    res = compare_policies(traces, [FixedLengthPolicy(), ThresholdPolicy(0.3), ThresholdPolicy(0.6),
                                    PrefixSchedulerPolicy(table)], table, concurrencies=[1, 4, 16], steps=5)
    assert len(res) == 12
    best = best_threshold_results(res)
    assert set(best) == {1, 4, 16}
    plot_pareto(res, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000
