"""The measurements of `bench/decode_cost.py row-invariant`: what row-invariant verification costs, the
batched verification forward against the one that runs every row through the one-token attention call
(`eval.row_invariant`, `deepspec.decoding.row_invariant`).

Per context length: a chain verification (``--chain`` tokens), a tree verification (``--tree`` nodes, the
shape of a 16 × 8 draft tree: a trunk with side branches) and one plain decoding step, each batched and
row-invariant, interleaved round-robin (A, B, A, B, ...) so machine load hits both alike.  Reported: median
CPU time per forward (``time.process_time``, this process only), the extra cost of the row-invariant call,
and whether its rows have the plain steps' bits (checked once per context).  The load average is recorded
at start and end.  Record: `bench/results/row_invariant_cost[-LABEL].{json,md}`.
"""
from __future__ import annotations

import copy
import os
import statistics
import time

from bench.records import header, write_record


def tree_shape(n: int):
    """Parents and depths of an n-node tree shaped like the draft trees: a trunk, a side branch per level."""
    parents, depths, trunk = [], [], -1
    while len(parents) < n:
        parents.append(trunk)
        depths.append(1 if trunk < 0 else depths[trunk] + 1)
        side = len(parents) - 1
        if len(parents) < n:
            parents.append(trunk)
            depths.append(depths[side])
        trunk = side
    return parents[:n], depths[:n]


def _timed(fn):
    t0 = time.process_time()
    out = fn()
    return time.process_time() - t0, out


def measure(t, context: int, chain: int, tree: int, reps: int, gen):
    import torch
    from deepspec.decoding.row_invariant import row_invariant
    from deepspec.decoding.tree_mask import tree_inputs
    prompt = torch.randint(0, t.vocab_size, (1, context), generator=gen)
    cache = t.decode(prompt).past_key_values
    par, dep = tree_shape(tree)
    mask, pos = tree_inputs(t, torch.tensor(par), torch.tensor(dep), context)
    ids = {"step": torch.randint(0, t.vocab_size, (1, 1), generator=gen),
           "chain": torch.randint(0, t.vocab_size, (1, chain), generator=gen),
           "tree": torch.randint(0, t.vocab_size, (1, tree + 1), generator=gen)}
    kw = {"step": {}, "chain": {}, "tree": {"attention_mask": mask, "position_ids": pos}}
    times = {(k, m): [] for k in ids for m in ("batched", "row_invariant")}
    outs = {}
    for rep in range(reps):
        for k in ids:
            for m in ("batched", "row_invariant"):
                c = copy.deepcopy(cache)
                if m == "batched":
                    s, o = _timed(lambda: t.decode(ids[k], c, **kw[k]))
                else:
                    with row_invariant(t):
                        s, o = _timed(lambda: t.decode(ids[k], c, **kw[k]))
                times[(k, m)].append(s)
                outs[(k, m)] = o.logits[0]
    c = copy.deepcopy(cache)
    steps = [t.decode(ids["chain"][:, i:i + 1], c).logits[0, -1] for i in range(chain)]
    same = {m: sum(bool(torch.equal(outs[("chain", m)][i], steps[i])) for i in range(chain))
            for m in ("batched", "row_invariant")}
    ms = {f"{k}/{m}": 1e3 * statistics.median(v[1:]) for (k, m), v in times.items()}
    return {"ms": ms, "chain_rows_identical_to_steps": same, "chain_rows": chain}


def markdown(rec: dict) -> str:
    m = rec["machine"]
    out = [f"# row_invariant_cost{('-' + rec['label']) if rec.get('label') else ''}", "", f"`{rec['command']}`", "",
           f"{rec['date']}; target {rec['args']['target']} in {rec['args']['dtype']}, {m['threads']} thread(s), load "
           f"{m['loadavg_start']} → {m['loadavg_end']}; median CPU ms per forward over {rec['args']['reps'] - 1} "
           "interleaved rounds (the first dropped)", "",
           "| context | forward | batched ms | row-invariant ms | extra | chain rows with the steps' bits (batched / row-inv.) |",
           "|---:|---|---:|---:|---:|---|"]
    for ctx, r in rec["contexts"].items():
        for k in ("step", "chain", "tree"):
            a, b = r["ms"][f"{k}/batched"], r["ms"][f"{k}/row_invariant"]
            n = {"step": "1 token", "chain": f"chain of {rec['args']['chain']}", "tree": f"tree of {rec['args']['tree']} + anchor"}[k]
            same = r["chain_rows_identical_to_steps"]
            bits = f"{same['batched']}/{r['chain_rows']} / {same['row_invariant']}/{r['chain_rows']}" if k == "chain" else ""
            out.append(f"| {ctx} | {n} | {a:.1f} | {b:.1f} | {b / a - 1:+.0%} | {bits} |")
    return "\n".join(out) + "\n"


def run(args) -> int:
    """Measure every context of ``args`` (the mode's options), print the table, write the record."""
    import torch
    from deepspec.config import TargetConfig
    from deepspec.targets import load_target
    torch.set_num_threads(args.threads)
    rec = header(label=args.label, args=vars(args))
    t = load_target(TargetConfig(path=args.target, device="cpu", dtype=args.dtype))
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        rec["contexts"] = {str(c): measure(t, c, args.chain, args.tree, args.reps, gen) for c in args.contexts}
    rec["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    md = markdown(rec)
    print(md)
    write_record(rec, "row_invariant_cost", args.out, args.label or None, markdown=md)
    return 0
