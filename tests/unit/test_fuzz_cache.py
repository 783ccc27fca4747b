"""Fuzzing the cache reader and the build's resume path with arbitrary and truncated bytes.

Complements the flip/field fuzzing in test_cache_build.py: here whole files are truncated at
any length, replaced by arbitrary bytes or grown, for every file kind (manifest.json, shards,
index.arrow, shard sidecars, build.json).  Opening, reading every sample, ``verify`` and a
resumed build either give correct data or raise the project's `CacheError` subclasses — never
a foreign exception — and the reader never writes to the cache directory.
"""
from __future__ import annotations

import copy
import json
import os
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepspec.cache import CacheError, CacheReader
from deepspec.cache import cli
from deepspec.cache.format import BUILD_INFO, INDEX, MANIFEST, shard_name, sidecar_name
from deepspec.cache.writer import build_cache
from deepspec.cache.finalize import finalize_cache
from tests.support.synthetic import write_regen_jsonl
from deepspec.config import load_config
from deepspec.targets import load_target

N, S = 6, 2     # 3 shards
BASE = ["target.path=tiny:llama", "target.dtype=float32", f"cache.shard_samples={S}", "data.max_length=64",
        "cache.batch_tokens=200", "cache.encode_threads=1"]
_FUZZ = settings(max_examples=40, deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _cfg(run_dir, *extra):
    return load_config(BASE + [f"run_dir={run_dir}", *extra])


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return load_target(_cfg("/tmp/unused").target)


@pytest.fixture(scope="module")
def built(tmp_path_factory, target):
    root = tmp_path_factory.mktemp("fuzzcache")
    regen = write_regen_jsonl(root / "regen" / "regen.jsonl", N, seed=3, max_words=8)
    cfg = _cfg(root)
    out = build_cache(cfg, target=target, progress=False)
    r = CacheReader(out)
    originals = [r[i] for i in range(len(r))]
    r.close()
    return cfg, out, regen, originals


def _same(a, b):
    for k in a:
        x, y = a[k], b[k]
        if x.is_floating_point():
            x, y = x.view(torch.int16), y.view(torch.int16)
        if not torch.equal(x, y):
            return False
    return True


def _snapshot(d):
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(d.iterdir())}


def _damage(data: bytes, how: str, pos: float, junk: bytes) -> bytes:
    k = int(pos * len(data))
    if how == "truncate":
        return data[:k]
    if how == "replace":
        return junk
    if how == "append":
        return data + junk
    return data[:k] + junk + data[k + len(junk):]   # overwrite a run of bytes


_how = st.sampled_from(["truncate", "replace", "append", "overwrite"])
_victims = st.sampled_from([MANIFEST, INDEX, shard_name(0), shard_name(1), shard_name(2)])


@_FUZZ
@given(victim=_victims, how=_how, pos=st.floats(0, 1, exclude_max=True), junk=st.binary(max_size=64))
def test_damaged_files_give_correct_data_or_cache_errors(built, tmp_path_factory, victim, how, pos, junk):
    _, out, _, originals = built
    d = tmp_path_factory.mktemp("d") / "c"
    shutil.copytree(out, d)
    p = d / victim
    before = p.read_bytes()
    after = _damage(before, how, pos, junk)
    p.write_bytes(after)
    snap = _snapshot(d)
    try:
        with CacheReader(d) as r:
            got = [r[i] for i in range(len(r))]
            errors = r.verify(decode=True)
    except CacheError:
        assert after != before, "an intact cache must open"
    else:
        # what opens must be exactly what was written; damage that is not caught on open
        # (bytes the reader never needs) is caught by verify
        assert len(got) == len(originals) and all(_same(a, b) for a, b in zip(originals, got))
        if after != before and victim.startswith("shard-"):
            assert errors and all(e.startswith(victim) for e in errors)
    assert _snapshot(d) == snap, "reading must never write to the cache directory"
    code = cli.main(["verify", str(d), "-q"]) if (d / MANIFEST).is_file() else None   # the CLI never crashes
    assert code in (None, 0, 1)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(victim=st.sampled_from(["sidecar0", "sidecar2", "build", "shard1"]), how=_how,
       pos=st.floats(0, 1, exclude_max=True), junk=st.binary(max_size=64), field=st.integers(0, 30),
       value=st.one_of(st.none(), st.integers(-5, 10 ** 20), st.text(max_size=5), st.lists(st.integers(), max_size=2),
                       st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)))
def test_damaged_build_state_on_resume(built, target, tmp_path_factory, victim, how, pos, junk, field, value):
    """A killed build's leftovers damaged on disk: the resumed build repairs them or stops with a
    `CacheError`; when it finishes, the cache is exactly the uninterrupted one."""
    cfg, out, regen, originals = built
    root = tmp_path_factory.mktemp("r")
    d = root / "cache"
    shutil.copytree(out, d)
    for name in (MANIFEST, INDEX):           # as if killed before finalize
        (d / name).unlink()
    p = d / {"sidecar0": sidecar_name(0), "sidecar2": sidecar_name(2), "build": BUILD_INFO,
             "shard1": shard_name(1)}[victim]
    data = p.read_bytes()
    if victim != "shard1" and field % 2 == 0:   # structurally valid JSON with one field changed
        obj = json.loads(data)
        keys = sorted(obj)
        obj[keys[field % len(keys)]] = value
        p.write_text(json.dumps(obj))
    else:
        p.write_bytes(_damage(data, how, pos, junk))
    cfg2 = copy.deepcopy(cfg)          # (composing a config per example would cost a second each)
    cfg2.cache.dir = str(d)
    try:
        build_cache(cfg2, regen_path=regen, target=target, progress=False, wait_timeout_s=0)
    except CacheError:
        return
    with CacheReader(d) as r:
        errors = r.verify(decode=True)
        if errors:   # a committed shard damaged in place (same size) is not re-hashed on resume: verify names it
            assert victim == "shard1" and all(e.startswith(shard_name(1)) for e in errors), errors
            return
        got = [r[i] for i in range(len(r))]
    assert len(got) == len(originals) and all(_same(a, b) for a, b in zip(originals, got))


_GARBAGE_FIELDS = [("rows", None), ("rows", [{"x": 1}]), ("rows", [{"sample_index": "zz"}]), ("rows", 5),
                   ("blob_bytes", None), ("blob_bytes", {"features": "many"}), ("samples", "x"), ("skipped", 3),
                   ("sha256", None), ("tokens", [1])]


@pytest.mark.parametrize("key,value", _GARBAGE_FIELDS)
def test_finalize_on_garbage_sidecars_raises_cache_errors(built, tmp_path, key, value):
    """A sidecar of the right build whose fields are garbage: `CacheCorruptError` naming it, no manifest."""
    _, out, _, _ = built
    d = tmp_path / "c"
    shutil.copytree(out, d)
    for name in (MANIFEST, INDEX):
        (d / name).unlink()
    sc = json.loads((d / sidecar_name(1)).read_text())
    sc[key] = value
    (d / sidecar_name(1)).write_text(json.dumps(sc))
    with pytest.raises(CacheError):
        finalize_cache(d)
    assert not (d / MANIFEST).exists()
    for bad in (b"", b"{", b"[]", b"\xff\xfe", b"null"):
        (d / sidecar_name(1)).write_bytes(bad)
        with pytest.raises(CacheError, match=sidecar_name(1)):
            finalize_cache(d)
        assert not (d / MANIFEST).exists()


def test_reader_refuses_file_names_outside_the_cache(built, tmp_path):
    """A hostile manifest cannot make the reader open files outside the cache directory."""
    _, out, _, _ = built
    d = tmp_path / "c"
    shutil.copytree(out, d)
    m = json.loads((d / MANIFEST).read_text())
    for name in ("../outside.arrow", "/etc/passwd", "shard-000000.arrow/../../x", "sub/shard-000000.arrow"):
        m["shards"][0]["file"] = name
        (d / MANIFEST).write_text(json.dumps(m))
        with pytest.raises(CacheError, match="bad file name"):
            CacheReader(d)
    assert sorted(os.listdir(tmp_path)) == ["c"]


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):       # unpickling would create the marker file
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("victim", [MANIFEST, INDEX, shard_name(0), sidecar_name(0)])
def test_pickle_payloads_in_a_cache_are_never_loaded(built, tmp_path, victim):
    import pickle
    _, out, _, _ = built
    marker = tmp_path / "PWNED"
    d = tmp_path / "c"
    shutil.copytree(out, d)
    (d / victim).write_bytes(pickle.dumps([_Payload(marker)]))
    if victim == sidecar_name(0):
        (d / MANIFEST).unlink()
        with pytest.raises(CacheError):
            finalize_cache(d)
    else:
        with pytest.raises(CacheError):
            with CacheReader(d) as r:
                [r[i] for i in range(len(r))]
    assert not marker.exists()
