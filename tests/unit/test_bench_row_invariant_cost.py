"""bench/decode_cost.py row-invariant (bench/row_invariant_timing.py): the draft-tree shape it times, and its
record on a tiny target."""
import json


def test_tree_shape_is_a_trunk_with_side_branches(bench_module):
    shape = bench_module("row_invariant_timing").tree_shape
    assert shape(1) == ([-1], [1])
    parents, depths = shape(6)
    assert parents == [-1, -1, 0, 0, 2, 2] and depths == [1, 1, 2, 2, 3, 3]
    for n in (2, 5, 16):
        parents, depths = shape(n)
        assert len(parents) == len(depths) == n
        assert all(p < i and depths[i] == (1 if p < 0 else depths[p] + 1) for i, p in enumerate(parents))


def test_row_invariant_mode_writes_its_record(tmp_path, bench_module):
    out = tmp_path / "row_invariant_cost-x.json"
    assert bench_module("decode_cost").main(
        ["row-invariant", "--target", "tiny:llama", "--dtype", "float32", "--contexts", "8", "12", "--chain", "3",
         "--tree", "5", "--reps", "2", "--label", "x", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["args"]["mode"] == "row-invariant" and rec["label"] == "x" and set(rec["contexts"]) == {"8", "12"}
    for r in rec["contexts"].values():
        assert set(r["ms"]) == {f"{k}/{m}" for k in ("step", "chain", "tree") for m in ("batched", "row_invariant")}
        assert all(v > 0 for v in r["ms"].values())
        same = r["chain_rows_identical_to_steps"]     # the bits themselves: tests/unit/test_decoding_row_invariant.py
        assert r["chain_rows"] == 3 and set(same) == {"batched", "row_invariant"}
        assert all(0 <= v <= 3 for v in same.values())
    md = out.with_suffix(".md").read_text().splitlines()
    assert md[0] == "# row_invariant_cost-x" and sum(l.startswith("| 8 |") for l in md) == 3
    same = rec["contexts"]["12"]["chain_rows_identical_to_steps"]
    assert any(l.startswith("| 12 | chain of 3 |") and l.endswith(f"| {same['batched']}/3 / {same['row_invariant']}/3 |")
               for l in md)
