"""Acceptance metrics: τ, prefix survival, conditional acceptance, macro averages, sweeps."""
import math

import pytest

from deepspec.eval.metrics import (acceptance_metrics, cumulative_confidence_points, macro_average, reliability,
                                   speed_metrics, threshold_sweep)
from tests.support.stats import chi_square_gof, total_variation


def R(acc, prop=4, conf=None, drafted=None):
    return {"accepted": acc, "proposed": prop, "drafted": drafted or prop, "confidence": conf}


def test_tau_survival_conditional():
    rounds = [R(4), R(2), R(0), R(1), R(4)]
    m = acceptance_metrics(rounds, gamma=4)
    assert m["rounds"] == 5
    assert m["tau"] == pytest.approx((5 + 3 + 1 + 2 + 5) / 5)
    assert m["accepted_per_round"] == pytest.approx(11 / 5)
    assert m["acceptance_rate"] == pytest.approx(11 / 20)
    assert m["verified_per_round"] == pytest.approx(5.0)
    assert m["prefix_survival"] == pytest.approx([4 / 5, 3 / 5, 2 / 5, 2 / 5])
    # P(acc >= k | acc >= k-1)
    assert m["conditional_acceptance"] == pytest.approx([4 / 5, 3 / 4, 2 / 3, 2 / 2])
    # product of conditionals = survival
    prod = 1.0
    for k in range(4):
        prod *= m["conditional_acceptance"][k]
        assert prod == pytest.approx(m["prefix_survival"][k])


def test_truncated_rounds_only_count_where_verified():
    rounds = [R(2, prop=2, drafted=4), R(4, prop=4), R(1, prop=4)]
    m = acceptance_metrics(rounds, gamma=4)
    assert m["position_rounds"] == [3, 3, 2, 2]
    assert m["prefix_survival"][2] == pytest.approx(1 / 2)
    assert m["drafted_per_round"] == pytest.approx(4.0)
    empty = acceptance_metrics([], gamma=3)
    assert empty["rounds"] == 0 and math.isnan(empty["tau"]) and len(empty["prefix_survival"]) == 3


def test_macro_average_by_domain():
    per = {"gsm8k": {"tau": 3.0}, "math500": {"tau": 5.0}, "humaneval": {"tau": 4.0},
           "mt-bench": {"tau": 2.0}, "mybench": {"tau": 1.0}}
    m = macro_average(per, keys=("tau",))
    assert m["domains"]["math"]["tau"] == 4.0 and m["domains"]["math"]["benchmarks"] == ["gsm8k", "math500"]
    assert m["domains"]["code"]["tau"] == 4.0 and m["domains"]["chat"]["tau"] == 2.0
    assert m["domains"]["other"]["tau"] == 1.0
    assert list(m["domains"]) == ["math", "code", "chat", "other"]
    assert m["overall"]["tau"] == pytest.approx(3.0)


def test_speed_metrics_totals():
    res = [{"num_tokens": 10, "t_total": 2.0, "t_prefill": 0.5, "t_draft": 0.5, "t_verify": 0.8, "t_overhead": 0.2},
           {"num_tokens": 30, "t_total": 2.0, "t_prefill": 0.5, "t_draft": 0.5, "t_verify": 0.8, "t_overhead": 0.2}]
    s = speed_metrics(res)
    assert s["generated_tokens"] == 40 and s["tokens_per_s"] == pytest.approx(10.0)
    assert s["decode_tokens_per_s"] == pytest.approx(38 / 3.0)
    assert s["draft_s"] == pytest.approx(1.0) and s["verify_s"] == pytest.approx(1.6)


def test_confidence_points_reliability_and_sweep():
    rounds = [R(2, conf=[0.9, 0.8, 0.5, 0.5]), R(4, conf=[0.99, 0.99, 0.9, 0.9]),
              R(1, prop=1, drafted=4, conf=[0.6, 0.5, 0.5, 0.5])]
    c, y, k = cumulative_confidence_points(rounds)
    # survival (accepted >= k) is observed at every k of a round whose chain broke, and up to ℓ
    # for a fully accepted truncated round (round 3 verified 1 of 4: censored after k=1)
    assert k.tolist() == [1, 2, 3, 4, 1, 2, 3, 4, 1]
    assert y.tolist() == [1, 1, 0, 0, 1, 1, 1, 1, 1]
    assert c[1] == pytest.approx(0.72)
    rel = reliability(c, y, n_bins=5)
    assert sum(rel["count"]) == 9 and 0 <= rel["ece"] <= 1
    sw = threshold_sweep(rounds, thresholds=[0.0, 0.7, 1.0])
    assert sw["threshold"] == [0.0, 0.7, 1.0]
    # t=0: verify all, τ = 1 + min(acc, 4); t=1: verify nothing, τ = 1
    assert sw["tau"][0] == pytest.approx((3 + 5 + 2) / 3) and sw["tau"][2] == 1.0
    assert sw["verified_per_round"][2] == 1.0
    # t=0.7: ℓ = [2, 4, 0] → τ = [3, 5, 1]
    assert sw["tau"][1] == pytest.approx(3.0) and sw["verified_per_round"][1] == pytest.approx((3 + 5 + 1) / 3)
    # temperatures > 1 pull confidences towards 0.5
    c2, _, _ = cumulative_confidence_points(rounds, temperatures=[2.0])
    assert c2[0] < c[0]


def test_chi_square_helper():
    stat, df, p = chi_square_gof([250, 250, 500], [0.25, 0.25, 0.5])
    assert stat == 0 and df == 2 and p == pytest.approx(1.0)
    _, _, p = chi_square_gof([400, 100, 500], [0.25, 0.25, 0.5])
    assert p < 1e-10
    assert chi_square_gof([1, 9], [0.0, 1.0])[2] == 0.0            # an impossible outcome observed
    assert total_variation([1, 3], [0.5, 0.5]) == pytest.approx(0.25)
