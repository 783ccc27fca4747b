"""Where a speculative round's time goes, next to plain decoding measured in the same run.

Per round (means over every verification round of the run):

- ``draft_ms``     the drafter: ``propose`` (γ draft tokens) + ``advance`` (the verified tokens' features)
- ``verify_ms``    the target's verification forward over ``[anchor, d_1..d_ℓ]``
- ``overhead_ms``  the rest of the loop: building the verify ids, acceptance (one device → host
                   transfer under greedy), cache rollback, bookkeeping
- ``plain_decode_ms_per_token``  the target-only baseline's decode time per token (one KV-cached forward
                   and one token each) — the cost a verification forward is compared with:
                   ``verify_over_plain_decode`` = verify_ms ÷ plain_decode_ms_per_token (ideally ≈ 1 on a GPU,
                   where 8 query tokens cost about what 1 does) and ``overhead_fraction`` = overhead ÷ round.

On a GPU the phases are CUDA-event intervals read after the request (no synchronisation inside a
round); on a CPU they are wall-clock intervals.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence

__all__ = ["round_split", "format_round_split"]


def _ratio(a: float, b: float) -> float:
    return a / b if b and b > 0 and not math.isnan(b) else float("nan")


def round_split(specs: Sequence[Any], baselines: Sequence[Any] = ()) -> Dict[str, Any]:
    """The per-round split of speculative `GenerationResult`s and the plain-decode step of the baselines."""
    rounds = [r for s in specs for r in s.rounds]
    n = len(rounds)
    draft = sum(r.t_draft for r in rounds)
    verify = sum(r.t_verify for r in rounds)
    over = sum(r.t_overhead for r in rounds)
    per = (lambda x: 1e3 * x / n) if n else (lambda x: float("nan"))
    out: Dict[str, Any] = {
        "rounds": n, "draft_ms": per(draft), "verify_ms": per(verify), "overhead_ms": per(over),
        "round_ms": per(draft + verify + over),
        "overhead_fraction": _ratio(over, draft + verify + over),
        "tokens_per_round": (sum(r.emitted for r in rounds) / n) if n else float("nan"),
        "verified_tokens_per_round": (sum(r.proposed + 1 for r in rounds) / n) if n else float("nan"),
        "prefill_ms": _ratio(1e3 * sum(s.t_prefill for s in specs), len(specs)),
    }
    steps = sum(max(b.num_tokens - 1, 0) for b in baselines)     # the first token comes from the prefill
    plain = sum(b.t_decode for b in baselines)
    out["plain_decode_steps"] = steps
    out["plain_decode_ms_per_token"] = _ratio(1e3 * plain, steps)
    out["verify_over_plain_decode"] = _ratio(out["verify_ms"], out["plain_decode_ms_per_token"])
    emitted = sum(max(s.num_tokens - 1, 0) for s in specs)
    out["spec_decode_ms_per_token"] = _ratio(1e3 * sum(s.t_decode for s in specs), emitted)
    return out


def _f(x: Optional[float], nd: int = 1) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def format_round_split(s: Dict[str, Any]) -> str:
    """One line for logs and progress output."""
    return (f"per round: draft {_f(s.get('draft_ms'))} ms, verify {_f(s.get('verify_ms'))} ms, overhead "
            f"{_f(s.get('overhead_ms'))} ms ({_f(100 * (s.get('overhead_fraction') or float('nan')))}% of "
            f"{_f(s.get('round_ms'))} ms); plain decode {_f(s.get('plain_decode_ms_per_token'))} ms/token; "
            f"verify ÷ plain step {_f(s.get('verify_over_plain_decode'), 2)}×")
