"""bench/decode_cost.py verify: the cost ratios divide by the right step (own dtype vs the fastest plain step)."""


def test_ratios_against_own_and_fastest_plain_step(bench_module):
    mod = bench_module("decode_cost")
    r = mod.ratios({"float32": {1: 70.0, 8: 140.0}, "bfloat16": {1: 90.0, 8: 90.0}})
    assert r["float32"][8]["over_own_step"] == 2.0 and r["float32"][8]["over_fastest_step"] == 2.0
    assert r["bfloat16"][8]["over_own_step"] == 1.0
    assert abs(r["bfloat16"][1]["over_fastest_step"] - 90.0 / 70.0) < 1e-12   # bf16's plain step is the slower one
