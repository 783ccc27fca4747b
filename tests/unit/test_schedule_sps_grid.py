"""SPS(R, B) grids: per-concurrency lookup, log-R blending, I/O, and the scheduler/simulator pricing
each step with the curve for its R; `deepspec profile` writes a loadable cost model."""
import json

import numpy as np
import pytest

from deepspec.config import load_config
from deepspec.schedule import (FixedLengthPolicy, PrefixSchedulerPolicy, SPSGrid, SPSTable, cost_at,
                               load_cost_model, policy_from_config, profile_sps_grid, schedule_prefix, simulate)
from deepspec.schedule.rollouts import group_by_request, synthetic_rollouts


def _flat(sps: float) -> SPSTable:
    return SPSTable(batch_tokens=[1, 4096], steps_per_second=[sps, sps])


def _linear(ms_per_token: float, fixed_ms: float) -> SPSTable:
    bs = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    return SPSTable(batch_tokens=bs, steps_per_second=[1000.0 / (fixed_ms + ms_per_token * b) for b in bs])


def test_lookup_blends_in_log_r_and_clamps():
    g = SPSGrid({1: _flat(100.0), 4: _flat(50.0)})
    assert cost_at(g, 1) is g.tables[1] and cost_at(g, 4) is g.tables[4]
    # R=2 is halfway between 1 and 4 in log R: step time is the mean of 10 ms and 20 ms
    assert cost_at(g, 2).step_time(8) == pytest.approx(0.015)
    assert cost_at(g, 2).sps(8) == pytest.approx(1 / 0.015)
    np.testing.assert_allclose(cost_at(g, 2).step_time(np.array([1, 100])), [0.015, 0.015])
    assert cost_at(g, 64).step_time(8) == pytest.approx(0.02)        # above the grid: largest R's table
    t = _flat(7.0)
    assert cost_at(t, 3) is t                                         # a plain table prices every R alike
    with pytest.raises(ValueError, match="≥ 1"):
        SPSGrid({0: _flat(1.0)})


def test_save_load_roundtrip_and_errors(tmp_path):
    g = SPSGrid({8: _linear(0.5, 10.0), 2: _linear(0.2, 10.0)}, device="dev", target="tgt")
    assert g.requests == [2, 8]
    p = g.save(tmp_path / "grid.json")
    back = load_cost_model(p)
    assert isinstance(back, SPSGrid) and back.requests == [2, 8] and back.device == "dev"
    assert back.tables[8].steps_per_second == g.tables[8].steps_per_second
    assert isinstance(load_cost_model(_flat(3.0).save(tmp_path / "t.json")), SPSTable)
    d = json.loads(p.read_text())
    del d["tables"][1]["meta"]["requests"]
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"bad.json.*tables\[1\].*requests"):
        load_cost_model(tmp_path / "bad.json")


def test_scheduler_prices_each_step_with_its_concurrency():
    # Per-request cost grows with R (KV caches): at R=1 a token costs little next to the fixed
    # cost, at R=8 tokens are expensive.  Same confidences → longer drafts at R=1.
    grid = SPSGrid({1: _linear(0.05, 10.0), 8: _linear(2.0, 10.0)})
    pol = PrefixSchedulerPolicy(grid)
    c1 = np.full((1, 7), 0.8)
    c8 = np.full((8, 7), 0.8)
    l1, l8 = pol.lengths(c1), pol.lengths(c8)
    assert l1 == schedule_prefix(np.cumprod(c1, 1), grid.tables[1]).lengths.tolist()
    assert l8 == schedule_prefix(np.cumprod(c8, 1), grid.tables[8]).lengths.tolist()
    assert l1 == [7] and max(l8) < 7                                  # the R=8 table makes verification dear
    assert pol.lengths(np.full((4, 7), 0.8)) == schedule_prefix(np.cumprod(np.full((4, 7), 0.8), 1),
                                                                cost_at(grid, 4)).lengths.tolist()


def test_simulator_uses_the_table_for_r():
    recs = synthetic_rollouts(n_requests=8, rounds_per_request=6, gamma=4, seed=0)
    traces = group_by_request(recs)
    grid = SPSGrid({1: _flat(100.0), 4: _flat(25.0)})
    for R, sps in ((1, 100.0), (4, 25.0), (2, 50.0)):
        res = simulate(traces, FixedLengthPolicy(), grid, R, steps=10)
        expect = 10 * (0.5 * 0.01 + 0.5 * 0.04) if R == 2 else 10 / sps
        assert res.time_s == pytest.approx(expect)


def test_profile_grid_shapes_on_a_tiny_target(one_thread):
    from conftest import make_tiny_target
    g = profile_sps_grid(make_tiny_target("llama"), [3, 1], tokens_per_request=3, context_len=4, repeats=1,
                         warmup=0)
    assert g.requests == [1, 3]
    assert g.tables[1].batch_tokens == [1, 2, 3] and g.tables[3].batch_tokens == [3, 6, 9]
    assert g.tables[3].meta["requests"] == 3 and g.meta["tokens_per_request"] == 3
    with pytest.raises(ValueError, match="≥ 1"):
        profile_sps_grid(make_tiny_target("llama"), [0], tokens_per_request=2)


def test_profile_command_writes_a_grid_the_scheduler_loads(tmp_path, one_thread):
    from deepspec.cli import main
    ov = [f"run_dir={tmp_path}", "target.path=tiny:llama", "target.dtype=float32", "target.device=cpu",
          "draft.gamma=3", "schedule.profile_requests=[1,2]", "schedule.profile_context_len=4",
          "schedule.profile_repeats=1"]
    assert main(["profile", *ov]) == 0
    path = tmp_path / "sps" / "sps_grid.json"
    assert path.is_file() and (tmp_path / "sps" / "resolved_config.yaml").is_file()
    grid = load_cost_model(path)
    assert grid.requests == [1, 2] and grid.tables[2].batch_tokens == [2, 4, 6, 8]
    cfg = load_config([f"run_dir={tmp_path}", "schedule.policy=scheduler", f"schedule.sps_table={path}"])
    p = policy_from_config(cfg)
    assert isinstance(p, PrefixSchedulerPolicy) and isinstance(p.sps_table, SPSGrid)
    assert len(p.lengths(np.full((2, 7), 0.9))) == 2
