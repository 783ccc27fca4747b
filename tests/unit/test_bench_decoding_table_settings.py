"""bench/decoding_table.py: the decoding settings it evaluates (``KIND@DTYPE``) and the eval keys each sets."""
import json

import pytest


def test_parse_setting(bench_module):
    mod = bench_module("decoding_table")
    assert mod.parse_setting("chain@float32") == {"name": "chain@float32", "tree": None, "depth": None, "lookup": 0,
                                                  "lookup_min": 1, "dtype": "float32"}
    assert mod.parse_setting("tree16x8l3@bfloat16") == {"name": "tree16x8l3@bfloat16", "tree": (16, 8), "depth": None, "lookup": 3,
                                                         "lookup_min": 1, "dtype": "bfloat16"}
    assert mod.parse_setting("tree16x8l3m2@bfloat16")["lookup_min"] == 2
    assert mod.parse_setting("tree16x8d4l3@bfloat16")["depth"] == 4
    with pytest.raises(SystemExit, match="≥ 1"):
        mod.parse_setting("tree16x8d0@float32")
    with pytest.raises(SystemExit, match="treeNxW"):
        mod.parse_setting("tree6@float32")
    with pytest.raises(SystemExit, match="treeNxW"):
        mod.parse_setting("chain@int8")
    with pytest.raises(SystemExit, match="≥ 1"):
        mod.parse_setting("tree0x8@float32")
    with pytest.raises(SystemExit, match="1 ≤ M"):
        mod.parse_setting("tree16x8l2m3@bfloat16")


def test_setting_overrides_state_every_eval_key(bench_module):
    mod = bench_module("decoding_table")
    assert mod.setting_overrides(mod.parse_setting("chain@bfloat16")) == ["eval.decoding=chain"]
    assert mod.setting_overrides(mod.parse_setting("tree16x8@bfloat16")) == [
        "eval.decoding=tree", "eval.tree_nodes=16", "eval.tree_width=8", "eval.tree_depth=0", "eval.lookup_ngram=0",
        "eval.lookup_min_ngram=1"]
    assert "eval.tree_depth=3" in mod.setting_overrides(mod.parse_setting("tree16x8d3l3@bfloat16"))
    assert mod.setting_overrides(mod.parse_setting("tree6x2l3m2@float32"))[-2:] == [
        "eval.lookup_ngram=3", "eval.lookup_min_ngram=2"]


def _record(rows):
    return {"script": "decoding_table", "label": "x", "date": "2026-12-07", "command": "c",
            "machine": {"loadavg_end": [0.1, 0.1, 0.1]},
            "args": {"benchmarks": ["gsm8k"], "max_samples": 2, "max_new_tokens": 8, "threads": 1},
            "rows": rows, "fastest_plain_tokens_per_s": {"0": 10.0}, "tuning": {}, "assisted_generation": "none"}


def test_markdown_states_the_speedup_after_the_first_token(bench_module, tmp_path):
    mod = bench_module("table_markdown")
    spec = {"kind": "deepspec", "temperature": 0.0, "dtype": "bfloat16", "setting": "tree8x4l3", "policy": "tree",
            "tau": 2.0, "tau_ci95": [1.9, 2.1], "greedy_check": {"compared": 2, "matched": 1},
            "speed": {"speedup_pooled": 1.2, "spec_tokens_per_s": 12.0, "draft_ms": 1.0, "verify_ms": 2.0,
                      "overhead_ms": 0.5, "plain_decode_ms_per_token": 60.0, "spec_decode_ms_per_token": 40.0}}
    hf = {"kind": "transformers", "temperature": 0.0, "dtype": "bfloat16", "plain": True, "tokens_per_s": 10.0,
          "tau": 1.0, "tau_ci95": [1.0, 1.0], "identical": None}
    rec = _record({"d tree8x4l3": spec, "hf plain": hf})
    assert mod.decode_speedup(spec["speed"]) == pytest.approx(1.5)
    assert mod.decode_speedup({"plain_decode_ms_per_token": 60.0}) is None
    md = mod.markdown(rec).splitlines()
    header = next(line for line in md if line.startswith("| row |")).split(" | ")
    row = next(line for line in md if line.startswith("| d tree8x4l3 |")).split(" | ")
    hf_row = next(line for line in md if line.startswith("| hf plain |")).split(" | ")
    col = header.index("after the first token")
    assert len(header) == len(row) == len(hf_row)
    assert row[col] == "1.500×" and hf_row[col] == "–"
    path = tmp_path / "decoding_table-x.json"
    path.write_text(json.dumps(rec))
    mod.main([str(path)])
    assert path.with_suffix(".md").read_text() == mod.markdown(rec)
    path.write_text(json.dumps({**rec, "script": "eval_drafters"}))
    with pytest.raises(SystemExit, match="not a decoding_table record"):
        mod.main([str(path)])


def test_markdown_lists_the_record_notes(bench_module):
    mod = bench_module("table_markdown")
    assert "Notes:" not in mod.markdown(_record({}))
    md = mod.markdown({**_record({}), "notes": ["two tables at once, one per core"]}).splitlines()
    assert md[md.index("Notes:") + 1] == "- two tables at once, one per core"


def test_note_option_is_repeatable(bench_module):
    args = bench_module("decoding_table").build_parser().parse_args(
        ["--drafter", "d=none", "--note", "a", "--note", "b"])
    assert args.note == ["a", "b"]
