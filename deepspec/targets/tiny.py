"""Tiny randomly initialised targets for tests and smoke runs (no downloads).

Each family gets its real model class from transformers with a tiny config and a
small byte-level BPE tokenizer trained in code on a fixed corpus, carrying a chat
template in the family's own style (Llama 3 headers, Qwen3 ChatML with thinking
switch, Gemma 3 turns, Mistral [INST], gpt-oss harmony channels).

Dense: llama, qwen2, qwen3, mistral, gemma3 (every layer a 16-token sliding window).
Mixtures of experts: qwen3_moe; mixtral (every layer a 24-token sliding window); gpt_oss (attention
sinks, sliding-window layers of 16 alternating with full ones, YaRN RoPE).  Linear-attention hybrid:
qwen3_next (Gated DeltaNet layers alternating with full attention, MoE).  Multimodal: gemma3_mm, a
Gemma 3 image-text checkpoint (a one-layer SigLIP tower) whose text model alternates sliding and full
layers — the adapter drives its language model only.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch
import transformers as tf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

FAMILIES = ("llama", "qwen3", "gemma3", "qwen2", "mistral", "qwen3_moe", "mixtral", "gpt_oss", "qwen3_next",
            "gemma3_mm")

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "Speculative decoding drafts several tokens and verifies them with the target in one pass.",
    "What is 12 times 7? It is 84. Let x = 3, then 2x + 1 = 7.",
    "Write a poem about the sea. The waves roll in, the gulls cry out.",
    "import math\nprint(math.sqrt(16))\nfor i in range(10):\n    print(i)\n",
    "Hello! How can I help you today? Sure, here is an answer with some detail.",
] * 4

_TEMPLATES = {
    "llama": (
        "{{ '<|begin_of_text|>' }}{% for m in messages %}"
        "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] + '<|eot_id|>' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    "qwen3": (
        "{% set ns = namespace(last_user=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
        "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
        "{% for m in messages %}{% if m['role'] == 'assistant' %}"
        "{{ '<|im_start|>assistant\n' }}{% if loop.index0 > ns.last_user %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
        "{{ m['content'] + '<|im_end|>\n' }}"
        "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
        "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
        "{% endif %}"
    ),
    "gemma3": (
        "{{ '<bos>' }}{% set sys = '' %}{% for m in messages %}"
        "{% if m['role'] == 'system' %}{% set sys = m['content'] + '\n\n' %}{% else %}"
        "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\n' }}"
        "{% if loop.index0 == 1 and messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
        "{{ m['content'] + '<end_of_turn>\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
    ),
}
_TEMPLATES["mixtral"] = (
    "{{ '<s>' }}{% set sys = namespace(text='') %}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set sys.text = m['content'] + '\n\n' %}"
    "{% elif m['role'] == 'user' %}{{ '[INST] ' + sys.text + m['content'] + ' [/INST]' }}{% set sys.text = '' %}"
    "{% else %}{{ m['content'] + '</s>' }}{% endif %}{% endfor %}"
)
_TEMPLATES["gpt_oss"] = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{{ '<|start|>assistant<|channel|>final<|message|>' + m['content'] + '<|return|>' }}"
    "{% else %}{{ '<|start|>' + m['role'] + '<|message|>' + m['content'] + '<|end|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start|>assistant<|channel|>final<|message|>' }}{% endif %}"
)
# the families that share another's chat style
_STYLE = {"qwen2": "qwen3", "mistral": "llama", "qwen3_moe": "qwen3", "qwen3_next": "qwen3", "gemma3_mm": "gemma3"}
for _f, _s in _STYLE.items():
    _TEMPLATES[_f] = _TEMPLATES[_s]

_SPECIAL = {
    "llama": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<pad>"],
    "qwen3": ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|endoftext|>"],
    "gemma3": ["<bos>", "<start_of_turn>", "<end_of_turn>", "<eos>", "<pad>"],
    "mixtral": ["<s>", "</s>", "[INST]", "[/INST]", "<pad>"],
    "gpt_oss": ["<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>", "<|endoftext|>"],
}
_EOS = {"llama": "<|eot_id|>", "qwen3": "<|im_end|>", "gemma3": "<end_of_turn>", "mixtral": "</s>",
        "gpt_oss": "<|return|>"}
_PAD = {"llama": "<pad>", "qwen3": "<|endoftext|>", "gemma3": "<pad>", "mixtral": "<pad>",
        "gpt_oss": "<|endoftext|>"}
# One token that never occurs in text, in the family's style, appended after training (the mask token
# of parallel drafts, deepspec/targets/mask_token.py): Llama 3 reserved tokens, Gemma unused tokens,
# an added Qwen special token the chat template does not write.
_UNUSED = {"llama": "<|reserved_special_token_0|>", "gemma3": "<unused0>", "qwen3": "<|box_start|>",
           "mixtral": "<unused0>", "gpt_oss": "<|reserved_200017|>"}
for _f, _s in _STYLE.items():
    _SPECIAL[_f], _EOS[_f], _PAD[_f], _UNUSED[_f] = _SPECIAL[_s], _EOS[_s], _PAD[_s], _UNUSED[_s]
# the image tokens a multimodal config names (trained as specials, so they get ids right after the rest)
_SPECIAL["gemma3_mm"] = _SPECIAL["gemma3"] + ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]


@lru_cache(maxsize=None)
def _tokenizer_json(family: str, vocab_size: int) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=_SPECIAL[family],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return tok.to_str()


def tiny_tokenizer(family: str, vocab_size: int = 512):
    if family not in FAMILIES:
        raise ValueError(f"unknown tiny family {family!r}; choose from {FAMILIES}")
    tk = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json(family, vocab_size)),
                                 eos_token=_EOS[family], pad_token=_PAD[family])
    tk.add_special_tokens({"additional_special_tokens": [_UNUSED[family]]})
    tk.chat_template = _TEMPLATES[family]
    return tk


def _alternating(first: str, second: str, n: int):
    return [first if i % 2 == 0 else second for i in range(n)]


def _moe_config(family: str, common: dict, hd: int):
    experts = dict(num_experts_per_tok=2)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, **experts, head_dim=hd, num_experts=4, moe_intermediate_size=hd * 2)
    if family == "mixtral":
        return tf.MixtralConfig(**common, **experts, num_local_experts=4, sliding_window=24)
    if family == "gpt_oss":
        n = common["num_hidden_layers"]
        rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 150000.0,
                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
        return tf.GptOssConfig(**{**common, "intermediate_size": hd * 4}, **experts, head_dim=hd, num_local_experts=4,
                               sliding_window=16, layer_types=_alternating("sliding_attention", "full_attention", n),
                               rope_parameters=rope)
    n = common["num_hidden_layers"]     # qwen3_next: Gated DeltaNet + full attention, MoE
    return tf.Qwen3NextConfig(**common, **experts, head_dim=hd, num_experts=4, moe_intermediate_size=hd * 2,
                              shared_expert_intermediate_size=hd * 2, linear_num_key_heads=2,
                              linear_num_value_heads=4, linear_key_head_dim=hd, linear_value_head_dim=hd,
                              linear_conv_kernel_dim=4,
                              layer_types=_alternating("linear_attention", "full_attention", n))


def _gemma3_mm_config(common: dict, hd: int):
    text = dict(common, head_dim=hd, sliding_window=16, query_pre_attn_scalar=hd,
                layer_types=_alternating("sliding_attention", "full_attention", common["num_hidden_layers"]))
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    boi, eoi, image = (_SPECIAL["gemma3_mm"].index(t) for t in ("<start_of_image>", "<end_of_image>",
                                                                 "<image_soft_token>"))
    return tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=boi,
                           eoi_token_index=eoi, image_token_index=image)


def tiny_config(family: str, vocab_size: int, num_layers: int = 4, hidden_size: int = 64):
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=1024, tie_word_embeddings=False)
    hd = hidden_size // 4
    if family == "llama":
        return tf.LlamaConfig(**common)
    if family == "mistral":
        return tf.MistralConfig(**common, sliding_window=None)
    if family == "qwen2":
        return tf.Qwen2Config(**common)
    if family == "qwen3":
        return tf.Qwen3Config(**common, head_dim=hd)
    if family == "gemma3":
        return tf.Gemma3TextConfig(**common, head_dim=hd, sliding_window=16, query_pre_attn_scalar=hd)
    if family in ("qwen3_moe", "mixtral", "gpt_oss", "qwen3_next"):
        return _moe_config(family, common, hd)
    if family == "gemma3_mm":
        return _gemma3_mm_config(common, hd)
    raise ValueError(f"unknown tiny family {family!r}; choose from {FAMILIES}")


def tiny_model(family: str, vocab_size: int, num_layers: int = 4, hidden_size: int = 64, seed: int = 0):
    cfg = tiny_config(family, vocab_size, num_layers, hidden_size)
    g = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(cfg)
    finally:
        torch.random.set_rng_state(g)
    model.generation_config.eos_token_id = None
    return model.eval()


def build_tiny(family: str, num_layers: int = 4, hidden_size: int = 64, vocab_size: int = 512, seed: int = 0):
    """(model, tokenizer) of a tiny random target of ``family``."""
    tok = tiny_tokenizer(family, vocab_size)
    n = len(tok)
    model = tiny_model(family, n, num_layers, hidden_size, seed)
    # every weight but the appended unused token's rows is the draw of the trained vocabulary alone
    drawn = tiny_model(family, n - 1, num_layers, hidden_size, seed).state_dict()
    model.load_state_dict({k: torch.cat([drawn[k], v[n - 1:]]) if v.shape != drawn[k].shape else drawn[k]
                           for k, v in model.state_dict().items()})
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def save_tiny(family: str, out_dir: str | Path, **kw) -> Path:
    """Write a tiny target as a normal HF directory (loadable with ``target.path=DIR``)."""
    out = Path(out_dir)
    model, tok = build_tiny(family, **kw)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def parse_tiny_spec(spec: str) -> Optional[dict]:
    """``tiny:llama`` / ``tiny:qwen3:layers=6`` → build kwargs, or None if not a tiny spec."""
    if not spec.startswith("tiny:"):
        return None
    parts = spec.split(":")[1:]
    kw = {"family": parts[0]}
    for p in parts[1:]:
        k, _, v = p.partition("=")
        key = {"layers": "num_layers", "hidden": "hidden_size", "vocab": "vocab_size", "seed": "seed"}.get(k)
        if key is None or not v.isdigit():
            raise ValueError(f"bad tiny target spec {spec!r}: {p!r} (use layers=, hidden=, vocab=, seed=)")
        kw[key] = int(v)
    return kw
