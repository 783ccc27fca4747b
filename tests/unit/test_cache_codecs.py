"""Codec registry and the lossless bf16 codec (bit-exact round trips, garbage rejected)."""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepspec.cache import codecs
from deepspec.cache.codecs import BF16Codec, Codec, get_codec, register_codec, same_spec
from deepspec.cache.errors import CacheCorruptError, CacheError


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int16)


def _special(t: int, d: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, d, generator=g) * 3).to(torch.bfloat16)
    flat = x.view(-1)
    vals = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-40, -3e38]
    for i, v in enumerate(vals[: flat.numel()]):
        flat[i] = v
    return x


@pytest.mark.parametrize("layout", BF16Codec.LAYOUTS)
@pytest.mark.parametrize("shape", [(1, 1), (7, 64), (33, 320), (0, 64)])
def test_bf16_roundtrip_bit_exact(layout, shape):
    c = BF16Codec(layout=layout, level=1)
    x = _special(*shape)
    blob = c.encode(x)
    y = c.decode(blob, shape)
    assert y.dtype == torch.bfloat16 and tuple(y.shape) == shape
    assert torch.equal(_bits(x), _bits(y))  # NaN payloads, -0.0 and infinities included


def test_bf16_encodes_views_and_other_dtypes():
    c = BF16Codec()
    base = torch.randn(10, 40, dtype=torch.float32)
    view = base[:, 8:24]  # non-contiguous
    y = c.decode(c.encode(view), (10, 16))
    assert torch.equal(_bits(view.to(torch.bfloat16)), _bits(y))


def test_planes_compress_real_like_data_better_than_plain():
    g = torch.Generator().manual_seed(0)
    scale = torch.rand(1, 256, generator=g) * 4
    x = (torch.randn(200, 256, generator=g) * scale).to(torch.bfloat16)
    sizes = {lay: len(BF16Codec(layout=lay).encode(x)) for lay in BF16Codec.LAYOUTS}
    assert sizes["planes"] < sizes["plain"] and sizes["planes_cm"] < sizes["plain"]


def test_registry_and_specs():
    assert "bf16" in codecs.available_codecs()
    c = get_codec({"name": "bf16", "params": {"layout": "planes", "level": 3}})
    assert c.spec() == {"name": "bf16", "params": {"layout": "planes", "level": 3}}
    assert same_spec(c.spec(), get_codec(c.spec()).spec())
    assert not same_spec(c.spec(), BF16Codec(layout="plain").spec())
    with pytest.raises(CacheError, match="unknown cache codec"):
        get_codec("nope")
    with pytest.raises(CacheError, match="layout"):
        get_codec("bf16", layout="zigzag")
    with pytest.raises(CacheError, match="bad parameters"):
        get_codec({"name": "bf16", "params": {"colour": 1}})
    with pytest.raises(CacheError):
        get_codec({"name": "bf16", "params": "x"})


def test_lossy_codec_can_plug_in_later():
    @register_codec("_test_halfprec")
    class Half(Codec):
        lossless = False

        def encode(self, x, column="features"):
            return x.to(torch.float16).numpy().tobytes()

        def decode(self, blob, shape, column="features"):
            return torch.from_numpy(np.frombuffer(blob, np.float16).reshape(shape).copy()).to(torch.bfloat16)

    try:
        c = get_codec("_test_halfprec")
        x = torch.randn(3, 4).to(torch.bfloat16)
        assert torch.allclose(c.decode(c.encode(x), (3, 4)).float(), x.float(), atol=1e-2)
        with pytest.raises(ValueError, match="already registered"):
            register_codec("bf16")(Half)
    finally:
        codecs.CODECS.pop("_test_halfprec", None)


def test_codec_from_config_lossy_and_unknown():
    from deepspec.config.cache import CacheConfig
    assert codecs.codec_from_config(CacheConfig()).spec()["name"] == "bf16"
    # fp8 / lowrank are implemented in deepspec/cache/lossy.py (tests/unit/test_cache_lossy.py)
    c = codecs.codec_from_config(CacheConfig(codec="lowrank", rank=32))
    assert c.needs_calibration and not c.lossless and c.params()["rank"] == 32
    with pytest.raises(CacheError, match="unknown cache codec"):
        codecs.codec_from_config(CacheConfig(codec="int4"))


def test_decode_rejects_wrong_shape_and_damage():
    c = BF16Codec()
    x = _special(9, 16)
    blob = bytearray(c.encode(x))
    with pytest.raises(CacheCorruptError, match="expected"):
        c.decode(bytes(blob), (9, 17))
    blob[len(blob) // 2] ^= 0x40
    with pytest.raises(CacheCorruptError):
        c.decode(bytes(blob), (9, 16))
    with pytest.raises(CacheCorruptError, match="missing"):
        codecs.zstd_decompress(None, 4)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300), st.integers(0, 20), st.integers(1, 20))
def test_decode_garbage_raises_project_error(data, t, d):
    for layout in BF16Codec.LAYOUTS:
        try:
            y = BF16Codec(layout=layout).decode(data, (t, d))
        except CacheCorruptError:
            continue
        assert tuple(y.shape) == (t, d)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(0, 200), st.integers(0, 255))
def test_bitflips_in_a_frame_never_pass_silently(seed, pos, flip):
    c = BF16Codec()
    x = _special(12, 24, seed=seed % 1000)
    blob = bytearray(c.encode(x))
    pos %= len(blob)
    blob[pos] ^= flip
    try:
        y = c.decode(bytes(blob), (12, 24))
    except CacheCorruptError:
        return
    assert torch.equal(_bits(x), _bits(y))  # only a no-op flip can decode
