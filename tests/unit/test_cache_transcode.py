"""`deepspec cache transcode`: a finished cache re-encoded with another codec, no target forward —
same samples and token data, features within the codec's error, resumable, refusals."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from deepspec.cache import CacheReader
from deepspec.cache.cli import main as cache_main
from deepspec.cache.errors import CacheError, CacheMismatchError
from deepspec.cache.transcode import transcode_cache
from deepspec.cache.writer import build_cache
from deepspec.targets import load_target
from tests.support.synthetic import tiny_cache_config, write_regen_jsonl


def _cfg(tmp, codec, **extra):
    return tiny_cache_config(tmp, codec, **{"cache.encode_threads": 1, **extra})


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("transcode")
    write_regen_jsonl(tmp / "regen.jsonl", 11, seed=3, max_words=40)
    target = load_target(_cfg(tmp, "bf16").target)
    built = {c: build_cache(_cfg(tmp, c), target=target, progress=False) for c in ("bf16", "fp8")}
    return tmp, target, built


def _rel_mse(a, b):
    a, b = a.float(), b.float()
    return float(((a - b) ** 2).sum() / (b ** 2).sum())


def test_fp8_transcode_keeps_the_data_and_matches_a_direct_build(caches):
    tmp, target, built = caches
    out = transcode_cache(built["bf16"], tmp / "tc-fp8", _cfg(tmp, "fp8").cache, progress=False)
    src, tc, direct = CacheReader(built["bf16"]), CacheReader(out).validate(target), CacheReader(built["fp8"])
    m, ms = tc.manifest, src.manifest
    assert m["codec"] == direct.manifest["codec"]
    assert m["transcoded_from"]["build_key"] == ms["build_key"] and m["build_key"] != ms["build_key"]
    assert m["source"] == ms["source"] and m["num_samples"] == ms["num_samples"] == len(src)
    assert [(s["range"], s["samples"], s["tokens"], s["loss_tokens"]) for s in m["shards"]] == \
        [(s["range"], s["samples"], s["tokens"], s["loss_tokens"]) for s in ms["shards"]]
    assert tc.ids == src.ids and list(tc.sample_indices) == list(src.sample_indices)
    assert m["codec_error"]["tokens"] == 400
    err_tc = err_direct = 0.0
    for i in range(len(src)):
        a, b, d = src[i], tc[i], direct[i]
        for k in ("input_ids", "loss_mask", "target_lse"):
            assert torch.equal(a[k], b[k]), k
        assert torch.equal(a["last_hidden"].view(torch.int16), b["last_hidden"].view(torch.int16))
        err_tc += _rel_mse(b["features"], a["features"])
        err_direct += _rel_mse(d["features"], a["features"])
    assert 0 < err_tc < 1e-3 * len(src)
    assert err_tc <= 1.5 * err_direct          # as close to the lossless data as a direct fp8 build
    assert tc.stats()["bytes_per_token"] < src.stats()["bytes_per_token"]
    assert tc.verify(decode=True) == []


def test_lossless_transcode_is_bit_exact(caches):
    tmp, _, built = caches
    out = transcode_cache(built["bf16"], tmp / "tc-plain", _cfg(tmp, "bf16", **{"cache.layout": "plain"}).cache,
                          progress=False)
    src, tc = CacheReader(built["bf16"]), CacheReader(out)
    assert tc.manifest["codec"]["params"]["layout"] == "plain" and "codec_state" not in tc.manifest
    for i in range(len(src)):
        a, b = src[i], tc[i]
        for k in a:
            assert torch.equal(a[k].view(torch.int16) if a[k].dtype == torch.bfloat16 else a[k],
                               b[k].view(torch.int16) if b[k].dtype == torch.bfloat16 else b[k]), k


def test_killed_transcode_resumes_to_the_same_cache(caches):
    tmp, _, built = caches
    cfg = _cfg(tmp, "lowrank").cache
    full = transcode_cache(built["bf16"], tmp / "tc-lr", cfg, progress=False)
    d = tmp / "tc-lr-resume"
    shutil.copytree(full, d)
    for name in ("manifest.json", "index.arrow", "shard-000001.json", "shard-000002.arrow"):
        (d / name).unlink()
    (d / ".tmp-r0-123-shard-000001.arrow").write_bytes(b"partial")
    transcode_cache(built["bf16"], d, cfg, progress=False)
    a, b = CacheReader(full).manifest, CacheReader(d).manifest
    for k in ("codec", "codec_state", "codec_error", "build_key", "index"):
        assert a[k] == b[k], k
    assert [s["sha256"] for s in a["shards"]] == [s["sha256"] for s in b["shards"]]
    assert not list(d.glob(".tmp-*"))


def test_refusals(caches, capsys):
    tmp, _, built = caches
    fp8 = transcode_cache(built["bf16"], tmp / "tc-refuse", _cfg(tmp, "fp8").cache, progress=False)
    with pytest.raises(CacheMismatchError, match="codec"):
        transcode_cache(built["bf16"], fp8, _cfg(tmp, "lowrank").cache, progress=False)
    with pytest.raises(CacheError, match="another directory"):
        transcode_cache(built["bf16"], built["bf16"], _cfg(tmp, "fp8").cache, progress=False)
    with pytest.raises(CacheError, match="last_hidden_codec=fp8 .*target_lse"):   # the carried lse would be stale
        transcode_cache(built["bf16"], tmp / "tc-lh", _cfg(tmp, "fp8", **{"cache.last_hidden_codec": "fp8"}).cache,
                        progress=False)
    assert not (tmp / "tc-lh").exists()
    with pytest.raises(CacheError, match="no manifest.json"):
        transcode_cache(tmp / "nothing", tmp / "tc-x", _cfg(tmp, "fp8").cache, progress=False)
    assert cache_main(["transcode", str(built["bf16"]), str(tmp / "tc-y"), "train.lr=1"]) == 1
    assert "cache overrides only" in capsys.readouterr().err


def test_cli_transcodes_and_reports_sizes(caches, capsys):
    tmp, _, built = caches
    dst = tmp / "tc-cli"
    assert cache_main(["transcode", str(built["bf16"]), str(dst), "cache=lowrank", "cache.rank=8",
                       "cache.calib_tokens=300", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "bytes/token" in out and str(dst) in out
    m = json.loads((dst / "manifest.json").read_text())
    assert m["codec"]["name"] == "lowrank" and m["codec"]["params"]["rank"] == 8
    assert m["codec_error"]["tokens"] == 300
