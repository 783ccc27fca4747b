"""Lossy cache codecs (`deepspec/cache/lossy.py`): round-trip error bounds, state files,
end-to-end builds on a tiny target, manifest/codec validation."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from deepspec.cache import CacheReader, get_codec
from deepspec.cache.reconstruction import reconstruction_error
from deepspec.cache.errors import CacheCorruptError, CacheError
from deepspec.cache.format import state_from_bytes, state_to_bytes
from deepspec.cache.writer import build_cache
from tests.support.synthetic import tiny_cache_config, write_regen_jsonl
from deepspec.targets import load_target

H, L = 64, 3


def realish(n=1536, seed=0):
    """Activation-like features [n, L*H]: per-channel scales over 3 decades, a few outlier
    channels, heavy tails, low-rank structure + noise, a shared offset (residual streams)."""
    g = torch.Generator().manual_seed(seed)
    cols = []
    for l in range(L):
        r = 12
        z = torch.randn(n, r, generator=g) * torch.logspace(0, -1.5, r)
        mix = torch.randn(r, H, generator=g)
        x = z @ mix + 0.05 * torch.distributions.Laplace(0.0, 1.0).sample((n, H))
        scale = torch.logspace(-1.5, 1.5, H)[torch.randperm(H, generator=g)]
        x = x * scale + torch.randn(H, generator=g) * scale
        x[:, :2] *= 30.0  # massive-activation channels
        cols.append(x)
    return torch.cat(cols, dim=1).to(torch.bfloat16)


def fitted(name, x, **kw):
    c = get_codec(name, **kw)
    c.calibrate([{"features": x, "last_hidden": x[:, :H]}], hidden_size=H)
    return c


def per_layer(x, y):
    xr, yr = x.float().reshape(-1, L, H), y.float().reshape(-1, L, H)
    return ((xr - yr) ** 2).sum((0, 2)) / (xr ** 2).sum((0, 2))


# -- fp8 ----------------------------------------------------------------------------------------
def test_fp8_round_trip_error_bound():
    both = realish(n=3072)
    x, held = both[:1536], both[1536:]  # held: same distribution, not the calibration sample
    c = fitted("fp8", x)
    for data in (x, held):
        y = c.decode(c.encode(data), tuple(data.shape))
        assert y.dtype == torch.bfloat16 and y.shape == data.shape
        rel = per_layer(data, y)
        assert (rel < 1e-3).all(), rel
        cos = torch.nn.functional.cosine_similarity(data.float(), y.float(), dim=-1)
        assert cos.min() > 0.998 and cos.mean() > 0.9995


def test_fp8_saturates_out_of_range_and_is_smaller_than_bf16():
    x = realish()
    c = fitted("fp8", x)
    big = x.clone()
    big[0] *= 100  # far beyond the calibrated range: clamps, never NaN/inf
    y = c.decode(c.encode(big), tuple(big.shape)).float()
    assert torch.isfinite(y).all()
    bf = get_codec("bf16")
    assert len(c.encode(x)) < 0.7 * len(bf.encode(x))


def test_last_hidden_lossless_by_default_and_fp8_option():
    x = realish()
    last = x[:, :H].contiguous()
    for name in ("fp8", "lowrank"):
        kw = {"rank": 8} if name == "lowrank" else {}
        c = fitted(name, x, **kw)
        blob = c.encode(last, "last_hidden")
        assert blob == get_codec("bf16").encode(last, "last_hidden")
        assert torch.equal(c.decode(blob, tuple(last.shape), "row 0 last_hidden").view(torch.int16),
                           last.view(torch.int16))
    c = fitted("fp8", x, last_hidden="fp8")
    y = c.decode(c.encode(last, "last_hidden"), tuple(last.shape), "last_hidden")
    err = ((y.float() - last.float()) ** 2).sum() / (last.float() ** 2).sum()
    assert 0 < err < 1e-3


# -- lowrank --------------------------------------------------------------------------------------
def test_lowrank_error_decreases_with_rank_and_equals_svd_tail():
    x = realish()
    prev = None
    for r in (2, 4, 8, 16, 32):
        c = fitted("lowrank", x, rank=r)
        y = c.decode(c.encode(x), tuple(x.shape))
        rel = per_layer(x, y)
        for l in range(L):  # independent SVD of the centred calibration matrix
            xl = x[:, l * H:(l + 1) * H].double()
            s = torch.linalg.svdvals(xl - xl.mean(0))
            tail = float((s[r:] ** 2).sum() / (xl ** 2).sum())
            assert c.tail_energy[l] == pytest.approx(tail, rel=1e-6, abs=1e-12)
            # stored: bf16 coefficients + bf16 output, so a small absolute floor on top of the tail
            assert float(rel[l]) == pytest.approx(tail, rel=0.05, abs=3e-5), (r, l)
        if prev is not None:
            assert (rel <= prev + 1e-6).all()
        prev = rel
    assert (prev < 1e-3).all()


def test_lowrank_fp8_coefficients_and_decoder_absorption():
    x = realish()
    c16 = fitted("lowrank", x, rank=16)
    c8 = fitted("lowrank", x, rank=16, coef="fp8")
    e16 = per_layer(x, c16.decode(c16.encode(x), tuple(x.shape)))
    e8 = per_layer(x, c8.decode(c8.encode(x), tuple(x.shape)))
    assert (e8 < e16 + 2e-3).all()
    assert len(c8.encode(x)) < len(c16.encode(x))
    # a linear layer on the reconstruction == the absorbed layer on the coefficients
    dec = c16.decoder_arrays()
    W, mu = dec["W"], dec["mu"]
    z = c16.decode_coefficients(c16.encode(x), x.shape[0])
    fc = torch.randn(7, L * H)
    direct = c16.reconstruct(z) @ fc.T
    fcl = fc.reshape(7, L, H)
    absorbed = sum(z[:, l * 16:(l + 1) * 16] @ (fcl[:, l] @ W[l]).T for l in range(L)) + \
        sum(fcl[:, l] @ mu[l] for l in range(L))
    assert torch.allclose(direct, absorbed, rtol=1e-4, atol=1e-3)


def test_lowrank_rank_checks():
    x = realish(n=256)
    with pytest.raises(CacheError, match="exceeds the hidden size"):
        fitted("lowrank", x, rank=H + 1)
    with pytest.raises(CacheError, match="positive int"):
        get_codec("lowrank", rank=0)
    with pytest.raises(CacheError, match="coef"):
        get_codec("lowrank", coef="int4")


# -- state files -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name,kw", [("fp8", {}), ("fp8", {"last_hidden": "fp8"}), ("lowrank", {"rank": 8}),
                                     ("lowrank", {"rank": 8, "coef": "fp8"})])
def test_state_round_trip(name, kw):
    x = realish(n=512)
    c = fitted(name, x, **kw)
    blob = c.encode(x)
    c2 = get_codec(c.spec())
    c2.load_state_arrays(state_from_bytes(state_to_bytes(c.state_arrays()), "state"))
    assert torch.equal(c2.decode(blob, tuple(x.shape)).view(torch.int16), c.decode(blob, tuple(x.shape)).view(torch.int16))
    with pytest.raises(CacheCorruptError):
        get_codec(c.spec()).load_state_arrays({})
    arrays = dict(c.state_arrays())
    arrays.pop(sorted(arrays)[0])
    with pytest.raises(CacheCorruptError):
        get_codec(c.spec()).load_state_arrays(arrays)
    bad = dict(c.state_arrays())
    key = "scale" if name == "fp8" else "mean"
    bad[key] = bad[key].copy()
    bad[key][0] = np.nan
    with pytest.raises(CacheCorruptError, match="non-finite"):
        get_codec(c.spec()).load_state_arrays(bad)


def test_uncalibrated_codec_refuses_to_encode():
    with pytest.raises(CacheError, match="no fitted state"):
        get_codec("fp8").encode(realish(n=8))


def test_reconstruction_error_report_matches_direct_measure():
    x = realish(n=512)
    c = fitted("fp8", x)
    rep = reconstruction_error(c, x, x[:, :H], H, [1, 5, 9])
    rel = per_layer(x, c.decode(c.encode(x), tuple(x.shape)))
    assert [e["layer_id"] for e in rep["features"]] == [1, 5, 9]
    for e, r in zip(rep["features"], rel):
        assert e["rel_mse"] == pytest.approx(float(r), rel=1e-3)
        assert 0.999 < e["cosine"] <= 1.0 + 1e-6
    assert rep["last_hidden"]["rel_mse"] == 0.0


# -- builds on the tiny target --------------------------------------------------------------------------
_cfg = tiny_cache_config


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("lossy")
    write_regen_jsonl(tmp / "regen.jsonl", 12, seed=1, max_words=40)
    target = None
    out = {}
    for codec in ("bf16", "fp8", "lowrank"):
        cfg = _cfg(tmp, codec)
        target = target or load_target(cfg.target)
        out[codec] = build_cache(cfg, target=target, progress=False)
    return tmp, target, out


def test_built_caches_round_trip_within_bounds(built):
    tmp, target, out = built
    ref = CacheReader(out["bf16"])
    sizes = {k: CacheReader(v).stats()["bytes_per_token"] for k, v in out.items()}
    assert sizes["fp8"] < sizes["bf16"] and sizes["lowrank"] < sizes["bf16"]
    for codec in ("fp8", "lowrank"):
        r = CacheReader(out[codec]).validate(target)
        m = r.manifest
        assert m["codec"]["name"] == codec and m["codec"]["params"]["last_hidden"] == "bf16"
        assert m["codec_state"]["file"] == "codec_state.arrow"
        err = m["codec_error"]
        assert [e["layer_id"] for e in err["features"]] == list(target.layer_ids)
        assert err["tokens"] == 400
        if codec == "fp8":
            assert all(e["rel_mse"] < 1e-3 for e in err["features"])
        else:
            assert all(e["rel_mse"] == pytest.approx(e["svd_tail_energy"], rel=0.05, abs=3e-5)
                       for e in err["features"])
        info = r.codec_info()
        assert info["lossless"] is False and info["error"] == err
        if codec == "lowrank":
            assert tuple(info["decoder"]["W"].shape) == (2, target.hidden_size, 16)
        for i in range(len(r)):
            a, b = ref[i], r[i]
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
            assert torch.equal(a["last_hidden"].view(torch.int16), b["last_hidden"].view(torch.int16))
            cos = torch.nn.functional.cosine_similarity(a["features"].float(), b["features"].float(), dim=-1)
            assert cos.mean() > (0.999 if codec == "fp8" else 0.5)
        assert r.verify(decode=True) == []


def test_fp8_last_hidden_build_normalises_the_stored_values(built):
    """With a lossy last_hidden the stored target_lse is the log-normaliser of the logits of the stored
    (decoded) values, so exp(logits - lse) sums to 1 over the vocabulary, not of the target's bf16 ones."""
    tmp, target, out = built
    d = build_cache(_cfg(tmp, "fp8", **{"cache.last_hidden_codec": "fp8", "cache.dir": str(tmp / "cache-lh8")}),
                    target=target, progress=False)
    r, ref = CacheReader(d).validate(target), CacheReader(out["bf16"])
    assert r.manifest["codec"]["params"]["last_hidden"] == "fp8"
    moved = 0.0
    for i in range(len(r)):
        a, b = ref[i], r[i]
        lse = target.log_normalizer(b["last_hidden"])
        assert torch.allclose(b["target_lse"], lse, atol=1e-4)
        mass = torch.exp(target.logits_from_hidden(b["last_hidden"].float(), dtype=torch.float32)
                         - b["target_lse"][:, None]).sum(-1)
        assert torch.allclose(mass, torch.ones_like(mass), atol=1e-4)
        moved = max(moved, float((a["target_lse"] - b["target_lse"]).abs().max()))
    assert moved > 1e-4      # the fp8 values do change the normaliser: the bf16 one would be stale


def test_info_prints_reconstruction(built, capsys):
    from deepspec.cache.cli import main
    _, _, out = built
    assert main(["info", str(out["lowrank"])]) == 0
    text = capsys.readouterr().out
    assert "reconstruction" in text and "SVD tail energy" in text and "last_hidden" in text


def test_resume_reuses_calibration(built):
    tmp, target, out = built
    state = (out["fp8"] / "codec_state.arrow").read_bytes()
    d = tmp / "cache-fp8-resume"
    shutil.copytree(out["fp8"], d)
    (d / "manifest.json").unlink()
    (d / "index.arrow").unlink()
    for p in list(d.glob("shard-000001.*")):
        p.unlink()
    build_cache(_cfg(tmp, "fp8", **{"cache.dir": str(d)}), target=target, progress=False)
    assert (d / "codec_state.arrow").read_bytes() == state
    a, b = CacheReader(out["fp8"]), CacheReader(d)
    for k in ("codec", "codec_state", "codec_error", "shards"):
        assert a.manifest[k] == b.manifest[k]


def _copy(out, tmp, name):
    d = tmp / name
    if d.exists():
        shutil.rmtree(d)
    shutil.copytree(out, d)
    return d


def _edit_manifest(d, fn):
    p = d / "manifest.json"
    m = json.loads(p.read_text())
    fn(m)
    p.write_text(json.dumps(m))


def test_tampered_codec_params_or_state_detected(built):
    tmp, _, out = built
    # codec params changed in the manifest: shards declare the original codec
    d = _copy(out["lowrank"], tmp, "t1")
    _edit_manifest(d, lambda m: m["codec"]["params"].update(rank=8))
    with pytest.raises(CacheCorruptError):
        CacheReader(d)[0]
    # codec swapped for lossless bf16: no mixing
    d = _copy(out["fp8"], tmp, "t2")
    _edit_manifest(d, lambda m: (m["codec"].update(name="bf16", params={"layout": "planes_cm", "level": 1}),
                                 m.pop("codec_state")))
    with pytest.raises(CacheCorruptError, match="never mixes codecs"):
        CacheReader(d)[0]
    # codec state replaced by another fit (even with a matching sha256 in the manifest)
    d = _copy(out["fp8"], tmp, "t3")
    other = out["lowrank"] / "codec_state.arrow"
    from deepspec.cache.format import sha256_bytes
    fp8 = get_codec(CacheReader(out["fp8"]).manifest["codec"])
    x = realish(n=64)
    fp8.calibrate([{"features": torch.cat([x[:, :H], x[:, :H]], 1)}], hidden_size=H)
    data = state_to_bytes(fp8.state_arrays())
    (d / "codec_state.arrow").write_bytes(data)
    with pytest.raises(CacheCorruptError, match="sha256"):
        CacheReader(d)
    _edit_manifest(d, lambda m: m["codec_state"].update(sha256=sha256_bytes(data)))
    with pytest.raises(CacheCorruptError, match="fitted codec state"):
        CacheReader(d)[0]
    # codec state missing
    d = _copy(out["lowrank"], tmp, "t4")
    (d / "codec_state.arrow").unlink()
    with pytest.raises(CacheCorruptError, match="missing"):
        CacheReader(d)
    d = _copy(out["lowrank"], tmp, "t5")
    _edit_manifest(d, lambda m: m.pop("codec_state"))
    with pytest.raises(CacheCorruptError, match="no codec_state"):
        CacheReader(d)
    assert other.is_file()


def test_lossy_build_refuses_other_codec_in_same_dir(built):
    tmp, target, out = built
    from deepspec.cache.errors import CacheMismatchError
    with pytest.raises(CacheMismatchError, match="codec"):
        build_cache(_cfg(tmp, "lowrank", **{"cache.dir": str(out["fp8"])}), target=target, progress=False)
