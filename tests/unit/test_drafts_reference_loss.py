"""DSpark training as DeepSpec's reference does it: the loss formula, partial blocks, head init."""
import math

import pytest
import torch
import torch.nn.functional as F

from deepspec.config.draft import DraftConfig
from deepspec.drafts import build_drafter
from deepspec.drafts.losses import token_terms

G = 4


def _batch(target, T=18, seed=0):
    ids = torch.randint(0, target.vocab_size, (1, T), generator=torch.Generator().manual_seed(seed))
    cap = target.capture(ids)
    lm = torch.ones(1, T, dtype=torch.bool)
    lm[0, :3] = False            # prompt
    lm[0, 9:11] = False          # a second user turn between two answers
    return {"input_ids": ids, "loss_mask": lm, "attention_mask": torch.ones(1, T, dtype=torch.bool),
            "features": cap.features.clone(), "last_hidden": cap.last_hidden.clone(),
            # 2: prompt anchor; 3: full block; 6: cut by the user turn; 8: first target is prompt;
            # 15: cut by the end of the sequence; 16: one position left; 17: nothing left to predict
            "anchors": torch.tensor([[2, 3, 6, 8, 15, 16, 17]])}


def test_l1_term_is_twice_tv_on_a_hand_example():
    # q = (0.75, 0.25), p = (0.25, 0.75): Σ|q − p| = 1.0, TV = 0.5
    q = torch.log(torch.tensor([[0.75, 0.25]]))
    p = torch.log(torch.tensor([[0.25, 0.75]]))
    t = token_terms(q, p, torch.tensor([0]))
    assert t["tv"].item() == pytest.approx(0.5)
    assert t["ce"].item() == pytest.approx(-math.log(0.75))


def test_partial_blocks_are_prefixes_and_never_start_on_the_prompt(tiny_llama):
    d = build_drafter(tiny_llama, DraftConfig(algorithm="dspark", gamma=G, num_layers=1, head_rank=8))
    vp = d.block_logits(_batch(tiny_llama))["valid_pos"][0].tolist()
    assert vp == [[False] * 4,                         # anchor on the prompt
                  [True] * 4,                          # x_4..x_7 all answer tokens
                  [True, True, False, False],          # x_7, x_8 answer; x_9 is the user's turn
                  [False] * 4,                         # x_9 (first target) is not an answer token
                  [True, True, False, False],          # x_16, x_17, then the sequence ends
                  [True, False, False, False],
                  [False] * 4]                         # p + 1 = length


@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_loss_equals_the_reference_formula(tiny_llama, head):
    """0.1·CE + 0.9·Σ|q − p| + 1.0·BCE(c, 1 − TV), each normalised by Σ of the decayed weights over the
    supervised positions (DeepSpec's modeling/dspark/loss.py), recomputed here from the block logits."""
    torch.manual_seed(0)
    d = build_drafter(tiny_llama, DraftConfig(algorithm="dspark", gamma=G, num_layers=1, head_rank=8,
                                              sequential_head=head))
    batch = _batch(tiny_llama)
    out = d(batch)
    bl = d.block_logits(batch)
    q = torch.softmax(bl["logits"].float(), -1)
    p = torch.softmax(tiny_llama.logits_from_hidden(bl["target_hidden"]).float(), -1)
    l1 = (q - p).abs().sum(-1)
    ce = F.cross_entropy(bl["logits"].flatten(0, -2), bl["tokens"].flatten(), reduction="none").view(l1.shape)
    accept = (1 - 0.5 * l1).clamp(0, 1)
    bce = F.binary_cross_entropy_with_logits(bl["confidence"].float(), accept, reduction="none")
    w = torch.exp(-torch.arange(G, dtype=torch.float32) / 4.0) * bl["valid_pos"].float()
    ref = sum(a * (x * w).sum() / w.sum() for a, x in ((0.1, ce), (0.9, l1), (1.0, bce)))
    torch.testing.assert_close(out["loss"].detach(), ref, rtol=1e-5, atol=1e-6)
    assert out["metrics"]["blocks"] == 4.0
    # expected τ = 1 + Σ_k E_blocks[Π_{j≤k} (1 − TV_j)] over the blocks whose position k is supervised
    valid = bl["valid_pos"].reshape(-1, G)
    chain = torch.cumprod(accept.reshape(-1, G).double(), -1)
    want = 1 + sum(float(chain[valid[:, k], k].mean()) for k in range(G) if valid[:, k].any())
    assert out["metrics"]["expected_tau"] == pytest.approx(want, rel=1e-5)


def test_head_init_matches_the_reference():
    """W1, W2 ~ N(0, 0.02) (the reference's _init_weights), so a fresh Markov bias W1[x]·W2 has
    std 0.02² · √r; RNN and confidence projections N(0, 0.02) with zero bias."""
    from deepspec.drafts.heads import ConfidenceHead, MarkovHead, RNNHead
    torch.manual_seed(0)
    V, H, r = 4096, 64, 256
    m = MarkovHead(V, H, r)
    assert m.w1.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert m.w2.std().item() == pytest.approx(0.02, rel=0.02)
    bias, _ = m(torch.zeros(8, G, H), torch.randint(0, V, (8, G)))
    assert bias.std().item() == pytest.approx(0.02 ** 2 * r ** 0.5, rel=0.05)
    rnn = RNNHead(V, H, r)
    assert rnn.cell.weight.std().item() == pytest.approx(0.02, rel=0.02) and (rnn.cell.bias == 0).all()
    c = ConfidenceHead(H, r, V)
    assert c.proj.weight.std().item() == pytest.approx(0.02, rel=0.2) and (c.proj.bias == 0).all()
    assert c.w1.weight.std().item() == pytest.approx(0.02, rel=0.02)
