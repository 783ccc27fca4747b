"""Regenerate one group of conversations turn by turn.

Every assistant turn is regenerated in order, each conditioned on the regenerated history:
`plan_turns` cuts a conversation into prompt segments, `SampleRun` carries one conversation
through them, and `run_samples` batches the active conversations of a group through the engine
until each has finished or failed, giving one part entry per conversation.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..data import Conversation
from ..engines.base import Engine, GenerationError, Messages, SamplingParams


def plan_turns(messages: Sequence[Dict[str, str]], max_turns: Optional[int] = None) -> List[List[Dict[str, str]]]:
    """Split a conversation into prompt segments, one per assistant turn to regenerate.

    Source assistant messages are dropped; each segment is the system/user messages
    since the previous generation point and ends with a user message.
    """
    steps, cur = [], []
    for m in messages:
        if m["role"] == "assistant":
            if any(x["role"] == "user" for x in cur):
                steps.append(cur)
                cur = []
            continue
        cur.append({"role": m["role"], "content": m["content"]})
    if any(x["role"] == "user" for x in cur):
        steps.append(cur)
    return steps[:max_turns] if max_turns else steps


class SampleRun:
    """One conversation being regenerated: its prompt segments, the history so far, the outcome."""

    def __init__(self, index: int, conv: Conversation, max_turns: Optional[int]):
        self.index, self.conv = index, conv
        self.steps = plan_turns(conv.messages, max_turns)
        self.history: List[Dict[str, str]] = []
        self.k = 0
        self.turn_tokens: List[int] = []
        self.finish: List[str] = []
        self.prompt_tokens = 0
        self.error: Optional[GenerationError] = None
        self.truncated = 0

    @property
    def active(self) -> bool:
        return self.error is None and self.k < len(self.steps)

    def prompt(self) -> Messages:
        return self.history + self.steps[self.k]

    def key(self) -> str:
        return f"{self.conv.id}\x00turn{self.k}"

    def accept(self, r) -> None:
        if isinstance(r, GenerationError):
            if r.code == "prompt_too_long" and self.k > 0:
                self.truncated = len(self.steps) - self.k   # keep the turns that fit
                self.k = len(self.steps)
            else:
                self.error = r
            return
        self.history = self.history + self.steps[self.k] + [{"role": "assistant", "content": str.__str__(r)}]
        self.turn_tokens.append(int(getattr(r, "num_tokens", 0)))
        self.finish.append(getattr(r, "finish_reason", "stop"))
        self.prompt_tokens += int(getattr(r, "prompt_tokens", 0))
        self.k += 1

    def entry(self, meta_base: Dict[str, Any]) -> Dict[str, Any]:
        if self.error is not None:
            return {"i": self.index, "id": self.conv.id, "ok": False, **self.error.to_dict(),
                    "turn": self.k, "origin": self.conv.origin}
        meta = dict(meta_base)
        meta.update(num_tokens=sum(self.turn_tokens), turn_tokens=self.turn_tokens,
                    finish_reason=self.finish[-1] if self.finish else None, finish_reasons=self.finish,
                    prompt_tokens=self.prompt_tokens, turns=len(self.turn_tokens),
                    truncated_turns=self.truncated, origin=self.conv.origin)
        return {"i": self.index, "id": self.conv.id, "ok": True,
                "sample": {"id": self.conv.id, "conversations": self.history, "meta": meta}}


def run_samples(engine: Engine, samples: Sequence[Tuple[int, Conversation]], params: SamplingParams,
                max_turns: Optional[int] = None, meta: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    """Regenerate a group of samples turn by turn; one part entry per sample (input order)."""
    runs = [SampleRun(i, c, max_turns) for i, c in samples]
    for r in runs:
        if not r.steps:
            r.error = GenerationError("nothing to regenerate: no user turn", code="bad_request")
    while True:
        active = [r for r in runs if r.active]
        if not active:
            break
        results = engine.generate([r.prompt() for r in active], params, keys=[r.key() for r in active])
        for r, res in zip(active, results):
            r.accept(res)
    return [r.entry(meta or {}) for r in runs]
