"""Bootstrap intervals over requests: τ as a ratio of sums, stratified macro, summary and report."""
import random

import numpy as np
import pytest

from deepspec.eval.bootstrap import (RequestTotals, benchmark_interval, bootstrap_intervals, percentile_interval,
                                     ratio_draws, request_totals)
from deepspec.eval.metrics import acceptance_metrics
from deepspec.eval.report import write_report
from deepspec.eval.runner import RequestRecord, summarize
from deepspec.decoding.loop import GenerationResult, RoundStats


def _result(accepted, tokens=None, seconds=1.0):
    rounds = [RoundStats(drafted=4, proposed=4, accepted=a, emitted=a + 1, draft_tokens=[1, 2, 3, 4],
                         confidence=None) for a in accepted]
    n = tokens if tokens is not None else 1 + sum(a + 1 for a in accepted)
    return GenerationResult(prompt_len=3, tokens=list(range(n)), stop_reason="max_new_tokens", rounds=rounds,
                            t_prefill=0.1 * seconds, t_total=seconds)


def _records(bench, per_request_accepted, baseline_seconds=None):
    out = []
    for i, acc in enumerate(per_request_accepted):
        spec = _result(acc, seconds=1.0 + 0.1 * i)
        base = None
        if baseline_seconds is not None:
            base = _result([], tokens=spec.num_tokens, seconds=baseline_seconds * (1.0 + 0.05 * i))
        out.append(RequestRecord(f"{bench}/{i}", bench, i, 0, 3, spec, base))
    return out


def _varied(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randint(0, 4) for _ in range(rng.randint(1, 12))] for _ in range(n)]


def test_tau_is_a_ratio_of_sums_over_requests():
    """Request A: 2 rounds emitting 5 each (τ 5); request B: 1 round emitting 1 (τ 1).  The pooled τ
    is 11/3, not the mean of the per-request τ (3); every resample is one of {5, 11/3, 1}."""
    recs = [RequestRecord("b/0", "gsm8k", 0, 0, 3, _result([4, 4])),
            RequestRecord("b/1", "gsm8k", 1, 0, 3, _result([0]))]
    t = request_totals(recs)
    assert t.tau_tokens.tolist() == [10.0, 1.0] and t.rounds.tolist() == [2.0, 1.0]
    pooled = acceptance_metrics([r for q in recs for r in q.spec.rounds], 4)["tau"]
    assert pooled == pytest.approx(11 / 3) == pytest.approx(t.tau_tokens.sum() / t.rounds.sum())
    idx = np.array([[0, 0], [0, 1], [1, 0], [1, 1]])
    assert ratio_draws(t.tau_tokens, t.rounds, idx) == pytest.approx([5.0, 11 / 3, 11 / 3, 1.0])
    from deepspec.eval.bootstrap import benchmark_draws
    d = benchmark_draws(t, 4000, np.random.default_rng(0))["tau"]
    values, counts = np.unique(np.round(d, 9), return_counts=True)
    assert values.tolist() == pytest.approx([1.0, 11 / 3, 5.0])
    assert counts / d.size == pytest.approx([0.25, 0.5, 0.25], abs=0.03)


def test_interval_contains_the_point_estimate_and_is_deterministic():
    recs = _records("gsm8k", _varied(30))
    t = request_totals(recs)
    tau = acceptance_metrics([r for q in recs for r in q.spec.rounds], 4)["tau"]
    a = benchmark_interval(t, 1000, seed=7, key="gsm8k")
    lo, hi = a["tau_ci95"]
    assert lo < tau < hi and a["requests"] == 30
    assert benchmark_interval(t, 1000, seed=7, key="gsm8k") == a
    assert benchmark_interval(t, 1000, seed=8, key="gsm8k") != a


def test_interval_narrows_with_more_requests():
    acc = _varied(25, seed=3)
    one = benchmark_interval(request_totals(_records("gsm8k", acc)), 1000)["tau_ci95"]
    four = benchmark_interval(request_totals(_records("gsm8k", acc * 4)), 1000)["tau_ci95"]
    assert four[1] - four[0] < 0.75 * (one[1] - one[0])     # ≈ half as wide (1/√4)
    assert one[0] <= four[0] and four[1] <= one[1]


def test_identical_requests_collapse_the_interval():
    # every request has τ = 3 (rounds differ in count and in accepted, the per-request ratio does not)
    recs = _records("gsm8k", [[2, 2], [1, 3, 2], [2], [0, 4]] * 3)
    lo, hi = benchmark_interval(request_totals(recs), 500)["tau_ci95"]
    assert lo == pytest.approx(3.0) and hi == pytest.approx(3.0)


def test_macro_interval_is_stratified_by_benchmark():
    """A benchmark with a constant τ of 2 next to one that varies: every macro resample is
    (2 + that benchmark's resample) / 2, and a benchmark's own interval ignores its neighbours."""
    const = request_totals(_records("gsm8k", [[1, 1]] * 10))
    varied = request_totals(_records("humaneval", _varied(20, seed=5)))
    ci = bootstrap_intervals({"gsm8k": const, "humaneval": varied}, 800, seed=1)
    alone = bootstrap_intervals({"humaneval": varied}, 800, seed=1)
    hv = ci["benchmarks"]["humaneval"]["tau_ci95"]
    assert hv == alone["benchmarks"]["humaneval"]["tau_ci95"]
    assert ci["benchmarks"]["gsm8k"]["tau_ci95"] == pytest.approx([2.0, 2.0])
    assert ci["overall"]["tau_ci95"] == pytest.approx([(2 + hv[0]) / 2, (2 + hv[1]) / 2])
    assert ci["domains"]["code"]["tau_ci95"] == pytest.approx(hv)
    assert ci["overall"]["requests"] == 30 and ci["domains"]["math"]["requests"] == 10
    assert bootstrap_intervals({"gsm8k": const}, 0) == {}


def test_requests_without_rounds_and_empty_draws():
    t = RequestTotals(tau_tokens=np.array([0.0, 6.0]), rounds=np.array([0.0, 2.0]),
                      spec_tokens=np.array([1.0, 7.0]), spec_time=np.array([1.0, 1.0]))
    lo, hi = benchmark_interval(t, 400)["tau_ci95"]          # resamples of only the empty request drop out
    assert lo == pytest.approx(3.0) and hi == pytest.approx(3.0)
    assert percentile_interval(np.array([np.nan, np.nan])) is None


def test_summary_and_report_carry_the_intervals(tmp_path):
    recs = (_records("gsm8k", _varied(12, seed=1), baseline_seconds=2.0)
            + _records("mt-bench", _varied(8, seed=2), baseline_seconds=2.0))
    recs += [RequestRecord(f"mt-bench/{i}/t1", "mt-bench", i, 1, 3, _result(a), _result([], 5, 2.0))
             for i, a in enumerate(_varied(8, seed=4))]
    s = summarize(recs, 4, bootstrap_resamples=300, bootstrap_seed=0)
    for m in (s["benchmarks"]["gsm8k"]["all_turns"], s["benchmarks"]["mt-bench"]["all_turns"],
              s["benchmarks"]["mt-bench"]["first_turn"], s["domains"]["math"], s["overall"]):
        lo, hi = m["tau_ci95"]
        assert lo <= m["tau"] <= hi
        lo, hi = m["speedup_ci95"]
        assert lo <= m["speedup"] <= hi
    assert s["overall"]["requests"] == 28 and s["benchmarks"]["mt-bench"]["first_turn"]["requests"] == 8
    assert s["bootstrap"]["resamples"] == 300
    assert summarize(recs, 4, bootstrap_resamples=300, bootstrap_seed=0)["overall"] == s["overall"]
    off = summarize(recs, 4)
    assert off["bootstrap"] is None and "tau_ci95" not in off["overall"] and off["overall"]["requests"] == 28
    report = write_report(tmp_path, s).read_text()
    ov = s["overall"]
    assert f"{ov['tau']:.2f} [{ov['tau_ci95'][0]:.2f}, {ov['tau_ci95'][1]:.2f}]" in report
    assert "percentile-bootstrap" in report
    assert "[" not in write_report(tmp_path, off).read_text().split("## Per benchmark")[1].split("## ")[0]
