"""bench/eval_drafters.py --confidence (bench/eval_tables.py): token shares and acceptance per bin of the target's top-1 probability."""
import json

import pytest

# the target's greedy path of one request: tokens and their top-1 probabilities
PATHS = {"gsm8k/0": ([5, 6, 7, 8, 9, 10], [1.0, 0.95, 0.85, 0.1, 0.5, 0.97])}
ROUNDS = {"gsm8k/0": [
    # after the prefill token (m = 1): drafts 6, 7 pass (0.95, 0.85), 99 fails against token 8 (0.1)
    {"round": 0, "accepted": 2, "verified": 3, "draft_tokens": [6, 7, 99]},
    # m = 4 (correction 8 emitted): draft 11 fails against token 9 (0.5)
    {"round": 1, "accepted": 0, "verified": 2, "draft_tokens": [11, 12]},
    # m = 5: draft 10 passes (0.97)
    {"round": 2, "accepted": 1, "verified": 1, "draft_tokens": [10, 3]},
]}


def test_shares_and_acceptance_per_bin(bench_module):
    mod = bench_module("eval_tables")
    t = mod.target_shares(PATHS, {"gsm8k/0": "gsm8k"})
    assert t["tokens"] == 6 and t["mean_top1"] == pytest.approx(sum(PATHS["gsm8k/0"][1]) / 6)
    assert t["share"] == pytest.approx([1 / 6, 0, 1 / 6, 0, 1 / 6, 3 / 6])
    a = mod.acceptance(ROUNDS, PATHS)
    assert a["rounds_used"] == 3 and a["requests_diverged"] == 0
    assert a["position1"]["reached"] == [0, 0, 1, 0, 0, 2]       # 0.95 pass, 0.5 fail, 0.97 pass
    assert a["position1"]["acceptance"] == [None, None, 0.0, None, None, 1.0]
    assert a["all_positions"]["reached"] == [1, 0, 1, 0, 1, 2]   # + 0.85 pass, 0.1 fail
    assert a["all_positions"]["acceptance"] == [0.0, None, 0.0, None, 1.0, 1.0]
    assert a["all_positions"]["overall"] == pytest.approx(3 / 5)
    assert a["position1_misses"] == {"repeat_anchor": 0.0, "skip_one": 0.0}
    # a miss at m = 4 that proposes the anchor (token 8) again, one that proposes token 10 (x_p+2)
    again = {"gsm8k/0": [ROUNDS["gsm8k/0"][0], dict(ROUNDS["gsm8k/0"][1], draft_tokens=[8, 12])]}
    skip = {"gsm8k/0": [ROUNDS["gsm8k/0"][0], dict(ROUNDS["gsm8k/0"][1], draft_tokens=[10, 12])]}
    assert mod.acceptance(again, PATHS)["position1_misses"] == {"repeat_anchor": 0.5, "skip_one": 0.0}
    assert mod.acceptance(skip, PATHS)["position1_misses"] == {"repeat_anchor": 0.0, "skip_one": 0.5}
    assert mod.bin_of(1.0) == 5 and mod.bin_of(0.9) == 5 and mod.bin_of(0.8999) == 4 and mod.bin_of(0.0) == 0


def test_a_round_off_the_greedy_path_ends_the_request(bench_module):
    mod = bench_module("eval_tables")
    off = {"gsm8k/0": [dict(ROUNDS["gsm8k/0"][0], draft_tokens=[6, 70, 99]), ROUNDS["gsm8k/0"][1]]}
    a = mod.acceptance(off, PATHS)                 # an accepted 70 where the plain path has 7
    assert a["rounds_used"] == 0 and a["requests_diverged"] == 1
    tie = {"gsm8k/0": [dict(ROUNDS["gsm8k/0"][0], draft_tokens=[6, 7, 8])]}   # a rejected draft equal to the path's
    assert mod.acceptance(tie, PATHS)["requests_diverged"] == 1
    with pytest.raises(SystemExit, match="request x/1 of the rollouts"):
        mod.acceptance({"x/1": ROUNDS["gsm8k/0"]}, PATHS)


def test_bad_rollouts_name_file_and_line(bench_module, tmp_path):
    mod = bench_module("eval_tables")
    p = tmp_path / "rollouts.jsonl"
    p.write_text(json.dumps({"request_id": "a/0", "round": 0, "accepted": 3, "verified": 2, "draft_tokens": [1, 2]}) + "\n")
    with pytest.raises(SystemExit, match=r"rollouts.jsonl:1: accepted 3, verified 2"):
        mod.read_rounds(p)
    p.write_text(json.dumps({"request_id": "a/0", "round": 0}) + "\n")
    with pytest.raises(SystemExit, match=r"rollouts.jsonl:1: no \['accepted'"):
        mod.read_rounds(p)
    p.write_text(json.dumps({"request_id": "a/0", "round": 1, "accepted": 0, "verified": 1, "draft_tokens": [1]}) + "\n")
    with pytest.raises(SystemExit, match="rounds of a/0 are not 0..0"):
        mod.read_rounds(p)
