"""Model cards (README.md) for exported drafts."""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

from .common import Checkpoint

FORMAT_TITLES = {"hf": "deepspec checkpoint (from_pretrained)", "vllm": "vLLM — speculators DSpark format",
                 "sglang": "SGLang — DSpark draft (Qwen3DSparkModel)"}
EAGLE3_TITLES = {"vllm": "vLLM — speculators EAGLE-3 format",
                 "sglang": "SGLang — EAGLE-3 draft (LlamaForCausalLMEagle3)"}


def _fmt(v, nd=3) -> str:
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return "—" if v is None else str(v)


def serve_command(fmt: str, out: str, verifier: str, gamma: int, algorithm: str = "dspark") -> Optional[str]:
    eagle3 = algorithm == "eagle3"
    if fmt == "vllm":
        spec = json.dumps({"model": out, "method": "eagle3" if eagle3 else "dspark", "num_speculative_tokens": gamma})
        return f"vllm serve {verifier} --speculative-config '{spec}'"
    if fmt == "sglang" and eagle3:
        return (f"python -m sglang.launch_server --model-path {verifier} --speculative-algorithm EAGLE3 "
                f"--speculative-draft-model-path {out} --speculative-num-steps {gamma} --speculative-eagle-topk 1 "
                f"--speculative-num-draft-tokens {gamma + 1}")
    if fmt == "sglang":
        return (f"python -m sglang.launch_server --model-path {verifier} --speculative-algorithm DSPARK "
                f"--speculative-draft-model-path {out} --speculative-num-draft-tokens {gamma + 1}")
    return None


def model_card(ckpt: Checkpoint, fmt: str, *, out: str, results: Optional[Dict[str, Any]] = None,
               dropped: List[str] = (), warnings: List[str] = (), target_path: Optional[str] = None,
               verifier: Optional[str] = None, engine_config: Optional[Dict[str, Any]] = None,
               verified: Optional[Dict[str, float]] = None) -> str:
    from .common import training_data
    meta, draft, tgt = ckpt.meta, ckpt.draft, ckpt.target
    fp = tgt.get("fingerprint") or {}
    gamma = int(draft.get("gamma") or 0)
    run_target = (ckpt.run or {}).get("target") or {}
    tpath = target_path or run_target.get("path") or tgt.get("name")
    title = (EAGLE3_TITLES.get(fmt) if ckpt.algorithm == "eagle3" else None) or FORMAT_TITLES[fmt]
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
    if ckpt.algorithm == "dspark":
        head_row = f"| sequential head | {draft.get('sequential_head', 'none')} (rank {draft.get('head_rank')}) |"
    elif ckpt.algorithm == "eagle3":
        head_row = (f"| training-time-test steps | {draft.get('ttt_steps')} (layout "
                    f"{draft.get('eagle3_layout') or 'native'}) |")
    else:
        head_row = "| heads | none |"
    lines += ["## Draft", "", "| field | value |", "|---|---|",
              f"| algorithm | `{ckpt.algorithm}` |",
              f"| γ (block size / draft tokens per round) | {gamma} |",
              f"| draft layers | {draft.get('num_layers')} |",
              head_row,
              f"| confidence head | {bool(draft.get('confidence_head')) and ckpt.algorithm == 'dspark'} |",
              f"| mask token id | {meta.get('mask_token_id')} |", ""]
    lines += ["## Target", "", "| field | value |", "|---|---|",
              f"| path | `{tpath}` |", f"| model type | {tgt.get('model_type')} |",
              f"| hidden size | {tgt.get('hidden_size')} |", f"| vocab size | {tgt.get('vocab_size')} |",
              f"| layer ids (deepspec: decoder-layer outputs, `hidden_states[i+1]`) | {tgt.get('layer_ids')} |",
              f"| weights sha256 | `{fp.get('weights_sha256')}` |",
              f"| tokenizer sha256 | `{fp.get('tokenizer_sha256')}` |",
              f"| chat template sha256 | `{fp.get('chat_template_sha256')}` |", ""]
    if engine_config is not None:
        if "eagle_aux_hidden_state_layer_ids" in engine_config:
            lines += [f"Engine layer ids: `eagle_aux_hidden_state_layer_ids = "
                      f"{engine_config['eagle_aux_hidden_state_layer_ids']}` (vLLM captures the input of decoder "
                      "layer k = deepspec id + 1).", ""]
        elif "eagle_config" in engine_config:
            lines += [f"Engine layer ids: `eagle_config.eagle_aux_hidden_state_layer_ids = "
                      f"{engine_config['eagle_config'].get('eagle_aux_hidden_state_layer_ids')}` (layer outputs, as "
                      "in deepspec; SGLang adds 1 itself).", ""]
        elif fmt == "vllm":
            aux = engine_config.get("aux_hidden_state_layer_ids")
            lines += [f"Engine layer ids: `aux_hidden_state_layer_ids = {aux}` (vLLM captures the input of decoder "
                      "layer k = deepspec id + 1).", ""]
        elif fmt == "sglang":
            lines += [f"Engine layer ids: `dflash_config.target_layer_ids = "
                      f"{(engine_config.get('dflash_config') or {}).get('target_layer_ids')}` (layer outputs, as in "
                      "deepspec).", ""]
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
    cmd = serve_command(fmt, out, verifier or str(tpath), gamma, ckpt.algorithm)
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
