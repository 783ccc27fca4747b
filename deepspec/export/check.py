"""`deepspec check CKPT [--target-path P | target.key=value ...]`: is this draft right for this target?

Checks, each reported with what it means for serving:

* the target's weights / tokenizer / chat-template hashes (`TargetAdapter.fingerprint`)
  against the ones the draft checkpoint recorded at training time;
* layer ids, hidden size, vocabulary size and feature width;
* the mask token is inside the vocabulary;
* a reduced draft vocabulary (``draft.vocab_size = N``): the checkpoint's ``draft_vocab`` or the
  export's ``draft_vocab_size`` / ``d2t`` / ``t2d`` are consistent (ids in range, strictly
  increasing, d2t and t2d agree, ``draft_vocab_size`` = len(d2t)) or, in SGLang's DSpark, the
  Markov rank dimension that holds it (`deepspec.export.vocab_rank`), the exported ``lm_head`` rows
  are the target's on those tokens, and the vocabulary was selected with this tokenizer (its
  ``draft_vocab.json`` — next to the draft or in the run directory — else the recorded hash); a
  ``draft_vocab.json`` next to a draft that scores the full vocabulary is a mismatch;
* the chat template rendered the way training did (``target.encode_chat`` of the whole
  conversation, with the training run's template switches) against the way an
  OpenAI-compatible server does (``tokenizer.apply_chat_template(messages before the
  assistant turn, add_generation_prompt=True)`` = `deepspec.targets.chat.encode_prompt`,
  with the server's switches): the server's prompt ids must be a prefix of the training
  ids, otherwise the draft sees, at serving, contexts it never saw in training.  The first
  differing position is reported with decoded context on both sides.

Exit status: 0 when everything matches, 1 when anything does not, 2 on usage errors.
Works on deepspec checkpoints and on `deepspec export` outputs (which carry a
``deepspec_export.json`` provenance file).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
import yaml

from ..config import ConfigError
from ..data.vocab import VocabError, load_vocab
from ..targets import load_target
from ..targets.chat import encode_chat, encode_prompt
from ..targets.mask_token import mask_token_problem, target_tokens
from .common import (CONFIG_NAME, PROVENANCE_NAME, RUN_YAML, WEIGHTS_NAME, Checkpoint, resolve_target_config,
                     target_overrides)
from .vocab_map import VOCAB_FILE, find_vocab_file, lm_head_rows, read_mapping, read_tensors
from .errors import ExportError
from .registry import exporter_for

log = logging.getLogger(__name__)

DEFAULT_CONVERSATIONS: List[List[Dict[str, str]]] = [
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "What is 12 times 7?"},
     {"role": "assistant", "content": "12 times 7 is 84."}],
    [{"role": "user", "content": "Write a short poem about the sea."},
     {"role": "assistant", "content": "The waves roll in, the gulls cry out."},
     {"role": "user", "content": "Now explain speculative decoding in one sentence."},
     {"role": "assistant", "content": "A draft proposes tokens and the target verifies them in one pass."}],
]


@dataclass
class Finding:
    name: str
    ok: bool
    detail: str
    data: Dict[str, Any] = field(default_factory=dict)


@dataclass
class CheckReport:
    checkpoint: str
    target: str
    findings: List[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(f.ok for f in self.findings)

    @property
    def mismatches(self) -> List[Finding]:
        return [f for f in self.findings if not f.ok]

    def add(self, name: str, ok: bool, detail: str, **data) -> Finding:
        f = Finding(name, bool(ok), detail, data)
        self.findings.append(f)
        return f

    def to_json(self) -> Dict[str, Any]:
        return {"checkpoint": self.checkpoint, "target": self.target, "ok": self.ok,
                "findings": [asdict(f) for f in self.findings]}

    def render(self) -> str:
        lines = [f"deepspec check: draft {self.checkpoint}  vs  target {self.target}"]
        for f in self.findings:
            lines.append(f"  [{'ok' if f.ok else 'MISMATCH'}] {f.name}: {f.detail}")
        n = len(self.mismatches)
        lines.append("all checks passed" if not n else f"{n} mismatch(es): this draft should not be served with "
                                                         "this target as configured")
        return "\n".join(lines)


# -- what the draft recorded ---------------------------------------------------------------------------------
def _recorded(path: Path) -> Dict[str, Any]:
    """{"target": {...fingerprint, layer_ids...}, "mask_token_id", "algorithm", "run"} of a checkpoint or an export."""
    cfg_path = path / CONFIG_NAME
    if not cfg_path.is_file():
        raise ExportError(f"{path}: no {CONFIG_NAME}")
    cfg = json.loads(cfg_path.read_text())
    run = None
    if (path / RUN_YAML).is_file():
        run = yaml.safe_load((path / RUN_YAML).read_text())
    if "architecture" in cfg and "target" in cfg:
        return {"target": cfg["target"], "mask_token_id": cfg.get("mask_token_id"),
                "algorithm": cfg["architecture"], "run": run, "engine_layer_ids": None, "config": cfg,
                "source_checkpoint": None}
    prov_path = path / PROVENANCE_NAME
    if not prov_path.is_file():
        raise ExportError(f"{path}: neither a deepspec checkpoint nor a `deepspec export` output "
                          f"(no {PROVENANCE_NAME}); engine checkpoints trained elsewhere record no target hashes")
    prov = json.loads(prov_path.read_text())
    engine_ids, mask = exporter_for(str(prov.get("algorithm"))).recorded_layer_ids(str(prov.get("format")), cfg)
    return {"target": prov.get("target") or {}, "mask_token_id": mask, "format": prov.get("format"),
            "algorithm": prov.get("algorithm"), "run": run, "engine_layer_ids": engine_ids, "config": cfg,
            "source_checkpoint": prov.get("source_checkpoint")}


# -- chat rendering ------------------------------------------------------------------------------------------
def _decode_window(tok, ids: Sequence[int], pos: int, before: int = 6, after: int = 4) -> str:
    lo, hi = max(0, pos - before), min(len(ids), pos + after)
    head = tok.decode(list(ids[lo:pos]))
    tail = tok.decode(list(ids[pos:hi])) if pos < len(ids) else "<end>"
    return f"{head!r} ⟨here⟩ {tail!r}"


def diff_renderings(tokenizer, conversation: List[Dict[str, str]], train_kwargs: Dict[str, Any],
                    server_kwargs: Dict[str, Any]) -> List[Dict[str, Any]]:
    """For each assistant turn: where the server's prompt ids leave the training ids (empty list = consistent)."""
    train = encode_chat(tokenizer, conversation, **train_kwargs).input_ids
    out = []
    for i, m in enumerate(conversation):
        if m["role"] != "assistant" or i == 0:
            continue
        served = encode_prompt(tokenizer, conversation[:i], **server_kwargs)
        n = min(len(served), len(train))
        first = next((k for k in range(n) if served[k] != train[k]), None)
        if first is None and len(served) > len(train):
            first = len(train)
        if first is not None:
            out.append({"turn": i, "position": first, "server_len": len(served),
                        "training": _decode_window(tokenizer, train, first),
                        "server": _decode_window(tokenizer, served, first),
                        "training_id": train[first] if first < len(train) else None,
                        "server_id": served[first] if first < len(served) else None})
    return out


def _training_template_kwargs(run: Optional[Dict[str, Any]], target) -> Dict[str, Any]:
    tgt = (run or {}).get("target") if run else None
    if isinstance(tgt, dict):
        kw = dict(tgt.get("chat_template_kwargs") or {})
        if tgt.get("enable_thinking") is not None:
            kw["enable_thinking"] = tgt["enable_thinking"]
        return kw
    return dict(target.chat_template_kwargs)


def load_conversations(path: Optional[str]) -> List[List[Dict[str, str]]]:
    if not path:
        return DEFAULT_CONVERSATIONS
    text = Path(path).read_text()
    try:
        doc = json.loads(text)
        items = doc if isinstance(doc, list) else [doc]
    except json.JSONDecodeError:
        items = [json.loads(line) for line in text.splitlines() if line.strip()]
    convs = []
    for it in items:
        conv = (it.get("conversations") or it.get("messages")) if isinstance(it, dict) else it
        if not isinstance(conv, list):
            raise ValueError(f"{path}: expected conversations (lists of {{role, content}} messages)")
        convs.append([{"role": m["role"], "content": m["content"]} for m in conv])
    return convs


# -- the check ------------------------------------------------------------------------------------------------
_HASH_MEANING = {
    "weights_sha256": ("target weights", "the draft was trained on another model's hidden states and logits; its "
                       "proposals will mostly be rejected (the hash covers the weights in the loaded dtype, so "
                       "load the target in the training dtype)"),
    "tokenizer_sha256": ("tokenizer", "token ids mean different strings for the draft and the target"),
    "chat_template_sha256": ("chat template", "prompts are rendered differently from the training data, so the "
                             "draft sees contexts it was not trained on"),
}


def check_draft(path, target, conversations: Optional[List[List[Dict[str, str]]]] = None,
                server_template_kwargs: Optional[Dict[str, Any]] = None, target_label: str = "") -> CheckReport:
    """Compare a draft (checkpoint or export directory) with a loaded target."""
    path = Path(path)
    rec = _recorded(path)
    saved = rec["target"] or {}
    report = CheckReport(str(path), target_label or getattr(target, "name", "target"))
    have = target.fingerprint()
    want = saved.get("fingerprint") or {}
    for key, (what, meaning) in _HASH_MEANING.items():
        if key not in want:
            report.add(what, False, f"the draft recorded no {what} hash, so it cannot be checked")
            continue
        same = want[key] == have.get(key)
        report.add(what, same, f"same ({have[key][:12]}…)" if same else
                   f"differs: draft trained with {want[key][:12]}…, this target has {have[key][:12]}… — {meaning}",
                   saved=want[key], target=have.get(key))
    ids = list(target.layer_ids)
    want_ids = [int(i) for i in saved.get("layer_ids") or []]
    report.add("layer ids", want_ids == ids,
               f"{ids}" if want_ids == ids else
               f"draft reads target layers {want_ids}, the target is configured to capture {ids}: the draft would "
               f"get features of other layers (or of the wrong width); set target.layer_ids={want_ids}",
               saved=want_ids, target=ids)
    if rec["engine_layer_ids"] is not None and rec["engine_layer_ids"] != want_ids:
        report.add("engine layer ids", False, f"the export's engine config reads layers {rec['engine_layer_ids']} "
                   f"(deepspec convention) but the draft was trained on {want_ids}")
    for key, have_v, meaning in (("hidden_size", target.hidden_size, "features and embeddings have another width"),
                                 ("vocab_size", target.vocab_size, "the shared LM head has another vocabulary"),
                                 ("feature_dim", target.feature_dim, "the draft's fc input has another width")):
        want_v = saved.get(key)
        if want_v is None:
            continue
        report.add(key.replace("_", " "), int(want_v) == int(have_v),
                   f"{have_v}" if int(want_v) == int(have_v) else f"draft {want_v}, target {have_v}: {meaning}",
                   saved=want_v, target=have_v)
    mask = rec.get("mask_token_id")
    if mask is not None:
        inside = 0 <= int(mask) < int(target.vocab_size)
        problem = mask_token_problem(*_tokens(target, int(mask))) if inside else None
        engine = rec.get("format") not in (None, "hf")     # engines stop a block at a stop token; deepspec does not
        report.add("mask token", inside and not (engine and problem),
                   (f"id {mask} ({target.tokenizer.convert_ids_to_tokens(int(mask))!r})"
                    + (f"; {problem} before serving it with an engine" if problem else ""))
                   if inside else f"id {mask} is outside the target vocabulary ({target.vocab_size})")
    _check_vocabulary(report, path, rec, target)
    train_kw = _training_template_kwargs(rec["run"], target)
    server_kw = dict(target.chat_template_kwargs) if server_template_kwargs is None else dict(server_template_kwargs)
    for c, conv in enumerate(conversations or DEFAULT_CONVERSATIONS):
        try:
            diffs = diff_renderings(target.tokenizer, conv, train_kw, server_kw)
        except Exception as e:   # a template that cannot render the conversation is itself a finding
            report.add(f"chat render #{c}", False, f"cannot render the conversation: {e}")
            continue
        if not diffs:
            report.add(f"chat render #{c}", True, "server prompt ids are a prefix of the training ids for every "
                       f"assistant turn (template kwargs: training {train_kw}, server {server_kw})")
        for d in diffs:
            report.add(f"chat render #{c} turn {d['turn']}", False,
                       f"server prompt ({d['server_len']} tokens) leaves the training token ids at position "
                       f"{d['position']}: training {d['training']} (id {d['training_id']}) vs server {d['server']} "
                       f"(id {d['server_id']}); the draft will see a context at serving that it never saw in "
                       f"training (template kwargs: training {train_kw}, server {server_kw})", **d)
    return report


def _tokens(target, mask: int):
    inventory, rows, stops = target_tokens(target)
    return inventory, mask, rows, stops


def _check_vocabulary(report: CheckReport, path: Path, rec: Dict[str, Any], target) -> None:
    """The "draft vocabulary" finding of a draft with a reduced vocabulary (none for a full one)."""
    V = int(target.vocab_size)
    held = None
    if rec.get("format") not in (None, "hf"):    # an engine layout of the algorithm's own (SGLang DSpark: a rank)
        held = exporter_for(str(rec.get("algorithm"))).held_vocabulary(str(rec["format"]), path, rec["config"], V)
    ids, problems = held if held is not None else read_mapping(path, rec["config"], V)
    if ids is None and not problems:
        if (path / VOCAB_FILE).is_file():      # exports write one for a reduced vocabulary only
            report.add("draft vocabulary", False, f"{path / VOCAB_FILE} lists a draft vocabulary but "
                       f"{path / WEIGHTS_NAME} scores the full target vocabulary: the draft does not hold the "
                       "vocabulary it was trained on — re-export from the training checkpoint")
        return
    if ids is not None:
        try:     # an export's lm_head must be the target's rows of the draft vocabulary
            head = read_tensors(path / WEIGHTS_NAME, ("lm_head.weight",)).get("lm_head.weight")
        except Exception:
            head = None      # unreadable weights were reported by read_mapping
        want = lm_head_rows(target, ids)
        if head is not None and head.shape == want.shape and not torch.equal(head, want.to(head.dtype)):
            problems.append(f"{path / WEIGHTS_NAME} lm_head.weight is not this target's LM head on the "
                            "draft vocabulary (d2t): the draft would score other vectors than in training")
    have_tok = target.fingerprint().get("tokenizer_sha256")
    vocab_file = find_vocab_file(path, rec.get("source_checkpoint"))
    made_with = ""
    if vocab_file is not None:
        try:
            listed = load_vocab(vocab_file, vocab_size=V, tokenizer_fingerprint=have_tok)
            if ids is not None and not np.array_equal(listed, ids.numpy()):
                problems.append(f"{vocab_file} lists other tokens than the draft holds: the draft was not trained "
                                "on this vocabulary file's selection")
            made_with = f"; {vocab_file} was made with this tokenizer"
        except VocabError as e:
            problems.append(str(e))
    else:
        want_tok = ((rec["target"] or {}).get("fingerprint") or {}).get("tokenizer_sha256")
        if want_tok and have_tok and want_tok != have_tok:
            problems.append(f"the draft vocabulary was selected with another tokenizer ({want_tok[:12]}… vs "
                            f"{have_tok[:12]}…): its token ids mean other strings for this target")
        made_with = "; selected with this tokenizer (recorded hash; no draft_vocab.json found)" if want_tok else ""
    if problems:
        report.add("draft vocabulary", False, " | ".join(problems) + " — re-export from the training checkpoint, or "
                   "serve a draft trained with draft.vocab_size=null")
        return
    eos = sorted(int(t) for t in target.eos_token_ids if not bool((ids == int(t)).any()))
    note = (f"; lacks the end-of-turn/EOS id(s) {eos}: the draft never proposes the end of an answer" if eos else "")
    report.add("draft vocabulary", True, f"{ids.numel()} of {V} target tokens, mapping consistent{made_with}{note}",
               draft_vocab_size=int(ids.numel()), vocab_file=str(vocab_file) if vocab_file else None)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepspec check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="draft checkpoint or `deepspec export` output directory")
    p.add_argument("overrides", nargs="*", help="target overrides, e.g. target.path=Qwen/Qwen3-4B target.dtype=float32")
    p.add_argument("--target", action="append", default=[], metavar="KEY=VALUE",
                   help="target override (repeatable): dtype=float32, target.layer_ids=[1,9], or a conf/target "
                        "choice NAME")
    p.add_argument("--target-path", help="target model (HF id, directory, .gguf, reference:NAME, tiny:FAMILY)")
    p.add_argument("--conversations", help="JSON / JSONL file of conversations to render (default: built-in)")
    p.add_argument("--chat-template-kwargs", help="JSON dict the server passes to apply_chat_template "
                                                   "(default: the target config's)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
    path = Path(args.checkpoint)
    overrides = [*args.overrides, *target_overrides(args.target)]
    try:
        rec = _recorded(path)
        ck = Checkpoint(path, {"target": rec["target"]}, rec["run"] if isinstance(rec["run"], dict) else None)
        if not (args.target_path or overrides or (ck.run or {}).get("target")):
            raise ConfigError("no target: give --target-path or target.* overrides (the checkpoint has no run.yaml)")
        tcfg = resolve_target_config(ck, args.target_path, overrides, default_layer_ids=False)
        server_kw = json.loads(args.chat_template_kwargs) if args.chat_template_kwargs else None
        if server_kw is not None and not isinstance(server_kw, dict):
            raise ConfigError("--chat-template-kwargs must be a JSON object")
        convs = load_conversations(args.conversations)
        target = load_target(tcfg)
    except (ExportError, ConfigError, ValueError, OSError) as e:
        print(f"deepspec check: error: {e}", file=sys.stderr)
        return 2
    report = check_draft(path, target, convs, server_kw, target_label=f"{tcfg.path} ({tcfg.dtype})")
    print(json.dumps(report.to_json(), indent=2, ensure_ascii=False) if args.json else report.render())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
