"""Benchmark (not a test): draft acceptance against the target's own confidence.

    OMP_NUM_THREADS=1 .venv/bin/python bench/target_confidence.py --label converge_4k \
        --run dspark_rnn=bench/work/converge/eval/dspark_rnn_4k dflash=bench/work/converge/eval/dflash_4k

Takes finished greedy evals (`deepspec eval`, e.g. through `bench/eval_drafters.py`) of the same prompts
and target, decodes those prompts once more with the target alone (its greedy path, in the evals'
dtype), recording the target's top-1 probability (softmax at temperature 1) at every token, and
answers two questions:

1. **How confident is the target along its own output?**  The share of output tokens per bin of
   the target's top-1 probability, per benchmark too.  This does not depend on any draft.
2. **How often does a draft position pass, given the target's confidence there?**  A round that
   starts after m output tokens checks draft position k against the target's distribution of output
   token m + k − 1, reached when the k − 1 positions before it passed.  Acceptance per bin, at
   position 1 and over all positions, for each eval, from its rollouts (accepted counts, drafts);
   and how many position-1 misses propose the anchor token again or the token after the next one.

A round whose accepted drafts are not the plain greedy path's tokens (a bf16 verification that
rounded a near-tie the other way) ends that request's analysis there; the count is recorded.
Writes `bench/results/target_confidence[-LABEL].{json,md}`.
"""
from __future__ import annotations

import argparse
import bisect
import datetime as dt
import json
import sys
from pathlib import Path
from typing import Dict, List, Mapping, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.records import repo_relative, write_record  # noqa: E402

EDGES = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0)
Path_ = Tuple[List[int], List[float]]      # the target's greedy tokens and their top-1 probabilities


def bin_of(p: float) -> int:
    """Index of ``p``'s bin in EDGES (the last bin is closed: 1.0 falls in [0.9, 1.0])."""
    return min(max(bisect.bisect_right(EDGES, p) - 1, 0), len(EDGES) - 2)


def bin_names() -> List[str]:
    return [f"[{a:.1f}, {b:.1f}{']' if b == 1.0 else ')'}" for a, b in zip(EDGES[:-1], EDGES[1:])]


def read_rounds(path: Path) -> Dict[str, List[dict]]:
    """Rounds of ``path`` (rollouts.jsonl) by request id, in round order."""
    out: Dict[str, List[dict]] = {}
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        r = json.loads(line)
        missing = [k for k in ("request_id", "round", "accepted", "verified", "draft_tokens") if k not in r]
        if missing:
            raise SystemExit(f"{path}:{i}: no {missing} in this rollout line")
        if not 0 <= int(r["accepted"]) <= int(r["verified"]) <= len(r["draft_tokens"]):
            raise SystemExit(f"{path}:{i}: accepted {r['accepted']}, verified {r['verified']} and "
                             f"{len(r['draft_tokens'])} drafts do not fit")
        out.setdefault(r["request_id"], []).append(r)
    for rid, rs in out.items():
        if [int(r["round"]) for r in rs] != list(range(len(rs))):
            raise SystemExit(f"{path}: the rounds of {rid} are not 0..{len(rs) - 1} in order")
    return out


def target_shares(paths: Mapping[str, Path_], bench_of: Mapping[str, str]) -> Dict[str, object]:
    """Share of output tokens per confidence bin, overall and per benchmark, and the mean top-1."""
    nb = len(EDGES) - 1
    tokens, by_bench, total_p = [0] * nb, {}, 0.0
    for rid, (_, top1) in paths.items():
        counts = by_bench.setdefault(bench_of.get(rid, ""), [0] * nb)
        for p in top1:
            b = bin_of(p)
            tokens[b] += 1
            counts[b] += 1
            total_p += p
    n = sum(tokens)
    return {"tokens": n, "mean_top1": total_p / n if n else None,
            "share": [t / n if n else None for t in tokens],
            "share_by_benchmark": {b: [c / sum(v) for c in v] for b, v in by_bench.items() if sum(v)}}


def acceptance(rounds: Mapping[str, Sequence[Mapping]], paths: Mapping[str, Path_]) -> Dict[str, object]:
    """Acceptance per bin of the target's top-1 probability, at position 1 and over all positions."""
    nb = len(EDGES) - 1
    pos1 = [[0, 0] for _ in range(nb)]      # [reached, passed]
    every = [[0, 0] for _ in range(nb)]
    used = diverged = 0
    kinds = {"anchor": 0, "skip": 0}       # position-1 misses that propose x_p again / x_{p+2}
    for rid, rs in rounds.items():
        if rid not in paths:
            raise SystemExit(f"request {rid} of the rollouts is not among the evaluated prompts")
        toks, top1 = paths[rid]
        m = 1                                # output tokens before the round (the prefill token)
        for r in rs:
            n, ell, d = int(r["accepted"]), int(r["verified"]), r["draft_tokens"]
            if m + n > len(toks) or d[:n] != toks[m: m + n] or (n < ell and m + n < len(toks) and d[n] == toks[m + n]):
                diverged += 1                # not the plain greedy path from here on
                break
            used += 1
            if ell >= 1 and n == 0:
                kinds["anchor"] += int(d[0] == toks[m - 1])
                kinds["skip"] += int(m + 1 < len(toks) and d[0] == toks[m + 1])
            for k in range(1, min(n + 1, ell) + 1):
                if m + k - 1 >= len(top1):
                    break
                b, passed = bin_of(top1[m + k - 1]), int(n >= k)
                every[b][0] += 1
                every[b][1] += passed
                if k == 1:
                    pos1[b][0] += 1
                    pos1[b][1] += passed
            m += n + 1

    def rate(c):
        return c[1] / c[0] if c[0] else None

    def block(cs):
        return {"reached": [c[0] for c in cs], "acceptance": [rate(c) for c in cs],
                "overall": rate([sum(c[0] for c in cs), sum(c[1] for c in cs)])}

    reached1 = sum(c[0] for c in pos1)
    return {"rounds_used": used, "requests_diverged": diverged, "position1": block(pos1),
            "all_positions": block(every),
            "position1_misses": {"repeat_anchor": kinds["anchor"] / reached1 if reached1 else None,
                                 "skip_one": kinds["skip"] / reached1 if reached1 else None}}


def greedy_paths(cfg) -> Tuple[Dict[str, Path_], Dict[str, str]]:
    """The target's greedy output on the eval's first turns (`target_generate`, the evals' own baseline
    decoder), with the top-1 probability of each token from one forward over prompt and output."""
    import torch
    from tqdm.auto import tqdm
    from deepspec.eval.benchmarks import load_benchmarks
    from deepspec.decoding.warp import make_warp
    from deepspec.decoding.loop import target_generate
    from deepspec.targets import load_target
    from deepspec.targets.chat import encode_prompt
    ec = cfg.eval
    benches = load_benchmarks(ec.data_dir, ec.benchmarks, ec.max_samples)
    target = load_target(cfg.target)
    kw = dict(getattr(target, "chat_template_kwargs", {}) or {})
    greedy = make_warp(0.0)
    paths, bench_of = {}, {}
    todo = [s for ss in benches.values() for s in ss]
    for s in tqdm(todo, desc="target greedy path", unit="req"):
        ids = encode_prompt(target.tokenizer, [{"role": "user", "content": s.turns[0]}], **kw)
        toks = target_generate(target, ids, max_new_tokens=ec.max_new_tokens, warp=greedy).tokens
        with torch.inference_mode():
            rows = target.decode(torch.tensor([ids + toks[:-1]])).logits[0, len(ids) - 1:].float()
        top1 = (rows.amax(-1) - rows.logsumexp(-1)).exp().tolist()
        paths[s.id], bench_of[s.id] = (toks, top1), s.benchmark
    return paths, bench_of


def cached_paths(file: Path, cfg, key) -> Tuple[Dict[str, Path_], Dict[str, str]]:
    """`greedy_paths`, kept in ``file`` with the settings it was decoded for (a file for other settings
    is decoded again and replaced)."""
    want = json.loads(json.dumps(list(key)))
    if file.is_file():
        saved = json.loads(file.read_text())
        if saved.get("settings") == want:
            return {k: (v[0], v[1]) for k, v in saved["paths"].items()}, saved["benchmark"]
        print(f"{file}: decoded for other settings {saved.get('settings')}; decoding again")
    paths, bench_of = greedy_paths(cfg)
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps({"settings": want, "paths": paths, "benchmark": bench_of}))
    return paths, bench_of


def eval_settings(eval_dir: Path):
    """The eval's resolved config and what must agree between evals analysed together."""
    from deepspec.config import config_from_yaml
    cfg = config_from_yaml(eval_dir / "resolved_config.yaml")
    ec, tc = cfg.eval, cfg.target
    if ec.temperature != 0 or ec.multi_turn:
        raise SystemExit(f"{eval_dir}: needs a greedy first-turn eval (eval.temperature=0 eval.multi_turn=false)")
    res = eval_dir / "results.json"
    if res.is_file() and str(json.loads(res.read_text()).get("setup", {}).get("policy", "")).startswith("tree("):
        raise SystemExit(f"{eval_dir}: needs chain rollouts (eval.decoding=chain); this eval verified draft trees")
    return cfg, (tc.path, str(tc.dtype), ec.data_dir, tuple(ec.benchmarks), ec.max_samples, ec.max_new_tokens)


def _f(x, nd=3):
    return "–" if x is None else f"{x:.{nd}f}"


def markdown(record: Mapping) -> str:
    names = bin_names()
    t = record["target"]
    lines = [f"# Draft acceptance against the target's confidence ({record['date']})", "",
             f"`{record['command']}`", "",
             f"## The target's confidence along its greedy output ({t['tokens']:,} tokens)", "",
             "| benchmark | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for bench, share in t["share_by_benchmark"].items():
        lines.append(f"| {bench} | " + " | ".join(_f(x, 2) for x in share) + " |")
    lines.append("| **all** | " + " | ".join(_f(x, 2) for x in t["share"]) + " |")
    lines += ["", f"Mean top-1 probability: {_f(t['mean_top1'])}."]
    for key, title in (("position1", "Acceptance at draft position 1"),
                       ("all_positions", "Conditional acceptance, all positions")):
        lines += ["", f"## {title}, by the target's top-1 probability there", "",
                  "| drafter | " + " | ".join(names) + " | overall |", "|---|" + "---:|" * (len(names) + 1)]
        for name, a in record["drafters"].items():
            cells = [f"{_f(r, 2)} ({n:,})" for r, n in zip(a[key]["acceptance"], a[key]["reached"])]
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {_f(a[key]['overall'])} |")
    lines += ["", "## Position-1 misses that propose the anchor token again (x_p) or skip a token (x_p+2)", "",
              "| drafter | repeat the anchor | skip one token |", "|---|---:|---:|"]
    for name, a in record["drafters"].items():
        mk = a["position1_misses"]
        lines.append(f"| {name} | {_f(mk['repeat_anchor'])} | {_f(mk['skip_one'])} |")
    lines += ["", "(as fractions of the rounds that reached position 1)", "",
              "(n) = positions reached in that bin. Rounds used / requests that left the plain greedy path: " +
              ", ".join(f"{n} {a['rounds_used']} / {a['requests_diverged']}" for n, a in record["drafters"].items()) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", nargs="+", required=True, metavar="NAME=EVAL_DIR",
                   help="finished greedy evals of the same prompts and target (rollouts.jsonl, resolved_config.yaml)")
    p.add_argument("--paths", default=None, metavar="JSON",
                   help="keep the target's greedy paths here: read when written for the same target and prompts, "
                        "else decoded and written (saves re-decoding when more evals are analysed later)")
    p.add_argument("--label", default=None)
    p.add_argument("--out", default=None, help="record path (default bench/results/target_confidence[-LABEL].json)")
    args = p.parse_args(argv)
    evals, key, cfg = {}, None, None
    for spec in args.run:
        name, sep, d = spec.partition("=")
        if not sep or not name or not d:
            raise SystemExit(f"--run {spec!r}: expected NAME=EVAL_DIR")
        c, k = eval_settings(Path(d))
        if key is not None and k != key:
            raise SystemExit(f"--run {name}: its target or prompts {k} differ from the first eval's {key}")
        cfg, key = cfg or c, key or k
        evals[name] = (Path(d), read_rounds(Path(d) / "rollouts.jsonl"))
    paths, bench_of = cached_paths(Path(args.paths), cfg, key) if args.paths else greedy_paths(cfg)
    record = {"date": dt.date.today().isoformat(),
              "command": repo_relative(" ".join([Path(sys.executable).name, "bench/target_confidence.py",
                                                 *(argv if argv is not None else sys.argv[1:])])),
              "settings": {"target": key[0], "dtype": key[1], "benchmarks": list(key[3]), "max_samples": key[4],
                           "max_new_tokens": key[5]},
              "bins": bin_names(), "target": target_shares(paths, bench_of),
              "drafters": {n: {"eval_dir": repo_relative(str(d.resolve())), **acceptance(rs, paths)}
                           for n, (d, rs) in evals.items()}}
    path = write_record(record, "target_confidence", args.out, args.label)
    Path(path).with_suffix(".md").write_text(markdown(record))
    print(markdown(record))


if __name__ == "__main__":
    main()
