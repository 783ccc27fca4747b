"""The mask token of parallel drafts (`deepspec.targets.mask_token`) on real tokenizers and the tiny targets.

The real tokenizers are described by small fixtures derived from their files
(tests/fixtures/tokenizers/*.json: size, special ids, added tokens, chat template, plus the
model's embedding rows and generation stop ids); the SmolLM2 reference tokenizer is also read
directly when it has been converted.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from deepspec.config import ConfigError
from deepspec.config.draft import DraftConfig
from deepspec.drafts import build_drafter
from deepspec.targets.mask_token import (AddedToken, TokenInventory, choose_mask_token, mask_token_problem,
                                         target_tokens)
from deepspec.targets.reference import reference_dir
from conftest import make_tiny_target

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "tokenizers"


def _fixture(name: str):
    doc = json.loads((FIXTURES / f"{name}.json").read_text())
    inv = TokenInventory(size=doc["size"], special_ids=doc["special_ids"], chat_template=doc["chat_template"],
                         added={int(i): AddedToken(c, s) for i, c, s in doc["added"]})
    return inv, doc["embedding_rows"], set(doc["stop_ids"])


@pytest.mark.parametrize("name, want, why", [
    ("llama3_1", 128002, "reserved token '<|reserved_special_token_0|>'"),
    ("gemma3", 6, "reserved token '<unused0>'"),
    ("qwen3", 151669, "spare embedding row"),                       # DeepSpec's Qwen3 mask id
    ("smollm2", 16, "'<empty_output>'"),
])
def test_real_tokenizers(name, want, why):
    inv, rows, stops = _fixture(name)
    got, reason = choose_mask_token(inv, rows, stops)
    assert got == want and why in reason
    assert mask_token_problem(inv, got, rows, stops) is None
    for stop in stops:                                               # every stop token is refused, naming the fix
        problem = mask_token_problem(inv, stop, rows, stops)
        assert "stop token" in problem and f"draft.mask_token_id={want}" in problem


def test_order_falls_through_to_unused_special_then_error():
    inv, rows, stops = _fixture("qwen3")
    # no spare row: the highest added special token that the template does not write and that stops nothing
    got, _ = choose_mask_token(inv, inv.size, stops)
    assert got == 151656 and inv.added[got].content == "<|video_pad|>"
    inv, rows, stops = _fixture("llama3_1")
    no_reserved = dataclasses.replace(inv, added={i: t for i, t in inv.added.items() if "reserved" not in t.content})
    with pytest.raises(ConfigError, match="draft.mask_token_id"):
        choose_mask_token(no_reserved, inv.size, stops)
    # a spare row comes after the reserved tokens, before the unused special ones
    assert choose_mask_token(no_reserved, inv.size + 8, stops)[0] == inv.size


def test_ordinary_and_template_tokens_are_refused():
    inv, rows, stops = _fixture("smollm2")
    assert "ordinary vocabulary token" in mask_token_problem(inv, 1000, rows, stops)
    assert "chat template" in mask_token_problem(inv, 1, rows, stops)           # <|im_start|>
    assert "outside" in mask_token_problem(inv, rows, rows, stops)


def test_smollm2_tokenizer_files():
    path = reference_dir("smollm2-135m")
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"the SmolLM2 reference target is not converted at {path} (deepspec targets fetch)")
    from transformers import AutoTokenizer
    inv = TokenInventory.of(AutoTokenizer.from_pretrained(path))
    assert choose_mask_token(inv, 49152, {2})[0] == 16
    assert "stop token" in mask_token_problem(inv, 2, 49152, {2})


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_tiny_targets_and_the_drafter(family, one_thread):
    target = make_tiny_target(family)
    inv, rows, stops = target_tokens(target)
    want, _ = choose_mask_token(inv, rows, stops)
    assert want not in stops and want != inv.special_ids.get("pad")
    d = build_drafter(target, DraftConfig(algorithm="dspark", gamma=3, num_layers=1, head_rank=4))
    assert d.mask_token_id == want and d.cfg.mask_token_id == want           # saved with the checkpoint
    d = build_drafter(target, DraftConfig(algorithm="dspark", gamma=3, num_layers=1, head_rank=4, mask_token_id=7))
    assert d.mask_token_id == 7
