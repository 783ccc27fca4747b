"""bench/decode_cost.py batched (bench/schedule_replay.py): the real-forward replay is the simulator's replay
(no timing asserts)."""
import json

import numpy as np
import pytest

from deepspec.schedule.prefix_scheduler import FixedLengthPolicy, PrefixSchedulerPolicy, ThresholdPolicy
from deepspec.schedule.profile import synthetic_gpu_table
from deepspec.schedule.rollouts import synthetic_rollouts, write_rollouts
from deepspec.schedule.simulator import simulate
from conftest import make_tiny_target


@pytest.fixture
def vb(bench_module):
    return bench_module("schedule_replay")


@pytest.fixture
def cli(bench_module):
    return lambda argv: bench_module("decode_cost").main(["batched", *argv])


def rollouts_file(tmp_path, gamma=4, with_tokens=True):
    recs = synthetic_rollouts(n_requests=5, rounds_per_request=4, gamma=gamma, seed=3)
    rng = np.random.default_rng(0)
    for i, r in enumerate(recs):
        if with_tokens and i % 2 == 0:  # half the rounds log their draft ids
            r.draft_tokens = rng.integers(0, 400, gamma).tolist()
    return write_rollouts(tmp_path / "rollouts.jsonl", recs)


@pytest.mark.parametrize("R", [1, 3])
def test_real_replay_matches_simulator(vb, tmp_path, one_thread, R):
    traces, info = vb.load_traces(rollouts_file(tmp_path))
    assert info["gamma"] == 4 and info["rounds"] == 20 and info["rounds_with_draft_tokens"] == 10
    target = make_tiny_target("llama")
    table = synthetic_gpu_table(knee_tokens=4)  # small knee: the scheduler trims, lengths vary
    cache, base = vb.prefill(target, R, 8)
    assert base == 8
    for policy in (FixedLengthPolicy(), ThresholdPolicy(0.5), PrefixSchedulerPolicy(table)):
        sim, ver = vb.measure(target, traces, policy, table, R, steps=4, cache=cache, base=base, seed=7)
        seen = []
        pure = simulate(traces, policy, table, R, steps=4, seed=7, on_step=lambda s: seen.append(s.lengths.tolist()))
        assert ver.lengths == seen                                    # identical per-step ℓ_r
        assert ver.tokens == sim.tokens == pure.tokens                # identical token count
        assert sim.to_json() == pure.to_json() == simulate(traces, policy, table, R, steps=4, seed=7).to_json()
        assert ver.shapes == [[R, 1 + max(ell)] for ell in seen]      # padded to the longest request
        assert ver.padded_tokens_total >= sim.batch_tokens_total
        assert len(ver.times) == 4 and target.cache_length(cache) == base   # rolled back after each step
        row = vb.row(sim, ver, 0.0, table)
        assert row["tokens"] == sim.tokens and row["measured_tps"] > 0
        assert row["predicted_tps_padded"] == pytest.approx(sim.tokens / ver.padded_time_s)


def test_logged_draft_ids_used(vb, tmp_path):
    traces, _ = vb.load_traces(rollouts_file(tmp_path))
    target = make_tiny_target("llama")
    ver = vb.RealVerifier(target, None, 0, synthetic_gpu_table())
    seen = []
    simulate(traces, FixedLengthPolicy(), synthetic_gpu_table(), 3, steps=3,
             on_step=lambda s: seen.append((s, ver.step_ids(s))))
    for step, ids in seen:
        for r, (tr, pos) in enumerate(zip(step.traces, step.positions)):
            if tr.draft_tokens[pos] is not None:
                assert ids[r, 1:5].tolist() == tr.draft_tokens[pos]


def test_bad_rollouts_name_file_and_line(vb, tmp_path):
    p = rollouts_file(tmp_path, with_tokens=False)
    lines = p.read_text().splitlines()
    bad = json.loads(lines[5])
    bad["confidence"] = bad["confidence"][:3]
    (tmp_path / "mixed.jsonl").write_text("\n".join(lines[:5] + [json.dumps(bad)] + lines[6:]) + "\n")
    with pytest.raises(ValueError, match=r"mixed.jsonl:6: γ=3 but line 1 has γ=4"):
        vb.load_traces(tmp_path / "mixed.jsonl")
    (tmp_path / "dup.jsonl").write_text("\n".join(lines + [lines[2]]) + "\n")
    with pytest.raises(ValueError, match=r"dup.jsonl:21: .* repeats line 3"):
        vb.load_traces(tmp_path / "dup.jsonl")
    (tmp_path / "junk.jsonl").write_text(lines[0] + "\n{not json\n")
    with pytest.raises(ValueError, match=r"junk.jsonl:2: bad rollout record"):
        vb.load_traces(tmp_path / "junk.jsonl")
    big = json.loads(lines[0])
    big["draft_tokens"] = [1, 2, 3, 10 ** 6]
    (tmp_path / "vocab.jsonl").write_text(json.dumps(big) + "\n")
    traces, _ = vb.load_traces(tmp_path / "vocab.jsonl")
    with pytest.raises(ValueError, match=r"vocab.jsonl:1: draft token ids"):
        vb.check_vocab(traces, 512, tmp_path / "vocab.jsonl")


def test_cli_end_to_end(cli, tmp_path, one_thread):
    out = tmp_path / "vb.json"
    assert cli(["--target", "tiny:llama", "--rollouts", str(rollouts_file(tmp_path)), "--steps", "2",
                    "--concurrency", "1", "2", "--threads", "1", "--context-len", "8", "--profile-sizes", "1", "5",
                    "--repeats", "1", "--warmup", "1", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert [(r["R"], r["policy"]) for r in d["results"]] == [(R, p) for R in (1, 2)
                                                             for p in ("fixed", "threshold0.5", "scheduler")]
    assert (tmp_path / "vb.sps.json").exists() and d["sps_table"]["meta"]["mode"] == "requests"
    assert "from the rollout log" in d["note"] and out.with_suffix(".md").exists()


def test_cli_per_r_profile(cli, tmp_path, one_thread):
    """--per-r-profile: a table per concurrency R, its predictions for the same forwards, and a
    scheduler replay that decides with it."""
    out = tmp_path / "vb.json"
    assert cli(["--target", "tiny:llama", "--rollouts", str(rollouts_file(tmp_path)), "--steps", "2",
                    "--concurrency", "2", "--threads", "1", "--context-len", "8", "--profile-sizes", "1", "5",
                    "--repeats", "1", "--warmup", "0", "--per-r-profile", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert [(r["policy"], r["table"]) for r in d["results"]] == [
        ("fixed", "global"), ("fixed", "per-R"), ("threshold0.5", "global"), ("threshold0.5", "per-R"),
        ("scheduler", "global"), ("scheduler", "per-R")]
    t2 = d["per_r_sps_tables"]["2"]
    assert t2["batch_tokens"] == [2, 4, 6, 8, 10] and t2["meta"]["requests"] == 2     # R·1 … R·(1+γ)
    fixed, fixed_r = d["results"][0], d["results"][1]
    assert fixed_r["step_times_s"] == fixed["step_times_s"] and fixed_r["measured_tps"] == fixed["measured_tps"]
    from deepspec.schedule import SPSGrid, load_cost_model
    grid = load_cost_model(tmp_path / "vb.sps_grid.json")      # the per-R tables, reusable as a cost model
    assert isinstance(grid, SPSGrid) and grid.requests == [2]
    assert grid.tables[2].steps_per_second == t2["steps_per_second"]
