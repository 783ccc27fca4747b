import pytest
import torch

from deepspec.targets import ChatTemplateError, default_layer_ids
from deepspec.targets.tiny import parse_tiny_spec

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 12 times 7?"},
    {"role": "assistant", "content": "It is 84."},
    {"role": "user", "content": "And 2x + 1 for x = 3?"},
    {"role": "assistant", "content": "Let x = 3, then 7."},
]


def test_default_layer_ids_match_paper():
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_layer_ids(4, 2) == [1, 3]
    assert default_layer_ids(3, 5) == [0, 1, 2]


def test_capture_shapes_and_index_convention(tiny_target):
    t = tiny_target
    ids = torch.tensor([t.encode_chat(CONV).input_ids])
    cap = t.capture(ids)
    T = ids.shape[1]
    assert cap.features.shape == (1, T, t.feature_dim)
    assert cap.last_hidden.shape == (1, T, t.hidden_size)
    out = t.model(ids, output_hidden_states=True)
    H = t.hidden_size
    for k, i in enumerate(t.layer_ids):
        got = cap.features[..., k * H:(k + 1) * H]
        if i < t.num_layers - 1:  # HF's last entry is post-norm; ours is the raw layer output
            torch.testing.assert_close(got, out.hidden_states[i + 1])
    torch.testing.assert_close(cap.last_hidden, out.hidden_states[-1])
    torch.testing.assert_close(t.logits_from_hidden(cap.last_hidden), out.logits.float())


def test_decode_with_cache_matches_full_forward(tiny_target):
    t = tiny_target
    ids = torch.tensor([t.encode_chat(CONV).input_ids])
    full = t.capture(ids)
    a = t.decode(ids[:, :10])
    b = t.decode(ids[:, 10:15], past_key_values=a.past_key_values)
    torch.testing.assert_close(b.features, full.features[:, 10:15], atol=1e-5, rtol=1e-4)
    # roll back and re-decode: same result
    t.rollback(b.past_key_values, 12)
    assert t.cache_length(b.past_key_values) == 12
    c = t.decode(ids[:, 12:15], past_key_values=b.past_key_values)
    torch.testing.assert_close(c.features, full.features[:, 12:15], atol=1e-5, rtol=1e-4)


def test_loss_mask_covers_assistant_turns_only(tiny_target):
    t = tiny_target
    enc = t.encode_chat(CONV)
    assert len(enc.input_ids) == len(enc.loss_mask)
    masked = t.tokenizer.decode([i for i, m in zip(enc.input_ids, enc.loss_mask) if m])
    assert "It is 84." in masked and "Let x = 3, then 7." in masked
    assert "12 times 7" not in masked and "Be brief" not in masked
    eot = t.tokenizer.eos_token
    assert masked.count(eot) == 2, masked  # end-of-turn of both assistant turns is trained
    # the mask is two contiguous runs, one per assistant turn
    runs = sum(1 for a, b in zip([0] + enc.loss_mask, enc.loss_mask) if b and not a)
    assert runs == 2


def test_qwen3_template_think_block_is_not_trained(tiny_qwen3):
    t = tiny_qwen3
    enc = t.encode_chat(CONV[:3], enable_thinking=False)
    assert "<think>" in enc.text
    masked = t.tokenizer.decode([i for i, m in zip(enc.input_ids, enc.loss_mask) if m])
    assert "<think>" not in masked and masked.startswith("It is 84.")


def test_chat_errors_are_clear(tiny_llama):
    with pytest.raises(ChatTemplateError, match="role"):
        tiny_llama.encode_chat([{"role": "robot", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="content"):
        tiny_llama.encode_chat([{"role": "user", "content": 3}])
    with pytest.raises(ChatTemplateError, match="empty"):
        tiny_llama.encode_chat([])


def test_frozen_and_shared_modules(tiny_target):
    t = tiny_target
    assert not any(p.requires_grad for p in t.model.parameters())
    assert t.embed_tokens.weight.shape[0] == t.vocab_size
    assert t.lm_head.weight.shape == (t.vocab_size, t.hidden_size)
    fp = t.fingerprint()
    assert set(fp) == {"weights_sha256", "tokenizer_sha256", "chat_template_sha256"}


def test_tiny_spec_parsing():
    assert parse_tiny_spec("tiny:qwen3:layers=6") == {"family": "qwen3", "num_layers": 6}
    assert parse_tiny_spec("Qwen/Qwen3-4B") is None
    with pytest.raises(ValueError):
        parse_tiny_spec("tiny:llama:depth=3")


def test_plain_chat_template_for_base_models(tmp_path):
    from deepspec.config import TargetConfig
    from deepspec.targets import encode_chat, load_target
    from deepspec.targets.chat import PLAIN_TEMPLATE, resolve_template
    from deepspec.targets.tiny import tiny_tokenizer
    tok = tiny_tokenizer("llama")
    tok.chat_template = None                     # a base model's tokenizer
    with pytest.raises(ChatTemplateError, match="no chat template .* set target.chat_template=plain"):
        encode_chat(tok, CONV)
    tok.chat_template = resolve_template("plain")
    enc = encode_chat(tok, CONV[1:3])
    assert enc.text == "### User:\nWhat is 12 times 7?\n\n### Assistant:\nIt is 84.\n\n"
    assert tok.decode([i for i, m in zip(enc.input_ids, enc.loss_mask) if m]) == "It is 84.\n\n"
    with pytest.raises(ChatTemplateError, match="target.chat_template='chatml': not a built-in template"):
        resolve_template("chatml")
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert resolve_template(str(jinja)) == jinja.read_text()
    plain = load_target(TargetConfig(path="tiny:llama", chat_template="plain", device="cpu"))
    own = load_target(TargetConfig(path="tiny:llama", device="cpu"))
    assert plain.tokenizer.chat_template == PLAIN_TEMPLATE
    assert plain.fingerprint()["chat_template_sha256"] != own.fingerprint()["chat_template_sha256"]
