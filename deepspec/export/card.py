"""Model cards (README.md): of exported drafts (`model_card`, `deepspec export`) and of the drafts shipped
in the package (`shipped_card`, `tools/ship_draft.py`, rendered from their ``provenance.json`` only)."""
from __future__ import annotations

import textwrap
from typing import Any, Dict, List, Mapping, Optional, Sequence

from .common import Checkpoint, training_data
from .registry import exporter_for

HF_TITLE = "deepspec checkpoint (from_pretrained)"
ALGO_NAMES = {"dspark": "DSpark", "dflash": "DFlash", "eagle3": "EAGLE-3"}


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
              f"A {describe_draft(draft)}. Format: **{title}**, exported by `deepspec export --to {fmt}` from "
              f"`{ckpt.path}`.", ""]
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
                     "frequent answer tokens; `draft_vocab.json`" + ("" if fmt == "hf" else f", {exporter.vocab_layout(fmt)}")
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


# -- the card of a draft shipped in the package (tools/ship_draft.py) -------------------------------------
def describe_draft(c: Mapping[str, Any]) -> str:
    """"DSpark draft (parallel drafter + Markov head rank 64 + confidence head, 1 layer, γ 7, …)"."""
    algo = c.get("algorithm")
    if algo == "eagle3":
        parts = [f"autoregressive drafter, {c.get('eagle3_layout')} layout"]
    else:
        arch = "parallel drafter"
        if c.get("sequential_head") not in (None, "none"):
            head = {"rnn": "RNN"}.get(str(c["sequential_head"]), str(c["sequential_head"]).capitalize())
            arch += f" + {head} head rank {c.get('head_rank')}"
            if c.get("head_embedding") == "target":
                arch += " (W1 over the target's embedding)"
        parts = [arch + (" + confidence head" if c.get("confidence_head") else "")]
    n = int(c.get("num_layers") or 0)
    parts += [f"{n} layer{'s' if n != 1 else ''}", f"γ {c.get('gamma')}"]
    parts.append(f"draft vocabulary of {int(c['vocab_size']):,} tokens" if c.get("vocab_size")
                 else "full target vocabulary")
    return f"{ALGO_NAMES.get(algo, algo)} draft ({', '.join(parts)})"


def _mb(n: int) -> str:
    mb = n / 2 ** 20
    return f"{mb:.0f} MB" if mb >= 10 else f"{mb:.1f} MB" if mb >= 0.1 else f"{n / 1024:.0f} KB"


def _wrap(text: str, bullet: bool = False) -> str:
    return textwrap.fill(text, width=100, initial_indent="- " if bullet else "",
                         subsequent_indent="  " if bullet else "", break_long_words=False, break_on_hyphens=False)


def shipped_card(prov: Mapping[str, Any], *, train_cfg, weights_bytes: int, heldout_sequences: int, load_hint: str,
                 notes: Sequence[str] = ()) -> str:
    """The README.md of a shipped draft, from its provenance record (and the run's batch shape)."""
    d, cfg = prov["data"], prov["config"]
    intro = (f"A {describe_draft(cfg)} for {prov['target']}, trained by deepspec on {prov['machine']['trained_on']}: "
             f"{prov['steps']} steps × {train_cfg.global_batch_sequences} sequences × "
             f"{train_cfg.anchors_per_sequence} anchors on {d['conversations']:,} conversations ({d['tokens']:,} "
             f"tokens, {d['answer_tokens']:,} answer tokens; {d['source']}). See `provenance.json` for the commands, "
             f"commit, data and held-out curve. Weights are bfloat16, {_mb(weights_bytes)}.")
    bullets = []
    h = prov.get("heldout")
    if h and h.get("eval/expected_tau") is not None:
        a1 = h.get("eval/accept_rate/1")
        bullets.append(f"held-out teacher-forced E[τ] {h['eval/expected_tau']:.3f}"
                       + (f" (position-1 acceptance {a1:.2f})" if a1 is not None else "")
                       + (f" at step {h['step']}" if h["step"] != prov["steps"] else "")
                       + f" on {heldout_sequences:,} held-out sequences;")
    else:
        bullets.append("no held-out evaluation was logged by the run;")
    e = prov.get("eval_check")
    if e:
        tau = f"greedy τ {e['tau_greedy']:.2f}" if e.get("tau_greedy") is not None else "greedy decoding"
        n = e["prompts"]
        speed = f"; speed-up over plain decoding there {e['speedup']:.2f}×" if e.get("speedup") else ""
        bullets.append(f"{tau} on {n} prompt{'s' if n != 1 else ''} ({', '.join(e['benchmarks'])}; at most "
                       f"{e['max_new_tokens']} new tokens), output identical to the target's on "
                       f"{e['greedy_identical_to_target']}: `deepspec eval` on {e['device']}"
                       + (f" (target {str(e['dtype']).replace('torch.', '')}, {e.get('policy') or 'fixed'} verification)"
                          if e.get("dtype") else "")
                       + f" with {e['evaluated']}{speed};")
    else:
        bullets.append("no decoding check recorded (`tools/ship_draft.py --eval-check` records one);")
    c = prov.get("calibration")
    if c:
        ece = (f"; position-1 ECE {c['ece_before']:.3f} → {c['ece_after']:.3f}"
               if c.get("ece_before") is not None and c.get("ece_after") is not None else "")
        bullets.append(f"`calibration.json`: Sequential Temperature Scaling fitted by `deepspec calibrate` on "
                       f"{c['rounds']:,} verification rounds of {c.get('requests') or '?'} requests "
                       f"(`{c.get('rollouts')}`){ece}; `schedule.policy=threshold|scheduler` apply it;")
    bullets += list(notes)
    outro = (f"Load it with {load_hint}. Shipped with `tools/ship_draft.py` (the exact command is `ship_command` "
             "in `provenance.json`); run it again on a newer run to replace this draft.")
    return "\n".join([f"# {prov['name']}", "", _wrap(intro), "", *(_wrap(b, True) for b in bullets), "",
                      _wrap(outro), ""])
