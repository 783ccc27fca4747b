"""SPS(B) tables: load/save, interpolation, extrapolation, profiling bookkeeping."""
import json

import numpy as np
import pytest

from deepspec.schedule.profile import SPSTable, profile_sps, synthetic_gpu_table


def test_save_load_roundtrip(tmp_path):
    t = SPSTable(batch_tokens=[4, 1, 16], steps_per_second=[90.0, 100.0, 50.0], device="dev", target="tgt",
                 meta={"note": "x"})
    assert t.batch_tokens == [1, 4, 16]                       # sorted on construction
    p = t.save(tmp_path / "sps.json")
    d = json.loads(p.read_text())
    assert set(d) >= {"device", "target", "batch_tokens", "steps_per_second"}
    back = SPSTable.load(p)
    assert back.batch_tokens == t.batch_tokens and back.steps_per_second == t.steps_per_second
    assert back.device == "dev" and back.meta == {"note": "x"}
    (tmp_path / "bad.json").write_text('{"batch_tokens": [1]}')
    with pytest.raises(ValueError, match="bad.json"):
        SPSTable.load(tmp_path / "bad.json")


def test_interpolation_clamp_extrapolation():
    t = SPSTable(batch_tokens=[2, 4, 8], steps_per_second=[100.0, 80.0, 40.0])
    assert t.sps(4) == pytest.approx(80.0)
    assert t.step_time(6) == pytest.approx((1 / 80 + 1 / 40) / 2)   # time piecewise linear in B
    assert t.sps(1) == pytest.approx(100.0)                 # below: clamp
    assert t.sps(16) == pytest.approx(20.0)                 # above: constant tokens/s
    np.testing.assert_allclose(t.sps(np.array([2, 3, 16])), [100.0, 1 / 0.01125, 20.0])
    assert t.step_time(8) == pytest.approx(1 / 40)
    assert t.tokens_per_second(8) == pytest.approx(320.0)


def test_noisy_table_made_non_increasing():
    t = SPSTable(batch_tokens=[1, 2, 4], steps_per_second=[100.0, 110.0, 90.0])
    assert t.sps(2) == pytest.approx(100.0)                 # step time made non-decreasing
    assert t.steps_per_second == [100.0, 110.0, 90.0]       # raw data kept
    with pytest.raises(ValueError):
        SPSTable(batch_tokens=[1, 1], steps_per_second=[1.0, 2.0])
    with pytest.raises(ValueError):
        SPSTable(batch_tokens=[1], steps_per_second=[0.0])


def test_convexified_lower_hull():
    # a cliff at 64 (non-convex step time): the hull goes under it
    t = SPSTable(batch_tokens=[1, 32, 64, 128], steps_per_second=[100.0, 90.0, 40.0, 35.0])
    c = t.convexified()
    assert c.convex and not t.convex
    x = np.arange(1, 300)
    tt = c.step_time(x)
    assert np.all(np.diff(tt) >= -1e-15) and np.all(np.diff(tt, 2) >= -1e-12)   # non-decreasing, convex
    assert np.all(tt <= t.step_time(x) + 1e-15)
    assert c.step_time(1) == pytest.approx(0.01) and c.step_time(128) == pytest.approx(1 / 35)
    assert SPSTable.from_json(c.to_json()).convex


def test_synthetic_gpu_shape():
    t = synthetic_gpu_table(base_sps=80.0, knee_tokens=256)
    assert t.meta["synthetic"] is True
    assert t.sps(1) == pytest.approx(80.0, rel=1e-3)
    assert t.sps(64) > 0.99 * t.sps(1)                      # flat below the knee
    assert t.sps(4096) == pytest.approx(80.0 * 256 / 4096, rel=0.01)   # ~1/B above it
    assert np.all(np.diff(t.sps(np.arange(1, 9000, 7))) <= 1e-9)


class _RecordingTarget:
    """A real tiny target whose decode calls are recorded (shape, cached length before the call)."""

    def __init__(self):
        from conftest import make_tiny_target
        self.inner = make_tiny_target("llama")
        self.name, self.vocab_size, self.device = "tiny-llama", self.inner.vocab_size, self.inner.device
        self.calls = []

    def decode(self, ids, past_key_values=None):
        seen = None if past_key_values is None else self.inner.cache_length(past_key_values)
        self.calls.append((tuple(ids.shape), seen))
        return self.inner.decode(ids, past_key_values=past_key_values)

    def rollback(self, cache, length):
        return self.inner.rollback(cache, length)


def test_profile_flat_and_requests_bookkeeping():
    pytest.importorskip("torch")
    tgt = _RecordingTarget()
    t = profile_sps(tgt, [1, 4, 3], context_len=16, repeats=2, warmup=1, mode="flat")
    assert t.batch_tokens == [1, 3, 4] and t.meta["mode"] == "flat" and t.target == "tiny-llama"
    # every timed step ran on top of exactly the context (cache rolled back after each)
    assert all(seen == 16 for shape, seen in tgt.calls[1:]) and tgt.calls[0] == ((1, 16), None)
    assert [s for s, _ in tgt.calls[1:]] == [(1, 1)] * 3 + [(1, 3)] * 3 + [(1, 4)] * 3
    tgt2 = _RecordingTarget()
    t2 = profile_sps(tgt2, [2, 8, 10], context_len=4, repeats=1, warmup=0, tokens_per_request=4)
    assert t2.meta["mode"] == "requests"
    assert t2.batch_tokens == [2, 8, 12]                    # 1×2, 2×4, 3×4 (rounded up to whole requests)
    timed = [c for c in tgt2.calls if c[1] == 4]
    assert [s for s, _ in timed] == [(1, 2), (2, 4), (3, 4)]
    assert ((3, 4), None) in tgt2.calls                     # the untimed prefill of 3 contexts
    tgt3 = _RecordingTarget()                               # fixed concurrency: R rows, B/R tokens each
    t3 = profile_sps(tgt3, [3, 6, 7, 24], context_len=4, repeats=1, warmup=0, requests=3)
    assert t3.batch_tokens == [3, 6, 9, 24] and t3.meta["requests"] == 3
    assert [s for s, seen in tgt3.calls if seen == 4] == [(3, 1), (3, 2), (3, 3), (3, 8)]
