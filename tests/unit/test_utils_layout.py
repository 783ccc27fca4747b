"""Column-major linear weights (`target.weight_layout`): same values, shared ties kept, the layout chosen
per device and dtype, and speculative decoding over a column-major target and draft stays lossless."""
import pytest
import torch
from torch import nn

from conftest import make_tiny_target
from deepspec.config.draft import DraftConfig
from deepspec.drafts.registry import available_drafters, build_drafter
from deepspec.eval.sampling import make_warp
from deepspec.eval.speculative import speculative_generate, target_generate
from deepspec.utils.layout import column_major_linears, is_column_major, resolve_layout, to_column_major


def test_resolve_layout():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_layout("auto", cpu, torch.float32) == "column"
    assert resolve_layout("auto", cpu, torch.bfloat16) == "row"
    assert resolve_layout("auto", cuda, torch.float32) == "row"
    assert resolve_layout("row", cpu, torch.float32) == "row"
    assert resolve_layout("column", cuda, torch.bfloat16) == "column"
    with pytest.raises(ValueError, match="target.weight_layout='colum'"):
        resolve_layout("colum", cpu, torch.float32)


def test_column_major_keeps_values_ties_and_is_idempotent():
    torch.manual_seed(0)
    emb = nn.Embedding(50, 8)
    head = nn.Linear(8, 50, bias=False)
    head.weight = emb.weight                                   # tied, as in most small HF decoders
    net = nn.ModuleDict({"emb": emb, "a": nn.Linear(8, 16), "b": nn.Linear(16, 8), "head": head,
                         "lowp": nn.Linear(8, 8).to(torch.bfloat16)})
    before = {k: v.clone() for k, v in net.state_dict().items()}
    x = torch.randn(5, 8)
    ref = net["head"](net["b"](net["a"](x)))
    assert column_major_linears(net, dtype=torch.float32) == 3   # a, b and the tied head once; not the bf16 one
    after = net.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(is_column_major(net[k].weight) for k in ("a", "b", "head"))
    assert not is_column_major(net["lowp"].weight) and net["lowp"].weight.is_contiguous()
    assert net["head"].weight is net["emb"].weight
    assert torch.equal(net["emb"](torch.tensor([3, 7])), before["emb.weight"][[3, 7]])
    torch.testing.assert_close(net["head"](net["b"](net["a"](x))), ref)
    assert column_major_linears(net) == 1                        # only the bf16 one is left to convert
    assert column_major_linears(net) == 0
    assert all(is_column_major(net[k].weight) for k in ("a", "b", "head", "lowp"))
    v = torch.randn(4, 3)
    assert torch.equal(to_column_major(v), v) and is_column_major(to_column_major(v))


def test_target_set_weight_layout():
    torch.set_num_threads(1)
    row, col = make_tiny_target("llama", num_layers=2), make_tiny_target("llama", num_layers=2)
    assert row.set_weight_layout("row") == "row" and row.weight_layout == "row"
    assert col.set_weight_layout("auto") == "column"            # fp32 on a CPU
    assert is_column_major(col.lm_head.weight)
    assert col.fingerprint() == row.fingerprint()               # hashes values, not strides
    ids = torch.randint(10, row.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(col.decode(ids).logits, row.decode(ids).logits, rtol=1e-5, atol=1e-5)
    rows = torch.arange(0, 40, 3)
    assert is_column_major(col.head_weight(torch.float32, rows))   # fp32 draft-vocabulary head follows
    assert col.head_weight(torch.bfloat16, rows).is_contiguous()   # bf16 (training autocast) stays row-major
    assert torch.equal(col.head_weight(torch.float32, rows), row.head_weight(torch.float32, rows))
    with pytest.raises(ValueError, match="already column-major"):
        col.set_weight_layout("row")


@pytest.mark.parametrize("name", [n for n in available_drafters()
                                  if n not in ("target_as_draft", "fixed_distribution_draft")])
def test_column_major_target_and_draft_stay_lossless(name):
    torch.set_num_threads(1)
    target = make_tiny_target("qwen3", num_layers=2)
    target.set_weight_layout("column")
    torch.manual_seed(0)
    drafter = build_drafter(target, DraftConfig(algorithm=name, gamma=3, num_layers=1, head_rank=16,
                                                ttt_steps=3, vocab_size=60)).eval()
    assert column_major_linears(drafter, dtype=torch.float32) > 0
    greedy = make_warp(0.0)
    prompt = torch.randint(10, target.vocab_size, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    base = target_generate(target, prompt, max_new_tokens=12, warp=greedy, eos_token_ids=[]).tokens
    spec = speculative_generate(target, drafter, prompt, gamma=3, max_new_tokens=12, warp=greedy, eos_token_ids=[])
    assert spec.tokens == base
