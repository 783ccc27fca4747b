"""Several caches read as one (`CacheUnion`): order, the reader API, and what it refuses."""
import json

import numpy as np
import pytest
import torch

from deepspec.cache import CacheMismatchError, CacheReader
from deepspec.cache.union import CacheUnion, open_caches
from deepspec.config import load_config
from deepspec.cache.writer import build_cache
from tests.support.synthetic import write_regen_jsonl
from deepspec.targets import load_target

BASE = ["target.path=tiny:llama", "target.dtype=float32", "cache.shard_samples=4", "data.max_length=64",
        "cache.batch_tokens=200", "cache.encode_threads=1"]


def _build(root, name, n, seed, id_prefix, *extra, target=None):
    regen = write_regen_jsonl(root / f"{name}.jsonl", n, seed=seed, max_words=10)
    rows = [json.loads(x) for x in regen.read_text().splitlines()]
    regen.write_text("".join(json.dumps({**r, "id": id_prefix + r["id"]}) + "\n" for r in rows))
    cfg = load_config(BASE + [f"run_dir={root / name}", f"data.regen_path={regen}",
                              f"cache.dir={root / name / 'cache'}", *extra])
    return build_cache(cfg, target=target or load_target(cfg.target), progress=False)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("union")
    target = load_target(load_config(BASE).target)
    return root, target, _build(root, "a", 6, 1, "a", target=target), _build(root, "b", 5, 2, "b", target=target)


def test_union_reads_the_caches_back_to_back(two):
    _, target, da, db = two
    a, b = CacheReader(da), CacheReader(db)
    u = open_caches([da, db])
    assert isinstance(u, CacheUnion) and len(u) == len(a) + len(b) >= 9
    assert u.ids == a.ids + b.ids and [u.sample_id(i) for i in range(len(u))] == u.ids
    assert u.lengths.tolist() == a.lengths.tolist() + b.lengths.tolist()
    assert u.manifest["num_samples"] == len(u) and u.manifest["num_tokens"] == int(u.lengths.sum())
    for i, (r, j) in enumerate([(a, j) for j in range(len(a))] + [(b, j) for j in range(len(b))]):
        got, want = u[i], r[j]
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
        assert torch.equal(u.tokens(i)["input_ids"], want["input_ids"]) and u.num_tokens(i) == r.num_tokens(j)
    assert torch.equal(u[-1]["input_ids"], b[len(b) - 1]["input_ids"])
    with pytest.raises(IndexError, match=f"union of {len(u)}"):
        u[len(u)]
    assert u.validate(target) is u
    st = u.stats()
    assert (st["samples"], st["tokens"]) == (len(u), a.stats()["tokens"] + b.stats()["tokens"])
    assert st["loss_tokens"] == int(u.loss_lengths.sum()) and len(st["caches"]) == 2
    assert isinstance(open_caches([da]), CacheReader)


def test_union_refuses_a_repeated_sample_and_another_layout(two):
    root, target, da, db = two
    with pytest.raises(CacheMismatchError, match="sample id 'as00000' is in both"):
        CacheUnion([CacheReader(da), CacheReader(da)])
    dc = _build(root, "c", 3, 3, "c", "target.layer_ids=[0,1]", target=load_target(
        load_config(BASE + ["target.layer_ids=[0,1]"]).target))
    with pytest.raises(CacheMismatchError, match="(?s)layer_ids: cache has \\[0, 1\\].*cache.extra_dirs must match"):
        CacheUnion([CacheReader(da), CacheReader(dc)])
    assert np.array_equal(CacheReader(dc).layer_ids, [0, 1])
