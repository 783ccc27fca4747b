"""Servable by default: every draft group (conf/draft/*.yaml) and every recipe (recipes/*.yaml) trains a draft
that `deepspec export --to vllm` and `--to sglang` both take, unless the recipe names in one ``# Export:`` line
the engine that refuses it and why.

Each config is built at tiny scale on a tiny target of the recipe's target family (same model class, chat
template style and feature-layer count), and put through what the export checks before writing anything: the
exporter's `analyze`, the target checks and the mask token."""
from __future__ import annotations

import dataclasses
import re

import pytest

from conftest import make_tiny_target
from deepspec.config import load_config
from deepspec.config.loader import conf_dir, list_recipes, recipes_dir
from deepspec.drafts import build_drafter
from deepspec.export.api import refuse
from deepspec.export.engine_formats import ENGINE_NAMES, target_blockers
from deepspec.export.errors import ExportUnsupported
from deepspec.export.registry import exporter_for

pytestmark = pytest.mark.usefixtures("one_thread")
FAMILY = {"smollm2": "llama", "llama3": "llama", "qwen3": "qwen3", "gemma3": "gemma3"}


def refusing_engines(cfg) -> set:
    """The engines whose export checks refuse the draft ``cfg`` trains, at tiny scale."""
    family = next(f for k, f in FAMILY.items() if k in cfg.target.name)
    n = len(cfg.target.layer_ids) if cfg.target.layer_ids else cfg.target.num_feature_layers
    target = make_tiny_target(family, num_feature_layers=n)
    d = cfg.draft
    small = dataclasses.replace(d, num_layers=1, head_rank=8, intermediate_size=None,
                                vocab_size=None if d.vocab_size is None else 100)
    drafter = build_drafter(target, small)
    meta = {**dataclasses.asdict(small), "_n_feature_layers": len(target.layer_ids)}
    exporter = exporter_for(small.algorithm)
    refused = set()
    for fmt in ("vllm", "sglang"):
        try:
            exporter.analyze(fmt, small.algorithm, meta, drafter.state_dict().keys())
            if target_blockers(target):
                raise ExportUnsupported("; ".join(target_blockers(target)))
            refuse(fmt, exporter, drafter.mask_token_id, target)
        except ExportUnsupported:
            refused.add(ENGINE_NAMES[fmt])
    return refused


def named_refusals(text: str) -> set:
    line = next((ln for ln in text.splitlines() if ln.startswith("# Export:")), "")
    return {e for e in ("vLLM", "SGLang") if re.search(rf"\b{e}\b[^;(]*\brefuse", line)}


@pytest.mark.parametrize("group", sorted(p.stem for p in (conf_dir() / "draft").glob("*.yaml")))
def test_every_draft_group_exports_to_both_engines(group):
    assert refusing_engines(load_config([f"draft={group}"])) == set()


@pytest.mark.parametrize("recipe", list_recipes())
def test_every_recipe_exports_or_says_which_engine_refuses(recipe):
    text = (recipes_dir() / f"{recipe}.yaml").read_text()
    assert refusing_engines(load_config([f"recipe={recipe}"])) == named_refusals(text), \
        f"recipes/{recipe}.yaml: the engines refusing its draft differ from its '# Export:' line"


def test_the_checks_see_a_refusal():
    """The helper is not vacuous: deepspec's native Eagle3 layout and an anchor-feature DSpark are refused."""
    assert refusing_engines(load_config(["draft=eagle3", "draft.eagle3_layout=native"])) == {"vLLM", "SGLang"}
    assert refusing_engines(load_config(["draft=dspark", "draft.anchor_feature=true"])) == {"vLLM", "SGLang"}
    assert named_refusals("# Export: vLLM and SGLang refuse drafts for Gemma 3 (...)") == {"vLLM", "SGLang"}
    assert named_refusals("# Export: vLLM refuses it (draft.x); SGLang takes it") == {"vLLM"}
    assert named_refusals("# Export: vLLM and SGLang both take it; vLLM 0.34 runs vanilla heads only") == set()
