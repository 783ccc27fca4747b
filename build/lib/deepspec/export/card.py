"""Model cards (README.md) for exported drafts."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from .common import Checkpoint, training_data
from .registry import exporter_for

HF_TITLE = "deepspec checkpoint (from_pretrained)"


def _fmt(v, nd=3) -> str:
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return "—" if v is None else str(v)


def model_card(ckpt: Checkpoint, fmt: str, *, out: str, results: Optional[Dict[str, Any]] = None,
               dropped: List[str] = (), warnings: List[str] = (), target_path: Optional[str] = None,
               verifier: Optional[str] = None, engine_config: Optional[Dict[str, Any]] = None,
               verified: Optional[Dict[str, float]] = None) -> str:
    exporter = exporter_for(ckpt.algorithm)
    meta, draft, tgt = ckpt.meta, ckpt.draft, ckpt.target
    fp = tgt.get("fingerprint") or {}
    gamma = int(draft.get("gamma") or 0)
    run_target = (ckpt.run or {}).get("target") or {}
    tpath = target_path or run_target.get("path") or tgt.get("name")
    title = HF_TITLE if fmt == "hf" else exporter.title(fmt)
    lines: List[str] = ["---", "library_name: deepspec", "tags:", "  - speculative-decoding",
                        f"  - {ckpt.algorithm}"]
    if tpath and "/" in str(tpath) and not str(tpath).startswith(("/", ".", "tiny:", "reference:")):
        lines.append(f"base_model: {tpath}")
    lines += ["---", "", f"# {ckpt.algorithm} draft for {tpath or 'an unknown target'}", "",
              f"Format: **{title}**, exported by `deepspec export --to {fmt}` from `{ckpt.path}`.", ""]
    if dropped:
        lines += ["> [!WARNING]", "> **Parts of the trained draft were left out of this export** "
                  "(`--allow-drop-heads`):", ">"]
        lines += [f"> - {d}" for d in dropped]
        lines += [">", "> Decoding stays lossless (the target verifies every token), but acceptance — and τ — "
                  "will be lower than the numbers below, which were measured with the full draft.", ""]
    if warnings:
        lines += ["**Notes:**", ""] + [f"- {w}" for w in warnings] + [""]
    lines += ["## Draft", "", "| field | value |", "|---|---|",
              f"| algorithm | `{ckpt.algorithm}` |",
              f"| γ (block size / draft tokens per round) | {gamma} |",
              f"| draft layers | {draft.get('num_layers')} |"]
    lines += [f"| {k} | {v} |" for k, v in exporter.draft_rows(ckpt.algorithm, draft)]
    lines += [f"| mask token id | {meta.get('mask_token_id')} |"]
    if draft.get("vocab_size") is not None:
        lines.append(f"| draft vocabulary | {draft['vocab_size']} of {tgt.get('vocab_size')} target tokens (the most "
                     "frequent answer tokens; `draft_vocab.json`" + ("" if fmt == "hf" else ", `d2t` / `t2d`")
                     + "); probability 0 elsewhere, verification stays exact |")
    lines.append("")
    lines += ["## Target", "", "| field | value |", "|---|---|",
              f"| path | `{tpath}` |", f"| model type | {tgt.get('model_type')} |",
              f"| hidden size | {tgt.get('hidden_size')} |", f"| vocab size | {tgt.get('vocab_size')} |",
              f"| layer ids (deepspec: decoder-layer outputs, `hidden_states[i+1]`) | {tgt.get('layer_ids')} |",
              f"| weights sha256 | `{fp.get('weights_sha256')}` |",
              f"| tokenizer sha256 | `{fp.get('tokenizer_sha256')}` |",
              f"| chat template sha256 | `{fp.get('chat_template_sha256')}` |", ""]
    note = exporter.layer_ids_note(fmt, engine_config) if engine_config is not None else None
    if note:
        lines += [note, ""]
    data = training_data(ckpt.run)
    lines += ["## Training data", ""]
    if data:
        lines += ["| field | value |", "|---|---|"] + [f"| {k} | `{v}` |" for k, v in data.items()] + [""]
    else:
        lines += ["Not recorded (no run.yaml next to the checkpoint).", ""]
    lines += ["## Evaluation", ""]
    if results:
        setup = results.get("setup") or {}
        lines += [f"Macro **τ = {_fmt(results.get('tau'))}** (accepted tokens + 1 per verification round), "
                  f"acceptance rate {_fmt(results.get('acceptance_rate'))}, "
                  f"speedup {_fmt(results.get('speedup'), 2)}× "
                  f"at γ = {results.get('gamma')}, {setup.get('warp', '')} — from `{results.get('path')}`.", ""]
        if results.get("benchmarks"):
            lines += ["| benchmark | τ |", "|---|---|"] + [f"| {n} | {_fmt(t)} |"
                                                         for n, t in results["benchmarks"].items()] + [""]
    else:
        lines += ["No eval results.json found next to the checkpoint (pass `--results` to include τ).", ""]
    lines += ["## Use", ""]
    cmd = None if fmt == "hf" else exporter.serve_command(fmt, out, verifier or str(tpath), gamma)
    if cmd:
        lines += ["```bash", cmd, "```", ""]
    else:
        lines += ["```python", "from deepspec.drafts import load_drafter",
                  "from deepspec.targets import load_target", "from deepspec.config import TargetConfig",
                  f"target = load_target(TargetConfig(path={str(tpath)!r}, layer_ids={tgt.get('layer_ids')}))",
                  f"drafter = load_drafter({out!r}, target)", "```", ""]
    if verified:
        lines += ["## Export check", "", "Logits of this export, re-read and run by an independent implementation "
                  "of the engine's forward, matched the trained draft on a random probe: "
                  + ", ".join(f"{k} = {v:.2e}" for k, v in verified.items()) + ".", ""]
    return "\n".join(lines)
